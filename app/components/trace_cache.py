"""Cached access to traces for the pages.

``st.cache_resource`` holds one :class:`app.components.safe_trace.SafeTrace` per path and manifest
modification time, so a manifest rewritten by the trainer (status ``finished``) is read again; the
trace memoises its listing of step files while its directories do not change. Step files are read
through one process-wide :class:`app.components.step_handles.StepHandles` (at most
:data:`MAX_OPEN_STEP_FILES` open ``safe_open`` handles of :data:`MAX_OPEN_STEP_BYTES` together,
least recently used closed first), shared by every session. ``st.cache_data`` with bounded ``max_entries`` holds the small per-step frames,
keyed by the step file's identity (:func:`file_id`: path, inode, size, mtime), or by the list of
step files for whole-trace tables, so a new or rewritten step is read again; :func:`clear_caches`
(the Reload button) drops everything, including the token strings of an open trace, and closes
the idle handles.
"""

from __future__ import annotations

import gc
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import streamlit as st

from app.components.safe_trace import SafeTrace
from app.components.step_handles import FileId, StepHandles
from app.components.step_handles import file_id as _file_id
from tracer import (
    views,  # lazy (PEP 562): each view's module is imported on its first call
)
from tracer.errors import TraceError
from tracer.format.names import MANIFEST_NAME
from tracer.format.scalar_log import SCALARS_GLOB
from tracer.read import StepKey, Trace

if TYPE_CHECKING:
    import pandas as pd

    from tracer.diff import DiffReport

# What a page imports is what it draws: the checks (Health, Runs), the diff engine (Diff) and the
# step view (Step) are imported inside the functions below that use them, so that the Tokens page
# of a cold server does not pay for them (nor for torch, which they import).

# Fields whose first dim is B, tried in this order to count the sequences of a step.
_B_FIELDS = ("completion_ids", "prompt_ids", "chosen_ids", "rewards", "advantages")
MAX_OPEN_STEP_FILES = 64  # bounds of the shared handle cache (each handle maps one step file)
MAX_OPEN_STEP_BYTES = 512 * 2**20  # summed size of the open step files


@st.cache_resource(show_spinner=False)
def freeze_startup_objects() -> bool:
    """Once per server process (the entry script calls it): collect, then move every object alive
    (the imported modules' ~270,000) out of the cyclic garbage collector's generations
    (``gc.freeze``). A page that allocates many objects, such as the listing of a 10,000-step
    run, triggers a full collection, which otherwise walks all of them: about 170 ms each time on
    this machine, more than the rest of that page's work. Frozen objects are never collected;
    they are the process's import-time state, which lives as long as the process."""
    gc.collect()
    gc.freeze()
    return True


@st.cache_resource(show_spinner=False)
def step_handles() -> StepHandles:
    """The process-wide cache of open step files, shared by every session and trace."""
    return StepHandles(MAX_OPEN_STEP_FILES, MAX_OPEN_STEP_BYTES)


def open_trace(path: str) -> SafeTrace:
    """The trace at ``path`` (a trace directory or a single step file), read again when its
    manifest changes. Never mutate it. Raises TraceError (OutsideRootError, TraceFormatError)."""
    return _open_trace(path, manifest_mtime(path))


@st.cache_resource(max_entries=16, show_spinner=False)
def _open_trace(path: str, manifest_identity: FileId) -> SafeTrace:
    return SafeTrace(path, handles=step_handles())


def manifest_mtime(trace_path: str | Path) -> int:
    """Modification time of the trace's manifest; 0 when there is none (a step file, no manifest)."""
    try:
        return (Path(trace_path) / MANIFEST_NAME).stat().st_mtime_ns
    except OSError:
        return 0


def step_key(trace: Trace, step_path: str) -> StepKey:
    """The :class:`StepKey` of the step file at ``step_path``; KeyError when it is gone. O(1) on a
    :class:`SafeTrace` (its memoised listing), O(step files) on another trace."""
    found = trace.key_of(step_path) if isinstance(trace, SafeTrace) else next(
        (key for key in trace.steps() if str(key.path) == step_path), None)
    if found is not None:
        return found
    raise KeyError(f"{step_path} is no longer a step file of {trace.path}; press Reload")


