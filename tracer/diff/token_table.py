"""One step pair's completion tokens side by side (``token_diff_table``, the app's Diff page): ids,
texts, masks and token-aligned values of both traces per ``(sequence, position)``, with the positions
the diff compares and those whose values fail the field's tolerance marked, by the rules of
``tracer.diff`` (token alignment: ``tracer.diff.tokens``; tolerances: ``tracer.diff.stats``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import pandas as pd
import torch

from tracer.diff.inputs import DiffInputError, check_compatible, pair_steps, per_field, step_id
from tracer.diff.locations import StepId
from tracer.diff.stats import field_tolerance, mismatch
from tracer.read import StepKey, Trace
from tracer.read.tables import TOKEN_VALUE_FIELDS


def token_diff_table(
    a: str | Path,
    b: str | Path,
    step: StepId | None = None,
    sequence: int | None = None,
    *,
    atol: float | Mapping[str, float] | None = None,
    rtol: float | Mapping[str, float] | None = None,
) -> pd.DataFrame:
    """Completion tokens of one step pair side by side, for a token view (the app's Diff page).

    Args:
        a, b: the reference and the candidate trace.
        step: ``(step, inner_step, micro_batch, rank)`` present in both, or a step number (inner step,
            micro-batch and rank 0) (default: the first of a;
            two single step files are paired whatever their step numbers).
        sequence: one sequence (reads only that row), or None for the whole step.
        atol, rtol: as for :func:`diff`.

    Returns:
        One row per ``(sequence, position)``: ``token_id_a/_b``, ``token_text_a/_b``, ``kept_a/_b``,
        ``mask_reason_a/_b``, ``mask_differs``, ``id_differs``, ``compared`` (both sides keep the
        position and its prompt and tokens so far agree: see ``tracer.diff.tokens``), and per value
        field present on both sides ``<field>_a``, ``<field>_b``, ``<field>_differs`` (True only
        where ``compared`` and the values fail the field's tolerance).

    Raises:
        TraceError: a path is not a trace, or ``step`` is not in both traces.
    """
    trace_a, trace_b = Trace(a), Trace(b)
    check_compatible(trace_a, trace_b)
    pairs, _, _ = pair_steps(trace_a, trace_b)
    if isinstance(step, StepKey):
        step = (step.step, step.inner_step, step.micro_batch, step.rank)
    elif isinstance(step, int):  # a bare step number: its first inner step, micro-batch and rank
        step = (step, 0, 0, 0)
    pair = next((p for p in pairs if step is None or step_id(p[0]) == tuple(step)), None)
    if pair is None:
        have = [step_id(p[0]) for p in pairs][:10]
        raise DiffInputError(f"step {step} is not in both traces; steps in both: {have}")
    frames = [t.token_table(k, sequence, derive=False) for t, k in ((trace_a, pair[0]), (trace_b, pair[1]))]
    if any("section" not in f for f in frames):
        raise DiffInputError(
            "the side-by-side token view shows completion tokens (completion_ids); these step files have "
            "none (a DPO trace records chosen_* / rejected_* fields): use the per-field report instead")
    prompts = [f[f["section"] == "prompt"] for f in frames]
    frames = [f[f["section"] == "completion"].drop(columns=["section", "step", "inner_step", "rank"]) for f in frames]
    table = frames[0].merge(frames[1], on=["sequence", "position"], how="outer", suffixes=("_a", "_b"))
    table["mask_differs"] = table["kept_a"] != table["kept_b"]
    table["id_differs"] = table["token_id_a"] != table["token_id_b"]
    both = (table["kept_a"] == True) & (table["kept_b"] == True)  # noqa: E712 (NaN rows stay False)
    table["compared"] = both & _same_context_rows(table, prompts)
    heads = [trace_a.fields(pair[0]), trace_b.fields(pair[1])]
    atols, rtols = per_field(atol, "atol"), per_field(rtol, "rtol")
    for name in TOKEN_VALUE_FIELDS:
        if f"{name}_a" in table and f"{name}_b" in table:
            tol = field_tolerance(name, heads[0][name][1], heads[1][name][1], atols, rtols)
            va = torch.tensor(table[f"{name}_a"].to_numpy(dtype="float64"))
            vb = torch.tensor(table[f"{name}_b"].to_numpy(dtype="float64"))
            _, fail = mismatch(va, vb, torch.tensor(table["compared"].to_numpy(dtype=bool)), tol)
            table[f"{name}_differs"] = fail.numpy()
    return table


def _same_context_rows(table: pd.DataFrame, prompts: list[pd.DataFrame]) -> pd.Series:
    """Per row of a merged token table: the prompt and the tokens up to this position agree."""
    same = (table["token_id_a"] == table["token_id_b"]).astype(int)
    context = same.groupby(table["sequence"]).cummin().astype(bool)
    if all("token_id" in p for p in prompts):
        kept = [p[p["kept"] == True] for p in prompts]  # noqa: E712
        texts = [k.groupby("sequence")["token_id"].apply(tuple) for k in kept]
        rows = pd.concat(texts, axis=1, keys=["a", "b"])
        differ = rows.index[rows["a"] != rows["b"]]
        context &= ~table["sequence"].isin(differ)
    return context
