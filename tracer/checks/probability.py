"""Rollout vs trainer in probability space (verl's convention): the numbers verl logs as
``training/rollout_probs_diff_{max,mean,std}`` and ``training/rollout_actor_probs_pearson_corr``,
recomputed from the trace so that a run's wandb curve can be traced to the tokens behind it.

verl compares ``exp(old_log_probs)`` (the trainer's recomputation) with ``exp(rollout_log_probs)``
(the inference engine's): ``|p_trainer - p_sampler|`` over kept tokens, and the Pearson correlation of
the two probabilities (``verl/utils/debug/metrics.py``; formula in
:func:`tracer.formulas.probability_gap`). Probability space weighs a gap by how likely the token is: a
log-space gap on a rare token (``sampler.mismatch``) barely moves it.

Severity: info with the numbers; a warning when the mean gap exceeds 0.05 or, over at least 100
kept tokens, the correlation falls below 0.9 (bf16 engines against an FSDP trainer typically show a
mean of a few 1e-3 and a correlation above 0.99). Reported once per rollout (inner step 0), like
``sampler.mismatch``; never an error (``sampler.mismatch`` judges the log-space gap and names the
cause, :func:`tracer.checks.sampler_patterns.diagnose`: this check gives the numbers only).

Rows sampled by an older policy than the trainer's (``policy_version`` below ``trainer_version``, an
asynchronous loop) are left out (:func:`tracer.checks.staleness.lagged_mask`): their gap is the policy
lag, which ``sampler.policy_lag`` and ``sampler.is_weights`` judge, not engine/trainer drift.
"""

from __future__ import annotations

import math

import torch

from tracer import formulas
from tracer.checks.context import NO_ENGINE, StepContext, engine_sampled, worst_positions
from tracer.checks.finding import INFO, RL_ALGORITHMS, WARNING, not_applicable, register
from tracer.checks.identity import is_fresh
from tracer.checks.staleness import lagged_mask

WARN_MEAN_GAP = 0.05
WARN_PEARSON, PEARSON_MIN_TOKENS = 0.9, 100


@register("sampler.probs_diff", "|exp(old) - exp(sampler)| over kept tokens (max, mean, std) and the Pearson "
          "correlation of the probabilities: verl's rollout_probs_diff metrics", RL_ALGORITHMS)
def check_probs_diff(ctx: StepContext):
    name = "old_logprobs" if ctx.has("old_logprobs") else "policy_logprobs"
    if name == "policy_logprobs" and not is_fresh(ctx):
        return []  # after an update the policy differs from the sampler for a good reason
    if ctx.key.inner_step != 0:
        return []
    if not ctx.has("sampler_logprobs") and not engine_sampled(ctx):
        raise not_applicable(NO_ENGINE)
    trainer, sampler = ctx.require(name, "sampler_logprobs")
    keep, lagged = lagged_mask(ctx, ctx.mask() & torch.isfinite(trainer) & torch.isfinite(sampler))
    n = int(keep.sum())
    if n == 0:
        return []
    gap = formulas.probability_gap(trainer, sampler, keep)
    b, t = worst_positions((torch.exp(trainer) - torch.exp(sampler)).abs(), keep, 1)[0]
    low_corr = n >= PEARSON_MIN_TOKENS and math.isfinite(gap["pearson"]) and gap["pearson"] < WARN_PEARSON
    severity = WARNING if gap["mean"] > WARN_MEAN_GAP or low_corr else INFO
    message = (
        f"exp({name}) vs exp(sampler_logprobs) over {n} kept tokens (verl's training/rollout_probs_diff_*): "
        f"max {gap['max']:.4g}, mean {gap['mean']:.4g}, std {gap['std']:.4g}; Pearson correlation "
        f"{gap['pearson']:.4f}; worst at seq {b}, token {t}: p_trainer {math.exp(float(trainer[b, t])):.4g}, "
        f"p_sampler {math.exp(float(sampler[b, t])):.4g}."
        + (f" {lagged} kept tokens of rows sampled by an older policy left out (their gap is the policy lag: "
           "sampler.policy_lag)." if lagged else "")
    )
    if severity == WARNING:
        message += (f" Rule: mean gap <= {WARN_MEAN_GAP} and correlation >= {WARN_PEARSON} (over >= "
                    f"{PEARSON_MIN_TOKENS} tokens). Why it matters: the engine sampled from a distribution the "
                    "trainer does not reproduce, so the update is off-policy. The cause that explains it (or that "
                    "none of the known ones does) is in this step's sampler.mismatch finding.")
    return [ctx.finding("sampler.probs_diff", severity, message, b, t, field="sampler_logprobs", kept_tokens=n,
                        lagged_tokens_left_out=lagged,
                        **{f"probs_diff_{k}" if k != "pearson" else "pearson": v for k, v in gap.items()})]
