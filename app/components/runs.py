"""The Runs page's table (one row per trace under the root) and the rule that opens a run at its
most informative step.

Each row is read from what the writer stores for the overview: the run's summary
(:meth:`tracer.read.Trace.step_summary`: headers or the summary columns, no tensor) and the header
of the last step's files (their shapes give the rows per step). The check status is
``tracer.checks.run_checks`` on every step file, the code ``tracer check`` runs, counted as the
Health page counts it; it is cached per run and listing of step files (a new step file checks the
run again). A run whose step files weigh more than the budget :data:`MAX_CHECKED_BYTES`
(:func:`check_cost`, from the files' sizes, no tensor read) is checked only when asked.

Opening a run (a row of the Runs page, a URL naming ``run=`` without ``step=``) shows the step a
user wants to see first: the first step file with an error finding (its sequence when the finding
names one), else the last step, where the ratio and the KL have moved from their first values.
"""

from __future__ import annotations

# tracer.checks (and torch, which it imports) is imported inside the functions that count findings:
# the Runs page lists runs too large to check automatically from their summaries and headers alone.
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import streamlit as st

from app.components import trace_cache, urls
from app.components.guard import report_of
from app.components.safe_trace import UNREADABLE
from tracer.errors import TraceError, TraceFormatError
from tracer.read.run_status import status_text

# The automatic check's budget, so that opening a run waits at most ~5 s for tracer check. Measured
# on the 2 shared CPU cores of the development machine, run_checks(reuse_guard=False) on GRPO traces
# of bench.viewer_traces (B x T, bytes per step file, time per step file): 8 x 16, 14 kB, 17 ms;
# 16 x 64, 59 kB, 23 ms; 64 x 128, 410 kB, 118 ms; 64 x 256, 780 kB, 212 ms: ~10 ms per file plus
# ~0.28 s per MB. A run is charged its step files' bytes plus FILE_OVERHEAD_BYTES per file (the
# fixed cost at that rate), so 16 MB buys ~290 tiny files (~5 s) or ~35 files of 64 x 128 (~4 s).
MAX_CHECKED_BYTES = 16_000_000
FILE_OVERHEAD_BYTES = 40_000
PASS = "pass"
NOT_CHECKED = "not checked yet"
CHECKING = "checking…"  # the check cell while the Runs page runs tracer check on the run
_REQUESTED_STATE = "_tracer_runs_check_requested"  # trace paths the user asked to check
# Fields whose first dim counts the rows of a step file (sequences; DPO: pairs).
_ROW_FIELDS = ("completion_ids", "chosen_ids", "prompt_ids", "rewards", "advantages")
# The page a run opens on, by algorithm: (page file, URL path).
_OPEN_PAGES = {"dpo": ("app_pages/dpo.py", "dpo"), None: ("app_pages/tokens.py", "tokens")}
COLUMNS = ("run", "open", "algorithm", "status", "steps", "step files", "rows", "last mean reward", "check",
           "guard")


@dataclass(frozen=True)
class CheckStatus:
    """What the checks found in a run: counts of error and warning findings, and where the first
    error lies (``first_error``: ``(step, inner_step, micro_batch, rank)`` of the earliest step
    file with an error; ``first_error_sequence``: the row that error names, or None)."""

    errors: int
    warnings: int
    first_error: tuple[int, int, int, int] | None = None
    first_error_sequence: int | None = None
    unreadable: int = 0  # step files whose data cannot be read (each one a trace.unreadable error)
    files: int = 0  # step files on disk, the unreadable ones included

    def text(self) -> str:
        """``pass``, ``2 errors, 1 warning`` (zero counts left out), or ``cannot read any of its 6
        step files`` when no step file can be read (``tracer check`` exits 2 there)."""
        from tracer.checks import ERROR, WARNING

        if self.unreadable and self.unreadable >= self.files:
            return f"cannot read any of its {self.files} step file{'s' if self.files != 1 else ''}"
        if not self.errors and not self.warnings:
            return PASS
        return ", ".join(f"{n} {name}{'s' if n != 1 else ''}"
                         for n, name in ((self.errors, ERROR), (self.warnings, WARNING)) if n)


