"""Policy lag (staleness) of asynchronous and off-policy loops: each row records the policy version
that sampled it (``policy_version [B]`` int64), the step records the trainer's version at the update
(metadata ``trainer_version``) and may declare the largest lag it accepts (``max_policy_lag``);
``policy_lag = trainer_version - policy_version`` (:func:`tracer.formulas.importance.policy_lag`).

``sampler.policy_lag`` reports per step the lag of each row, the share beyond the declared maximum,
and how the lagged rows enter the loss:

- ``old_logprobs`` are the behaviour policy's (the sampler's own logprobs, or old ≠ policy on the
  first pass of a lagged row): the first-pass ratio ≠ 1 of those rows is the lag, not an old/policy
  mismatch (``identity.first_step`` and ``sampler.mismatch`` leave lagged rows to this check);
- ``old_logprobs`` were recomputed with the trainer's weights and an importance-sampling correction
  (``is_weights`` / ``sequence_is_weights`` / ``rollout_is_weights``) corrects the gap to the sampler;
- neither: the stale rows are trained as if on-policy (miles#1829 "staleness is silently ignored").

Severity. Error: rows beyond ``max_policy_lag`` (the loop trains on rollouts staler than it declares
acceptable), or a row sampled by a version newer than the trainer's (bookkeeping). Warning: lagged rows
whose sampler gap is corrected by nothing. Info otherwise, with the numbers.
"""

from __future__ import annotations

import torch

from tracer.checks.context import StepContext
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, WARNING, Skip, register
from tracer.checks.text import count
from tracer.formulas import importance

IS_WEIGHT_FIELDS = ("is_weights", "sequence_is_weights", "rollout_is_weights")
IDENTITY_NOISE = 1e-3  # nats: |policy - old| below this on a first pass = old recomputed with the trainer's weights


def row_lag(ctx: StepContext) -> torch.Tensor | None:
    """``[B]`` int64 policy lag of each row, or None when the step records no ``policy_version`` or no
    ``trainer_version`` (a synchronous loop: every row is on-policy)."""
    if "policy_version" not in ctx.data:
        return None
    version = ctx.hyper("trainer_version", None)
    if version is None:
        return None
    return importance.policy_lag(ctx.data["policy_version"].reshape(-1), int(version))


def lagged_rows(ctx: StepContext) -> torch.Tensor | None:
    """``[B]`` bool: rows sampled by an older policy than the trainer's (lag > 0); None without lag data."""
    lag = row_lag(ctx)
    return None if lag is None else lag > 0


def lagged_mask(ctx: StepContext, keep: torch.Tensor, behaviour_old_only: bool = False) -> tuple[torch.Tensor, int]:
    """``keep`` ``[B, T]`` without the rows of positive lag, and how many kept tokens that left out (0 when
    the step records no lag or its shapes disagree). ``behaviour_old_only``: leave out only lagged rows
    whose ``old_logprobs`` may be the behaviour policy's (within :data:`IDENTITY_NOISE` of
    ``sampler_logprobs`` on average, or no sampler logprobs to tell): a lagged row whose old logprobs
    were recomputed with the trainer's weights must still equal the policy on the first pass."""
    lagged = lagged_rows(ctx)
    if lagged is None or lagged.shape[0] != keep.shape[0] or not bool(lagged.any()):
        return keep, 0
    if behaviour_old_only and ctx.has("old_logprobs", "sampler_logprobs"):
        old, sampler = ctx.tensor("old_logprobs").double(), ctx.tensor("sampler_logprobs").double()
        if old.shape == keep.shape == sampler.shape:
            finite = keep & torch.isfinite(old) & torch.isfinite(sampler)
            gap = torch.where(finite, (old - sampler).abs(), torch.zeros_like(old)).sum(dim=1)  # (B,)
            behaviour = gap <= IDENTITY_NOISE * finite.sum(dim=1).clamp(min=1)
            lagged = lagged & behaviour
    out = keep & ~lagged.unsqueeze(1)
    return out, int(keep.sum()) - int(out.sum())