def file_id(path: str | Path) -> FileId:
    """Identity of a step file (path, inode, size, mtime_ns), part of the cache keys below: a file
    rewritten under the same name has another. Raises OSError when it is gone."""
    return _file_id(path)


@st.cache_data(max_entries=64, show_spinner=False)
def token_table(trace_path: str, step_path: str, sequence: int, identity: FileId) -> pd.DataFrame:
    """``Trace.token_table(key, sequence)``: reads only that sequence's rows (``get_slice``)."""
    trace = open_trace(trace_path)
    return trace.token_table(step_key(trace, step_path), sequence)


@st.cache_resource(max_entries=16, show_spinner=False)  # no copy per rerun: never mutate it
def conversation(trace_path: str, step_path: str, sequence: int, identity: FileId) -> views.Conversation:
    """``views.conversation``: one sequence as an episode (reads that sequence's row and the [B] rewards)."""
    trace = open_trace(trace_path)
    return views.conversation(trace, step_key(trace, step_path), sequence)


@st.cache_data(max_entries=64, show_spinner=False)
def step_fields(trace_path: str, step_path: str, identity: FileId) -> dict[str, tuple[list[int], str]]:
    """``{field: (shape, dtype)}`` of one step file (header only)."""
    trace = open_trace(trace_path)
    return trace.fields(step_key(trace, step_path))


def recorded_fields(trace_path: str, keys: list[StepKey]) -> set[str] | None:
    """The fields the step files ``keys`` hold (:func:`step_fields`: headers, cached); None when
    none of them can be read. The navigation asks it for a run's first and selected step files."""
    fields = None
    for key in dict.fromkeys(keys):
        try:
            found = step_fields(trace_path, str(key.path), file_id(key.path))
        except (TraceError, OSError):
            continue
        fields = (fields or set()) | set(found)
    return fields


@st.cache_data(max_entries=64, show_spinner=False)
def step_metadata(trace_path: str, step_path: str, identity: FileId) -> dict:
    """Decoded metadata of one step file (header only)."""
    trace = open_trace(trace_path)
    return trace.metadata(step_key(trace, step_path))


@st.cache_data(max_entries=64, show_spinner=False)
def sequence_labels(trace_path: str, step_path: str, identity: FileId) -> list[str]:
    """One label per sequence of a step (``seq 3 · group 1 · reward 0.5``; ``pair 2`` for DPO); empty
    when no field has a B dim. Reads only the ``[B]`` fields ``group_ids`` and ``rewards``."""
    trace = open_trace(trace_path)
    key = step_key(trace, step_path)
    fields = trace.fields(key)
    sizes = [fields[name][0][0] for name in _B_FIELDS if name in fields and fields[name][0]]
    if not sizes:
        return []
    per_seq = {name: t.tolist() for name, t in trace.load_step(key, ["group_ids", "rewards"], as_numpy=True).items()
               if t.ndim == 1 and t.shape[0] == sizes[0]}  # numpy arrays: no torch for a label
    group_ids, rewards = per_seq.get("group_ids"), per_seq.get("rewards")
    noun = "pair" if "chosen_ids" in fields else "seq"  # a DPO row is a chosen / rejected pair
    labels = []
    for b in range(sizes[0]):
        parts = [f"{noun} {b}"]
        if group_ids is not None:
            parts.append(f"group {group_ids[b]}")
        if rewards is not None:
            parts.append(f"reward {rewards[b]:.4g}")
        labels.append(" · ".join(parts))
    return labels


def step_summary(trace_path: str, listing: str) -> pd.DataFrame:
    """``Trace.step_summary()``; ``listing`` (:func:`listing_token` of the names on disk) and the
    sizes of the run's logged-scalar files (:func:`scalar_log_stamp`) key the cache, so that new
    steps are summarised when they appear and a TRL log line written after its step's file (the
    step it closes) shows without waiting for the next step file."""
    return _step_summary(trace_path, listing, scalar_log_stamp(trace_path))


def scalar_log_stamp(trace_path: str) -> tuple[tuple[str, int], ...]:
    """(name, size) of each logged-scalar file (:data:`tracer.format.scalar_log.SCALARS_GLOB`) at
    the trace root: a few ``stat`` calls, no read."""
    root = Path(trace_path)
    root = root if root.is_dir() else root.parent.parent  # a step file: its trace root is two up
    out = []
    for path in sorted(root.glob(SCALARS_GLOB)):
        try:
            out.append((path.name, path.stat().st_size))
        except OSError:  # removed between the listing and the stat
            continue
    return tuple(out)


