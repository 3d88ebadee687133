"""verl's GRPO advantage rule, recomputed: ``(r - mean_g) / (std_g + 1e-6)`` with Bessel's std over the
rows of each ``uid`` (``group_ids``), in any row order (:func:`tracer.formulas.verl_grpo_advantages`).

Runs on steps that declare ``advantage_rule = "verl_grpo"`` (the verl hook does), where
``recompute.advantages`` skips (its rules take G consecutive rows and TRL's eps 1e-4, which differ
from verl's by more than float32 tolerance on low-variance groups). Only groups whose G rows are
all in the step file are compared (a micro-batch holds parts of groups; the driver's rollout file
holds them all).
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.advantages import full_groups
from tracer.checks.context import StepContext
from tracer.checks.finding import ERROR, Skip, register

RULE = "verl_grpo"


@register("recompute.verl_advantages", "advantages == verl's GRPO rule (Bessel std per uid, eps 1e-6) when the "
          "step declares advantage_rule = 'verl_grpo'", {"grpo", "cispo", ""})
def check_verl_advantages(ctx: StepContext):
    if ctx.hyper("advantage_rule", None) != RULE:
        return []
    advantages, rewards = ctx.require("advantages", "rewards")
    if advantages.dim() != 1:
        raise Skip("per-token advantages: verl's GRPO rule gives one value per sequence")
    groups, _ = full_groups(ctx, rewards.shape[0])
    rows = torch.tensor([r for g in groups for r in g])
    ids = ctx.data["group_ids"][rows] if "group_ids" in ctx.data else torch.arange(len(groups)).repeat_interleave(len(groups[0]))
    expected = formulas.verl_grpo_advantages(rewards[rows], ids).double()  # (N,)
    recorded = advantages[rows].double()
    diff = (recorded - expected).abs()
    bad = (diff > 10 * ctx.tol.atol + 10 * ctx.tol.rtol * expected.abs()) & torch.isfinite(expected)
    if not bool(bad.any()):
        return []
    i = int(diff.masked_fill(~bad, -1.0).argmax())
    row = int(rows[i])
    message = (
        f"advantages differ from verl's GRPO rule recomputed from rewards and group_ids at {int(bad.sum())} of "
        f"{len(rows)} rows; worst at seq {row}: recorded {float(recorded[i]):.6g}, recomputed {float(expected[i]):.6g}. "
        "Rule: (r - mean_g) / (std_g + 1e-6), Bessel's std over the rows of one uid (verl core_algos."
        "compute_grpo_outcome_advantage). Why it matters: the advantages that reached the loss are not the ones "
        "the configuration asks for (wrong uid grouping, a modified estimator, rows reordered after scoring). "
        "Likely fix: keep uid attached to its rows through any filtering or reordering before compute_advantage."
    )
    return [ctx.finding("recompute.verl_advantages", ERROR, message, row, field="advantages", rule=RULE)]
