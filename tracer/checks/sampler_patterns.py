"""Patterns that tell a systematic sampler/trainer mismatch from numerical noise (used by
:mod:`tracer.checks.sampler`). Each detector takes the kept tokens' logprobs as float64 vectors
``[N]`` (``trainer``, ``sampler``; ``delta = trainer - sampler``) and returns a sentence naming the
cause, or None.

What each bug does to the numbers (derivations in the docstrings):

- temperature applied on one side only (trl#4159: the engine reports raw logprobs while it sampled
  from logits / τ): on confident tokens ``log(1 - p)`` scales by the ratio of the two temperatures;
  on a near-uniform distribution the logprobs themselves scale by it;
- top-p / top-k renormalisation on the sampler's side only (trl#6789): the sampler's probability
  of every kept token is its trainer probability divided by the nucleus mass (< 1), so
  ``trainer < sampler`` on ~every token;
- a constant offset: ``delta`` the same on every token (a normalisation term lost on one side).

Noise (fp32 kernels differ, bf16 rounding) has random sign, no scale factor and no constant part,
so none of these fire on it; all also need the mismatch to exceed :data:`NOISE_FLOOR`.
"""

from __future__ import annotations

import math

import torch

NOISE_FLOOR = 0.01  # nats: mean |old - sampler| below this is noise-level (healthy fp32 runs: ~1e-3)
ONE_SIGNED_SHARE = 0.9  # share of kept tokens on one side
MIN_TOKENS = 8  # fewer tokens than this: no pattern is claimed
SLOPE_TOLERANCE = 0.2  # |slope - 1| above this is a scale factor (healthy bf16-engine runs: within 0.04)
MIN_CORRELATION = 0.98  # a scale factor must explain the relation (correlation ≈ 1)
OFFSET_SPREAD = 0.1  # constant offset: std(delta) below this share of |mean(delta)|
DTYPE_EPS = {"float64": 2.2e-16, "float32": 1.2e-7, "float16": 9.8e-4, "bfloat16": 7.8e-3}


def _fit(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float] | None:
    """Symmetric (reduced major axis) slope of ``y`` on ``x`` and their correlation; None when
    either is constant. Symmetric so that noise on the trainer's side does not shrink the slope
    (an ordinary least-squares slope would drift below 1 on a healthy noisy run)."""
    xc, yc = x - x.mean(), y - y.mean()
    sxx, syy, sxy = float((xc * xc).sum()), float((yc * yc).sum()), float((xc * yc).sum())
    if sxx <= 0 or syy <= 0:
        return None
    corr = sxy / math.sqrt(sxx * syy)
    return math.copysign(math.sqrt(syy / sxx), corr), corr


