"""The shared sidebar: where traces are looked for (the root), and the run / step file / sequence
choosers. Every page reads the choice with :func:`current_selection`."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import streamlit as st

from app.components import trace_cache
from tracer.errors import TraceError
from tracer.reader import StepKey, find_traces
from tracer.writer import MANIFEST_NAME, STEPS_DIR

ROOT_ENV = "TRACER_ROOT"
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "sample_traces"
_SELECTION_STATE = "_tracer_selection"


@dataclass(frozen=True)
class Selection:
    """What the sidebar chose: a trace, one of its step files (None while it has none) and a
    sequence of that step (None when no field has a B dim)."""

    root: Path
    trace_path: Path
    key: StepKey | None
    sequence: int | None


def resolve_root(argv: Sequence[str], environ: Mapping[str, str]) -> Path:
    """The directory to look for traces in: ``--root DIR`` among the script arguments (what
    follows ``--`` in ``streamlit run app/streamlit_app.py -- --root DIR``), else the
    ``TRACER_ROOT`` environment variable, else ``sample_traces/`` next to the repository root."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--root")
    try:
        args, _ = parser.parse_known_args(list(argv))
    except SystemExit:  # "--root" without a value: fall back rather than kill the app
        args = argparse.Namespace(root=None)
    if args.root:
        return Path(args.root).expanduser()
    if environ.get(ROOT_ENV):
        return Path(environ[ROOT_ENV]).expanduser()
    return DEFAULT_ROOT


def discover_traces(root: Path) -> list[Path]:
    """Traces at or under ``root`` (``find_traces``); ``root`` itself counts when it is a trace,
    including a step directory without manifest or a single ``.safetensors`` step file."""
    found = find_traces(root) if root.is_dir() else []
    if found:
        return found
    try:
        trace_cache.open_trace(str(root))
    except TraceError:
        return []
    return [root]


def no_trace_message(root: Path) -> str:
    """What the app says when ``root`` holds no trace (Markdown; the path is in a code span)."""
    where = "does not exist" if not root.exists() else "holds no trace"
    return (
        f"`{root}` {where}. Expected a trace directory written by tracer (a `{MANIFEST_NAME}` and "
        f"a `{STEPS_DIR}/` folder of `.safetensors` step files), at the root or up to two levels "
        "below it, or a single `.safetensors` step file. Write one with `python -m tracer demo OUT` "
        f"or by attaching `TraceWriter` to a trainer, then start the app with `--root DIR` "
        f"(or set `{ROOT_ENV}`)."
    )


def _run_label(root: Path, path: Path) -> str:
    try:
        rel = path.relative_to(root)
    except ValueError:
        return str(path)
    return str(rel) if str(rel) != "." else f"{path.name} (the root)"


def _step_labels(keys: list[StepKey]) -> list[str]:
    labels = [k.label for k in keys]
    if len(set(labels)) < len(labels):  # user-named files claiming the same step
        labels = [f"{k.label} · {k.path.name}" for k in keys]
    return labels


def render_sidebar(root: Path) -> Selection | None:
    """Draw the sidebar and return the choice; None when ``root`` holds no trace."""
    sb = st.sidebar
    sb.title("tracer")
    sb.text(f"root: {root}")
    if sb.button("Reload", help="read the trace again: new steps, manifest status, token strings"):
        trace_cache.clear_caches()
    traces = discover_traces(root)
    if not traces:
        return None
    run = sb.selectbox("Run", traces, format_func=lambda p: _run_label(root, p), key="run")
    trace = trace_cache.open_trace(str(run))
    keys = trace.steps()
    sb.text(f"{trace.algorithm or 'unknown algorithm'} · {trace.status} · {len(keys)} step files")
    if not keys:
        return Selection(root, run, None, None)
    labels = _step_labels(keys)
    label = sb.selectbox("Step file", labels, key="step_file",
                         help="step · inner step (PPO epoch / GRPO iteration) · micro-batch · rank")
    key = keys[labels.index(label)]
    seq_labels = trace_cache.sequence_labels(str(run), str(key.path), trace_cache.mtime_ns(key.path))
    sequence = None
    if seq_labels:
        sequence = sb.selectbox("Sequence", range(len(seq_labels)), format_func=seq_labels.__getitem__,
                                key="sequence")
    return Selection(root, run, key, sequence)


def store_selection(selection: Selection) -> None:
    """Make the sidebar's choice available to the page that runs next."""
    st.session_state[_SELECTION_STATE] = selection


def current_selection() -> Selection:
    """The sidebar's choice of this run of the app (set by the entry script before the page)."""
    return st.session_state[_SELECTION_STATE]
