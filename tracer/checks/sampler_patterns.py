"""The causes of a sampler/trainer mismatch, each a hypothesis tested on the recorded numbers (used
by :mod:`tracer.checks.sampler` and :mod:`tracer.checks.probability`). Each detector takes the kept
tokens' logprobs as float64 vectors ``[N]`` (``trainer``, ``sampler``; ``delta = trainer - sampler``)
and returns a sentence naming the cause with its evidence, or None. :func:`diagnose` tries them in
order and keeps the first that explains the data: one cause per finding.

What each cause does to the numbers (derivations in the docstrings):

- temperature applied on one side only (trl#4159: the engine reports raw logprobs while it sampled
  from logits / τ): on confident tokens ``log(1 - p)`` scales by the ratio of the two temperatures;
  on a near-uniform distribution the logprobs themselves scale by it;
- top-p / top-k / min-p renormalisation on the sampler's side only (trl#6789): the sampler's
  probability of every kept token is its trainer probability divided by the kept mass (< 1), so
  ``trainer < sampler`` on ~every token. Only a hypothesis when truncation is in effect (or the
  settings are unrecorded): with top_p = 1, top_k off and min_p = 0 vLLM truncates nothing;
- a repetition / presence / frequency penalty on the sampler's side only: vLLM lowers the logits of
  tokens already in the context, so the mismatch sits on tokens seen earlier in the row;
- a stale policy (the engine samples with weights older than the trainer's: a weight sync that did
  not happen): the first rollout agrees (both sides start from the same weights), later ones drift
  with the updates;
- a constant offset: ``delta`` the same on every token (a normalisation term lost on one side).

Engine noise (bf16 weights and activations, other kernels) has random sign, no scale factor, no
constant part and no link to the context, so none of these fire on it; all also need the mismatch
to exceed the noise floor of the engine's dtype (:func:`noise_floor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

NOISE_FLOOR = 0.01  # nats of mean |old - sampler|: the floor of an fp32 engine, or an unrecorded dtype
# mean |old - sampler| over kept tokens on healthy runs of the vLLM CPU engine, tiny model, TRL GRPO
# (BENCHMARKS.md "Sampler noise floor"): bf16 weights give ~5e-3 nats, fp32 ~1e-7
ENGINE_NOISE = {"bfloat16": 0.0056, "float16": 0.0056, "float32": 1e-6}
NOISE_MARGIN = 4  # a mismatch below this multiple of the engine's measured noise is noise
ONE_SIGNED_SHARE = 0.9  # share of kept tokens on one side
MIN_TOKENS = 8  # fewer tokens than this: no pattern is claimed
SLOPE_TOLERANCE = 0.2  # |slope - 1| above this is a scale factor (healthy bf16-engine runs: within 0.04)
MIN_CORRELATION = 0.98  # a scale factor must explain the relation (correlation ≈ 1)
OFFSET_SPREAD = 0.1  # constant offset: std(delta) below this share of |mean(delta)|
STALE_GROWTH = 3.0  # a stale policy: this step's mean |delta| over the first rollout's
DTYPE_EPS = {"float64": 2.2e-16, "float32": 1.2e-7, "float16": 9.8e-4, "bfloat16": 7.8e-3}
TRUNCATION_KEYS = ("top_p", "top_k", "min_p")
PENALTY_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty")
NEUTRAL = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "temperature": 1.0}


def noise_floor(engine_dtype: object) -> float:
    """Mean |old - sampler| (nats) below which a mismatch is the engine's rounding noise:
    :data:`NOISE_MARGIN` × the noise measured on healthy runs of an engine in ``engine_dtype``, at
    least :data:`NOISE_FLOOR` (an unrecorded dtype gets :data:`NOISE_FLOOR`)."""
    return max(NOISE_FLOOR, NOISE_MARGIN * ENGINE_NOISE.get(str(engine_dtype), 0.0))


def is_off(name: str, value: object) -> bool:
    """Whether a sampler setting leaves the distribution alone (vLLM: top_k 0 or -1, top_p 1, min_p 0,
    repetition_penalty 1, presence/frequency_penalty 0, temperature 1)."""
    number = float(value)  # type: ignore[arg-type]
    if name == "top_k":
        return number <= 0
    return number == NEUTRAL[name]


@dataclass(frozen=True)
class Settings:
    """The sampler's settings as recorded: ``values[name]`` a number, or None when unrecorded."""

    values: dict[str, float | None]
    engine_dtype: str | None
    logprobs_mode: str | None

    def in_effect(self, names: tuple[str, ...]) -> list[str]:
        """``"name = value"`` for each of ``names`` recorded and not neutral."""
        return [f"{n} = {_fmt(self.values[n])}" for n in names
                if self.values.get(n) is not None and not is_off(n, self.values[n])]

    def unrecorded(self, names: tuple[str, ...]) -> bool:
        return all(self.values.get(n) is None for n in names)

    def show(self, name: str) -> str:
        """The recorded value of ``name`` as the messages write it (``"unrecorded"`` when absent)."""
        return _fmt(self.values.get(name))

    def text(self, names: tuple[str, ...]) -> str:
        return ", ".join(f"{n} = {_fmt(self.values.get(n))}" for n in names)


