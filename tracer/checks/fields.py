"""Fields (SPEC.md section 4): a step carries the canonical fields its algorithm requires.

Without them most checks can only be skipped, and a trace that passes with everything skipped
proves nothing, so a missing required field is a warning naming the fields; a DPO reference the
trainer kept only as per-pair sums (recorded as such) is an info finding instead.
"""

from __future__ import annotations

import torch

from tracer.checks.context import StepContext
from tracer.checks.finding import INFO, WARNING, Skip, register
from tracer.format.schema import (
    ALGORITHMS,
    REF_PRECOMPUTED_SUMS,
    REF_SEQUENCE_SUMS,
    TOKEN_ADVANTAGES,
    required_fields,
)


def _varies_along_tokens(ctx: StepContext, name: str) -> bool:
    """True when some row of the ``[B, T]`` field ``name`` holds more than one value over its kept tokens
    (a real per-token advantage, not one per sequence broadcast over the tokens); False without a
    completion_mask of the same shape."""
    values = ctx.data[name]
    if not ctx.has("completion_mask") or values.dim() != 2 or ctx.data["completion_mask"].shape != values.shape:
        return False
    keep = ctx.mask()
    high = torch.where(keep, values, float("-inf")).amax(dim=1)
    low = torch.where(keep, values, float("inf")).amin(dim=1)
    return bool((keep.any(dim=1) & (high > low)).any())


@register("fields.required", "the step carries the fields its algorithm requires (tracer.format.schema)",
          frozenset(ALGORITHMS) | {""})
def check_required(ctx: StepContext):
    if not ctx.algorithm:
        raise Skip("needs metadata key 'algorithm' to know which fields are required")
    missing = [f for f in required_fields(ctx.algorithm) if f not in ctx.data]
    notes = []
    summed = [f for f in missing if REF_SEQUENCE_SUMS.get(f) in ctx.data]
    if summed and ctx.hyper("ref_logprobs_source", None) == REF_PRECOMPUTED_SUMS:
        missing = [f for f in missing if f not in summed]
        notes.append(ctx.finding(
            "fields.required", INFO,
            f"this {ctx.algorithm} step records the reference as per-pair sums "
            f"({', '.join(REF_SEQUENCE_SUMS[f] for f in summed)}) instead of {summed}: the trainer precomputed "
            "them (metadata ref_logprobs_source = 'trl_precomputed_sums', TRL's precompute_ref_log_probs) and "
            "keeps no per-token reference, so the checks that need it are skipped.", None, summed=summed))
    if "advantages" in missing and TOKEN_ADVANTAGES in ctx.data and _varies_along_tokens(ctx, TOKEN_ADVANTAGES):
        missing.remove("advantages")
        notes.append(ctx.finding(
            "fields.required", INFO,
            f"this {ctx.algorithm} step records per-token advantages ({TOKEN_ADVANTAGES}, [B, T]) instead of one "
            "advantage per sequence: the estimator gives each token its own (verl's optimal_token_baseline, "
            "for one), so the checks of per-sequence advantages are skipped.", None, standin=TOKEN_ADVANTAGES))
    if not missing:
        return notes
    message = (
        f"this {ctx.algorithm} step lacks required fields {missing}. Why it matters: the checks that need them "
        "are skipped, so a clean report says little about this step. Likely fix: record them (see the field "
        "table in docs/format.md and tracer/format/schema.py)."
    )
    return [ctx.finding("fields.required", WARNING, message, None, missing=missing), *notes]
