"""The run overview's frame (:meth:`tracer.read.reader.Trace.step_summary`) from the run's summary
columns (:mod:`tracer.format.summary_store`) as arrays: which listed step files the columns vouch for
(name, coordinates and current size, compared as arrays), their rows as columns of the frame, and
the one column order that every way of building the frame gives; and :class:`TraceOverview`, which
builds the frame of one :class:`tracer.read.reader.Trace` and reads the run's summary index.

A row is taken from the columns only when its file lies in ``steps/``, under the name the columns
list, with the coordinates they list, and its size on disk now is the size they list, and when no
later index line (the index tail the reader parsed) speaks for that file; every other file is
summarised as before (index line, header, tensors), and the frames are put together in the order
of the step keys.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable

import numpy as np
import pandas as pd

from tracer.format import run_index, scalar_log
from tracer.read import tables
from tracer.format import summary as summary_format
from tracer.errors import TraceFormatError
from tracer.format.integrity import check_step_header
from tracer.format.names import STEP_FILE_RE, STEPS_DIR
from tracer.read.step_table import StepKey
from tracer.format.summary_store import SummaryColumns
from tracer.format.text import clean_str

COORDINATES = ("step", "inner_step", "micro_batch", "rank")
TRAILING = ("summary_source", "derived", "problem")


def ordered(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with its columns in the overview's order: coordinates, summary keys in
    :func:`tracer.format.summary.ordered_keys` order (``mean_reward/<name>``, ``scalars/<name>`` after the
    fixed ones), any other column as it came, then ``summary_source``, ``derived``, ``problem``."""
    known = [*(c for c in COORDINATES if c in frame.columns),
             *summary_format.ordered_keys(c for c in frame.columns if summary_format.is_key(c))]
    tail = [c for c in TRAILING if c in frame.columns]
    middle = [c for c in frame.columns if c not in known and c not in tail]
    order = [*known, *middle, *tail]
    return frame if list(frame.columns) == order else frame[order]


# The per-step columns a plot starts from, in this order (each when present); the rest follow.
_FIRST = ("loss", "mean_reward", summary_format.COMPONENT_PREFIX, "mean_advantage", "mean_length", "mean_entropy",
          "mean_ratio", "mean_ref_kl_k3", "mean_approx_kl_k2", "mean_mismatch", "clip_fraction", "clip_fraction_low",
          "clip_fraction_high", "clip_region", summary_format.SCALAR_PREFIX, "kept_tokens", "groups",
          "zero_variance_groups")
_NOT_PLOTTED = frozenset({*COORDINATES, "wall_time", "group_ids_recorded"})


def scalar_columns(frame: pd.DataFrame) -> list[str]:
    """Every plottable per-step column of a :meth:`TraceOverview.step_summary` frame (or one a caller
    added derived columns to): numeric (not bool), with at least one finite value, neither a
    coordinate nor ``wall_time`` (an x-axis) nor ``group_ids_recorded`` (a flag). Order: the loss,
    rewards and their components, advantages, lengths, entropy, ratio, KL estimators, mismatch, clip
    fractions, the user's ``scalars/<name>`` (recorded, then TRL's logs), counts, then the
    quantiles and any other column in frame order."""
    plottable = [c for c in frame.columns if isinstance(c, str) and c not in _NOT_PLOTTED
                 and pd.api.types.is_numeric_dtype(frame[c]) and not pd.api.types.is_bool_dtype(frame[c])
                 and np.isfinite(frame[c].to_numpy(dtype=np.float64, na_value=np.nan)).any()]
    first = []
    for item in _FIRST:
        first += [c for c in plottable if c.startswith(item)] if item.endswith("/") else [c for c in plottable if c == item]
    return [*first, *(c for c in plottable if c not in first)]


def rows_of(columns: SummaryColumns, names: np.ndarray) -> np.ndarray:
    """``int64 [n]``: the row of ``columns`` listing each of the file ``names`` (``str [n]``), -1 for
    a name they do not list (a sort and a binary search, no loop over the names)."""
    if not len(columns) or not len(names):
        return np.full(len(names), -1, dtype=np.int64)
    order = columns.name_order
    found = order[np.minimum(np.searchsorted(columns.names, names, sorter=order), len(order) - 1)]
    return np.where(columns.names[found] == names, found, -1)


