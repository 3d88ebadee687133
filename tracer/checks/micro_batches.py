"""On-policy identity by micro-batch position (verl#2305, verl#6280): on fresh rollouts the ratio must
be 1 in *every* micro-batch; when it is 1 in some positions of the mini-batch and not in others, the
trainer's log-probabilities depend on where a row lands (padding or remove-padding layout, dynamic
batch sizes, a micro-batch's own longest sequence), not only on the weights.

A trace check over every step file that is on fresh rollouts (metadata ``fresh_rollouts``, else
:func:`tracer.checks.identity.is_fresh`). A file's position is its metadata
``micro_batch_in_mini_batch`` (the verl hook records it), else its ``micro_batch`` coordinate. Per
position it counts the files whose kept tokens differ (``|policy - old|`` beyond the dtype's
identity tolerance) and reports the positions and ranks that deviate next to those that are exact.
Silent when every fresh file is exact, and when every position deviates (then nothing depends on the
position; ``identity.first_step`` reports each file on its own).
"""

from __future__ import annotations

from tracer.checks.context import CheckOptions, StepContext
from tracer.checks.finding import ERROR, RL_ALGORITHMS, Finding, register
from tracer.checks.identity import is_fresh
from tracer.errors import TraceFormatError


def _position_stats(ctx: StepContext) -> tuple[int, float, int, int] | None:
    """(position, max |policy - old| over kept tokens, tokens beyond tolerance, kept tokens), or None."""
    if not ctx.has("policy_logprobs", "old_logprobs", "completion_mask"):
        return None
    policy, old = ctx.tensor("policy_logprobs"), ctx.tensor("old_logprobs")
    keep = ctx.mask()
    if not bool(keep.any()):
        return None
    delta = (policy - old).abs()[keep]  # (N,)
    position = ctx.metadata.get("micro_batch_in_mini_batch", ctx.key.micro_batch)
    position = position if isinstance(position, int) else ctx.key.micro_batch
    return position, float(delta.max()), int((delta > ctx.tol.identity_atol).sum()), int(keep.sum())


@register("identity.micro_batch_position", "on fresh rollouts the ratio is 1 at every micro-batch position of "
          "the mini-batch (positions that deviate vs positions that are exact)", RL_ALGORITHMS, scope="trace")
def check_micro_batch_position(trace, options: CheckOptions, keys) -> list[Finding]:
    by_position: dict[int, dict] = {}
    for key in keys:
        try:
            ctx = StepContext(trace, key, options)
        except TraceFormatError:
            continue
        if ctx.algorithm not in RL_ALGORITHMS or not is_fresh(ctx):
            continue
        stats = _position_stats(ctx)
        if stats is None:
            continue
        position, worst, beyond, kept = stats
        slot = by_position.setdefault(position, {"files": 0, "bad": [], "worst": 0.0})
        slot["files"] += 1
        slot["worst"] = max(slot["worst"], worst)
        if beyond:
            slot["bad"].append((key, beyond, kept))
    bad = {p: s for p, s in by_position.items() if s["bad"]}
    exact = sorted(p for p in by_position if p not in bad)
    if not bad or not exact:
        return []  # all exact, or every position deviates: identity.first_step's per-file errors say it all
    first_key = min(k for s in bad.values() for k, _, _ in s["bad"])
    ranks = sorted({k.rank for s in bad.values() for k, _, _ in s["bad"]})
    parts = [f"position {p}: {len(s['bad'])} of {s['files']} files, max |policy - old| {s['worst']:.3g} nats"
             for p, s in sorted(bad.items())]
    where = f"positions {exact} are exact, so the log-probabilities depend on where a row lands in the mini-batch"
    message = (
        f"on fresh rollouts (no optimizer step yet) policy_logprobs differ from old_logprobs by micro-batch "
        f"position — {'; '.join(parts)}; ranks {ranks}; {where}. Rule: ratio = 1 on every kept token of every "
        "micro-batch before the first optimizer step. Why it matters: the first update already clips and "
        "reweights tokens for a numerics artefact (verl#2305, verl#6280). Likely fix: compute old and policy "
        "log-probs with the same micro-batch layout (same micro-batch size / dynamic-bsz token budget for "
        "compute_log_prob and the update, same remove-padding setting), or deterministic kernels."
    )
    return [Finding("identity.micro_batch_position", ERROR, message, step=first_key.step,
                    inner_step=first_key.inner_step, micro_batch=first_key.micro_batch, rank=first_key.rank,
                    field="policy_logprobs", path=str(first_key.path),
                    details={"deviating_positions": sorted(bad), "exact_positions": exact, "ranks": ranks})]
