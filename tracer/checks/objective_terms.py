"""The optional term of the objective a loop left out or added, named from its recorded per-token loss:
the declared importance-sampling weights not applied (TRL's ``vllm_importance_sampling_correction``,
the explicit API's ``is_correction``), the dual clip (``clip_ratio_c``, dual-clip PPO) missing, or the
ratio at the other level than the declared one (per token vs per sequence, GSPO). Each is tried by
recomputing the loss without or with that term (:func:`tracer.checks.objective.recomputed_per_token_loss`)."""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.comparison import compare
from tracer.checks.context import StepContext
from tracer.checks.finding import Skip
from tracer.checks.objective import (
    applied_is_weights,
    corrects_pg_term,
    dual_clip_c,
    importance_sampling_level,
    recomputed_per_token_loss,
    trl_loss_type,
)


def _matches(ctx: StepContext, recorded: torch.Tensor, **variant) -> bool:
    """The recorded per-token loss equals the one recomputed with ``variant`` (keywords of
    :func:`recomputed_per_token_loss`) under the dtype tolerance; False when it cannot be recomputed."""
    try:
        other = recomputed_per_token_loss(ctx, **variant)
    except Skip:
        return False
    return not compare(ctx, "recompute.per_token_loss", "per_token_loss", recorded, other, ctx.mask(), "")


def objective_term_at_fault(ctx: StepContext, recorded: torch.Tensor) -> tuple[str, dict] | None:
    """The objective's term at fault, when the recorded per-token loss is another objective than the
    recorded settings say: the declared importance-sampling weights not applied, the dual clip
    (``clip_ratio_c``) missing, or the ratio's level (token vs sequence, GSPO). Returns ``(the message's opening, details)`` or None."""
    if corrects_pg_term(ctx) and _matches(ctx, recorded, is_weights=False):
        weights = applied_is_weights(ctx, ctx.old_logprobs()).double()
        name = "is_weights" if ctx.has("is_weights") else "sequence_is_weights" if ctx.has("sequence_is_weights") \
            else "derived IS weights"
        keep = ctx.mask() if weights.dim() == 2 else ctx.mask().any(dim=1)
        off = keep & ~torch.isclose(weights, torch.ones_like(weights), rtol=1e-3, atol=1e-6)  # sampler.is_weights' rule
        text = (f"IS weights not applied: the recorded per_token_loss is the clipped surrogate without the "
                f"importance-sampling weights ({name}; {int(off.sum())} of {int(keep.sum())} kept "
                f"{'tokens' if weights.dim() == 2 else 'rows'} ≠ 1, mean {float(weights[keep].mean()):.4f}), while "
                "the step declares the correction (is_correction / vllm_importance_sampling_correction): the loss "
                "ignores the sampler/trainer correction. ")
        return text, {"cause": "is_weights_not_applied", "weights_not_one": int(off.sum())}
    if ctx.algorithm == "cispo" or trl_loss_type(ctx) == "cispo":
        return None
    c = dual_clip_c(ctx)
    if c is not None and _matches(ctx, recorded, dual_clip=0.0):
        r = formulas.ratio(ctx.tensor("policy_logprobs"), ctx.old_logprobs())
        adv = ctx.tensor("advantages")
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        binds = ctx.mask() & (adv < 0) & (r > c)  # (B, T) where the dual clip caps the loss
        largest = float(r[binds].max()) if bool(binds.any()) else float("nan")
        text = (f"dual clip missing: the recorded per_token_loss is the clipped surrogate without the dual clip, "
                f"while clip_ratio_c = {c:g} is recorded: on {int(binds.sum())} kept tokens with A < 0 and ratio > "
                f"{c:g} (largest ratio there {largest:.4g}) the loss should be capped at -{c:g}·A (dual-clip PPO, "
                "tracer.formulas.dual_clip). ")
        return text, {"cause": "dual_clip_missing", "clip_ratio_c": c, "tokens_beyond_c": int(binds.sum())}
    level = importance_sampling_level(ctx)
    if not _matches(ctx, recorded, sequence_level=level != "sequence"):
        return None
    if level == "sequence":
        text = ("ratio level: the recorded per_token_loss follows the per-token ratio exp(policy − old), while "
                "importance_sampling_level = 'sequence' (GSPO) is recorded: the loop does not clip one ratio per "
                "sequence, exp(masked mean of policy − old). ")
        return text, {"cause": "token_ratio_under_sequence_level"}
    text = ("ratio level: the recorded per_token_loss follows GSPO's sequence ratio exp(masked mean of policy − old), "
            "while importance_sampling_level is 'token' (or not recorded): record importance_sampling_level = "
            "'sequence' if GSPO is meant. ")
    return text, {"cause": "sequence_ratio_under_token_level"}