def check_status(findings: pd.DataFrame) -> CheckStatus:
    """The :class:`CheckStatus` of a findings frame (:func:`app.components.health.findings_frame`):
    error and warning counts, and the earliest ``(step, inner_step, micro_batch, rank)`` among the
    error findings located in a step file (trace-level errors count but locate nothing)."""
    from app.components.health import severity_counts
    from tracer.checks import ERROR, WARNING

    counts = severity_counts(findings)
    if not counts[ERROR]:
        return CheckStatus(counts[ERROR], counts[WARNING])
    where = ["step", "inner_step", "micro_batch", "rank"]
    errors = findings[(findings["severity"] == ERROR)].dropna(subset=where)
    if errors.empty:
        return CheckStatus(counts[ERROR], counts[WARNING])
    first = errors.sort_values(where, kind="stable").iloc[0]
    sequence = None if pd.isna(first["sequence"]) else int(first["sequence"])
    return CheckStatus(counts[ERROR], counts[WARNING], tuple(int(first[c]) for c in where), sequence)


def informative_index(coordinates: np.ndarray, status: CheckStatus | None) -> int:
    """The row of a step table (``coordinates``: ``int64 [n, 4]`` step, inner_step, micro_batch,
    rank, sorted, n >= 1) to open a run at: the step file of ``status.first_error`` when the run
    has one, else the first file (lowest micro-batch and rank) of the last step's last inner step."""
    if status is not None and status.first_error is not None:
        hit = np.flatnonzero((coordinates == np.asarray(status.first_error)).all(axis=1))
        if len(hit):
            return int(hit[0])
    last = coordinates[-1]
    return int(np.flatnonzero((coordinates[:, 0] == last[0]) & (coordinates[:, 1] == last[1]))[0])


@dataclass(frozen=True)
class CheckCost:
    """What ``tracer check`` reads in a run: ``files`` step files of ``bytes`` bytes together."""

    files: int
    bytes: int

    @property
    def charged(self) -> int:
        """The bytes counted against :data:`MAX_CHECKED_BYTES`: the files' sizes plus
        :data:`FILE_OVERHEAD_BYTES` per file (run_checks' fixed cost per file)."""
        return self.bytes + self.files * FILE_OVERHEAD_BYTES

    @property
    def automatic(self) -> bool:
        """Whether the run is checked without being asked (charged at most :data:`MAX_CHECKED_BYTES`)."""
        return self.charged <= MAX_CHECKED_BYTES


def check_cost(trace_path: str) -> CheckCost:
    """The :class:`CheckCost` of the run at ``trace_path``: its step files and their summed size
    (``os.stat`` of each listed file; one removed since the listing counts 0), cached per listing."""
    trace = trace_cache.open_trace(trace_path)
    return _check_cost(trace_path, trace_cache.listing_token(trace))


@st.cache_data(max_entries=256, show_spinner=False)
def _check_cost(trace_path: str, listing: str) -> CheckCost:
    keys = trace_cache.open_trace(trace_path).steps()
    return CheckCost(len(keys), sum(_size(k.path) for k in keys))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # removed since the listing: nothing to check there
        return 0


def budget_text() -> str:
    """The rule in words, for the pages' notes."""
    return (f"runs of up to {MAX_CHECKED_BYTES / 1e6:g} MB of step files (each file counted "
            f"{FILE_OVERHEAD_BYTES / 1e3:g} kB more) are checked without asking")


def request_check(trace_path: str) -> None:
    """Remember (for this session) that the user asked to check ``trace_path`` whatever its size."""
    st.session_state.setdefault(_REQUESTED_STATE, set()).add(trace_path)


def known_status(trace_path: str) -> CheckStatus | None:
    """The run's :class:`CheckStatus` when it may be computed now (a run within the budget,
    :attr:`CheckCost.automatic`, or one the user asked to check), else None."""
    trace = trace_cache.open_trace(trace_path)
    if not checked_now(trace_path):
        return None
    return run_status(trace_path, trace_cache.listing_token(trace), unreadable_files(trace_path))


def checked_now(trace_path: str) -> bool:
    """Whether :func:`known_status` checks the run now: within the budget (:attr:`CheckCost.automatic`,
    from the files' sizes) or asked for in this session. Raises TraceError when it cannot be opened."""
    return check_cost(trace_path).automatic or trace_path in st.session_state.get(_REQUESTED_STATE, ())


def unreadable_files(trace_path: str) -> tuple[str, ...]:
    """The names of the run's step files whose data cannot be read (``SafeTrace.problems``,
    ``unreadable: ...``), which ``steps()`` leaves out and ``tracer check`` reports as
    ``trace.unreadable`` errors."""
    problems = trace_cache.open_trace(trace_path).problems()
    return tuple(sorted(p.name for p, why in problems.items() if why.startswith(UNREADABLE)))


