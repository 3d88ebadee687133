"""``tracer view`` stops its Streamlit server when it is stopped: SIGTERM (``kill``, systemd,
``docker stop``, CI scripts) and SIGINT (Ctrl+C) are passed on to the server and waited for, so the
port is free and no server process is left once ``tracer view`` has exited."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("streamlit")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Streamlit and tracer view do
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stopping_tracer_view_stops_the_server_and_frees_the_port(signum):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tracer", "view", str(REPO / "sample_traces"), "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    server: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not _healthy(port):  # wait until Streamlit serves (a signal during its start-up trips Streamlit)
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        server = _children(proc.pid)
        assert len(server) == 1
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 5  # tracer view waited for the server: it is gone already
        while _alive(server[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server[0]), "the Streamlit server outlived tracer view"
        assert _port_free(port)
    finally:
        for pid in [proc.pid, *server]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