def table_rows(columns: SummaryColumns, table: Any) -> np.ndarray:
    """:func:`rows_of` the names of ``table`` (a :class:`tracer.read.step_table.StepTable`), computed
    once per table and columns (the listing and the overview of one page share it)."""
    held = table.__dict__.get("_rows_of")
    if held is not None and held[0] is columns:
        return held[1]
    found = rows_of(columns, table.name_array)
    table.__dict__["_rows_of"] = (columns, found)
    return found


def vouched_files(columns: SummaryColumns | None, later: dict[str, Any], folders: list[str] | str,
                  names: list[str], sizes: Any, steps_folder: str, rows: np.ndarray | None = None) -> np.ndarray:
    """``bool [n]``: whether the columns or an index line after them (``later``) vouch for each file
    ``names[i]`` of ``folders[i]`` (of ``folders`` when it is one folder's ``str``) at ``sizes[i]``
    bytes (a list or ``int64 [n]``): listed under that name at that size, in ``steps_folder``
    (and, for an index line, under the coordinates its name gives). The columns' rows are
    compared as arrays, index lines one by one. ``rows``: :func:`rows_of` the names, when known."""
    out = np.zeros(len(names), dtype=bool)
    one = folders if isinstance(folders, str) else None
    if one is not None and one != steps_folder:
        return out
    if columns is not None and len(names):
        rows = rows_of(columns, np.array(names, dtype=str)) if rows is None else rows
        out = (rows >= 0) & (columns.size[rows] == np.asarray(sizes, dtype=np.int64))
        if one is None:
            out &= np.array(folders, dtype=str) == steps_folder
    for i in [i for i, name in enumerate(names) if name in later] if later else ():
        entry, match = later[names[i]], STEP_FILE_RE.match(names[i])
        folder = one if one is not None else folders[i]
        out[i] = (entry["size"] == int(sizes[i]) and folder == steps_folder and match is not None
                  and run_index.vouched(entry, tuple(int(g) for g in match.groups()), int(sizes[i])))
    return out


def vouched_rows(columns: SummaryColumns, table: Any, steps_folder: str, later: dict[str, Any],
                 sizes: Callable[[str, list[str]], list[int]] | None = None) -> np.ndarray:
    """``int64 [n]``: the row of ``columns`` that vouches for each file of ``table`` (a
    :class:`tracer.read.step_table.StepTable`), -1 where none does (not listed, listed under other
    coordinates, not in ``steps_folder``, named in ``later`` (index lines after the columns), gone,
    or of another size now). ``sizes(folder, names)``: the current size of each named file of
    ``folder``, -1 when gone (default :func:`current_sizes`: one ``stat`` per candidate file)."""
    n = len(table)
    rows = np.full(n, -1, dtype=np.int64)
    if not n or not len(columns):
        return rows
    if table.folder is not None:  # one folder for the whole table
        in_folder: Any = str(table.folder) == steps_folder
    else:
        in_folder = np.array([str(k.path).rpartition(os.sep)[0] for k in table.keys_list], dtype=str) == steps_folder
    found = table_rows(columns, table)
    hit = (found >= 0) & (columns.coordinates[found] == table.coordinates).all(axis=1) & in_folder  # in steps/
    candidates = np.flatnonzero(hit)
    if later:
        candidates = np.array([i for i in candidates.tolist() if table.names[i] not in later], dtype=np.int64)
    if not len(candidates):
        return rows
    now = np.asarray((sizes or current_sizes)(steps_folder, [table.names[i] for i in candidates.tolist()]),
                     dtype=np.int64)
    match = now == columns.size[found[candidates]]
    rows[candidates[match]] = found[candidates[match]]
    return rows