def _fmt(value: object) -> str:
    if value is None:
        return "unrecorded"
    number = float(value)  # type: ignore[arg-type]
    return str(int(number)) if number == int(number) and abs(number) >= 1 or number == 0 else f"{number:g}"


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
                        temperature: object, logprobs_mode: object, floor: float = NOISE_FLOOR) -> tuple[str, float] | None:
    """A temperature applied on one side only: returns (sentence, factor) or None.

    Confident tokens (p > 1/2 on both sides: the argmax): with z the logits and Δ = z_2 - z_max
    the gap to the runner-up, ``1 - p ≈ exp(Δ / τ)``, so ``log(1 - p_sampler) ≈ (τ_trainer /
    τ_sampler) · log(1 - p_trainer)``: a slope ≠ 1 with correlation ≈ 1. Near-uniform
    distributions: ``log p ≈ -log V + (z - mean z) / τ``, the same slope on the logprobs
    themselves. Complements below ``10 · eps(dtype)`` (rounded) are left out.
    """
    if float(delta.abs().mean()) < floor:
        return None
    eps_floor = max(1e-5, 10 * DTYPE_EPS.get(dtype, 1.2e-7))
    confident = (trainer > -math.log(2)) & (sampler > -math.log(2)) & (trainer < -eps_floor) & (sampler < -eps_floor)
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
                    f"only (temperature = {temperature}{mode})", slope)
    return None


def truncation_pattern(delta: torch.Tensor, settings: str, floor: float = NOISE_FLOOR) -> str | None:
    """Top-p / top-k / min-p renormalisation on the sampler's side only: ``p_sampler = p_trainer /
    Z`` with the kept mass ``Z < 1`` for every sampled (hence kept) token, so ``trainer - sampler =
    log Z < 0`` on ~every token (``Z = 1`` only where nothing was cut). Fires when ≥
    :data:`ONE_SIGNED_SHARE` of the tokens are below and the mean gap is beyond ``floor``;
    ``settings`` names the truncation in effect."""
    if delta.numel() < MIN_TOKENS:
        return None
    below = float((delta < 0).double().mean())
    if below < ONE_SIGNED_SHARE or float(delta.mean()) > -floor:
        return None
    return (f"trainer logprobs are below the sampler's on {below:.0%} of tokens (mean {float(delta.mean()):+.4f} "
            f"nats): the sampler renormalised over a truncated distribution ({settings}) that the trainer does not "
            "apply")


