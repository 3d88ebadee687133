"""``tracer view`` runs its Streamlit server as a user meets it: the URL is printed only once the
server answers (a click on it never meets "connection refused"); a server that exits or stays silent
during start-up is reported with what it printed, and none is left behind; SIGTERM (``kill``,
systemd, ``docker stop``, CI scripts) and SIGINT (Ctrl+C) are passed on to the server and waited
for, so the port is free and no server process is left once ``tracer view`` has exited."""

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

from tests.fixtures.paths import REPO
from tests.fixtures.ports import free_port

pytest.importorskip("streamlit")


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


def _reap(proc: subprocess.Popen, server: list[int]) -> None:
    """Kill what a test left running: tracer view and its server."""
    for pid in [proc.pid, *server]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_stopping_tracer_view_stops_the_server_and_frees_the_port(signum):
    port = free_port()
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
        _reap(proc, server)


def _view(port: int, *extra: str, env: dict[str, str] | None = None, cwd: Path = REPO,
          stderr: int = subprocess.PIPE) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "tracer", "view", str(REPO / "sample_traces"), "--port", str(port),
                             *extra], env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=cwd)


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status


def test_the_url_is_printed_once_the_server_answers():
    port = free_port()
    proc = _view(port)
    try:
        first = proc.stdout.readline()  # blocks until tracer view prints
        assert first.startswith("tracer: serving ") and f"http://127.0.0.1:{port} " in first, first
        # the moment the URL is printed, both the page and Streamlit's health endpoint answer
        assert _get(f"http://127.0.0.1:{port}/") == 200
        assert _get(f"http://127.0.0.1:{port}/_stcore/health") == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert _port_free(port)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("level", [None, "info"])
def test_streamlit_does_not_repeat_the_url_and_its_own_lines_still_come(level):
    """The URL is printed once, by tracer view: no Streamlit banner ("You can now view your Streamlit
    app", its URL), no "Uvicorn server started on" info line; Streamlit's other output still passes
    (its "Stopping..." at SIGTERM), and a user's own STREAMLIT_LOGGER_LEVEL wins (info: the line shows)."""
    port = free_port()
    proc = _view(port, env={"STREAMLIT_LOGGER_LEVEL": level} if level else None, stderr=subprocess.STDOUT)
    try:
        first = proc.stdout.readline()
        assert first.startswith("tracer: serving ") and f"http://127.0.0.1:{port} " in first, first
        assert _get(f"http://127.0.0.1:{port}/") == 200
        time.sleep(1)  # what the server prints after it answers has come through by now
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert "You can now view" not in rest and "Stopping..." in rest, rest
    assert ("Uvicorn server started on" in rest) == (level == "info"), rest
    assert (first + rest).count(f"127.0.0.1:{port}") == 1 + (level == "info"), first + rest


def test_a_server_that_exits_during_start_up_is_reported_with_what_it_printed(tmp_path):
    # a user setting Streamlit cannot honour (TLS files that do not exist): the server dies on start-up
    port = free_port()
    proc = _view(port, env={"STREAMLIT_SERVER_SSL_CERT_FILE": str(tmp_path / "missing.pem"),
                            "STREAMLIT_SERVER_SSL_KEY_FILE": str(tmp_path / "missing.key")})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (out, err)
    assert "http://" not in out, out  # no URL to click: nothing serves it
    assert err.startswith("tracer view: error: the Streamlit server exited with code 1 before it answered on "
                          f"http://127.0.0.1:{port}/_stcore/health; it printed:\n"), err
    assert "FileNotFoundError" in err  # the server's own words: why it died
    assert _port_free(port)


