"""The guard's checking side: runs ``tracer check``'s own step checks on each step file as soon as the
writer has renamed it into place, on a thread of the process that writes (the writer thread's process,
or the writer process), never on the training thread; writes what it finds into the findings file
(:mod:`tracer.format.findings_log`) and hands each error or warning to ``report``.

Per step file: the file is read back (it was just written: it is in the page cache; 1 ms for a tiny
GRPO step against 9-21 ms for its checks, so checking the staged tensors instead would save little and
could differ from ``tracer check``) into a :class:`tracer.checks.context.StepContext`, and
:func:`tracer.checks.runner.check_step` runs every step check on it, the same call ``tracer check`` makes.
Each check runs with the trace watched (:class:`_WatchedTrace`): one that reads other step files (the
pass's micro-batches, the run's latest files) is listed in the ``checked`` line's ``depends``, so that
``tracer check`` runs it again rather than reuse a result the later files may change.

Cost bound: the first :data:`FIRST_FILES` step files are always checked (a bug that shows from the
first update is caught there); after them the checker keeps its own time under ``share`` of the run's
wall time, taking the newest file when it is free and leaving out those that arrive while it is busy or
resting: it drops to one file in n, says so (a ``note`` line, a log line), and never makes ``record``
wait (a bounded queue of :data:`MAX_PENDING` files, older ones left out first). With ``share`` 1 (the
forked checker process, a core of its own: :mod:`tracer.guard.process`) nothing is left out for being
busy: files wait in that queue, so a burst (the writer's batch) is checked whole when the checker keeps
up on average, and the oldest go first when it does not.

Checks over several step files (``scope="trace"``: trends, drifts) run over the files on disk after 2, 4,
8, ... checked files and once more at the end: their total cost stays about twice one run over the
whole trace, and a finding of theirs comes at most twice as many steps late. Their findings are written
once per place (check, severity, location).
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracer.checks.context import CheckOptions, StepContext, clear_check_memos, clear_step_memos
from tracer.checks.finding import CHECKS, ERROR, WARNING, Finding, Skip
from tracer.checks.guard_records import context_digest, options_key
from tracer.checks.runner import check_step, step_conditions
from tracer.errors import TraceError
from tracer.format.findings_log import FindingsAppender
from tracer.format.names import STEP_FILE_RE
from tracer.read import StepKey, Trace

log = logging.getLogger("tracer.guard")
FIRST_FILES = 4  # step files always checked, whatever they cost
MAX_PENDING = 4  # step files waiting to be checked at most (older ones are left out first)
SHARE = 0.05  # the checker's time at most this share of the run's wall time, past the first files
SHARE_ENV = "TRACER_GUARD_SHARE"
LISTING_REFRESH_S = 5.0  # a check that lists the run's step files sees a listing at most this old (plus its own file)
CLOSE_TRACE_CHECKS_S = 5.0  # at close, the trace checks run again unless their last run took longer
REPORTED = (ERROR, WARNING)  # severities handed to ``report`` (info and skipped stay in the file)


def guard_share(default: float = SHARE) -> float:
    """The ``TRACER_GUARD_SHARE`` environment variable (a number in (0, 1]), else ``default``."""
    try:
        share = float(os.environ.get(SHARE_ENV, default))
    except ValueError:
        return default
    return min(1.0, share) if share > 0 else default


def _place(key: StepKey) -> tuple[int, int, int, int]:
    return (key.step, key.inner_step, key.micro_batch, key.rank)


class _WatchedTrace(Trace):
    """A :class:`Trace` that notes when a check reads beyond its own step file (:attr:`beyond`)."""

    own: StepKey | None = None
    beyond = False
    headers: dict[tuple, Any] | None = None  # the checker's fields() of each step file, shared across files
    listing: dict[str, Any] | None = None  # the checker's steps() listing, listed again every LISTING_REFRESH_S

    def steps(self):
        self.beyond = True
        memo = self.listing
        if memo is None:
            return super().steps()
        now = time.monotonic()
        if "keys" not in memo or now - memo["at"] > LISTING_REFRESH_S:
            memo["keys"], memo["at"] = super().steps(), now
        keys, own = memo["keys"], self.own
        if own is not None:  # the file being checked is listed even between two listings
            place = _place(own)
            at = bisect.bisect_left(keys, place, key=_place)
            if at == len(keys) or _place(keys[at]) != place:
                keys.insert(at, own)
        return list(keys)

    def load_step(self, key, *args, **kwargs):
        self._touch(key)
        return super().load_step(key, *args, **kwargs)

    def metadata(self, key, *args, **kwargs):
        self._touch(key)
        return super().metadata(key, *args, **kwargs)

    def fields(self, key, *args, **kwargs):
        self._touch(key)
        if args or kwargs or self.headers is None:
            return super().fields(key, *args, **kwargs)
        place = (key.step, key.inner_step, key.micro_batch, key.rank)
        got = self.headers.get(place)
        if got is None:  # a step file never changes once renamed into place: its header is read once a run
            got = self.headers[place] = super().fields(key)
        return got

    def _touch(self, key) -> None:
        own = self.own
        if own is None or (key.step, key.inner_step, key.micro_batch, key.rank) != (
                own.step, own.inner_step, own.micro_batch, own.rank):
            self.beyond = True


class StepChecker:
    """Checks step files on its own daemon thread (module docstring).

    Args:
        root, rank: the trace and the rank whose findings file it writes.
        mode: the guard's mode, kept in the file's ``guard`` line.
        report: ``report(finding_dict)`` for each error or warning (its JSON form), and
            ``report({"note": text})`` for what it leaves out; called on the checker's thread.
        share: the time share past the first files (:func:`guard_share` when None).
        where: where it runs, for the findings file's ``guard`` line: ``"thread"`` (a thread of the
            training process), ``"checker process"`` (:mod:`tracer.guard.process`), ``"writer process"``.
    """

    def __init__(self, root: Path, rank: int, mode: str, report: Callable[[dict[str, Any]], None],
                 share: float | None = None, where: str = "thread") -> None:
        self.root, self.rank, self.mode, self.report, self.where = Path(root), rank, mode, report, where
        self.share = guard_share() if share is None else share
        self.options = CheckOptions()
        self.checks = list(CHECKS.values())
        self.out = FindingsAppender(self.root, rank)
        self._pending: collections.deque[tuple[bool, Path]] = collections.deque()  # (one of the first files, path)
        self._cond = threading.Condition()
        self._busy = self._closing = False
        self._rest_until = 0.0  # no file is taken before this (the share)
        self.arrived = self.checked = self.left_out = 0
        self._every_said = 1  # the "one file in n" the last note said
        self._cost = 0.0  # seconds the last step file's checks took
        self._next_trace_run = 2  # checked files after which the trace checks run next
        self._trace_cost = 0.0
        self._trace_runs = 0
        self._seen: set[tuple] = set()  # places of trace-check findings written
        self._headers: dict[tuple, Any] = {}  # fields() of the step files read so far (_WatchedTrace.headers)
        self._listing: dict[str, Any] = {}  # the step files listed (_WatchedTrace.listing)
        self._thread = threading.Thread(target=self._run, name="tracer-guard", daemon=True)
        self._thread.start()

    # -- the writer's side --------------------------------------------------------------------

    def step_written(self, path: Path) -> None:
        """Queue ``path`` for checking, or leave it out (busy, resting, or the queue full: the oldest
        file queued after the first :data:`FIRST_FILES` goes); never waits."""
        with self._cond:
            self.arrived += 1
            if self.arrived == 1:  # the file starts with the line that says who checks (this process)
                self.out.add([{"kind": "guard", "mode": self.mode, "options": options_key(self.options),
                               "checks": [c.id for c in self.checks], "pid": os.getpid(), "where": self.where,
                               "share": self.share}])
            first = self.arrived <= FIRST_FILES
            # under a share below 1 a file that finds the checker busy or resting is left out; at 1 (a core of
            # its own) it waits in the queue, so a burst of files (the writer's batch) is checked whole
            if not first and self.share < 1.0 and (self._busy or time.monotonic() < self._rest_until):
                self._leave_out(path)
                return
            later = [item for item in self._pending if not item[0]]
            if not first and len(later) >= MAX_PENDING:
                self._pending.remove(later[0])
                self._leave_out(later[0][1])
            self._pending.append((first, path))
            self._cond.notify_all()

    def close(self) -> None:
        """Check what is queued (at most :data:`MAX_PENDING` files), run the trace checks a last time,
        close the findings file and end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()  # it ran the last trace checks (_last_trace_checks)
        self.out.close()

    def _last_trace_checks(self) -> None:
        """At close, on the checker's thread: the trace checks over every file, unless their last run took
        over :data:`CLOSE_TRACE_CHECKS_S` (then a note says to run ``tracer check``)."""
        try:
            if self.checked and self._trace_cost <= CLOSE_TRACE_CHECKS_S:
                self._trace_checks()
            elif self.checked:
                self._note(f"the trace checks did not run at the end: their last run took {self._trace_cost:.1f} s "
                           f"(over {CLOSE_TRACE_CHECKS_S:.0f} s); run `tracer check {self.root}` for them")
        except Exception as err:  # noqa: BLE001  (a guard never breaks the writer's close)
            log.warning("tracer guard: the trace checks failed at close: %s: %s", type(err).__name__, err)

    # -- the checker's thread -----------------------------------------------------------------

    def _leave_out(self, path: Path) -> None:
        """Count ``path`` as not checked; a note when the share of files checked halves (lock held)."""
        self.left_out += 1
        every = max(1, round(self.arrived / max(1, self.arrived - self.left_out)))
        if every >= 2 * self._every_said:
            self._every_said = every
            cost = f"its checks take {self._cost * 1e3:.0f} ms a file, " if self._cost else ""
            self._note(f"the guard fell behind and checks about one step file in {every} now ({cost}kept under "
                       f"{self.share:.0%} of the run's time, past the first {FIRST_FILES}); "
                       f"{self.left_out} left out so far, the first {path.name}: `tracer check {self.root}` checks "
                       "them all")

    def _note(self, message: str) -> None:
        self.out.add([{"kind": "note", "message": message}])
        try:
            self.report({"note": message})
        except Exception as err:  # noqa: BLE001
            log.warning("tracer guard: reporting a note failed: %s", err)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    break
                _, path = self._pending.popleft()
                self._busy = True
            started = time.monotonic()
            try:
                self._check_file(path)
                if self.checked >= self._next_trace_run:
                    self._next_trace_run *= 2
                    self._trace_checks()
            except Exception as err:  # noqa: BLE001  (a bug here must not end the thread: close() joins it)
                log.warning("tracer guard: checking %s failed: %s: %s", path.name, type(err).__name__, err)
            finally:
                spent = time.monotonic() - started
                with self._cond:
                    self._busy = False
                    self._cost = spent
                    if self.arrived >= FIRST_FILES:
                        self._rest_until = time.monotonic() + spent * (1 / self.share - 1)
        self._last_trace_checks()

    def _check_file(self, path: Path) -> None:
        """The step checks on one step file; its finding lines, then its ``checked`` line."""
        trace = _WatchedTrace(self.root)
        trace.headers, trace.listing = self._headers, self._listing
        try:
            stat = os.stat(path)
            match = STEP_FILE_RE.match(path.name)
            if match is None:
                raise TraceError("not a step file name")
            key = trace.step_key(*(int(g) for g in match.groups()))
            trace.own = key
            ctx = StepContext(trace, key, self.options)
        except (OSError, TraceError) as err:
            self._note(f"{path.name} was not checked: {type(err).__name__}: {err}")
            return
        depends: list[str] = []

        def before(check) -> None:
            clear_check_memos(trace)  # a check's memo of the run is its own: what it reads is seen
            clear_step_memos(ctx)  # and so is its memo of this file (it may come from other files)
            trace.beyond = False

        def after(check) -> None:
            if trace.beyond:
                depends.append(check.id)

        result = check_step(ctx, self.checks, before, after)
        lines = [_line(f, "step", path.name) for f in result.findings]
        lines.append({"kind": "checked", "file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                      "findings": len(result.findings), "ran": result.ran, "skipped": result.skipped,
                      "depends": depends, "fields": sorted(set(ctx.data) - ctx.derived), "algorithm": ctx.algorithm,
                      "conditions": sorted(step_conditions(ctx)), "context": context_digest(trace)})
        self.out.add(lines)
        self.checked += 1
        self._report(result.findings)

    def _trace_checks(self) -> None:
        """The checks over several step files, over the files on disk now; new places only."""
        started = time.monotonic()
        trace = Trace(self.root)
        keys = trace.steps()
        algorithm = trace.algorithm or ""
        new: list[Finding] = []
        for check in self.checks:
            if check.scope != "trace" or algorithm not in check.algorithms:
                continue
            try:
                found = list(check.run(trace, self.options, keys))
            except Skip:
                continue
            except (ValueError, RuntimeError, IndexError, KeyError, TypeError, ZeroDivisionError, TraceError) as err:
                log.debug("trace check %s failed: %s", check.id, err)
                continue
            for f in found:
                place = (f.check, f.severity, f.step, f.inner_step, f.micro_batch, f.rank, f.sequence, f.token)
                if place not in self._seen:
                    self._seen.add(place)
                    new.append(f)
        lines = [_line(f, "trace", None) for f in new]
        if not self._trace_runs:
            lines.insert(0, {"kind": "note", "message": "the checks over several step files (trends, drifts) run "
                             "after 2, 4, 8, ... checked files and at the end of the run: a finding of theirs may "
                             "come up to twice as many steps after the step that shows it"})
        self._trace_runs += 1
        self.out.add(lines)
        self._trace_cost = time.monotonic() - started
        self._report(new)

    def _report(self, findings: list[Finding]) -> None:
        for f in findings:
            if f.severity in REPORTED:
                try:
                    self.report(f.to_dict())
                except Exception as err:  # noqa: BLE001  (the user's callable, a closed pipe)
                    log.warning("tracer guard: reporting %s failed: %s: %s", f.check, type(err).__name__, err)


