"""Per-step summaries: a few masked means, quantiles and counts of one step, computed once by the
writer thread when it writes the step file and stored in the file's header (metadata key
``summary``, JSON), so that a run overview (``Trace.step_summary``, ``tracer info``, the Steps page)
reads headers only. Files without a summary (older traces) are summarised from their tensors by
the same function, so both paths give the same numbers. The maths comes from :mod:`tracer.formulas`.

Keys of a summary (all optional; a step has those its fields allow):

    kept_tokens                          completion_mask.sum()
    mean_ratio, ratio_{p10,p50,p90,max}  over kept tokens; likewise ref_kl_k3, approx_kl_k2 (nats)
    mean_mismatch, mismatch_{...}        old_logprobs - sampler_logprobs over kept tokens (nats)
    mean_reward, reward_{...}            over all B sequences
    mean_advantage, advantage_{...}      over B ([B] advantages) or kept tokens ([B, T], PPO)
    clip_fraction{,_low,_high}, clip_region
                                         formulas.clip_fractions, when clip_epsilon_low/high are known
    nonfinite_values, nonfinite_kept     NaN/Inf values in the fields above (all positions / the kept
                                         positions of [B, T] fields)

Quantiles leave NaN values out (:func:`tracer.formulas.masked_quantiles`); means do not (a NaN at a
kept position makes the mean NaN, as the loss would be).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import torch

from tracer import formulas

SUMMARY_KEY = "summary"  # the step metadata key holding the summary
SUMMARY_VERSION = 1  # bumped when a definition changes; other versions are recomputed from tensors
QUANTILES = {"p10": 0.1, "p50": 0.5, "p90": 0.9, "max": 1.0}
# Statistics over the kept tokens of [B, T] fields (mismatch = old_logprobs - sampler_logprobs).
TOKEN_STATS = ("ratio", "ref_kl_k3", "approx_kl_k2", "mismatch")
# The fields a summary reads (the reader loads only these for a file without a summary).
FIELDS = ("completion_mask", "ratio", "ref_kl_k3", "approx_kl_k2", "old_logprobs", "sampler_logprobs",
          "rewards", "advantages")
COUNT_KEYS = ("kept_tokens", "nonfinite_values", "nonfinite_kept")
CLIP_KEYS = ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "clip_region")


def _stat_keys(name: str) -> list[str]:
    return [f"mean_{name}"] + [f"{name}_{q}" for q in QUANTILES]


KEYS = frozenset([*COUNT_KEYS, *CLIP_KEYS, *(k for n in (*TOKEN_STATS, "reward", "advantage") for k in _stat_keys(n))])


def _number(value: Any) -> float | None:
    """A clip epsilon as a float, when it is a real number (not a bool)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _stats(out: dict[str, Any], name: str, values: torch.Tensor, mask: torch.Tensor | None) -> None:
    """``mean_<name>`` and the quantiles of ``values`` (at ``mask``'s kept positions)."""
    values = values.float()
    mean = formulas.masked_mean(values, mask) if mask is not None else values.mean()
    out[f"mean_{name}"] = float(mean)
    for q, value in zip(QUANTILES, formulas.masked_quantiles(values, mask, tuple(QUANTILES.values())).tolist()):
        out[f"{name}_{q}"] = value


def compute_summary(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The summary of one step from its (stored, CPU) tensors and its metadata (for the clip
    epsilons). Returns ``{key: int | float}`` with the keys of the module docstring that the step's
    fields allow; floats may be NaN. Shapes as in SPEC.md section 4 (``[B, T]`` token fields, ``[B]``
    rewards, ``[B]`` or ``[B, T]`` advantages); a field whose shape does not fit is left out."""
    out: dict[str, Any] = {}
    mask = tensors.get("completion_mask")
    mask = mask.bool() if mask is not None else None
    bt = mask.shape if mask is not None else None
    token_fields = {name: tensors[name] for name in ("ratio", "ref_kl_k3", "approx_kl_k2") if name in tensors}
    if "old_logprobs" in tensors and "sampler_logprobs" in tensors:
        token_fields["mismatch"] = tensors["old_logprobs"].float() - tensors["sampler_logprobs"].float()
    seen = []  # (values, the mask of their kept positions or None)
    if mask is not None:
        out["kept_tokens"] = int(mask.sum())
        for name, values in token_fields.items():
            if values.shape == bt:
                _stats(out, name, values, mask)
                seen.append((values, mask))
    rewards = tensors.get("rewards")
    if rewards is not None and rewards.dim() == 1 and rewards.is_floating_point():
        _stats(out, "reward", rewards, None)
        seen.append((rewards, None))
    adv = tensors.get("advantages")
    if adv is not None and adv.is_floating_point():
        if adv.dim() == 1:
            _stats(out, "advantage", adv, None)
            seen.append((adv, None))
        elif mask is not None and adv.shape == bt:
            _stats(out, "advantage", adv, mask)
            seen.append((adv, mask))
    _clip(out, tensors, mask, metadata)
    out["nonfinite_values"] = sum(int((~torch.isfinite(v)).sum()) for v, _ in seen)
    out["nonfinite_kept"] = sum(int((~torch.isfinite(v) & m).sum()) for v, m in seen if m is not None)
    return out


def _clip(out: dict[str, Any], tensors: Mapping[str, torch.Tensor], mask: torch.Tensor | None,
          metadata: Mapping[str, Any]) -> None:
    eps_low, eps_high = _number(metadata.get("clip_epsilon_low")), _number(metadata.get("clip_epsilon_high"))
    ratio, adv = tensors.get("ratio"), tensors.get("advantages")
    if mask is None or ratio is None or adv is None or eps_low is None or eps_high is None:
        return
    if ratio.shape != mask.shape or adv.shape not in (mask.shape, mask.shape[:1]):
        return
    fr = formulas.clip_fractions(ratio.float(), adv.float(), mask, eps_low, eps_high)
    out["clip_fraction_low"], out["clip_fraction_high"] = float(fr["low"]), float(fr["high"])
    out["clip_fraction"] = float(fr["low"] + fr["high"])
    out["clip_region"] = float(fr["region"])


def header_value(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary as stored in the header (with its version)."""
    return {"version": SUMMARY_VERSION, **summary}


def read_summary(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """The summary stored in a step file's decoded metadata, or None when there is none, its
    version is not :data:`SUMMARY_VERSION`, or it is malformed (a hostile or foreign header: then
    the caller recomputes it from the tensors). Only known keys with number values are returned."""
    raw = metadata.get(SUMMARY_KEY)
    if not isinstance(raw, dict) or raw.get("version") != SUMMARY_VERSION:
        return None
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "version":
            continue
        if key not in KEYS:
            return None
        if key in COUNT_KEYS:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return None
        elif value is None:  # NaN written by a JSON encoder without NaN support
            value = math.nan
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        out[key] = value if key in COUNT_KEYS else float(value)
    return out
