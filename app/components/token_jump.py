"""The jump from a finding (Health page) to its token (Tokens page).

1. The Health page calls :func:`request` with the finding's :class:`FindingTarget` and
   ``st.switch_page("app_pages/tokens.py")``.
2. On that rerun the sidebar, before it draws its choosers, calls :func:`select_run` and
   :func:`select_step`: they write the run, rank, step file and sequence into the choosers' keys
   in ``st.session_state`` (allowed before a widget is drawn) and keep the target as the highlight.
3. The Tokens page asks :func:`highlight_for` whether the shown sequence is the target's, and if so
   marks the token's row and shows :meth:`FindingTarget.caption`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import streamlit as st

from app.components.finding_target import FindingTarget
from tracer.read import StepKey

_JUMP_STATE = "_tracer_jump"  # a FindingTarget waiting for the sidebar
_HIGHLIGHT_STATE = "_tracer_highlight"  # the FindingTarget the Tokens page marks


def request(target: FindingTarget) -> None:
    """Ask the next run's sidebar to select ``target`` (then call ``st.switch_page``)."""
    st.session_state[_JUMP_STATE] = target


def pending() -> FindingTarget | None:
    return st.session_state.get(_JUMP_STATE)


def select_run(target: FindingTarget, traces: list[Path]) -> None:
    """Point the Run chooser at the target's trace (before it is drawn)."""
    match = next((t for t in traces if str(t) == target.trace_path), None)
    if match is None:
        st.session_state.pop(_JUMP_STATE, None)
        return
    st.session_state["run"] = match


def select_step(target: FindingTarget, run: Path, keys: list[StepKey],
                labels_of: Callable[[list[StepKey]], list[str]]) -> None:
    """Point the Rank, Step file and Sequence choosers at the target (before they are drawn) and
    keep the target as the highlight. ``keys`` are every step file of ``run``; ``labels_of`` gives
    the Step file chooser's labels of a list of keys."""
    st.session_state.pop(_JUMP_STATE, None)
    key = next((k for k in keys if str(run) == target.trace_path and str(k.path) == target.step_path), None)
    if key is None:
        return
    rank = st.session_state.get("rank")
    if rank is not None and rank != key.rank:
        st.session_state["rank"] = None  # all ranks, so that the target's step file is listed
        rank = None
    shown = [k for k in keys if rank is None or k.rank == rank]
    st.session_state["step_file"] = labels_of(shown)[shown.index(key)]
    st.session_state["sequence"] = target.sequence
    st.session_state[_HIGHLIGHT_STATE] = target


def highlight_for(trace_path: Path, key: StepKey | None, sequence: int | None) -> FindingTarget | None:
    """The target to mark when the page shows its sequence of its step file, else None."""
    target = st.session_state.get(_HIGHLIGHT_STATE)
    if target is None or key is None:
        return None
    if (target.trace_path, target.step_path, target.sequence) != (str(trace_path), str(key.path), sequence):
        return None
    return target


def clear_highlight() -> None:
    st.session_state.pop(_HIGHLIGHT_STATE, None)