def _line(f: Finding, scope: str, file: str | None) -> dict[str, Any]:
    line = {"kind": "finding", "scope": scope, **f.to_dict()}
    if file is not None:
        line["file"] = file
    return line


def in_writer_process(root: Path, rank: int, send: Callable[[dict[str, Any]], None], mode: str = "warn",
                      share: float | None = None) -> ChildGuard:
    """The observer the writer process builds from :meth:`tracer.guard.guard.Guard.child_spec`: it
    checks there and sends each error, warning and note to the training process (``{"k": "guard", ...}``)."""
    return ChildGuard(root, rank, send, mode, share)


class ChildGuard:
    """The writer process's observer: a :class:`StepChecker` whose reports travel to the training
    process, where :class:`tracer.guard.guard.Guard` prints, calls back or stops."""

    def __init__(self, root: Path, rank: int, send: Callable[[dict[str, Any]], None], mode: str,
                 share: float | None) -> None:
        self.mode = mode
        self._send = send
        self._args = (root, rank, mode, share)
        self._checker: StepChecker | None = None

    def _forward(self, item: dict[str, Any]) -> None:
        self._send({"k": "guard", **({"note": item["note"]} if "note" in item else {"finding": item})})

    def step_written(self, path: Path) -> None:
        if self._checker is None:
            root, rank, mode, share = self._args
            self._checker = StepChecker(root, rank, mode, self._forward, share, where="writer process")
        self._checker.step_written(path)

    def stop_finding(self) -> None:
        return None

    def stop_text(self) -> str:
        return ""

    def child_spec(self) -> None:
        return None

    def receive(self, message: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        if self._checker is not None:
            self._checker.close()