def test_a_server_that_does_not_answer_in_time_is_stopped_and_reported():
    # 0.05 s is far less than Python takes to import Streamlit: the server cannot answer in time
    port = free_port()
    proc = _view(port, "--start-timeout", "0.05")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (out, err)
    assert "http://" not in out, out
    assert err.startswith(f"tracer view: error: the Streamlit server did not answer within 0.05 s (stopped it; a "
                          f"slow machine may need --start-timeout 120) on http://127.0.0.1:{port}/_stcore/health; "
                          "it printed:\n"), err
    time.sleep(1)  # the server was waited for; give a late bind no chance to hide
    assert _port_free(port) and not _healthy(port)


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_start_timeout_must_be_a_positive_number_of_seconds(value):
    proc = _view(free_port(), "--start-timeout", value)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""
    assert "argument --start-timeout: expected a number of seconds > 0, got " in err, err


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_server_is_being_started_stops_both(signum):
    """The signal lands the moment the server process exists (forked, maybe not yet Streamlit):
    tracer view must neither die of it, leaving the server to its parent-death signal (SIGTERM
    came before its handler), nor lose it and serve on (SIGINT raised inside an at-fork hook)."""
    port = free_port()
    proc = _view(port)
    server: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not server and proc.poll() is None and time.monotonic() < deadline:
            server = _children(proc.pid)
        assert len(server) == 1, (proc.poll(), server)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, (proc.returncode, out, err)  # stopped, not killed
        assert "http://" not in out and "Traceback" not in err, (out, err)
        assert not _alive(server[0]), "the server outlived tracer view"
        time.sleep(1)
        assert _port_free(port) and not _healthy(port)
    finally:
        _reap(proc, server)


STUBBORN_SERVER = """
import http.server, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc (Linux)")
def test_a_server_that_ignores_the_signal_after_serving_is_killed_after_the_grace(tmp_path):
    """A server that serves, then ignores SIGTERM: ``serve`` (as tracer view runs it) kills it
    ``grace_s`` seconds after the signal, instead of waiting for it for ever."""
    port = free_port()
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN_SERVER)
    code = ("import sys; from tracer.view_server import serve; "
            f"run = serve([sys.executable, {str(script)!r}, '{port}'], {port}, lambda: print('serving', flush=True), "
            "lambda line: None, grace_s=1.0); print(run.state, run.code, flush=True)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    server: list[int] = []
    try:
        assert proc.stdout.readline() == "serving\n"
        server = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert out == f"stopped {-signal.SIGKILL}\n", (out, err)
        assert not _alive(server[0]) and _port_free(port)
    finally:
        _reap(proc, server)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc (Linux)")
def test_a_closed_stdout_stops_the_server_before_tracer_view_exits():
    """``tracer view DIR | head -0``: printing the URL fails (BrokenPipeError) once the server answers;
    tracer view exits 1 and has stopped and waited for the server (it was left to its parent-death
    signal, an orphan for as long as Streamlit takes to stop, and for ever where prctl is missing)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    read_end, write_end = os.pipe()
    os.close(read_end)
    proc = subprocess.Popen([sys.executable, "-m", "tracer", "view", str(REPO / "sample_traces"), "--port", str(port)],
                            env=env, stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=REPO)
    os.close(write_end)
    server: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            server = server or _children(proc.pid)
            time.sleep(0.01)
        assert proc.wait(timeout=60) == 1 and len(server) == 1, (proc.returncode, server)
        assert not _alive(server[0]), "the server outlived tracer view"
        assert _port_free(port) and "Traceback" not in proc.stderr.read()
    finally:
        _reap(proc, server)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc (Linux)")
def test_a_sigkilled_tracer_view_leaves_no_server(tmp_path):
    """README: on Linux the server also stops if ``tracer view`` is killed with SIGKILL. It used to
    get SIGTERM, whose Streamlit handler wrote to the pipe of the dead tracer view (EPIPE) and never
    stopped, keeping the port. Run from a directory holding a ``click.py`` (which Streamlit
    imports): the current directory must not shadow the server's modules."""
    (tmp_path / "click.py").write_text("raise SystemExit('this click.py shadowed the real one')\n")
    port = free_port()
    proc = _view(port, cwd=tmp_path, stderr=subprocess.STDOUT)
    server: list[int] = []
    try:
        first = proc.stdout.readline()
        assert first.startswith("tracer: serving "), first + proc.stdout.read()[-2000:]
        server = _children(proc.pid)
        assert len(server) == 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while (_alive(server[0]) or not _port_free(port)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server[0]), "the Streamlit server outlived a SIGKILLed tracer view"
        assert _port_free(port)
    finally:
        _reap(proc, server)