def current_sizes(folder: str, names: list[str]) -> list[int]:
    """The size of each file of ``folder`` (-1 when it cannot be stat'ed), stat'ed by name relative
    to the open folder (no path built and resolved per file)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return [-1] * len(names)
    try:
        out = []
        for name in names:
            try:
                out.append(os.stat(name, dir_fd=fd).st_size)
            except OSError:
                out.append(-1)
        return out
    finally:
        os.close(fd)


def columns_frame(columns: SummaryColumns, rows: np.ndarray, coordinates: np.ndarray) -> pd.DataFrame:
    """The overview rows of ``columns``' ``rows`` (step files at ``coordinates``), as the header
    path would build them: a count column is int64 when every row holds it, float64 with NaN
    otherwise; ``summary_source`` is ``header``; ``derived`` the text of the derived fields."""
    data: dict[str, Any] = {name: coordinates[:, j] for j, name in enumerate(COORDINATES)}
    values, present = columns.values[rows], columns.present[rows]
    for j, key in enumerate(columns.keys):
        held = present[:, j]
        if not held.any():
            continue
        column = np.where(held, values[:, j], np.nan)
        data[key] = column.astype(np.int64) if key in summary_format.COUNT_KEYS and held.all() else column
    data["summary_source"] = np.full(len(rows), "header", dtype=object)
    data["derived"] = np.array(columns.derived_texts, dtype=object)[columns.derived[rows]]
    return pd.DataFrame(data)


def with_logged_scalars(frame: pd.DataFrame, logged: dict[int, dict[str, float]]) -> pd.DataFrame:
    """``frame`` with a ``scalars/<name>`` column per logged scalar (``{step: {name: value}}``), each
    row taking its step's value; where the step recorded the same scalar itself, that value stays."""
    if not logged or not len(frame) or "step" not in frame.columns:
        return frame
    names = list(dict.fromkeys(name for values in logged.values() for name in values))
    steps = frame["step"].to_numpy()
    added = {}
    for name in names:
        column = summary_format.SCALAR_PREFIX + name
        if not summary_format.named_key(column):
            continue
        values = np.array([logged.get(int(s), {}).get(name, np.nan) for s in steps], dtype=np.float64)
        if column in frame.columns:
            held = frame[column].to_numpy(dtype=np.float64, na_value=np.nan)
            values = np.where(np.isnan(held), values, held)
        added[column] = values
    frame = frame.drop(columns=[c for c in added if c in frame.columns]).assign(**added)
    return ordered(frame)


def combined(parts: list[tuple[np.ndarray, pd.DataFrame]], n: int) -> pd.DataFrame:
    """One frame of ``n`` rows from ``(positions, frame)`` parts (row i of a part is row
    ``positions[i]`` of the result)."""
    parts = [(p, f) for p, f in parts if len(p)]
    if not parts:
        return pd.DataFrame()
    if len(parts) == 1:
        return ordered(parts[0][1])
    frame = pd.concat([f for _, f in parts], ignore_index=True)
    where = np.concatenate([p for p, _ in parts])
    return ordered(frame.iloc[np.argsort(where, kind="stable")].reset_index(drop=True))


