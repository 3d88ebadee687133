"""The step summary's format: a few masked means, quantiles and counts of one step, computed once by the
writer thread when it writes the step file and stored in the file's header (metadata key
``summary``, JSON), so that a run overview (``Trace.step_summary``, ``tracer info``, the Steps page)
reads headers only. Files without a summary (older traces) are summarised from their tensors by
the same function, so both paths give the same numbers. This module holds the keys, their order, the
header encoding and its validation; the maths is :mod:`tracer.formulas.summaries`.

Keys of a summary (all optional; a step has those its fields allow):

    kept_tokens                          completion_mask.sum()
    mean_ratio, ratio_{p10,p50,p90,max}  over kept tokens; likewise ref_kl_k3, approx_kl_k2 (nats)
    mean_mismatch, mismatch_{...}        old_logprobs - sampler_logprobs over kept tokens (nats)
    mean_reward, reward_{...}            over all B sequences
    mean_advantage, advantage_{...}      over B ([B] advantages) or kept tokens ([B, T], PPO)
    groups, zero_variance_groups         groups of rewards (group_ids, else num_generations consecutive
                                         rows) and those whose rewards are all equal
                                         (formulas.zero_variance_groups), with group_ids_recorded 1
                                         when the groups came from a group_ids field (0: from
                                         num_generations); absent in older traces
    clip_fraction{,_low,_high}, clip_region
                                         formulas.clip_fractions, when clip_epsilon_low/high are known
    nonfinite_values, nonfinite_kept     NaN/Inf values in the fields above (all positions / the kept
                                         positions of [B, T] fields)

Quantiles leave NaN values out (:func:`tracer.formulas.masked_quantiles`); means do not (a NaN at a
kept position makes the mean NaN, as the loss would be).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

SUMMARY_KEY = "summary"  # the step metadata key holding the summary
SUMMARY_VERSION = 1  # bumped when a definition changes; other versions are recomputed from tensors
QUANTILES = {"p10": 0.1, "p50": 0.5, "p90": 0.9, "max": 1.0}
# Statistics over the kept tokens of [B, T] fields (mismatch = old_logprobs - sampler_logprobs).
TOKEN_STATS = ("ratio", "ref_kl_k3", "approx_kl_k2", "mismatch")
# The fields a summary reads (the reader loads only these for a file without a summary).
FIELDS = ("completion_mask", "ratio", "ref_kl_k3", "approx_kl_k2", "old_logprobs", "sampler_logprobs",
          "rewards", "advantages", "group_ids")
GROUP_KEYS = ("groups", "zero_variance_groups", "group_ids_recorded")
COUNT_KEYS = ("kept_tokens", "nonfinite_values", "nonfinite_kept", *GROUP_KEYS)
CLIP_KEYS = ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "clip_region")


def _stat_keys(name: str) -> list[str]:
    return [f"mean_{name}"] + [f"{name}_{q}" for q in QUANTILES]


# Every key, in the order a summary holds them (counts, token statistics, per-sequence ones, clip, NaN counts).
ORDER = ("kept_tokens", *(k for n in TOKEN_STATS for k in _stat_keys(n)),
         *(k for n in ("reward", "advantage") for k in _stat_keys(n)), *GROUP_KEYS, *CLIP_KEYS, "nonfinite_values",
         "nonfinite_kept")
KEYS = frozenset(ORDER)
_FLOAT_KEYS = KEYS - frozenset(COUNT_KEYS)



def header_value(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary as stored in the header (with its version)."""
    return {"version": SUMMARY_VERSION, **summary}


def header_text(summary: dict[str, Any]) -> str:
    """The summary's header text: :func:`header_value` as JSON (``tracer.format.metadata_codec.encode_metadata``
    stores a string as it is, so the header holds the text it would make of the dict)."""
    return json.dumps(header_value(summary), allow_nan=True)


def read_summary(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """The summary stored in a step file's decoded metadata, or None when there is none, its
    version is not :data:`SUMMARY_VERSION`, or it is malformed (a hostile or foreign header: then
    the caller recomputes it from the tensors). Only known keys with number values are returned."""
    raw = metadata.get(SUMMARY_KEY)
    if not isinstance(raw, dict) or raw.get("version") != SUMMARY_VERSION:
        return None
    out: dict[str, Any] = {}
    for key, value in raw.items():
        kind = type(value)  # fast path (a run overview reads thousands): an exact float or count
        if (kind is float and key in _FLOAT_KEYS) or (kind is int and key in COUNT_KEYS and value >= 0):
            out[key] = value
            continue
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
