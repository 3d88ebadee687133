"""The live guard as the training process sees it (``TraceWriter(guard=...)``, ``tracer.attach(...,
guard=...)``, ``tracer.watch(..., guard=...)``): what to do with what the checks find while the run
goes on.

* ``"warn"``: the first error or warning of each check prints one line (through the
  ``tracer.guard`` logger: stderr unless the program configured logging), with the check id, where
  (step, inner step, micro-batch, rank, sequence, token), the cause, and the ``tracer view`` link that
  opens the token; training goes on.
* ``"stop"``: as ``"warn"``, and the first error ends the run: the next ``record`` flushes every step
  recorded so far, writes the manifest's ``guard`` entry (``mode``, ``stopped_at``, ``finding``) and
  raises :class:`tracer.errors.GuardStop` (integrations that stop their trainer another way poll
  :attr:`tracer.record.writer.TraceWriter.guard_stop` instead).
* a callable: called with each error or warning :class:`tracer.checks.finding.Finding` (to page a team,
  log to a tracker); on the guard's thread, or, under the writer process, on the training thread at the
  ``record`` that collects it. Its exceptions are logged, never raised.

The checks themselves run where the steps are written (:mod:`tracer.guard.checker`), never on the
training thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from tracer.checks.finding import ERROR, Finding
from tracer.checks.guard_records import finding_of
from tracer.guard.checker import StepChecker, guard_share
from tracer.guard.process import CheckerProcess, process_wanted
from tracer.record.observer import GUARD_MODES

log = logging.getLogger("tracer.guard")
VIEW_URL = "http://localhost:8501"  # where `tracer view` serves (Streamlit's default port)
# The writer batches the steps that arrive within its linger (0.25 s: tracer.record.thread.LINGER_S) to save
# interpreter time per file (about 1 ms of a small step's); guard="stop" writes each step at once, or a
# fast loop (the tiny GRPO loop: 0.05 s a record) runs several steps past a bad one before its file exists
# to be checked (a warning printed 0.2 s later costs nothing: "warn" and a callable keep the batching).
GUARD_LINGER_S = 0.0
PROCESS_SHARE = 1.0  # the forked checker process checks every file it keeps up with (its own core)
WRITER_PROCESS_SHARE = 0.5  # in the writer process, the checks leave the writing half its time at least


class Guard:
    """A :class:`tracer.record.observer.StepObserver` (module docstring).

    Args:
        guard: ``"warn" | "stop"`` or a callable taking a Finding (its mode is then ``"callable"``).
        root, rank: the trace and rank the writer writes.
        share: the checker's time share; None: ``TRACER_GUARD_SHARE`` if set, else every file it keeps up
            with in a forked checker process (:data:`PROCESS_SHARE`), :data:`WRITER_PROCESS_SHARE` in the
            writer process, :data:`tracer.guard.checker.SHARE` on a thread of the training process.
    Raises:
        ValueError: a word other than ``"warn"`` or ``"stop"``. TypeError: neither a word nor a callable.
    """

    def __init__(self, guard: str | Callable[[Finding], Any], root: Path, rank: int = 0,
                 share: float | None = None) -> None:
        if isinstance(guard, str):
            if guard not in GUARD_MODES or guard == "off":
                raise ValueError(f"guard={guard!r}: expected 'warn', 'stop' or a callable taking a Finding")
            self.mode, self.callback = guard, None
        elif callable(guard):
            self.mode, self.callback = "callable", guard
        else:
            raise TypeError(f"guard={guard!r}: expected 'warn', 'stop' or a callable taking a Finding")
        self.root, self.rank, self.share = Path(root), rank, share
        self.linger_s = GUARD_LINGER_S if self.mode == "stop" else None  # read by the writer (tracer.record.observer)
        self._lock = threading.Lock()
        self._checker: StepChecker | CheckerProcess | None = None
        self._said: set[str] = set()  # checks whose first finding was printed
        self._stop: Finding | None = None
        self._stop_line = ""
        self.findings: list[dict[str, Any]] = []  # every error and warning reported, in order (JSON form)
        self.notes: list[str] = []
        self.where = "none"  # where the checks run: "process" (forked), "thread", "writer process"

    # -- StepObserver ---------------------------------------------------------------------------

    def start_local(self) -> None:
        """The writer writes in this process: start the checks now, on the training thread (the writer
        calls this before its writer thread starts). A forked checker process
        (:class:`tracer.guard.process.CheckerProcess`, every file it keeps up with) where the platform can
        fork, else a thread of this process (:class:`StepChecker`, :data:`tracer.guard.checker.SHARE` of
        the run's time)."""
        with self._lock:
            if self._checker is not None:
                return
            if process_wanted():
                try:
                    share = guard_share(PROCESS_SHARE) if self.share is None else self.share
                    self._checker = CheckerProcess(self.root, self.rank, self.mode, self._on_report, share)
                    self.where = "process"
                    return
                except OSError as err:
                    log.warning("tracer guard: could not fork the checker process (%s); checking on a thread", err)
            self._checker = StepChecker(self.root, self.rank, self.mode, self._on_report, self.share)
            self.where = "thread"

    def step_written(self, path: Path) -> None:
        """Hand ``path`` to the checker (a thread of this process when :meth:`start_local` was not called)."""
        if self._checker is None:
            with self._lock:
                if self._checker is None:
                    self._checker = StepChecker(self.root, self.rank, self.mode, self._on_report, self.share)
                    self.where = "thread"
        self._checker.step_written(path)

    def stop_finding(self) -> Finding | None:
        """The error that stops the run under ``"stop"``, else None."""
        return self._stop

    def stop_text(self) -> str:
        """The stopping finding's line (:func:`warn_line`), for :class:`tracer.errors.GuardStop`'s message."""
        return self._stop_line

    def child_spec(self) -> dict[str, Any]:
        """The writer process checks with :func:`tracer.guard.checker.in_writer_process`."""
        self.where = "writer process"
        return {"factory": "tracer.guard.checker:in_writer_process",
                "config": {"mode": self.mode, "share": guard_share(WRITER_PROCESS_SHARE) if self.share is None else self.share}}

    def receive(self, message: dict[str, Any]) -> None:
        """An error, warning or note the writer process's checker sent."""
        self._on_report({"note": message["note"]} if "note" in message else message.get("finding") or {})

    def close(self) -> None:
        """Check what is queued, run the trace checks a last time, close the findings file."""
        if self._checker is not None:
            self._checker.close()

    # -- reporting ----------------------------------------------------------------------------

    def _on_report(self, item: dict[str, Any]) -> None:
        if "note" in item:
            self.notes.append(item["note"])
            log.warning("tracer guard: %s", item["note"])
            return
        if "check" not in item:
            return
        with self._lock:
            self.findings.append(item)
            first = item["check"] not in self._said
            self._said.add(item["check"])
            stops = self.mode == "stop" and item.get("severity") == ERROR and self._stop is None
            line = warn_line(item, self.root, stops)
            if stops:
                self._stop_line, self._stop = line, finding_of(item)  # the line first: read once the finding is set
        if (first or stops) and self.mode != "callable":
            log.warning("%s", line)
        if self.callback is not None:
            try:
                self.callback(finding_of(item))
            except Exception as err:  # noqa: BLE001  (the user's callable must not end the guard)
                log.warning("tracer guard: the guard callable raised %s: %s", type(err).__name__, err)


def view_link(item: dict[str, Any], root: Path) -> str:
    """The ``tracer view`` command and the app's URL that opens the finding's step, sequence and token:
    ``run=.`` (the trace is the viewer's root: ``?run=`` is a path under it), and on the Tokens page
    ``colour=<field>``, the tokens coloured by the field the finding is about (the page falls back on
    its default when that field is not a per-token value)."""
    page = "tokens" if item.get("sequence") is not None else "step"
    params = {"run": ".", "step": item.get("step"), "inner": item.get("inner_step"),
              "mb": item.get("micro_batch"), "rank": item.get("rank"), "seq": item.get("sequence"),
              "token": item.get("token"), "colour": item.get("field") if page == "tokens" else None}
    query = urlencode({k: str(v) for k, v in params.items() if v is not None}, quote_via=quote)
    return f"tracer view {root} → {VIEW_URL}/{page}?{query}"


def warn_line(item: dict[str, Any], root: Path, stops: bool = False) -> str:
    """One line: severity, check id, where, the cause (the finding's message on one line), the link."""
    where = " · ".join(f"{label} {item[key]}" for label, key in (
        ("step", "step"), ("inner", "inner_step"), ("mb", "micro_batch"), ("rank", "rank"), ("seq", "sequence"),
        ("token", "token")) if item.get(key) is not None)
    cause = " ".join(str(item.get("message", "")).split())
    head = "tracer guard: stopping at" if stops else "tracer guard:"
    return (f"{head} {str(item.get('severity', '')).upper()} {item.get('check')}"
            f"{' at ' + where if where else ''}: {cause} | open: {view_link(item, root)}")


def make_guard(guard: Any, root: Path, rank: int) -> Guard | None:
    """The factory :mod:`tracer.record.observer` calls for ``guard="warn" | "stop"`` or a callable."""
    if isinstance(guard, str) and guard == "off":
        return None
    return Guard(guard, root, rank)
