"""Logprob range (SPEC.md section 3): a token logprob is ``log p`` with ``0 < p <= 1``, so it is <= 0
nats. A kept logprob above 0 (beyond the dtype's tolerance) is not a log-probability at all: a
logit, a probability, a log-ratio or a sign slip stored under a logprob name.

Only kept positions count (TRL writes exactly 0 at masked positions, which is allowed anyway).
"""

from __future__ import annotations

from tracer.checks.context import StepContext, worst_positions
from tracer.checks.finding import ERROR, Skip, register

# (logprob field, mask field, ids field): every per-token logprob of the canonical schema
LOGPROB_FIELDS = (
    ("policy_logprobs", "completion_mask", "completion_ids"),
    ("old_logprobs", "completion_mask", "completion_ids"),
    ("ref_logprobs", "completion_mask", "completion_ids"),
    ("sampler_logprobs", "completion_mask", "completion_ids"),
    ("chosen_policy_logprobs", "chosen_mask", "chosen_ids"),
    ("rejected_policy_logprobs", "rejected_mask", "rejected_ids"),
    ("chosen_ref_logprobs", "chosen_mask", "chosen_ids"),
    ("rejected_ref_logprobs", "rejected_mask", "rejected_ids"),
)


@register("logprobs.positive", "every kept token logprob is <= 0 nats (log p with p <= 1)")
def check_positive(ctx: StepContext):
    present = [(f, m, i) for f, m, i in LOGPROB_FIELDS if ctx.has(f, m) and ctx.data[f].dim() == 2]
    if not present:
        raise Skip("needs a per-token logprob field and its mask")
    findings = []
    for name, mask_name, ids_name in present:
        logprobs, keep = ctx.tensor(name), ctx.mask(mask_name)
        if logprobs.shape != keep.shape:
            continue  # fields.* reports shape disagreements
        positive = (logprobs > ctx.tol.atol) & keep
        if not bool(positive.any()):
            continue
        (b, t), = worst_positions(logprobs, positive, 1)
        message = (
            f"{name}[{b}, {t}] = {float(logprobs[b, t]):.6g} nats > 0; {int(positive.sum())} of {int(keep.sum())} "
            f"kept tokens are positive (largest shown; tolerance {ctx.tol.atol:g} for {ctx.dtype}). A logprob is "
            "log p with p <= 1, so it is <= 0. Why it matters: whatever this tensor is (raw logits, a "
            "probability, a log-ratio, a flipped sign), ratio, KL and loss built on it are meaningless. Likely "
            "fix: take log_softmax(logits / temperature) and gather the sampled token "
            "(tracer.formulas.token_logprobs); do not gather from the logits themselves."
        )
        findings.append(ctx.finding("logprobs.positive", ERROR, message, b, t, field=name, ids_field=ids_name,
                                    positive_tokens=int(positive.sum()), value=float(logprobs[b, t])))
    return findings
