"""Sampler vs trainer (SPEC.md section 6): when the inference engine reported its own logprobs,
compare them with the trainer's for the same tokens.

Reports, over kept tokens, the mean and quantiles of ``old - sampler`` (nats), the share of tokens
whose ratio ``exp(old - sampler)`` lies outside [1/C, C] (C = ``CheckOptions.sampler_ratio_bound``,
default 2), the worst tokens, and two patterns: a one-sided gap (the sampler renormalised after
top-p/top-k truncation) and a slope away from 1 (a temperature applied on one side only).
"""

from __future__ import annotations

import math

import torch

from tracer.checks.context import StepContext, worst_positions
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, WARNING, register
from tracer.checks.identity import is_fresh

QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)
WARN_SHARE, ERROR_SHARE = 0.01, 0.10  # share of tokens outside [1/C, C]
WARN_MEAN, ERROR_MEAN = 0.05, 0.5  # |mean(old - sampler)| in nats
MAX_QUANTILE_ELEMENTS = 1 << 20


def _patterns(trainer: torch.Tensor, sampler: torch.Tensor, delta: torch.Tensor, ctx: StepContext) -> list[str]:
    out = []
    below = float((delta < -1e-3).float().mean())
    if below >= 0.9 and float(delta.mean()) < -WARN_MEAN:
        out.append(f"trainer logprobs are below the sampler's on {below:.0%} of tokens: the sampler renormalised "
                   f"over a truncated distribution (top_p = {ctx.hyper('top_p', 'unrecorded')}, top_k = "
                   f"{ctx.hyper('top_k', 'unrecorded')}); score with the same truncation or log the engine's "
                   "unprocessed logprobs")
    if trainer.numel() >= 8:
        x = trainer - trainer.mean()
        y = sampler - sampler.mean()
        var = float((x * x).sum())
        if var > 0:
            slope = float((x * y).sum()) / var
            corr = float((x * y).sum()) / math.sqrt(var * float((y * y).sum()) or 1.0)
            if abs(slope - 1) > 0.1 and corr > 0.9:
                out.append(f"sampler logprobs ≈ {slope:.3f} × trainer logprobs (correlation {corr:.3f}): a "
                           f"temperature applied on one side only (temperature = "
                           f"{ctx.hyper('temperature', 'unrecorded')}); divide logits by τ before log_softmax "
                           "for every model that is compared")
    return out


@register("sampler.mismatch", "old - sampler logprobs over kept tokens: mean, quantiles, share of "
          "ratios outside [1/C, C], worst tokens, temperature/top-p patterns", RL_ALGORITHMS)
def check_sampler_mismatch(ctx: StepContext):
    name = "old_logprobs" if ctx.has("old_logprobs") else "policy_logprobs"
    if name == "policy_logprobs" and not is_fresh(ctx):
        return []  # after an update the policy differs from the sampler for a good reason
    if name == "old_logprobs" and ctx.key.inner_step != 0:
        return []  # old and sampler logprobs of a rollout are the same at every inner step: report once
    trainer, sampler = ctx.require(name, "sampler_logprobs")
    keep = ctx.mask() & torch.isfinite(trainer) & torch.isfinite(sampler)
    n = int(keep.sum())
    if n == 0:
        return []
    delta_full = trainer - sampler  # (B, T)
    delta = delta_full[keep].double()  # (N,)
    C = ctx.options.sampler_ratio_bound
    outside = delta.abs() > math.log(C)
    share = float(outside.double().mean())
    mean = float(delta.mean())
    sample = delta if delta.numel() <= MAX_QUANTILE_ELEMENTS else delta[:: delta.numel() // MAX_QUANTILE_ELEMENTS + 1]
    quantiles = {f"q{int(q * 100):02d}": float(v) for q, v in zip(QUANTILES, torch.quantile(sample, torch.tensor(QUANTILES, dtype=sample.dtype)))}
    worst = worst_positions(delta_full.abs(), keep, ctx.options.worst_tokens)
    worst_list = [{"sequence": b, "token": t, "old_minus_sampler": float(delta_full[b, t])} for b, t in worst]
    patterns = _patterns(trainer[keep].double(), sampler[keep].double(), delta, ctx)
    if share > ERROR_SHARE or abs(mean) > ERROR_MEAN:
        severity = ERROR
    elif share > WARN_SHARE or abs(mean) > WARN_MEAN:
        severity = WARNING
    else:
        severity = INFO
    b, t = worst[0]
    qtext = ", ".join(f"{k} {v:+.4f}" for k, v in quantiles.items())
    message = (
        f"{name} - sampler_logprobs over {n} kept tokens: mean {mean:+.4f} nats, {qtext}; {int(outside.sum())} "
        f"tokens ({share:.2%}) have exp(old - sampler) outside [1/{C:g}, {C:g}]; worst at seq {b}, token {t}: "
        f"{float(delta_full[b, t]):+.4f} nats."
    )
    if patterns:
        message += " Pattern: " + "; ".join(patterns) + "."
    if severity != INFO:
        message += (f" Rule: |mean| <= {WARN_MEAN} nats and at most {WARN_SHARE:.0%} of tokens outside [1/C, C]. "
                    "Why it matters: the rollout was sampled from a different distribution than the trainer "
                    "scores, so the update is off-policy without correction. Likely fix: align sampler and "
                    "trainer (temperature, top-p/top-k, dtype, weight sync), or correct with truncated "
                    "importance sampling on exp(old - sampler).")
    return [ctx.finding("sampler.mismatch", severity, message, b, t, field="sampler_logprobs", mean=mean,
                        quantiles=quantiles, share_outside=share, ratio_bound=C, worst_tokens=worst_list,
                        patterns=patterns)]
