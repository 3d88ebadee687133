"""The guard's checker process: the checks of a run whose steps are written by a thread of the training
process (``writer="thread"``, and ``"auto"`` with CUDA tensors: every GPU run) run in a child process
forked from the training process when its writer starts, so that they take neither the training
thread's interpreter lock nor its core.

Why a fork: the child must be checking when the first step file lands (a bug that shows from the first
update stops the run at its first or second step), and a fresh interpreter spends 1-3 s importing torch
and the checks. A child forked on the training thread, before the writer thread starts, has them at
once. What the child may not touch it never does: it reads step files from disk onto the CPU (never
CUDA), sets torch to one intra-op thread (OpenMP's pool does not survive a fork: PyTorch's DataLoader
workers do the same), ignores SIGINT (Ctrl-C is the training loop's), never writes to stdout (buffers
copied at the fork would print twice), and leaves through ``os._exit`` (the parent's atexit handlers
and CUDA context are not its own). ``gc.freeze()`` keeps its garbage collector off the parent's objects,
so copy-on-write copies only what it allocates.

Protocol: the parent writes one step file path a line to the child's pipe (a line under PIPE_BUF is
written whole) and ``"\\x00close"`` at the end; the child answers with one JSON object a line: an error
or warning (:meth:`tracer.checks.finding.Finding.to_dict`), ``{"note": text}``, or ``{"closed": true}``
once its last checks ran. A listener thread in the parent (blocked on the pipe: no cost while nothing
comes) hands each to the guard. The child also ends when the parent dies (its parent pid changes).

Cost bound in the child: it checks every step file it can (:class:`tracer.guard.checker.StepChecker`
with ``share=1``): a file that arrives while it is busy is left out, the newest is taken next, and a note
says how many are left out. It keeps training's nice value (:data:`CHECKER_NICENESS` 0): with a lower
priority, on a machine whose cores training and other jobs keep busy, the first bad file was checked a
step later than ``guard="stop"`` promises (stopped at step 3 instead of 2 in the test suite's CI run).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracer.checks import CHECKS

log = logging.getLogger("tracer.guard")
CLOSE_LINE = b"\x00close\n"  # the parent's last line: finish the queued checks, then exit
CHECKER_NICENESS = 0  # added to the child's nice value (module docstring: why not lower its priority)
CLOSE_TIMEOUT_S = 60.0  # close() waits this long for the child's last checks, then kills it
PROCESS_ENV = "TRACER_GUARD_PROCESS"  # "0": check on a thread of the training process instead


def process_wanted() -> bool:
    """A checker process can be forked here: ``os.fork`` exists (Linux, macOS) and ``TRACER_GUARD_PROCESS``
    is not ``0``."""
    return hasattr(os, "fork") and os.environ.get(PROCESS_ENV, "1").strip() != "0"


class CheckerProcess:
    """The parent's side of the checker process (module docstring).

    Args:
        root, rank, mode: the trace, rank and guard mode the child's :class:`StepChecker` checks for.
        report: called on the listener thread with each finding dict and ``{"note": ...}`` the child sends.
        share: the child's time share (1.0: every file it keeps up with).
    Raises:
        OSError: the pipes or the fork failed (the caller falls back to a thread).
    """

    def __init__(self, root: Path, rank: int, mode: str, report: Callable[[dict[str, Any]], None],
                 share: float = 1.0) -> None:
        self.root, self.report = Path(root), report
        CHECKS.load()  # the child has the check modules at the fork (the registry imports them on first use)
        paths_r, self._paths_w = os.pipe()
        reports_r, reports_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(self._paths_w)
            os.close(reports_r)
            _child_main(paths_r, reports_w, parent, Path(root), rank, mode, share)
        self.pid = pid
        os.close(paths_r)
        os.close(reports_w)
        os.set_blocking(self._paths_w, False)  # step_written never waits; close() sets it back for its last line
        self._reports_r = reports_r
        self._closed = threading.Event()  # the child said it is done (or its pipe ended)
        self._broken = False
        self._lock = threading.Lock()
        self._listener = threading.Thread(target=self._listen, name="tracer-guard-listener", daemon=True)
        self._listener.start()

    def step_written(self, path: Path) -> None:
        """Send ``path`` to the child (a few microseconds; never waits: a full pipe leaves the file out)."""
        data = os.fsencode(os.fspath(path)) + b"\n"
        with self._lock:
            if self._broken:
                return
            try:
                os.write(self._paths_w, data)  # non-blocking since __init__
            except BlockingIOError:
                log.debug("tracer guard: the checker's pipe is full; %s left out", path)
            except OSError as err:  # the child is gone: the listener says so
                self._broken = True
                log.debug("tracer guard: the checker process cannot be reached: %s", err)

    def close(self) -> None:
        """Ask the child to finish (its queued files, the trace checks), wait for it (at most
        :data:`CLOSE_TIMEOUT_S`), then reap it; kill it past the wait."""
        with self._lock:
            if not self._broken:
                try:
                    os.set_blocking(self._paths_w, True)  # the close line must get through: wait for room
                    os.write(self._paths_w, CLOSE_LINE)
                except OSError:
                    pass
            try:
                os.close(self._paths_w)
            except OSError:
                pass
            self._broken = True
        if not self._closed.wait(CLOSE_TIMEOUT_S):
            log.warning("tracer guard: the checker process (pid %d) did not finish its last checks in %.0f s; "
                        "stopped it: run `tracer check %s`", self.pid, CLOSE_TIMEOUT_S, self.root)
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        self._listener.join(timeout=5.0)
        self._reap(wait=True)

    def _reap(self, wait: bool) -> int | None:
        try:
            pid, status = os.waitpid(self.pid, 0 if wait else os.WNOHANG)
        except ChildProcessError:
            return None
        return os.waitstatus_to_exitcode(status) if pid else None

    def _listen(self) -> None:
        """The listener thread: each JSON line the child writes, to ``report``."""
        said_closed = False
        with os.fdopen(self._reports_r, "rb") as reports:
            for raw in reports:
                try:
                    item = json.loads(raw)
                except ValueError:
                    continue
                if item.get("closed"):
                    said_closed = True
                    break
                try:
                    self.report(item)
                except Exception as err:  # noqa: BLE001  (a report never ends the listener)
                    log.warning("tracer guard: reporting failed: %s: %s", type(err).__name__, err)
        if not said_closed:
            code = self._reap(wait=False)
            with self._lock:
                closing = self._broken
                self._broken = True
            if not closing:
                log.warning("tracer guard: the checker process ended (exit code %s); the run goes on unguarded: "
                            "run `tracer check %s` after it", code, self.root)
        self._closed.set()


def _child_main(paths_r: int, reports_w: int, parent: int, root: Path, rank: int, mode: str,
                share: float) -> None:
    """The forked child: check what the parent sends until it says close, dies or the pipe ends."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        gc.freeze()
        if CHECKER_NICENESS:
            try:
                os.nice(CHECKER_NICENESS)
            except OSError:
                pass
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)
        lock = threading.Lock()

        def send(item: dict[str, Any]) -> None:
            data = (json.dumps(item, default=str) + "\n").encode()
            with lock:
                os.write(reports_w, data)

        from tracer.guard.checker import StepChecker  # imported by the parent already, mostly

        checker = StepChecker(root, rank, mode, send, share, where="checker process")
        buffered = b""
        while True:
            ready, _, _ = select.select([paths_r], [], [], 1.0)
            if not ready:
                if os.getppid() != parent:  # the training process died: nothing more will come
                    break
                continue
            chunk = os.read(paths_r, 65536)
            if not chunk:
                break
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            closing = False
            for line in lines:
                if line + b"\n" == CLOSE_LINE:
                    closing = True
                    break
                if line:
                    checker.step_written(Path(os.fsdecode(line)))
            if closing:
                break
        checker.close()
        send({"closed": True})
    except BaseException as err:  # noqa: BLE001  (the child reports and leaves; it never returns)
        code = 1
        try:
            os.write(2, f"tracer guard: the checker process failed: {type(err).__name__}: {err}\n".encode())
        except OSError:
            pass
    finally:
        os._exit(code)