class TraceOverview:
    """The run overview of one :class:`tracer.read.reader.Trace` (``trace.overview``). It reads the
    trace through ``root``, ``step_table``, ``load_step``, ``derived_fields``, ``_open``, ``_single``,
    ``_algorithm_of`` and ``_current_sizes`` (a subclass of Trace may override the last: the app's
    listing hands over the sizes it stat'ed)."""

    def __init__(self, trace: Any) -> None:
        self._trace_ref = weakref.ref(trace)  # the trace holds this overview: no reference cycle
        self._index_reader: run_index.IndexReader | None = None
        self.steps_folder = str(trace.root / STEPS_DIR)

    @property
    def trace(self) -> Any:
        """The trace this overview belongs to."""
        return self._trace_ref()

    def step_summary(self) -> pd.DataFrame:
        """One row per step file with the step's summary (:mod:`tracer.format.summary`): ``kept_tokens``,
        masked means and quantiles (``mean_ratio``, ``ratio_p50``, ``mean_ref_kl_k3``,
        ``mean_approx_kl_k2``, ``mean_mismatch``, ``mean_reward``, ``mean_advantage``...),
        ``clip_fraction`` (sign-aware, from the step's clip epsilons), NaN counts, and
        ``summary_source``: ``header`` when the writer stored the summary in the file's header,
        ``tensors`` when it was computed from the file's tensors (older traces).
        Values a step lacks are NaN. When a step file cannot be read, its row has only its
        coordinates and a ``problem`` column says why.

        A step file that the run's summary columns (:mod:`tracer.format.summary_store`) or summary index
        (:mod:`tracer.format.run_index`) list under its name, coordinates and current size is not opened:
        its row comes from them (the same numbers as its header); the others are read as above.
        ``attrs["from_index"]`` counts the rows read from either. Cost: one listing of the steps
        (:meth:`step_table`: a key is built only for a file the columns do not vouch for),
        one ``stat`` per step file, one load of the columns and a parse of the index lines after
        them, plus one header per file they do not vouch for; the rows of the columns are put in
        the frame as arrays (:mod:`tracer.read.overview`)."""
        trace = self.trace
        table = trace.step_table()
        index = self.summary_index()
        columns = self.summary_columns()
        coordinates = table.coordinates
        rows = vouched_rows(columns, table, self.steps_folder, index, trace._current_sizes) \
            if columns else np.full(len(table), -1, dtype=np.int64)
        stored = np.flatnonzero(rows >= 0)
        records, rest = [], np.flatnonzero(rows < 0)
        from_index = len(stored)
        for i in rest.tolist():
            key = table.key(i)
            rec: dict[str, Any] = {"step": key.step, "inner_step": key.inner_step,
                                   "micro_batch": key.micro_batch, "rank": key.rank}
            listed = run_index.summary_row(index, key, self.steps_folder) if index else None
            if listed is not None:
                rec.update(listed)
                from_index += 1
                records.append(rec)
                continue
            try:
                rec.update(self._step_summary_of(key))
                rec["derived"] = ", ".join(trace.derived_fields(key))
            except TraceFormatError as err:
                rec["problem"] = clean_str(str(err))  # a non-UTF-8 path must not break the table
            records.append(rec)
        parts = [(rest, pd.DataFrame.from_records(records))]
        if len(stored):
            parts.append((stored, columns_frame(columns, rows[stored], coordinates[stored])))
        frame = with_logged_scalars(combined(parts, len(table)), self.logged_scalars())
        frame.attrs["from_index"] = from_index
        return frame

    def logged_scalars(self) -> dict[int, dict[str, float]]:
        """``{step: {name: value}}`` of the run's logged scalars (:mod:`tracer.format.scalar_log`: TRL's
        logs, ``TraceWriter.log_scalars``), read again only when a file changed; {} for a single step file."""
        trace = self.trace
        if trace._single:
            return {}
        paths = sorted(trace.root.glob(scalar_log.SCALARS_GLOB))
        signature = []
        for path in paths:
            try:
                st = path.stat()
            except OSError:
                continue
            signature.append((path.name, st.st_ino, st.st_size, st.st_mtime_ns))
        held = self.__dict__.get("_logged")
        if held is None or held[0] != signature:
            held = self._logged = (signature, scalar_log.read_scalars(paths))
        return held[1]

    def summary_index(self) -> dict[str, dict[str, Any]]:
        """``{step file name: entry}`` of the trace's summary index files (:func:`tracer.format.run_index.read_index`)
        beyond what their summary columns hold (:meth:`summary_columns`); {} for a single step file
        or a trace without one. Only what a live writer appended since the last call is read
        (:class:`tracer.format.run_index.IndexReader`)."""
        if self.trace._single:
            return {}
        if self._index_reader is None:
            self._index_reader = run_index.IndexReader(self.trace.root)
        return self._index_reader.entries()

    def summary_columns(self) -> SummaryColumns | None:
        """The rows of the run's summary columns (:mod:`tracer.format.summary_store`, every rank's) that
        go with its index as of the last :meth:`summary_index`, or None."""
        return None if self._index_reader is None else self._index_reader.columns()

    def vouched(self, folders: list[str] | str, names: list[str], sizes: Any,
                index: dict[str, dict[str, Any]] | None = None) -> np.ndarray:
        """Whether the summary index or columns list each of the files ``names`` of ``folders`` (one
        each, or one folder's ``str``) at ``sizes`` bytes, as ``bool [n]``: then it is a file the
        writer wrote and renamed whole. The columns' rows are compared as arrays, index lines (those
        after the columns) one by one."""
        index = self.summary_index() if index is None else index
        return vouched_files(self.summary_columns(), index, folders, names, sizes, self.steps_folder)

    def _step_summary_of(self, key: StepKey) -> dict[str, Any]:
        """The summary of one step file: from its header when it holds one, else from its tensors."""
        trace = self.trace
        with trace._open(key.path) as fh:
            meta = trace._metadata_of(key.path, fh)
            check_step_header(key.path, fh, trace._algorithm_of(meta))
        stored = summary_format.read_summary(meta)
        if stored is not None:
            return {**stored, "summary_source": "header"}
        data = trace.load_step(key, tables.SUMMARY_FIELDS)
        try:
            computed = tables.summary_values(meta, data)
        except (RuntimeError, ValueError, IndexError, TypeError) as err:  # tensors the header check let through
            raise TraceFormatError(f"{key.path}: could not summarise the step from its tensors "
                                   f"({type(err).__name__}: {err})") from err
        return {**computed, "summary_source": "tensors"}
