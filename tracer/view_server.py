"""The web UI's Streamlit server for ``tracer view``, from start to stop: its output held back until
it answers on Streamlit's health endpoint (``GET /_stcore/health`` → 200 "ok"), a server that exits
or stays silent during start-up told apart from one that serves, and the signals that stop
``tracer view`` passed on to it.

``tracer view`` prints its URL only once the server answers (a user who clicks at once must not meet
"connection refused"). No printing here: the output goes to the callables the CLI passes in.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import IO, Any, Callable

HEALTH_PATH = "/_stcore/health"
# What tracer view tells Streamlit through its environment, so that the server does not repeat the URL
# tracer view prints once the server answers: logger.hideWelcomeMessage (added in 2026,
# streamlit/streamlit#14118, hidden from `streamlit config show`; a Streamlit without it ignores the
# variable) drops the "You can now view your Streamlit app" banner, logger.level = warning the
# "Uvicorn server started on 127.0.0.1:PORT" info line. Warnings and errors still print; the user's
# own STREAMLIT_LOGGER_LEVEL, when set, wins.
QUIET_ENV = {"STREAMLIT_LOGGER_HIDE_WELCOME_MESSAGE": "true", "STREAMLIT_LOGGER_LEVEL": "warning"}
SERVING, EXITED, TIMED_OUT, STOPPED = "serving", "exited", "timed out", "stopped"


class ServerOutput:
    """Reads a server's combined stdout/stderr (text lines) in a daemon thread: lines are held back
    until :meth:`release`, then passed on to ``sink`` as they come; the last ``keep`` lines stay
    available as :meth:`tail` (what to show when the server failed to start)."""

    def __init__(self, stream: IO[str], sink: Callable[[str], None], keep: int = 60) -> None:
        self._stream, self._sink = stream, sink
        self._lock = threading.Lock()
        self._held: list[str] = []
        self._last: collections.deque[str] = collections.deque(maxlen=keep)
        self._released = False
        self._thread = threading.Thread(target=self._pump, name="tracer-view-output", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._stream:
            with self._lock:
                self._last.append(line)
                if self._released:
                    self._sink(line)
                else:
                    self._held.append(line)

    def release(self, before: Callable[[], None] = lambda: None) -> None:
        """Call ``before`` (e.g. print the URL), then pass the held lines and every later one on to
        the sink, in order."""
        with self._lock:
            before()
            for line in self._held:
                self._sink(line)
            self._held.clear()
            self._released = True

    def tail(self, wait_s: float = 2.0) -> str:
        """The last lines read (waiting up to ``wait_s`` for the stream to end, so that the last
        words of a server that exited are in)."""
        self._thread.join(timeout=wait_s)
        with self._lock:
            return "".join(self._last)


def answers(port: int, timeout_s: float = 1.0) -> bool:
    """True when ``http://127.0.0.1:port/_stcore/health`` answers 200 (Streamlit serves)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{HEALTH_PATH}", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def wait_until_serving(proc: subprocess.Popen, port: int, timeout_s: float,
                       stopped: Callable[[], bool] = lambda: False, poll_s: float = 0.1) -> str:
    """Poll the server's health endpoint until it answers.

    Returns :data:`SERVING` (it answers), :data:`EXITED` (the process ended first), :data:`STOPPED`
    (``stopped()`` became true: the user stopped ``tracer view``) or :data:`TIMED_OUT` (no answer
    within ``timeout_s`` seconds). Raises nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        if stopped():
            return STOPPED
        if proc.poll() is not None:
            return EXITED
        if answers(port):
            return SERVING
        if time.monotonic() >= deadline:
            return TIMED_OUT
        time.sleep(poll_s)


@dataclass(frozen=True)
class ServerRun:
    """How a server run ended: ``state`` (:data:`SERVING`: it served, then ended; :data:`STOPPED`:
    a signal stopped ``tracer view``; :data:`EXITED` / :data:`TIMED_OUT`: it never served), the
    server's exit ``code`` and the last lines it ``printed``."""

    state: str
    code: int
    printed: str


def _parent_death_signal():
    """A ``preexec_fn`` for the Streamlit child (Linux): the child is killed when ``tracer view``
    dies, even by SIGKILL, so no server is left holding the port. SIGKILL, not SIGTERM: Streamlit's
    own SIGTERM handler writes to its output, a pipe nobody reads once ``tracer view`` is gone, and
    it never stopped (EPIPE). None where prctl is missing."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _pass_on(proc: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to the server ``proc`` while it runs (SIGHUP as SIGTERM: Streamlit stops on it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM if signum == getattr(signal, "SIGHUP", None) else signum)


def _wait_for(proc: subprocess.Popen, grace_s: float, stopping: Callable[[], bool], poll_s: float = 0.1) -> int:
    """Wait for ``proc``; once ``stopping()`` is true (a signal came, or the start-up timed out),
    kill it past ``grace_s`` more seconds. Returns its exit code."""
    deadline = None
    while True:
        if deadline is None and stopping():
            deadline = time.monotonic() + grace_s
        try:
            return proc.wait(timeout=poll_s if deadline is None else max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:  # the server ignored the signal: end it
                proc.kill()
                return proc.wait()


def serve(cmd: list[str], port: int, on_serving: Callable[[], None], sink: Callable[[str], None],
          start_timeout_s: float = 60.0, grace_s: float = 10.0) -> ServerRun:
    """Run the server ``cmd`` (listening on 127.0.0.1:``port``) until it ends.

    Its stdout and stderr (without Streamlit's welcome banner: :data:`QUIET_ENV`) are held back until
    it answers on :data:`HEALTH_PATH`; then
    ``on_serving()`` is called (print the URL) and the output goes to ``sink``, line by line. One
    that does not answer within ``start_timeout_s`` seconds is stopped. SIGTERM, SIGINT or SIGHUP
    sent to this process (``kill``, systemd, ``docker stop``, Ctrl+C) is passed on to the server,
    which is waited for (killed after ``grace_s`` seconds), so the port is free on return.
    Raises OSError when ``cmd`` cannot be started, and what ``on_serving`` or ``sink`` raise (the
    server stopped and waited for first)."""
    env = {**QUIET_ENV, **os.environ, "PYTHONUNBUFFERED": "1"}  # its last words reach the pipe even if it is killed
    received: list[int] = []
    started: list[subprocess.Popen] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        for proc in started:  # none yet: passed on once the server is started, below
            _pass_on(proc, signum)

    handled = [s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if s is not None]
    # installed before the server is started: a signal that came while it was being forked would
    # otherwise kill tracer view before it could stop the server (SIGTERM), or be lost (SIGINT)
    previous = {s: signal.signal(s, forward) for s in handled}
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="backslashreplace", env=env,
                                preexec_fn=_parent_death_signal() if sys.platform.startswith("linux") else None)
        started.append(proc)
        if received:  # a signal came while the server was being started
            _pass_on(proc, received[0])
        output = ServerOutput(proc.stdout, sink)
        state = wait_until_serving(proc, port, start_timeout_s, stopped=lambda: bool(received))
        if state == SERVING:
            output.release(on_serving)
        elif state == TIMED_OUT:
            proc.terminate()
        code = _wait_for(proc, grace_s, lambda: bool(received) or state == TIMED_OUT)
    except BaseException:  # on_serving or sink failed (stdout a closed pipe: `tracer view | head`): no server left
        for proc in started:
            if proc.poll() is None:
                proc.terminate()
                _wait_for(proc, grace_s, lambda: True)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        state = STOPPED
    return ServerRun(state, code, output.tail() if state in (EXITED, TIMED_OUT) else "")