@st.cache_data(max_entries=256, show_spinner=False)
def run_status(trace_path: str, listing: str, unreadable: tuple[str, ...] = ()) -> CheckStatus:
    """:func:`check_status` of every step file of the run (``listing``: :func:`trace_cache.listing_token`,
    the cache key that changes when a step file appears); the findings are those the Health page
    shows for "every step file" (one cache). Each of the ``unreadable`` step files (names,
    :func:`unreadable_files`) counts one error more, the ``trace.unreadable`` finding ``tracer
    check`` gives it; when no step file can be read the status says so."""
    trace = trace_cache.open_trace(trace_path)
    names = tuple(k.path.name for k in trace.steps())
    files = len(names) + len(unreadable)
    if not names:
        return CheckStatus(len(unreadable), 0, unreadable=len(unreadable), files=files)
    try:
        status = check_status(trace_cache.findings(trace_path, names))
    except TraceFormatError:  # none of the listed step files can be read (their headers are corrupt)
        return CheckStatus(files, 0, unreadable=files, files=files)
    return replace(status, errors=status.errors + len(unreadable), unreadable=len(unreadable), files=files)


def rows_per_step(trace_path: str, last_step_paths: list[Path]) -> int | None:
    """Sequences in one step: the rows (first dim of :data:`_ROW_FIELDS`' first recorded field, read
    from the step file's header) summed over the given files of one step and inner step (its
    micro-batches and ranks); None when no header names such a field."""
    total = None
    for path in last_step_paths:
        fields = trace_cache.step_fields(trace_path, str(path), trace_cache.file_id(path))
        shape = next((fields[name][0] for name in _ROW_FIELDS if name in fields and fields[name][0]), None)
        if shape is not None:
            total = (total or 0) + int(shape[0])
    return total


def last_mean_reward(summary: pd.DataFrame) -> float:
    """The mean reward of the last step: the mean of ``mean_reward`` over the files of its first
    inner step (inner steps train on the same rollouts); NaN when not recorded."""
    if summary.empty or "mean_reward" not in summary:
        return float("nan")
    last = summary[summary["step"] == summary["step"].max()]
    first_inner = last[last["inner_step"] == last["inner_step"].min()]
    return float(first_inner["mean_reward"].mean())


def open_page(algorithm: str | None) -> str:
    """The page file a run opens on: the DPO pairs page for a DPO run (no completions to list
    token by token), else the Tokens page."""
    return _OPEN_PAGES.get(algorithm, _OPEN_PAGES[None])[0]


def run_row(trace_path: str, label: str, status: CheckStatus | None) -> dict:
    """One row of the Runs table (:data:`COLUMNS`) for the trace at ``trace_path`` (``label``: its
    ``run=`` value; ``status``: None when not checked): ``open`` is a link to :func:`open_page`
    with ``?run=``; ``guard`` what the live guard found while the run went on
    (:meth:`app.components.guard.GuardReport.text`; empty when no guard ran). A run that cannot be opened
    gets its reason in ``check``."""
    row = dict.fromkeys(COLUMNS)
    row["run"] = label
    try:
        trace = trace_cache.open_trace(trace_path)
        table = trace.step_table()
        summary = trace_cache.step_summary(trace_path, trace_cache.listing_token(trace))
    except TraceError as err:
        row["check"] = f"cannot open: {err}"
        return row
    except UnicodeEncodeError:  # the app's caches key by text: a name that is not UTF-8 cannot be one
        row["check"] = "cannot open: its path is not valid UTF-8 (rename the directory)"
        return row
    coordinates = table.coordinates
    row["open"] = urls.link(_OPEN_PAGES.get(trace.algorithm, _OPEN_PAGES[None])[1], {"run": label})  # URL path
    row.update({"algorithm": trace.algorithm or "unknown", "status": status_text(trace.status, trace.manifest),
                "steps": len(np.unique(coordinates[:, 0])),
                "step files": len(table) + len(unreadable_files(trace_path))})
    if len(table):
        of_last = coordinates[:, 0] == coordinates[-1, 0]
        at_last = np.flatnonzero(of_last & (coordinates[:, 1] == coordinates[of_last, 1].min()))
        try:
            row["rows"] = rows_per_step(trace_path, [table.key(i).path for i in at_last.tolist()])
        except TraceError:
            row["rows"] = None
        row["last mean reward"] = last_mean_reward(summary)
    row["check"] = status.text() if status is not None else NOT_CHECKED
    guard = report_of(trace_path)
    row["guard"] = guard.text() if guard is not None else ""  # empty, not "None", when no guard ran
    return row
