"""Fields (SPEC.md section 4): a step carries the canonical fields its algorithm requires.

Without them most checks can only be skipped, and a trace that passes with everything skipped
proves nothing, so a missing required field is a warning naming the fields.
"""

from __future__ import annotations

from tracer.checks.context import StepContext
from tracer.checks.finding import WARNING, Skip, register
from tracer.schema import ALGORITHMS, required_fields


@register("fields.required", "the step carries the fields its algorithm requires (tracer.schema)",
          frozenset(ALGORITHMS) | {""})
def check_required(ctx: StepContext):
    if not ctx.algorithm:
        raise Skip("needs metadata key 'algorithm' to know which fields are required")
    missing = [f for f in required_fields(ctx.algorithm) if f not in ctx.data]
    if not missing:
        return []
    message = (
        f"this {ctx.algorithm} step lacks required fields {missing}. Why it matters: the checks that need them "
        "are skipped, so a clean report says little about this step. Likely fix: record them (see the field "
        "table in README.md and tracer/schema.py)."
    )
    return [ctx.finding("fields.required", WARNING, message, None, missing=missing)]
