"""The Diff page's choices and tables: which pair of traces to open on, the ``tracer diff`` command
a choice of fields and tolerances amounts to, the step files two traces share, and the side-by-side
token view of ``tracer.diff.token_diff_table`` with differing cells marked and positions that are
not compared greyed. Pure Python and pandas, no Streamlit: tests call it. Which values differ
(tolerances, masks, token alignment) is decided by ``tracer.diff``; nothing here compares numbers.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Callable, Mapping

import pandas as pd
from pandas.io.formats.style import Styler

from app.components.token_table import MASK_BACKGROUND, MASKED_TEXT_COLOUR, MAX_STYLED_CELLS, visible_tokens
from tracer.diff.locations import StepId
from tracer.read import StepKey
from tracer.read.tables import MASKED, TOKEN_VALUE_FIELDS

DIFF_STYLE = "background-color: #ffb3b3; color: #000000; font-weight: bold"
DIFFERS_COLUMN = "differs"
LEAD_COLUMNS = ("position", "token_text_a", "token_text_b", "mask_reason_a", "mask_reason_b", DIFFERS_COLUMN)


BASELINE_KEY = "diff_baseline"  # manifest config key: the trace this one is a variant of (path relative to it)


def declared_baseline(trace_path: Path, manifest: Mapping[str, Any], traces: list[Path]) -> Path | None:
    """The trace among ``traces`` that ``trace_path``'s manifest names as its baseline
    (``config.diff_baseline``, a path relative to the trace, as ``tracer.demo.diff_pair`` writes it)."""
    config = manifest.get("config")
    name = config.get(BASELINE_KEY) if isinstance(config, dict) else None
    if not isinstance(name, str) or not name:
        return None
    try:
        target = (trace_path / name).resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    return next((t for t in traces if t.resolve() == target and t != trace_path), None)


def default_pair(traces: list[Path], selected: Path | None, baselines: Mapping[Path, Path],
                 comparable: Callable[[Path, Path], bool]) -> tuple[int, int]:
    """Indices ``(a, b)`` into ``traces`` of the pair the Diff page opens on (``len(traces) >= 2``):
    the selected trace and its declared baseline (a = baseline), else the first declared pair, else
    the selected trace and the first trace it can be compared with, else the first comparable pair,
    else the selected trace and the next one."""
    index = {t: i for i, t in enumerate(traces)}
    sel = index.get(selected, 0) if selected is not None else 0
    if traces[sel] in baselines:
        return index[baselines[traces[sel]]], sel
    for variant, base in baselines.items():
        if variant in index and base in index:
            return index[base], index[variant]
    partner = next((j for j, t in enumerate(traces) if j != sel and comparable(traces[sel], t)), None)
    if partner is not None:
        return sel, partner
    for i, ta in enumerate(traces):
        for j in range(i + 1, len(traces)):
            if comparable(ta, traces[j]):
                return i, j
    return sel, (sel + 1) % len(traces)


def split_tolerances(text: str) -> list[str]:
    """``"1e-4, ratio=1e-3"`` -> ``["1e-4", "ratio=1e-3"]`` (commas or spaces between items)."""
    return [item for item in re.split(r"[,\s]+", text.strip()) if item]


def cli_command(a: Path, b: Path, fields: list[str], atol: list[str], rtol: list[str]) -> str:
    """The ``tracer diff`` command line that compares what the page compares."""
    parts = ["python", "-m", "tracer", "diff", str(a), str(b)]
    if fields:
        parts += ["--fields", ",".join(fields)]
    for flag, items in (("--atol", atol), ("--rtol", rtol)):
        for item in items:
            parts += [flag, item]
    return shlex.join(parts)


def step_id(key: StepKey) -> StepId:
    """``(step, inner_step, micro_batch, rank)`` of a step file, as ``tracer.diff`` pairs them."""
    return (key.step, key.inner_step, key.micro_batch, key.rank)


def common_steps(keys_a: list[StepKey], keys_b: list[StepKey], single_files: bool = False,
                 rank: int | None = None) -> list[StepId]:
    """Step ids present in both traces (of ``rank`` when given), in a's order. Two single step
    files pair whatever their step numbers (as in ``tracer.diff``): then a's id."""
    if single_files:
        return [step_id(keys_a[0])] if keys_a and keys_b else []
    ids_b = {step_id(k) for k in keys_b}
    return [step_id(k) for k in keys_a if step_id(k) in ids_b and (rank is None or k.rank == rank)]


