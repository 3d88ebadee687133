"""Cached access to traces for the pages.

``st.cache_resource`` holds one :class:`tracer.reader.Trace` per path (it keeps no open file: the
reader opens a step file per call). ``st.cache_data`` with bounded ``max_entries`` holds the small
frames. Keys include the step file's modification time or the list of step files, so a new or
rewritten step is read again; :func:`clear_caches` (the Reload button) drops everything, including
the manifest and token strings of an open trace.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from tracer.reader import StepKey, Trace

# Fields whose first dim is B, tried in this order to count the sequences of a step.
_B_FIELDS = ("completion_ids", "prompt_ids", "chosen_ids", "rewards", "advantages")


@st.cache_resource(max_entries=16, show_spinner=False)
def open_trace(path: str) -> Trace:
    """The trace at ``path`` (a trace directory or a single step file). Never mutate it."""
    return Trace(path)


def step_key(trace: Trace, step_path: str) -> StepKey:
    """The :class:`StepKey` of the step file at ``step_path``; KeyError when it is gone."""
    for key in trace.steps():
        if str(key.path) == step_path:
            return key
    raise KeyError(f"{step_path} is no longer a step file of {trace.path}; press Reload")


def mtime_ns(path: str | Path) -> int:
    """Modification time of a file, part of the cache keys below."""
    return Path(path).stat().st_mtime_ns


@st.cache_data(max_entries=64, show_spinner=False)
def token_table(trace_path: str, step_path: str, sequence: int, mtime: int) -> pd.DataFrame:
    """``Trace.token_table(key, sequence)``: reads only that sequence's rows (``get_slice``)."""
    trace = open_trace(trace_path)
    return trace.token_table(step_key(trace, step_path), sequence)


@st.cache_data(max_entries=64, show_spinner=False)
def step_fields(trace_path: str, step_path: str, mtime: int) -> dict[str, tuple[list[int], str]]:
    """``{field: (shape, dtype)}`` of one step file (header only)."""
    trace = open_trace(trace_path)
    return trace.fields(step_key(trace, step_path))


@st.cache_data(max_entries=64, show_spinner=False)
def step_metadata(trace_path: str, step_path: str, mtime: int) -> dict:
    """Decoded metadata of one step file (header only)."""
    trace = open_trace(trace_path)
    return trace.metadata(step_key(trace, step_path))


@st.cache_data(max_entries=64, show_spinner=False)
def sequence_labels(trace_path: str, step_path: str, mtime: int) -> list[str]:
    """One label per sequence of a step (``seq 3 · group 1 · reward 0.5``); empty when no field
    has a B dim. Reads only the ``[B]`` fields ``group_ids`` and ``rewards``."""
    trace = open_trace(trace_path)
    key = step_key(trace, step_path)
    fields = trace.fields(key)
    sizes = [fields[name][0][0] for name in _B_FIELDS if name in fields and fields[name][0]]
    if not sizes:
        return []
    per_seq = {name: t.tolist() for name, t in trace.load_step(key, ["group_ids", "rewards"]).items()
               if t.dim() == 1 and t.shape[0] == sizes[0]}
    group_ids, rewards = per_seq.get("group_ids"), per_seq.get("rewards")
    labels = []
    for b in range(sizes[0]):
        parts = [f"seq {b}"]
        if group_ids is not None:
            parts.append(f"group {group_ids[b]}")
        if rewards is not None:
            parts.append(f"reward {rewards[b]:.4g}")
        labels.append(" · ".join(parts))
    return labels


@st.cache_data(max_entries=8, show_spinner=False)
def step_summary(trace_path: str, step_files: tuple[str, ...]) -> pd.DataFrame:
    """``Trace.step_summary()``; ``step_files`` (the names on disk) keys the cache so that new
    steps are summarised when they appear."""
    return open_trace(trace_path).step_summary()


def clear_caches() -> None:
    """Forget every cached trace and table (new steps, a finished manifest, new token strings)."""
    for cached in (open_trace, token_table, step_fields, step_metadata, sequence_labels, step_summary):
        cached.clear()