def _handling(ctx: StepContext, lagged: torch.Tensor) -> tuple[str, str]:
    """(how the lagged rows enter the loss, severity) from the recorded tensors."""
    weights = next((f for f in IS_WEIGHT_FIELDS if f in ctx.data), None)
    if weights is not None:
        return (f"corrected by the recorded {weights} ({ctx.hyper('is_mode', None) or ctx.hyper('rollout_is', '?')}; "
                "sampler.is_weights checks them)"), INFO
    if not ctx.has("policy_logprobs", "old_logprobs", "completion_mask") or ctx.key.inner_step != 0:
        return "corrected by no recorded importance-sampling weights", INFO
    keep = ctx.mask() & lagged.unsqueeze(1)
    policy, old = ctx.tensor("policy_logprobs").double(), ctx.tensor("old_logprobs").double()
    n = int(keep.sum())
    if n == 0:
        return "", INFO
    gap = float((policy - old)[keep].abs().mean())
    mean_ratio = float(torch.exp(policy - old)[keep].mean())
    if gap > IDENTITY_NOISE:
        return (f"old_logprobs are the behaviour policy's: the first-pass ratio of the lagged rows (mean "
                f"{mean_ratio:.4f}, mean |policy − old| {gap:.4f} nats over {n} kept tokens) is the lag, which "
                "the clipped ratio corrects, not an old/policy mismatch"), INFO
    if ctx.has("sampler_logprobs"):
        sampler = ctx.tensor("sampler_logprobs").double()
        finite = keep & torch.isfinite(sampler)
        stale = float((old - sampler)[finite].abs().mean()) if bool(finite.any()) else 0.0
        if stale > IDENTITY_NOISE:
            return (f"uncorrected: old_logprobs were recomputed with the trainer's weights (first-pass ratio 1 on "
                    f"the lagged rows) while the sampler's logprobs differ by mean |old − sampler| {stale:.4f} nats, "
                    "and no importance-sampling weights (is_weights / sequence_is_weights) are recorded: the stale "
                    "rows are trained as if on-policy"), WARNING
    return "old_logprobs recomputed with the trainer's weights; no sampler logprobs recorded to measure the gap", INFO


@register("sampler.policy_lag", "policy lag per row (trainer_version - policy_version), the share beyond "
          "max_policy_lag, and how lagged rows enter the loss (behaviour old logprobs, IS weights, or uncorrected)",
          RL_ALGORITHMS)
def check_policy_lag(ctx: StepContext):
    if "policy_version" not in ctx.data:
        if ctx.hyper("max_policy_lag", None) is not None:
            raise Skip("metadata max_policy_lag is declared but no policy_version [B] is recorded: record the "
                       "policy version that sampled each row (record(..., policy_version=...))")
        return []  # a synchronous loop: nothing lags
    if ctx.hyper("trainer_version", None) is None:
        raise Skip("policy_version is recorded but metadata trainer_version is not: record the trainer's policy "
                   "version at this update (metadata={'trainer_version': ...})")
    lag = row_lag(ctx)
    assert lag is not None
    trainer_version = int(ctx.hyper("trainer_version"))
    B = int(lag.numel())
    details = {"policy_lag": lag.tolist(), "trainer_version": trainer_version, "mean_lag": float(lag.double().mean()),
               "max_lag": int(lag.max()) if B else 0}
    if B == 0:
        return []
    ahead = lag < 0
    if bool(ahead.any()):
        b = int(ahead.nonzero()[0])
        return [ctx.finding("sampler.policy_lag", ERROR, (
            f"policy_version: {count(int(ahead.sum()), 'row')} of {B} claim a policy version newer than the trainer's "
            f"(seq {b}: policy_version {int(ctx.data['policy_version'].reshape(-1)[b])} > trainer_version "
            f"{trainer_version}): the versions are counted on different clocks (updates vs steps, or the sampler's "
            "counter not reset with the trainer's); the lag of every row is unknown."), b, field="policy_version",
            **details)]
    max_lag = ctx.hyper("max_policy_lag", None)
    beyond = lag > int(max_lag) if max_lag is not None else torch.zeros_like(lag, dtype=torch.bool)
    details.update(max_policy_lag=max_lag, rows_beyond_max=int(beyond.sum()), share_beyond_max=float(beyond.double().mean()))
    histogram = ", ".join(f"lag {int(v)}: {int(c)}" for v, c in zip(*torch.unique(lag, return_counts=True)))
    lagged = lag > 0
    handling, severity = _handling(ctx, lagged) if bool(lagged.any()) else ("", INFO)
    if bool(beyond.any()):
        b = int(beyond.nonzero()[0])
        message = (f"policy_lag beyond max_policy_lag = {int(max_lag)}: {count(int(beyond.sum()), 'row')} of {B} "
                   f"({float(beyond.double().mean()):.0%}) were sampled up to {count(int(lag.max()), 'update')} ago "
                   f"(policy_version {int(ctx.data['policy_version'].reshape(-1)[b])} at seq {b}, trainer_version "
                   f"{trainer_version}; {histogram}): the loop trains on rollouts staler than it declares acceptable, "
                   "so its buffer neither drops nor bounds them.")
        if handling:
            message += f" The lagged rows are {handling}."
        return [ctx.finding("sampler.policy_lag", ERROR, message, b, field="policy_version", **details)]
    bound = f" (max_policy_lag {int(max_lag)}: none beyond)" if max_lag is not None else ""
    message = (f"policy lag per row: mean {details['mean_lag']:.2f}, max {count(details['max_lag'], 'update')}{bound}; "
               f"{histogram} (trainer_version {trainer_version}).")
    if handling:
        message += f" Lagged rows: {handling}."
    b = int(lag.argmax())
    return [ctx.finding("sampler.policy_lag", severity, message, b, field="policy_version", **details)]

