"""Starting the web UI's Streamlit server for ``tracer view``: its output held back until it serves,
and the wait for it to answer on Streamlit's health endpoint (``GET /_stcore/health`` → 200 "ok").

``tracer view`` prints its URL only once the server answers (a user who clicks at once must not meet
"connection refused"); a server that exits or stays silent during start-up is reported with what it
printed. No printing here: the output goes to the ``sink`` the CLI passes in.
"""

from __future__ import annotations

import collections
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import IO, Callable

HEALTH_PATH = "/_stcore/health"
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