@st.cache_data(max_entries=8, show_spinner=False)
def _step_summary(trace_path: str, listing: str, scalars: tuple[tuple[str, int], ...]) -> pd.DataFrame:
    return open_trace(trace_path).step_summary()


def step_files(trace: Trace) -> tuple[str, ...]:
    """The names of the trace's step files: the cache key of whole-trace tables."""
    return tuple(trace.step_table().names)


def listing_token(trace: Trace) -> str:
    """A digest of the names of the trace's step files (:func:`step_files`): the same cache key in
    a few bytes (Streamlit hashes a tuple argument element by element: ~40 ms at 10,000 steps)."""
    return hashlib.blake2b("\0".join(step_files(trace)).encode("utf-8", "surrogateescape"),
                           digest_size=16).hexdigest()


# -- algorithm views (tracer.views) ------------------------------------------------------------------


@st.cache_data(max_entries=32, show_spinner=False)
def rollout_rows(trace_path: str, step: int, inner_step: int, files: tuple[str, ...]) -> list[views.RolloutRow]:
    """``views.rollout_rows``: where each rollout row of a PPO step and epoch lies."""
    return views.rollout_rows(open_trace(trace_path), step, inner_step)


@st.cache_data(max_entries=32, show_spinner=False)
def ppo_minibatch_table(trace_path: str, step: int, files: tuple[str, ...]) -> pd.DataFrame:
    """``views.ppo_minibatch_table``: epochs x minibatches of one PPO step."""
    return views.ppo_minibatch_table(open_trace(trace_path), step)


@st.cache_data(max_entries=8, show_spinner=False)
def ppo_early_stops(trace_path: str, files: tuple[str, ...]) -> pd.DataFrame:
    """``views.ppo_early_stops``: one row per PPO step (headers only)."""
    return views.ppo_early_stops(open_trace(trace_path))


@st.cache_data(max_entries=64, show_spinner=False)
def group_frame(trace_path: str, step_path: str, identity: FileId) -> pd.DataFrame:
    """``views.group_frame``: one row per group of one step file."""
    trace = open_trace(trace_path)
    return views.group_frame(trace, step_key(trace, step_path))


@st.cache_data(max_entries=64, show_spinner=False)
def group_completions(trace_path: str, step_path: str, group: int, identity: FileId) -> pd.DataFrame:
    """``views.group_completions``: the completions of one group."""
    trace = open_trace(trace_path)
    return views.group_completions(trace, step_key(trace, step_path), group)


@st.cache_data(max_entries=64, show_spinner=False)
def prompt_text(trace_path: str, step_path: str, sequence: int, identity: FileId) -> str:
    """``views.group_prompt_text``: the prompt of one row as text."""
    trace = open_trace(trace_path)
    return views.group_prompt_text(trace, step_key(trace, step_path), sequence)


@st.cache_data(max_entries=8, show_spinner=False)
def zero_variance_shares(trace_path: str, listing: str) -> pd.DataFrame:
    """``views.zero_variance_shares``: share of zero-variance groups per step, from the per-step
    summaries (:func:`step_summary`, shared with the Steps page) where they hold the counts."""
    return views.zero_variance_shares(open_trace(trace_path), step_summary(trace_path, listing))


@st.cache_data(max_entries=64, show_spinner=False)
def dpo_pair_tokens(trace_path: str, step_path: str, pair: int, identity: FileId) -> pd.DataFrame:
    """``views.dpo_pair_tokens``: one DPO pair, token by token."""
    trace = open_trace(trace_path)
    return views.dpo_pair_tokens(trace, step_key(trace, step_path), pair)


@st.cache_data(max_entries=64, show_spinner=False)
def dpo_pair_terms(trace_path: str, step_path: str, pair: int, identity: FileId) -> pd.DataFrame:
    """``views.dpo_pair_terms``: sums and DPO terms of one pair, recorded and recomputed."""
    trace = open_trace(trace_path)
    return views.dpo_pair_terms(trace, step_key(trace, step_path), pair)


@st.cache_data(max_entries=8, show_spinner=False)
def dpo_step_summary(trace_path: str, listing: str) -> pd.DataFrame:
    """``views.dpo_step_summary``: margin and preference accuracy per step."""
    return views.dpo_step_summary(open_trace(trace_path))