def value_fields(table: pd.DataFrame) -> list[str]:
    """Per-token value fields compared on both sides, in the reader's display order."""
    return [name for name in TOKEN_VALUE_FIELDS if f"{name}_a" in table and f"{name}_b" in table]


def differing_names(table: pd.DataFrame) -> pd.Series:
    """Per row: ``token, mask, ratio, ...``, what differs at that position (empty when nothing)."""
    flags = []
    if "id_differs" in table:
        flags.append(("token", table["id_differs"].fillna(False).astype(bool)))
    if "mask_differs" in table:
        flags.append(("mask", table["mask_differs"].fillna(False).astype(bool)))
    flags += [(name, table[f"{name}_differs"].fillna(False).astype(bool)) for name in value_fields(table)
              if f"{name}_differs" in table]
    return pd.Series([", ".join(name for name, flag in flags if flag.iloc[i]) for i in range(len(table))],
                     index=table.index, dtype="string")


def side_by_side_frame(table: pd.DataFrame) -> pd.DataFrame:
    """The columns of ``token_diff_table`` worth showing: position, token text and mask reason of
    a and b, what differs, then ``<field>_a, <field>_b`` for each value field. The ``*_differs``
    and ``kept_*`` flags are left out (:func:`style_side_by_side` shows them as colours). Token
    texts go through ``token_table.visible_tokens`` (a space token reads ``␣``)."""
    frame = table.assign(**{DIFFERS_COLUMN: differing_names(table)})
    columns = [c for c in LEAD_COLUMNS if c in frame]
    for name in value_fields(table):
        columns += [f"{name}_a", f"{name}_b"]
    return visible_tokens(frame[columns].reset_index(drop=True))


def _greyed(table: pd.DataFrame) -> pd.Series:
    if "compared" in table:  # kept on both sides, with the same prompt and tokens so far (tracer.diff.tokens)
        return ~table["compared"].fillna(False).astype(bool)
    kept_a = table["kept_a"].fillna(False).astype(bool) if "kept_a" in table else True
    kept_b = table["kept_b"].fillna(False).astype(bool) if "kept_b" in table else True
    return ~(kept_a & kept_b)


def style_side_by_side(frame: pd.DataFrame, table: pd.DataFrame) -> Styler | pd.DataFrame:
    """Grey the positions whose values are not compared (not kept on both sides, or another prompt
    or earlier token: the ``compared`` column of ``token_diff_table``), mark each differing cell
    (both values of a differing field, both token texts when ids differ, both mask reasons when the
    masks differ, and the ``differs`` cell) with :data:`DIFF_STYLE`, format floats with 7
    significant digits. ``frame`` is :func:`side_by_side_frame` of ``table``. Returns ``frame``
    unstyled past :data:`MAX_STYLED_CELLS` cells."""
    if frame.size > MAX_STYLED_CELLS:
        return frame
    table = table.reset_index(drop=True)
    grey = f"background-color: {MASK_BACKGROUND[MASKED]}; color: {MASKED_TEXT_COLOUR}"
    styles = pd.DataFrame("", index=frame.index, columns=frame.columns)
    styles.loc[_greyed(table).to_numpy(), :] = grey
    marks = {"token_text": table.get("id_differs"), "mask_reason": table.get("mask_differs")}
    marks.update({name: table.get(f"{name}_differs") for name in value_fields(table)})
    for name, flag in marks.items():
        if flag is None or f"{name}_a" not in frame:
            continue
        hit = flag.fillna(False).astype(bool).to_numpy()
        styles.loc[hit, [f"{name}_a", f"{name}_b"]] = DIFF_STYLE
    styles.loc[(frame[DIFFERS_COLUMN] != "").to_numpy(), DIFFERS_COLUMN] = DIFF_STYLE
    floats = [c for c in frame.columns if pd.api.types.is_float_dtype(frame[c])]
    return frame.style.apply(lambda _: styles, axis=None).format("{:.7g}", subset=floats, na_rep="")
