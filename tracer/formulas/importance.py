"""Importance-sampling corrections for the gap between the policy that sampled a rollout (an
inference engine, or a policy some updates old) and the policy the trainer scores it with, and the
policy lag of asynchronous loops. Pure torch, no I/O.

Notation: ``log_ratio = trainer - sampler`` per token ``[B, T]`` nats (the trainer's ``old_logprobs``
minus the engine's ``sampler_logprobs``), ``mask`` ``[B, T]`` (True = the token enters the loss).
The canonical description of a correction is TRL's: ``is_mode`` in :data:`IS_MODES` with the caps
``clip_min`` / ``clip_max``; verl's ``rollout_is`` / ``rollout_is_threshold`` map onto it
(:func:`verl_is_settings`): a single threshold is TIS (truncate, upper cap only), a ``"lower_upper"``
threshold is IcePop (mask: weight 0 outside ``[lower, upper]``).

Sources: TRL 1.16 ``trl/trainer/grpo_trainer.py`` (``_generate_and_score_completions``, the
``vllm_importance_sampling_*`` block; the loss multiplies the clipped policy-gradient term by the
weights, before ``beta * per_token_kl`` is added); verl 0.9.1 ``verl/trainer/ppo/rollout_corr_helper.py``
(``compute_rollout_correction_weights``, ``compute_rollout_rejection_mask``; ``core_algos`` multiplies
``pg_losses`` after the clip by ``rollout_is_weights``); IcePop: Ling team, "Every step evolves" (2025);
TIS: Yao et al., "Your efficient RL framework secretly brings you off-policy RL training" (2025).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tracer.formulas.reductions import masked_sum

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's vllm_importance_sampling_mode
SEQUENCE_AGGREGATIONS = ("sum", "mean")
VERL_SAFETY_BOUND = 20.0  # verl clamps log ratios to [-20, 20] before exp (rollout_corr_helper.SAFETY_BOUND)
VERL_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                   "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, aggregation: str = "sum") -> torch.Tensor:
    """Per-sequence log importance ratio ``[B]`` from token log ratios ``[B, T]`` over kept tokens
    (NaN -> 0, as TRL does).

    ``aggregation``: ``"sum"`` (the product of the token ratios; TRL 1.16 ``sequence_*`` modes, verl
    ``rollout_is="sequence"``) or ``"mean"`` (the geometric mean, length-invariant; GSPO, the fix
    proposed in trl#5814). Raises ValueError for another aggregation.
    """
    if aggregation not in SEQUENCE_AGGREGATIONS:
        raise ValueError(f"aggregation must be 'sum' or 'mean', got {aggregation!r}")
    total = torch.nan_to_num(masked_sum(log_ratio, mask, dim=-1), nan=0.0)
    return total if aggregation == "sum" else total / mask.bool().sum(dim=-1).clamp(min=1)


def is_weights(log_ratio: torch.Tensor, mode: str, clip_min: float | None = None,
               clip_max: float | None = 3.0) -> torch.Tensor:
    """TRL's cap applied to log ratios (``[B, T]`` for token modes, ``[B]`` per sequence for
    sequence modes): ``exp(log_ratio)``, then ``*_truncate`` clamps it to ``[clip_min, clip_max]``
    and ``*_mask`` sets it to 0 outside (IcePop when both caps are set). Source: TRL 1.16
    ``grpo_trainer.py`` (``vllm_importance_sampling_mode``). Raises ValueError for an unknown mode."""
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; expected one of {list(IS_MODES)}")
    weights = torch.exp(torch.nan_to_num(log_ratio, nan=0.0))
    if mode.endswith("truncate"):
        return weights if clip_min is None and clip_max is None else torch.clamp(weights, min=clip_min, max=clip_max)
    return weights.masked_fill(outside_caps(weights, clip_min, clip_max), 0.0)


def outside_caps(raw: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """Bool, same shape as ``raw``: the raw weights (before any cap) that the correction changes:
    ``raw < clip_min`` or ``raw > clip_max`` (a None cap never cuts). A truncate mode clamps them, a
    mask mode zeroes them."""
    low = -math.inf if clip_min is None else float(clip_min)
    high = math.inf if clip_max is None else float(clip_max)
    return (raw < low) | (raw > high)


def raw_is_ratio(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                 mode: str, aggregation: str = "sum") -> torch.Tensor:
    """The importance ratio before any cap: ``exp(trainer - sampler)`` per kept token ``[B, T]``
    (1 off the mask) for token modes, ``exp(aggregate of trainer - sampler)`` ``[B]`` for sequence
    modes (``aggregation`` sum as TRL and verl do, or mean). NaN logprobs count 0 (TRL)."""
    log_ratio = torch.nan_to_num((trainer_logprobs - sampler_logprobs) * mask, nan=0.0)
    if mode.startswith("sequence"):
        return torch.exp(sequence_log_ratio(log_ratio, mask, aggregation))
    return torch.exp(log_ratio)


def correction_weights(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str, clip_min: float | None = None, clip_max: float | None = 3.0,
                       aggregation: str = "sum") -> torch.Tensor:
    """TRL's importance-sampling weights from the trainer's ``old_logprobs`` and the engine's
    ``sampler_logprobs`` (``[B, T]`` nats) and ``mask`` ``[B, T]``: ``[B, T]`` for token modes (1 off
    the mask, as TRL leaves it), ``[B]`` for sequence modes. ``aggregation="mean"`` gives the
    length-invariant sequence ratio (trl#5814's fix); TRL 1.16 sums. Source: TRL 1.16
    ``grpo_trainer.py`` ``_generate_and_score_completions``. Raises ValueError for an unknown mode."""
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; expected one of {list(IS_MODES)}")
    log_ratio = torch.nan_to_num((trainer_logprobs - sampler_logprobs) * mask, nan=0.0)
    if mode.startswith("sequence"):
        log_ratio = sequence_log_ratio(log_ratio, mask, aggregation)
    return is_weights(log_ratio, mode, clip_min, clip_max)


# -- verl's form -----------------------------------------------------------------------------------
def verl_is_threshold(spec: str | float) -> tuple[float | None, float]:
    """``(lower, upper)`` of verl's ``rollout_is_threshold``: a number or ``"2.0"`` is TIS (lower
    None), ``"0.5_2.0"`` is IcePop. Raises ValueError for a malformed or non-positive spec, lower >
    upper, TypeError for a bool. Source: verl 0.9.1 ``_parse_rollout_is_threshold``."""
    if isinstance(spec, bool):
        raise TypeError("rollout_is_threshold must be a float or a 'lower_upper' string, not a bool")
    if isinstance(spec, str) and "_" in spec.strip():
        lower_text, upper_text = spec.strip().split("_", 1)
        lower, upper = float(lower_text), float(upper_text)
    else:
        lower, upper = None, float(spec)
    if upper <= 0 or (lower is not None and (lower <= 0 or lower > upper)):
        raise ValueError(f"invalid rollout_is_threshold {spec!r}: need 0 < lower <= upper")
    return lower, upper


def verl_is_settings(rollout_is: str, rollout_is_threshold: str | float) -> tuple[str, float | None, float]:
    """verl's ``rollout_is`` (``token`` | ``sequence``) and threshold as the canonical ``(is_mode,
    clip_min, clip_max)``: TIS -> ``*_truncate`` with no lower cap, IcePop -> ``*_mask``. Raises
    ValueError for another level."""
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"rollout_is must be 'token' or 'sequence', got {rollout_is!r}")
    lower, upper = verl_is_threshold(rollout_is_threshold)
    return f"{rollout_is}_{'truncate' if lower is None else 'mask'}", lower, upper


def verl_is_weights(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                    rollout_is: str = "token", rollout_is_threshold: str | float = 2.0,
                    batch_normalize: bool = False) -> torch.Tensor:
    """verl's ``rollout_is_weights`` ``[B, T]`` (0 off the mask; a sequence weight broadcast over its
    tokens): ``exp(clamp(log_ratio, -20, 20))`` per token or of the masked sum per sequence, TIS
    clamps it to the upper threshold, IcePop zeroes it outside ``[lower, upper]``; with
    ``batch_normalize`` divided by its mean over kept tokens (token) or sequences (sequence) when that
    mean exceeds 1e-8 (single process). Source: verl 0.9.1 ``rollout_corr_helper.py``
    ``compute_rollout_correction_and_rejection_mask`` / ``compute_rollout_correction_weights``."""
    _, lower, upper = verl_is_settings(rollout_is, rollout_is_threshold)
    mask_f = mask.to(trainer_logprobs.dtype)
    log_ratio = trainer_logprobs - sampler_logprobs
    if rollout_is == "token":
        raw = torch.exp(log_ratio.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND))
    else:
        total = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)  # (B, 1)
        raw = torch.exp(total.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask_f
    weights = raw.clamp(max=upper) if lower is None else torch.where(outside_caps(raw, lower, upper),
                                                                    torch.zeros_like(raw), raw)
    if batch_normalize:
        if rollout_is == "token":
            mean = masked_sum(weights, mask) / (mask_f.sum() + 1e-8)
        else:
            per_seq = masked_sum(weights, mask, dim=-1) / (mask_f.sum(dim=-1) + 1e-8)  # (B,)
            has_tokens = (mask_f.sum(dim=-1) > 0).to(weights.dtype)
            mean = (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1e-8)
        if float(mean) > 1e-8:
            weights = weights / mean
    return weights


def verl_rejection_mask(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                        rollout_rs: str, rollout_rs_threshold: str | float) -> torch.Tensor:
    """verl's rejection sampling: the response mask ``[B, T]`` (mask's dtype) with every token that a
    ``rollout_rs`` criterion rejects set to 0. Criteria (comma separated, all must pass), on
    ``log_ratio = clamp(trainer - sampler, -20, 20)``: ``token_k1`` keeps ``log(lower) <= -log_ratio
    <= log(upper)``; ``token_k2`` ``0.5 log_ratio^2 <= upper``; ``token_k3`` ``exp(log_ratio) - 1 -
    log_ratio <= upper``; ``seq_{sum,mean,max}_kN`` apply the same bound to the masked sum / mean /
    max per sequence and reject every token of the sequence. A k1 threshold is ``"lower_upper"`` or
    one ``upper`` (lower = 1/upper); one threshold may serve every criterion. Source: verl 0.9.1
    ``compute_rollout_rejection_mask``. Raises ValueError for an unknown criterion or threshold."""
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    unknown = [o for o in options if o not in VERL_RS_OPTIONS]
    if not options or unknown:
        raise ValueError(f"rollout_rs {rollout_rs!r}: unknown criteria {unknown}; expected {list(VERL_RS_OPTIONS)}")
    specs = ([str(rollout_rs_threshold)] if isinstance(rollout_rs_threshold, (int, float))
             else [p.strip() for p in str(rollout_rs_threshold).split(",") if p.strip()])
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold {rollout_rs_threshold!r}: one threshold or one per criterion")
    specs = specs * len(options) if len(specs) == 1 else specs
    log_ratio = (trainer_logprobs - sampler_logprobs).clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)
    stats = {"k1": -log_ratio, "k2": 0.5 * log_ratio ** 2, "k3": torch.exp(log_ratio) - 1.0 - log_ratio}
    keep_bool = mask.bool()
    combined = torch.ones_like(keep_bool)
    for option, spec in zip(options, specs):
        estimator = option[-2:]
        if estimator == "k1":
            lower_text, upper_text = spec.split("_", 1) if "_" in spec else (str(1.0 / float(spec)), spec)
            low, high = math.log(float(lower_text)), math.log(float(upper_text))
        else:
            low, high = None, float(spec)
        stat = stats[estimator]
        if option.startswith("seq_sum"):
            stat = masked_sum(stat, mask, dim=-1)
        elif option.startswith("seq_mean"):
            stat = masked_sum(stat, mask, dim=-1) / (mask.to(stat.dtype).sum(dim=-1) + 1e-8)
        elif option.startswith("seq_max"):
            peak = stat.masked_fill(~keep_bool, -math.inf).max(dim=-1).values
            stat = torch.where(peak == -math.inf, torch.zeros_like(peak), peak)
        passed = (stat <= high) if low is None else (stat >= low) & (stat <= high)
        combined &= passed if option.startswith("token") else passed.unsqueeze(-1).expand_as(keep_bool)
    return (mask * combined.to(mask.dtype)).to(mask.dtype)


# -- the correction a run declares -----------------------------------------------------------------
@dataclass(frozen=True)
class Correction:
    """An importance-sampling correction as a run declares it: ``mode`` (:data:`IS_MODES`), the caps,
    the sequence aggregation, and verl's own form when declared that way (``verl`` =
    ``(rollout_is, rollout_is_threshold, batch_normalize)``, whose weights :func:`verl_is_weights` gives)."""

    mode: str
    clip_min: float | None
    clip_max: float | None
    aggregation: str = "sum"
    verl: tuple[str, Any, bool] | None = None

    @property
    def sequence(self) -> bool:
        return self.mode.startswith("sequence")

    def text(self) -> str:
        """The settings in the run's own words, for messages."""
        agg = f", sequence ratio by {self.aggregation}" if self.sequence else ""
        if self.verl is not None:
            return f"rollout_is = {self.verl[0]}, rollout_is_threshold = {self.verl[1]!r} (is_mode {self.mode}{agg})"
        return f"is_mode = {self.mode}, caps [{self.clip_min}, {self.clip_max}]{agg}"

    def weights(self, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """The declared weights: ``[B, T]`` (token modes; verl's form, a sequence weight broadcast) or ``[B]``."""
        if self.verl is not None:
            return verl_is_weights(trainer_logprobs, sampler_logprobs, mask, *self.verl)
        return correction_weights(trainer_logprobs, sampler_logprobs, mask, self.mode, self.clip_min, self.clip_max,
                                  self.aggregation)


def declared_correction(lookup: Callable[[str], Any], recorded_weights: bool = False) -> Correction | None:
    """The correction a step declares, from ``lookup(key)`` (step metadata, then the run's
    hyperparameters; None when absent): verl's ``rollout_is`` / ``rollout_is_threshold`` /
    ``rollout_is_batch_normalize``, else ``is_mode`` / ``is_clip_min`` / ``is_clip_max`` /
    ``is_sequence_aggregation`` (TRL's ``vllm_importance_sampling_*`` names too) when ``is_correction``
    (or TRL's ``vllm_importance_sampling_correction``) is true or weights are recorded. None when the
    step declares none. Raises ValueError naming what is missing or unknown (a correction declared
    without a mode, an unknown mode, aggregation or threshold)."""
    rollout_is = lookup("rollout_is")
    if rollout_is is not None:
        threshold = lookup("rollout_is_threshold")
        threshold = 2.0 if threshold is None else threshold
        mode, low, high = verl_is_settings(str(rollout_is), threshold)
        return Correction(mode, low, high, "sum", (str(rollout_is), threshold, bool(lookup("rollout_is_batch_normalize"))))
    declared = lookup("is_correction")
    declared = lookup("vllm_importance_sampling_correction") if declared is None else declared
    if not declared and not recorded_weights:
        return None
    mode = lookup("is_mode") or lookup("vllm_importance_sampling_mode")
    if mode is None:
        raise ValueError("an importance-sampling correction of unrecorded mode: record metadata is_mode (token_truncate "
                         "| token_mask | sequence_truncate | sequence_mask) with is_clip_min / is_clip_max, or verl's "
                         "rollout_is and rollout_is_threshold")
    if mode not in IS_MODES:
        raise ValueError(f"is_mode {mode!r} is not modelled: the modelled modes are {', '.join(IS_MODES)}")
    low = lookup("is_clip_min")
    low = lookup("vllm_importance_sampling_clip_min") if low is None else low
    high = lookup("is_clip_max")
    high = lookup("vllm_importance_sampling_clip_max") if high is None else high
    aggregation = str(lookup("is_sequence_aggregation") or "sum")
    if aggregation not in SEQUENCE_AGGREGATIONS:
        raise ValueError(f"is_sequence_aggregation {aggregation!r} is not modelled: the modelled ones are sum and mean")
    return Correction(str(mode), None if low is None else float(low), None if high is None else float(high), aggregation)


# -- policy lag ------------------------------------------------------------------------------------
def policy_lag(policy_version: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """Per row ``[B]`` int64: how many optimizer updates the trainer's policy is ahead of the policy
    that sampled the row, ``trainer_version - policy_version`` (0 = on-policy; negative = a row
    sampled by a policy newer than the trainer, a bookkeeping error). Source: the staleness of
    asynchronous RL (AReaL, Fu et al. 2025; verl ``staleness_threshold``; slime, miles)."""
    return int(trainer_version) - policy_version.to(torch.int64)
