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
    mean_entropy, entropy_{...}          entropy over kept tokens (nats)
    mean_length, length_{...}            kept completion tokens per sequence (completion_mask.sum(-1)), over B
    loss                                 the recorded scalar loss field
    mean_reward/<name>                   mean over B of each reward component (reward_components [B, F],
                                         names from reward_component_names, else component_<f>)
    clip_fraction{,_low,_high}, clip_region
                                         formulas.clip_fractions, when clip_epsilon_low/high are known
    nonfinite_values, nonfinite_kept     NaN/Inf values in the fields above (all positions / the kept
                                         positions of [B, T] fields)
    wall_time                            unix seconds (float) when record() was called for the step,
                                         taken on the training thread
    scalars/<name>                       the user's scalars of the step (record(..., scalars={name: value}))

``wall_time`` and ``scalars/<name>`` are recorded values, not computed ones: the writer takes them
from the header key :data:`RECORDED_KEY` (where ``TraceWriter.record`` puts them) into the summary,
and a reader that recomputes a summary from the tensors (another version) carries them over from
the stored summary of any version (:func:`recorded_values`). They live in the summary only (no
other header key), so ``tracer diff`` never reports the wall clock as a difference.

Quantiles leave NaN values out (:func:`tracer.formulas.masked_quantiles`); means do not (a NaN at a
kept position makes the mean NaN, as the loss would be).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

SUMMARY_KEY = "summary"  # the step metadata key holding the summary
SUMMARY_VERSION = 2  # bumped when a definition changes; other versions are recomputed from tensors
QUANTILES = {"p10": 0.1, "p50": 0.5, "p90": 0.9, "max": 1.0}
# Statistics over the kept tokens of [B, T] fields (mismatch = old_logprobs - sampler_logprobs).
TOKEN_STATS = ("ratio", "ref_kl_k3", "approx_kl_k2", "mismatch", "entropy")
# Statistics over the B sequences.
SEQUENCE_STATS = ("reward", "advantage", "length")
# The fields a summary reads (the reader loads only these for a file without a summary).
FIELDS = ("completion_mask", "ratio", "ref_kl_k3", "approx_kl_k2", "old_logprobs", "sampler_logprobs", "entropy",
          "rewards", "advantages", "group_ids", "reward_components", "loss")
RECORDED_KEY = "recorded_summary_values"  # header key of wall_time and scalars/<name> until the writer summarises
COMPONENT_PREFIX = "mean_reward/"
SCALAR_PREFIX = "scalars/"
MAX_NAME_CHARS = 100  # a scalar's or a reward component's name in a summary key
GROUP_KEYS = ("groups", "zero_variance_groups", "group_ids_recorded")
COUNT_KEYS = ("kept_tokens", "nonfinite_values", "nonfinite_kept", *GROUP_KEYS)
CLIP_KEYS = ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "clip_region")


def _stat_keys(name: str) -> list[str]:
    return [f"mean_{name}"] + [f"{name}_{q}" for q in QUANTILES]


# Every key, in the order a summary holds them (counts, token statistics, per-sequence ones, clip, NaN counts).
ORDER = ("kept_tokens", *(k for n in TOKEN_STATS for k in _stat_keys(n)),
         *(k for n in SEQUENCE_STATS for k in _stat_keys(n)), "loss", *GROUP_KEYS, *CLIP_KEYS, "nonfinite_values",
         "nonfinite_kept", "wall_time")
KEYS = frozenset(ORDER)  # the fixed keys; mean_reward/<name> and scalars/<name> are keys too (is_key)
_FLOAT_KEYS = KEYS - frozenset(COUNT_KEYS)


def named_key(key: object) -> bool:
    """Whether ``key`` is a ``mean_reward/<name>`` or ``scalars/<name>`` key (a name of 1 to
    :data:`MAX_NAME_CHARS` characters)."""
    if type(key) is not str:
        return False
    for prefix in (COMPONENT_PREFIX, SCALAR_PREFIX):
        if key.startswith(prefix):
            return 0 < len(key) - len(prefix) <= MAX_NAME_CHARS
    return False


def is_key(key: object) -> bool:
    """Whether ``key`` is a summary key (fixed or named)."""
    return key in KEYS or named_key(key)


def ordered_keys(keys) -> list[str]:
    """``keys`` (summary keys, any iterable) in a summary's order: :data:`ORDER`, then the reward
    components' means, then the scalars, each in the order first met."""
    keys = list(dict.fromkeys(keys))
    present = set(keys)
    return ([k for k in ORDER if k in present] + [k for k in keys if k.startswith(COMPONENT_PREFIX)]
            + [k for k in keys if k.startswith(SCALAR_PREFIX)])


def _number(value: object) -> float | None:
    """``value`` as a float when it is a JSON number (NaN and infinities included: a recorded value, such
    as an infinite gradient norm, is kept as it was), else None."""
    if type(value) in (int, float):
        return float(value)
    return None


def recorded_values(metadata: Mapping[str, Any]) -> dict[str, float]:
    """``wall_time`` and ``scalars/<name>`` of a step's decoded header: from :data:`RECORDED_KEY`
    (a header written before the writer summarised it) or from the stored summary of any version;
    values that are not numbers are left out."""
    out: dict[str, float] = {}
    for source in (metadata.get(SUMMARY_KEY), metadata.get(RECORDED_KEY)):
        if not isinstance(source, Mapping):
            continue
        for key, value in source.items():
            if key == "wall_time" or (named_key(key) and key.startswith(SCALAR_PREFIX)):
                number = _number(value) if value is not None else math.nan
                if number is not None:
                    out[key] = number
    return out



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
        if (kind is float and (key in _FLOAT_KEYS or named_key(key))) or (kind is int and key in COUNT_KEYS
                                                                           and value >= 0):
            out[key] = value
            continue
        if key == "version":
            continue
        if not is_key(key):
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
