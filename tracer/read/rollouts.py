"""Every completion of a run in one table (:func:`rollout_frame`, ``Trace.rollouts()``): one row per
sequence row of every step file, with its reward, reward components, length, advantage, mean ratio,
mean k3, mean |old - sampler| and text, for sorting, filtering and searching across steps.

A step file that the run's rollout summaries (:mod:`tracer.format.rollout_store`, written by the writer
thread) list under its name, coordinates and current size is not opened: its rows come from the
summaries (``source = "summary"``). Every other file (an older trace, a file written after a crash,
a single step file) is read, only the fields :data:`tracer.formulas.rows.ROW_FIELDS` (plus the inputs of a
derived ratio or k3), and its rows computed by the same :func:`tracer.formulas.rows.row_statistics`
(``source = "tensors"``). Not offered for DPO (its rows are preference pairs, not completions).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from tracer.errors import TraceError, TraceFormatError
from tracer.format import rollout_store
from tracer.format.text import clean_str

# The frame's columns, in order (reward components, ``reward/<name>``, go after ``reward``).
LEADING = ("step", "inner_step", "micro_batch", "rank", "seq", "group", "reward")
TRAILING = ("length", "advantage", "mean_ratio", "mean_ref_kl_k3", "mean_abs_mismatch", "mean_entropy", "text",
            "text_truncated", "source")
COMPONENT_PREFIX = "reward/"

Progress = Callable[[int, int], None]


def component_names(raw: Any, count: int) -> list[str]:
    """The column name of each of ``count`` reward components: ``reward/<name>`` from
    ``reward_component_names`` when it is a list of that many strings, else ``reward/component_<f>``
    (a repeated name gets its index added)."""
    names = raw if isinstance(raw, list) and len(raw) == count and all(isinstance(n, str) for n in raw) \
        else [f"component_{f}" for f in range(count)]
    out: list[str] = []
    for f, name in enumerate(names):
        column = COMPONENT_PREFIX + name
        out.append(column if column not in out else f"{column}_{f}")
    return out


def rollout_frame(trace: Any, progress: Progress | None = None) -> pd.DataFrame:
    """One row per completion of every step file of ``trace`` (a :class:`tracer.read.reader.Trace`).

    Columns: ``step, inner_step, micro_batch, rank, seq`` (row in its step file), ``group`` (int64,
    -1 when the step has no groups), ``reward``, ``reward/<name>`` per reward component (names from
    ``reward_component_names``), ``length`` (kept completion tokens), ``advantage`` (per sequence;
    PPO: mean over kept tokens), ``mean_ratio``, ``mean_ref_kl_k3`` (nats), ``mean_abs_mismatch``
    (mean |old_logprobs - sampler_logprobs| over kept tokens, nats), ``mean_entropy`` (nats),
    ``text`` (the kept completion tokens' text, at most
    :data:`tracer.format.rollout_store.MAX_TEXT_CHARS` characters), ``text_truncated`` (bool),
    ``source`` (``summary`` or ``tensors``). Values as :func:`tracer.formulas.rows.row_statistics`;
    NaN where a field is not recorded. Rows in step-file order, then ``seq``.

    ``progress(done, total)`` is called after each step file read from its tensors (``total``:
    the files no summary vouches for). A file that cannot be read gives no rows; ``attrs["problems"]``
    maps its name to why.

    Raises:
        TraceError: the trace is a DPO trace (no completions to list).
    """
    if trace.algorithm == "dpo":
        raise TraceError(f"{trace.path} is a DPO trace: its rows are preference pairs (chosen/rejected), not "
                         "completions; use the DPO page or Trace.token_table per step")
    table = trace.step_table()
    store = _store(trace)
    vouched = _vouched(trace, table, store)
    parts: list[dict[str, Any]] = []
    problems: dict[str, str] = {}
    pending = [i for i in range(len(table)) if vouched[i] is None]
    done = 0
    for i in range(len(table)):
        entry = vouched[i]
        if entry is not None:
            parts.append(_summary_part(entry, table.coordinates[i]))
            continue
        key = table.key(i)
        try:
            parts.append(_tensor_part(trace, key))
        except (TraceFormatError, RuntimeError, ValueError, IndexError, TypeError) as err:
            problems[key.path.name] = clean_str(str(err))
        done += 1
        if progress is not None:
            progress(done, len(pending))
    frame = _frame(parts)
    frame.attrs["problems"] = problems
    return frame


def _store(trace: Any) -> dict[str, dict[str, Any]]:
    """The trace's rollout summaries (every rank's), read again only when a file changed."""
    if trace._single:
        return {}
    paths = sorted(trace.root.glob(rollout_store.ROLLOUT_GLOB))
    signature = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            continue
        signature.append((path.name, st.st_ino, st.st_size, st.st_mtime_ns))
    held = trace.__dict__.get("_rollout_store")
    if held is not None and held[0] == signature:
        return held[1]
    entries = rollout_store.read_store(paths)
    trace.__dict__["_rollout_store"] = (signature, entries)
    return entries


def _vouched(trace: Any, table: Any, store: dict[str, dict[str, Any]]) -> list[dict[str, Any] | None]:
    """The store entry that vouches for each file of ``table`` (listed under its name, with its
    coordinates, in the trace's ``steps/``, at its current size), None where none does."""
    out: list[dict[str, Any] | None] = [None] * len(table)
    if not store or not len(table):
        return out
    steps_folder = trace.overview.steps_folder
    candidates = [i for i, name in enumerate(table.names) if name in store
                  and str(table.key(i).path.parent) == steps_folder
                  and tuple(store[name][k] for k in rollout_store.COORDINATES) == tuple(table.coordinates[i].tolist())]
    sizes = trace._current_sizes(steps_folder, [table.names[i] for i in candidates])
    for i, size in zip(candidates, sizes):
        if store[table.names[i]]["size"] == size:
            out[i] = store[table.names[i]]
    return out


def _summary_part(entry: dict[str, Any], coordinates: np.ndarray) -> dict[str, Any]:
    rows = entry["rows"]
    part: dict[str, Any] = {k: rows[k] for k in rollout_store.NUMBER_KEYS}  # arrays (rollout_store.read_store)
    part["group"] = rows["group"]
    part["text"], part["text_truncated"] = rows["text"], np.asarray(rows["text_truncated"], dtype=bool)
    values = rows.get("reward_components")  # (B, F) or None
    if values is not None:
        for f, name in enumerate(component_names(entry.get("reward_component_names"), values.shape[1])):
            part[name] = values[:, f]
    part["_coordinates"], part["source"] = coordinates, "summary"
    return part


def _tensor_part(trace: Any, key: Any) -> dict[str, Any]:
    """The rows of one step file computed from its tensors (:mod:`tracer.formulas.rows`, imported
    here with torch: a run whose rollout summaries are on disk is listed without it)."""
    from tracer.formulas import rows as row_formulas

    meta = trace.metadata(key)
    data = trace.load_step(key, row_formulas.ROW_FIELDS)
    stats = row_formulas.row_statistics(data, meta)
    part: dict[str, Any] = {k: stats[k] for k in row_formulas.ROW_STATS}
    part["group"] = stats["group"]
    shown = trace._shown_tokens
    texts = [rollout_store.completion_text(shown, ids) for ids in row_formulas.kept_ids(data)]
    part["text"] = [t for t, _ in texts]
    part["text_truncated"] = np.array([c for _, c in texts], dtype=bool)
    if "reward_components" in stats:
        values = stats["reward_components"]
        for f, name in enumerate(component_names(meta.get("reward_component_names"), values.shape[1])):
            part[name] = values[:, f]
    part["_coordinates"] = np.array([key.step, key.inner_step, key.micro_batch, key.rank], dtype=np.int64)
    part["source"] = "tensors"
    return part


def _frame(parts: list[dict[str, Any]]) -> pd.DataFrame:
    """One frame from the parts (each ``{column: [B] values}``), columns in :data:`LEADING`,
    components, :data:`TRAILING` order; a component a part lacks is NaN there."""
    components = list(dict.fromkeys(k for p in parts for k in p if k.startswith(COMPONENT_PREFIX)))
    sizes = [len(p["length"]) for p in parts]
    n = sum(sizes)
    data: dict[str, Any] = {}
    coordinates = np.repeat(np.stack([p["_coordinates"] for p in parts]) if parts else np.zeros((0, 4), np.int64),
                            sizes, axis=0)
    for j, name in enumerate(LEADING[:4]):
        data[name] = coordinates[:, j] if n else np.zeros(0, dtype=np.int64)
    data["seq"] = np.concatenate([np.arange(s, dtype=np.int64) for s in sizes]) if parts else np.zeros(0, np.int64)
    data["group"] = np.concatenate([p["group"] for p in parts]) if parts else np.zeros(0, np.int64)
    data["reward"] = _floats(parts, "reward", sizes)
    for name in components:
        data[name] = _floats(parts, name, sizes)
    for name in TRAILING[:6]:
        data[name] = _floats(parts, name, sizes)
    data["text"] = [t for p in parts for t in p["text"]]
    data["text_truncated"] = np.concatenate([p["text_truncated"] for p in parts]) if parts else np.zeros(0, bool)
    data["source"] = np.repeat(np.array([p["source"] for p in parts], dtype=object), sizes) if parts \
        else np.zeros(0, dtype=object)
    return pd.DataFrame(data)


def _floats(parts: list[dict[str, Any]], name: str, sizes: list[int]) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=np.float64)
    return np.concatenate([np.asarray(p[name], dtype=np.float64) if name in p else np.full(s, math.nan)
                           for p, s in zip(parts, sizes)])