@st.cache_resource(max_entries=4, show_spinner="Reading the step…")  # no copy per rerun: never mutate it
def step_tokens(trace_path: str, step: int, inner_step: int, rank: int | None,
                identities: tuple[FileId, ...]) -> pd.DataFrame:
    """``views.step.step_token_frame``: every completion position of one step (all micro-batches,
    all ranks or one), shared between reruns: never mutate it. ``identities``
    (:func:`step_file_ids`) key it. Raises TraceFormatError."""
    from tracer.views import step as step_view

    return step_view.step_token_frame(open_trace(trace_path), step, inner_step, rank=rank)


def step_file_ids(trace: Trace, step: int, inner_step: int, rank: int | None) -> tuple[FileId, ...]:
    """:func:`file_id` of every step file of one step and inner step (every micro-batch; every rank
    or one): the cache key of :func:`step_tokens`, so that a step file rewritten under its name is
    read again, and a new step elsewhere in the run does not invalidate it."""
    from tracer.views import step as step_view

    return tuple(file_id(k.path) for k in step_view.step_files(trace, step, inner_step, None, rank))


# -- health (tracer.checks) and diff (tracer.diff) ------------------------------------------------------


def run_checks(trace: Trace, **kwargs):
    """:func:`tracer.checks.run_checks` (same arguments and result), imported on first call: the
    checks and torch are loaded by the first page that shows findings, not by every page."""
    from tracer.checks import run_checks as _run_checks

    return _run_checks(trace, **kwargs)


@st.cache_data(max_entries=8, show_spinner="Running the checks…")
def findings(trace_path: str, files: tuple[str, ...]) -> pd.DataFrame:
    """``run_checks`` on the step files named ``files`` (names on disk) as a findings frame
    (:func:`app.components.health.findings_frame`). A step file whose data cannot be read is a
    ``trace.unreadable`` error finding naming the file; the others are checked."""
    from app.components.health import findings_frame

    trace = open_trace(trace_path)
    keys = [k for k in trace.steps() if k.path.name in set(files)]
    return findings_frame(run_checks(trace, steps=keys) if keys else [])


@st.cache_data(max_entries=4, show_spinner="Comparing the traces…")
def diff_report(a: str, b: str, files_a: tuple[str, ...], files_b: tuple[str, ...],
                fields: tuple[str, ...] | None = None, atol: tuple[tuple[str, float], ...] = (),
                rtol: tuple[tuple[str, float], ...] = ()) -> DiffReport:
    """``tracer.diff(a, b, fields=, atol=, rtol=)`` (tolerances as ``(field or "*", value)`` pairs);
    the step file names of both sides key the cache. Raises TraceError."""
    from tracer.diff import diff

    return diff(a, b, fields=fields, atol=dict(atol) or None, rtol=dict(rtol) or None, progress=False)


@st.cache_data(max_entries=64, show_spinner=False)
def comparable(a: str, b: str) -> bool:
    """``tracer.diff.comparable``: whether the two traces can be diffed (headers only)."""
    from tracer.diff import comparable as comparable_traces

    return comparable_traces(a, b) is None


@st.cache_data(max_entries=16, show_spinner=False)
def token_diff(a: str, b: str, step: tuple[int, int, int, int], sequence: int,
               identities: tuple[FileId, FileId]) -> pd.DataFrame:
    """``tracer.diff.token_diff_table`` of one step pair and sequence; ``identities`` are the two step
    files' identities (:func:`file_id`). Raises TraceError."""
    from tracer.diff import token_diff_table

    return token_diff_table(a, b, step=step, sequence=sequence)


_CACHED = (_open_trace, token_table, step_fields, step_metadata, sequence_labels, _step_summary, rollout_rows,
           findings, diff_report, comparable, token_diff, ppo_minibatch_table, ppo_early_stops, group_frame, group_completions, prompt_text,
           zero_variance_shares, dpo_pair_tokens, dpo_pair_terms, dpo_step_summary, step_tokens)


def clear_caches() -> None:
    """Forget every cached trace and table (new steps, a finished manifest, new token strings) and
    close the open step files that no script run is reading."""
    step_handles().clear()
    for cached in _CACHED:
        cached.clear()