def temperature_pattern(trainer: torch.Tensor, sampler: torch.Tensor, delta: torch.Tensor, dtype: str,
                        temperature: object, logprobs_mode: object) -> tuple[str, float] | None:
    """A temperature applied on one side only: returns (sentence, factor) or None.

    Confident tokens (p > 1/2 on both sides: the argmax): with z the logits and Δ = z_2 - z_max
    the gap to the runner-up, ``1 - p ≈ exp(Δ / τ)``, so ``log(1 - p_sampler) ≈ (τ_trainer /
    τ_sampler) · log(1 - p_trainer)``: a slope ≠ 1 with correlation ≈ 1. Near-uniform
    distributions: ``log p ≈ -log V + (z - mean z) / τ``, the same slope on the logprobs
    themselves. Complements below ``10 · eps(dtype)`` (rounded) are left out.
    """
    if float(delta.abs().mean()) < NOISE_FLOOR:
        return None
    floor = max(1e-5, 10 * DTYPE_EPS.get(dtype, 1.2e-7))
    confident = (trainer > -math.log(2)) & (sampler > -math.log(2)) & (trainer < -floor) & (sampler < -floor)
    candidates = []
    if int(confident.sum()) >= MIN_TOKENS:
        fit = _fit(torch.log(-torch.expm1(trainer[confident])), torch.log(-torch.expm1(sampler[confident])))
        if fit is not None:
            candidates.append(("sampler log(1 - p) ≈ {slope:.3f} × trainer log(1 - p) on the {n} confident tokens "
                               "(p > 1/2)", int(confident.sum()), *fit))
    if trainer.numel() >= MIN_TOKENS:
        fit = _fit(trainer, sampler)
        if fit is not None:
            candidates.append(("sampler logprobs ≈ {slope:.3f} × trainer logprobs", trainer.numel(), *fit))
    for what, n, slope, corr in candidates:
        if abs(slope - 1) > SLOPE_TOLERANCE and corr >= MIN_CORRELATION:
            mode = f", engine logprobs_mode = {logprobs_mode}" if logprobs_mode is not None else ""
            return (what.format(slope=slope, n=n) + f" (correlation {corr:.3f}): a temperature applied on one side "
                    f"only (temperature = {temperature}{mode}); the engine must report logprobs after temperature "
                    "(vLLM logprobs_mode='processed_logprobs') and the trainer must divide logits by τ before "
                    "log_softmax", slope)
    return None


def truncation_pattern(delta: torch.Tensor, top_p: object, top_k: object) -> str | None:
    """Top-p / top-k renormalisation on the sampler's side only: ``p_sampler = p_trainer / Z`` with
    the nucleus mass ``Z < 1`` for every sampled (hence kept) token, so ``trainer - sampler = log Z
    < 0`` on ~every token (a one-signed shift; ``Z = 1`` only where the nucleus is the whole
    vocabulary). Fires when ≥ :data:`ONE_SIGNED_SHARE` of the tokens are below and the mean gap is
    beyond the noise floor."""
    if delta.numel() < MIN_TOKENS:
        return None
    below = float((delta < 0).double().mean())
    if below < ONE_SIGNED_SHARE or float(delta.mean()) > -NOISE_FLOOR:
        return None
    return (f"trainer logprobs are below the sampler's on {below:.0%} of tokens (mean {float(delta.mean()):+.4f} "
            f"nats): the sampler renormalised over a truncated distribution (top_p = {top_p}, top_k = {top_k}); "
            "score with the same truncation, sample without it, or log the engine's logprobs before truncation")


def offset_pattern(delta: torch.Tensor) -> str | None:
    """A constant offset: ``delta`` nearly the same on every token (std below
    :data:`OFFSET_SPREAD` × |mean|), beyond the noise floor. A log-normaliser or a constant
    term is missing on one side."""
    if delta.numel() < MIN_TOKENS:
        return None
    mean, std = float(delta.mean()), float(delta.std())
    if abs(mean) < NOISE_FLOOR or std > OFFSET_SPREAD * abs(mean):
        return None
    return (f"old - sampler is a constant {mean:+.4f} nats (std {std:.2e}) on every token: a normalisation "
            "term is missing on one side (log_softmax vs raw logits, a log-probability shifted by a constant)")


def one_signed_pattern(delta: torch.Tensor) -> str | None:
    """Trainer above the sampler on ≥ :data:`ONE_SIGNED_SHARE` of the tokens beyond the noise
    floor (the mirror of truncation): the sampler's distribution is flatter than the trainer's on
    the sampled tokens (a temperature above the trainer's on the engine side, or the trainer
    renormalising)."""
    if delta.numel() < MIN_TOKENS:
        return None
    above = float((delta > 0).double().mean())
    if above < ONE_SIGNED_SHARE or float(delta.mean()) < NOISE_FLOOR:
        return None
    return (f"trainer logprobs are above the sampler's on {above:.0%} of tokens (mean {float(delta.mean()):+.4f} "
            "nats): the two sides score different distributions (a temperature or a truncation applied to the "
            "trainer only)")