def seen_in_context(prompt_ids: torch.Tensor | None, prompt_mask: torch.Tensor | None,
                    completion_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: completion token ``t`` of row ``b`` occurred earlier in the row, in the kept
    prompt tokens (``prompt_ids``/``prompt_mask`` ``[B, L]``, may be None) or at a completion position
    before ``t``. A stable sort of each row's ids puts equal ids together in position order; every
    one but the first of a run was seen before."""
    B, T = completion_ids.shape
    if prompt_ids is None:
        prompt_ids = completion_ids.new_zeros((B, 0))
        prompt_mask = torch.zeros(B, 0, dtype=torch.bool)
    L = prompt_ids.shape[1]
    unique = -1 - torch.arange(L, dtype=torch.int64).expand(B, L)  # never equal to a real id
    prompt = torch.where(prompt_mask.bool() if prompt_mask is not None else torch.ones_like(unique, dtype=torch.bool),
                         prompt_ids.long(), unique)  # (B, L)
    row = torch.cat([prompt, completion_ids.long()], dim=1)  # (B, L + T)
    sorted_ids, order = torch.sort(row, dim=1, stable=True)
    repeat = torch.zeros_like(row, dtype=torch.bool)
    repeat[:, 1:] = sorted_ids[:, 1:] == sorted_ids[:, :-1]
    seen = torch.zeros_like(repeat).scatter(1, order, repeat)  # (B, L + T)
    return seen[:, L:]  # (B, T)


def penalty_pattern(delta: torch.Tensor, seen: torch.Tensor, settings: str, floor: float = NOISE_FLOOR,
                    min_seen: int = MIN_TOKENS // 2) -> str | None:
    """A repetition / presence / frequency penalty applied by the sampler only. vLLM divides a
    positive logit of a token already in the context by ``repetition_penalty`` (multiplies a negative
    one) and subtracts ``presence_penalty + frequency_penalty · count``; the trainer scores the plain
    logits. A penalty that discourages repeats lowers the sampler's logprob of every token seen
    earlier in the row (``seen`` ``[N]`` bool): ``delta > 0`` there; renormalisation raises the others:
    ``delta < 0`` (a penalty < 1 flips both). So the sign of ``delta`` follows ``seen``. Over the
    tokens whose |delta| exceeds ``floor`` (below it a token says nothing: noise, or p ≈ 1), fires
    when there are ≥ :data:`MIN_TOKENS` of them, ≥ :data:`ONE_SIGNED_SHARE` have the sign ``seen``
    predicts, ≥ ``min_seen`` were seen (1 is enough when a penalty is recorded in effect: the
    settings make it the hypothesis, the signs confirm it) and the seen tokens' mean |delta| is
    beyond ``floor``."""
    informative = delta.abs() > floor
    if delta.numel() < MIN_TOKENS or int(informative.sum()) < MIN_TOKENS:
        return None
    seen_i, delta_i = seen[informative], delta[informative]
    if int(seen_i.sum()) < max(1, min_seen) or float(delta[seen].abs().mean()) < floor:
        return None
    discourage = float(((delta_i > 0) == seen_i).double().mean())
    agreement = max(discourage, 1 - discourage)
    if agreement < ONE_SIGNED_SHARE:
        return None
    gap = delta.abs()
    share = float(gap[seen].sum() / gap.sum())
    lower, higher = ("lower", "higher") if discourage >= 0.5 else ("higher", "lower")
    return (f"the mismatch sits on tokens repeated from the context: the {float(seen.double().mean()):.0%} of kept "
            f"tokens seen earlier in the row (prompt or completion) carry {share:.0%} of |old - sampler| and get "
            f"{lower} sampler logprobs (mean old - sampler {float(delta[seen].mean()):+.4f} nats), the others "
            f"{higher} ({float(delta[~seen].mean()):+.4f}, renormalisation); the sign follows the context on "
            f"{agreement:.0%} of the {int(informative.sum())} tokens beyond the noise: a sampler penalty on repeated "
            f"tokens that the trainer does not apply ({settings})")


def stale_policy_pattern(mean_abs: float, step: int, first_step: int, first_mean_abs: float,
                         floor: float) -> str | None:
    """A stale policy: the engine samples with weights older than the trainer's. At the first
    rollout both sides hold the same (initial) weights, so ``first_mean_abs`` (mean |delta| of the
    first recorded step, ``first_step``) is at the noise floor; every update the engine misses moves
    the trainer away, so later steps drift. Fires when this ``step`` is later, the first step is
    within ``floor`` and this step's mean |delta| is beyond ``floor`` and ≥ :data:`STALE_GROWTH` ×
    the first's."""
    if step <= first_step or first_mean_abs > floor or mean_abs < floor or mean_abs < STALE_GROWTH * first_mean_abs:
        return None
    return (f"mean |old - sampler| {mean_abs:.4f} nats at step {step} against {first_mean_abs:.4f} at step "
            f"{first_step} (the first rollout, both sides on the same initial weights), {mean_abs / max(first_mean_abs, 1e-12):.0f}× "
            "larger with no temperature, truncation, penalty or offset pattern: the engine samples with a stale "
            "policy (weights older than the trainer's: the weight sync into the engine did not take effect)")


def offset_pattern(delta: torch.Tensor, floor: float = NOISE_FLOOR) -> str | None:
    """A constant offset: ``delta`` nearly the same on every token (std below
    :data:`OFFSET_SPREAD` × |mean|), beyond ``floor``. A log-normaliser or a constant term is
    missing on one side."""
    if delta.numel() < MIN_TOKENS:
        return None
    mean, std = float(delta.mean()), float(delta.std())
    if abs(mean) < floor or std > OFFSET_SPREAD * abs(mean):
        return None
    return (f"old - sampler is a constant {mean:+.4f} nats (std {std:.2e}) on every token: a normalisation "
            "term is missing on one side (log_softmax vs raw logits, a log-probability shifted by a constant)")


def one_signed_pattern(delta: torch.Tensor, floor: float = NOISE_FLOOR) -> str | None:
    """Trainer above the sampler on ≥ :data:`ONE_SIGNED_SHARE` of the tokens beyond ``floor`` (the
    mirror of truncation): the sampler's distribution is flatter than the trainer's on the sampled
    tokens (a temperature above the trainer's on the engine side, or the trainer renormalising)."""
    if delta.numel() < MIN_TOKENS:
        return None
    above = float((delta > 0).double().mean())
    if above < ONE_SIGNED_SHARE or float(delta.mean()) < floor:
        return None
    return (f"trainer logprobs are above the sampler's on {above:.0%} of tokens (mean {float(delta.mean()):+.4f} "
            "nats): the two sides score different distributions (a temperature or a truncation applied to the "
            "trainer only)")


@dataclass(frozen=True)
class Evidence:
    """What :func:`diagnose` tests the causes on. ``trainer``, ``sampler``, ``delta`` ``[N]`` float64
    over kept tokens; ``seen`` ``[N]`` bool (token seen earlier in its row) or None when the ids are
    not recorded; ``first`` (first recorded step, its mean |delta|) or None; ``step``; ``dtype`` of
    the trainer's logprobs; ``settings``."""

    trainer: torch.Tensor
    sampler: torch.Tensor
    delta: torch.Tensor
    seen: torch.Tensor | None
    first: tuple[int, float] | None
    step: int
    dtype: str
    settings: Settings


def diagnose(ev: Evidence, temperature: object) -> str | None:
    """The one cause that explains ``ev`` (a sentence with its evidence), or None (noise, or no
    known cause). Order: a constant offset; truncation when it is in effect; a penalty when one is in
    effect or none is recorded; a temperature on one side; a stale policy; truncation when its
    settings are unrecorded; a one-signed shift. A cause ruled out by the recorded settings is not
    tried: with top_p = 1, top_k off and min_p = 0 nothing was truncated."""
    s, delta = ev.settings, ev.delta
    floor = noise_floor(s.engine_dtype)
    truncating = s.in_effect(TRUNCATION_KEYS)
    penalties = s.in_effect(PENALTY_KEYS)
    offset = offset_pattern(delta, floor)
    if offset is not None and not (truncating and float(delta.mean()) < 0):
        return offset  # a constant shift is also one-signed: name one cause (truncation when configured)
    tries: list[Callable[[], str | None]] = []
    if truncating:
        tries.append(lambda: truncation_pattern(delta, ", ".join(truncating), floor))
    if ev.seen is not None and (penalties or s.unrecorded(PENALTY_KEYS)):
        tries.append(lambda: penalty_pattern(delta, ev.seen, ", ".join(penalties) or "penalty settings unrecorded",
                                             floor, 1 if penalties else MIN_TOKENS // 2))

    def temperature_cause() -> str | None:
        found = temperature_pattern(ev.trainer, ev.sampler, delta, ev.dtype, temperature, s.logprobs_mode, floor)
        return None if found is None else found[0]

    tries.append(temperature_cause)
    if ev.first is not None:
        tries.append(lambda: stale_policy_pattern(float(delta.abs().mean()), ev.step, ev.first[0], ev.first[1], floor))
    if not truncating and any(s.values.get(n) is None for n in TRUNCATION_KEYS[:2]):
        tries.append(lambda: truncation_pattern(delta, s.text(TRUNCATION_KEYS), floor))
    tries.append(lambda: one_signed_pattern(delta, floor))
    for attempt in tries:
        cause = attempt()
        if cause is not None:
            return cause
    return None


def settings_of(hyper: Callable[[str, Any], Any]) -> Settings:
    """The sampler's settings from a step's hyperparameters (``hyper(name, default)``): the engine's
    settings in effect (``sampler_<name>``, recorded from the engine's ``SamplingParams``) first,
    then the trainer's (``<name>``)."""
    values: dict[str, float | None] = {}
    for name in ("temperature", *TRUNCATION_KEYS, *PENALTY_KEYS):
        value = hyper(f"sampler_{name}", None)
        if value is None:
            value = hyper(name, None)
        values[name] = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    dtype = hyper("sampler_dtype", None)
    mode = hyper("sampler_logprobs_mode", None)
    return Settings(values, None if dtype is None else str(dtype), None if mode is None else str(mode))
