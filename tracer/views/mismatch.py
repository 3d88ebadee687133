"""Sampler vs trainer, token by token: the tables the app's Mismatch page shows.

The trainer side is ``old_logprobs`` when recorded, else ``policy_logprobs`` (a fresh inner step,
where policy == old), as in the ``sampler.mismatch`` check. The maths (``old - sampler``,
``|p_old - p_sampler|``, the importance-sampling corrections) comes from :mod:`tracer.formulas`.

Importance sampling. The raw ratio before any cap is ``exp(trainer - sampler)`` per token (and, in
sequence modes, ``exp`` of its sum or mean over the row); the weight applied is the one the trainer
recorded (``is_weights`` / ``sequence_is_weights`` / verl's ``rollout_is_weights``), else, where the
step declares a correction (:func:`tracer.formulas.importance.declared_correction`) but keeps no
weights, the weight that correction gives, marked ``derived``; a token (token modes) or a sequence
(sequence modes) whose raw ratio lies outside the declared caps is ``cut`` (truncated or masked). Policy
lag per row: ``trainer_version - policy_version`` when both are recorded. Nothing is filled in:
a value the step cannot give is NaN.

- :func:`mismatch_tokens`: one row per kept token of a step file.
- :func:`mismatch_steps`: one row per step file (mean/max of both conventions, the share the correction
  cut, the mean lag).
- :func:`correction_settings`: the engine and correction settings of a step, for display.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd
import torch

from tracer import formulas
from tracer.formulas import importance
from tracer.read import StepKey, Trace

__all__ = [
    "SAMPLER_FIELDS",
    "STEP_COLUMNS",
    "TOKEN_COLUMNS",
    "correction_of",
    "correction_settings",
    "mismatch_steps",
    "mismatch_tokens",
    "trainer_field",
]

SAMPLER_FIELDS = ("sampler_logprobs", "completion_mask", "completion_ids")
TOKEN_COLUMNS = ("sequence", "token", "token_id", "token_text", "trainer_logprob", "sampler_logprob", "log_diff",
                 "abs_log_diff", "prob_diff", "entropy", "raw_ratio", "raw_sequence_ratio", "is_weight", "cut",
                 "policy_lag")
STEP_COLUMNS = ("step", "inner_step", "micro_batch", "rank", "path", "tokens", "mean", "mean_abs", "max_abs",
                "prob_diff_mean", "prob_diff_max", "cut", "cut_unit", "cut_share", "mean_lag", "max_lag")
WEIGHT_FIELDS = ("is_weights", "sequence_is_weights", "rollout_is_weights")
_SETTINGS = ("sampler_engine", "vllm_mode", "sampler_logprobs_mode", "temperature", "top_p", "top_k",
             "is_correction", "is_mode", "is_clip_min", "is_clip_max", "is_sequence_aggregation", "rollout_is",
             "rollout_is_threshold", "rollout_is_batch_normalize", "trainer_version", "max_policy_lag")


def trainer_field(fields: Iterable[str]) -> str | None:
    """The trainer-side logprobs to compare with the sampler's, or None when the step lacks one."""
    names = set(fields)
    if "sampler_logprobs" not in names:
        return None
    return next((n for n in ("old_logprobs", "policy_logprobs") if n in names), None)


def correction_settings(metadata: dict[str, Any]) -> dict[str, Any]:
    """The sampler and importance-sampling settings recorded in a step's metadata (absent keys left out)."""
    return {k: metadata[k] for k in _SETTINGS if metadata.get(k) is not None}


def correction_of(metadata: dict[str, Any], recorded_weights: bool) -> importance.Correction | None:
    """The importance-sampling correction a step declares (None when none, or when its settings are
    not modelled: ``sampler.is_weights`` reports those as not checked)."""
    try:
        return importance.declared_correction(metadata.get, recorded_weights)
    except (TypeError, ValueError):
        return None


def _load(trace: Trace, key: StepKey) -> tuple[dict[str, torch.Tensor], str] | None:
    fields = trace.fields(key)
    name = trainer_field(fields)
    if name is None or "completion_mask" not in fields:
        return None
    wanted = [*SAMPLER_FIELDS, name, "entropy", *WEIGHT_FIELDS, "policy_version"]
    return trace.load_step(key, [f for f in wanted if f in fields]), name


def _lag(data: dict[str, torch.Tensor], meta: dict[str, Any], rows: int) -> torch.Tensor:
    """``[B]`` float64 policy lag of each row, NaN when ``policy_version`` or ``trainer_version`` is not recorded."""
    version = meta.get("trainer_version")
    if "policy_version" not in data or version is None or data["policy_version"].numel() != rows:
        return torch.full((rows,), float("nan"), dtype=torch.float64)
    return importance.policy_lag(data["policy_version"].reshape(-1), int(version)).double()


def mismatch_tokens(trace: Trace, key: StepKey) -> pd.DataFrame:
    """One row per kept token (``completion_mask`` and both logprobs finite) of the step file ``key``
    with :data:`TOKEN_COLUMNS`: ``log_diff`` = trainer - sampler (nats), ``prob_diff`` =
    ``|p_trainer - p_sampler|``, ``entropy`` (nats, NaN when not recorded), ``raw_ratio`` =
    ``exp(trainer - sampler)`` before any cap, ``raw_sequence_ratio`` (sequence modes: the row's ratio
    before the cap, ``exp`` of the declared sum or mean; NaN otherwise), ``is_weight`` (the weight
    applied to the token, or to its sequence: recorded, else derived from the declared correction; NaN
    when neither), ``cut`` (the correction truncated or masked it: its raw ratio, or its sequence's,
    outside the declared caps), ``policy_lag`` (its row's, NaN when not recorded).
    ``attrs``: ``trainer_field``, ``weights_source`` (``recorded`` | ``derived`` | None) and ``correction``
    (the declared settings as text, or None). Empty when the step file has no sampler logprobs."""
    loaded = _load(trace, key)
    if loaded is None:
        return pd.DataFrame(columns=list(TOKEN_COLUMNS))
    data, name = loaded
    trainer, sampler = data[name].double(), data["sampler_logprobs"].double()  # (B, T)
    keep = data["completion_mask"].bool() & torch.isfinite(trainer) & torch.isfinite(sampler)
    rows, cols = keep.nonzero(as_tuple=True)
    meta = trace.metadata(key)
    nan = torch.full(trainer.shape, float("nan"), dtype=torch.float64)
    recorded = next((f for f in WEIGHT_FIELDS if f in data), None)
    correction = correction_of(meta, recorded is not None)
    safe_sampler = torch.where(keep, sampler, trainer)  # off the mask: a zero log ratio, never a NaN placeholder
    weights, cut, sequence_raw, source = nan, torch.zeros(trainer.shape, dtype=torch.bool), nan, None
    if recorded is not None:
        weights = data[recorded].double()
        weights = weights.unsqueeze(1).expand_as(trainer) if weights.dim() == 1 else weights
        source = "recorded"
    elif correction is not None:
        weights = correction.weights(trainer, safe_sampler, keep).double()
        weights = weights.unsqueeze(1).expand_as(trainer) if weights.dim() == 1 else weights
        source = "derived"
    if correction is not None:
        raw = importance.raw_is_ratio(trainer, safe_sampler, keep, correction.mode, correction.aggregation)
        outside = importance.outside_caps(raw, correction.clip_min, correction.clip_max)
        if correction.sequence:
            sequence_raw = raw.unsqueeze(1).expand_as(trainer)
            cut = outside.unsqueeze(1).expand_as(trainer)
        else:
            cut = outside
    log_diff = formulas.sampler_log_ratio(trainer, sampler)
    ids = data["completion_ids"]
    entropy = data["entropy"].double() if "entropy" in data else nan
    lag = _lag(data, meta, trainer.shape[0])
    frame = pd.DataFrame({
        "sequence": rows.numpy(), "token": cols.numpy(), "token_id": ids[rows, cols].numpy(),
        "token_text": trace.token_text(ids[rows, cols].tolist()) if trace.tokens is not None else None,
        "trainer_logprob": trainer[rows, cols].numpy(), "sampler_logprob": sampler[rows, cols].numpy(),
        "log_diff": log_diff[rows, cols].numpy(), "abs_log_diff": log_diff[rows, cols].abs().numpy(),
        "prob_diff": formulas.sampler_prob_diff(trainer, sampler)[rows, cols].numpy(),
        "entropy": entropy[rows, cols].numpy(), "raw_ratio": torch.exp(log_diff[rows, cols]).numpy(),
        "raw_sequence_ratio": sequence_raw[rows, cols].numpy(), "is_weight": weights[rows, cols].numpy(),
        "cut": cut[rows, cols].numpy(), "policy_lag": lag[rows].numpy()})
    frame.attrs.update(trainer_field=name, weights_source=source,
                       correction=None if correction is None else correction.text())
    return frame


def mismatch_steps(trace: Trace, keys: Iterable[StepKey]) -> pd.DataFrame:
    """One row per step file of ``keys`` that has sampler logprobs, with :data:`STEP_COLUMNS`
    (``cut``: kept tokens, or sequences in sequence modes, that the correction truncated or masked, and
    ``cut_share`` their share; NaN when the step neither records nor declares weights; ``mean_lag`` /
    ``max_lag`` over its rows, NaN when no policy lag is recorded)."""
    records = []
    for key in keys:
        tokens = mismatch_tokens(trace, key)
        if tokens.empty:
            continue
        seq_mode = bool(tokens["raw_sequence_ratio"].notna().any())
        has_weights = bool(tokens["is_weight"].notna().any())
        units = tokens.drop_duplicates("sequence") if seq_mode else tokens
        cut = units["cut"].sum()
        lags = tokens.drop_duplicates("sequence")["policy_lag"]
        records.append({
            "step": key.step, "inner_step": key.inner_step, "micro_batch": key.micro_batch, "rank": key.rank,
            "path": str(key.path), "tokens": len(tokens), "mean": tokens["log_diff"].mean(),
            "mean_abs": tokens["abs_log_diff"].mean(), "max_abs": tokens["abs_log_diff"].max(),
            "prob_diff_mean": tokens["prob_diff"].mean(), "prob_diff_max": tokens["prob_diff"].max(),
            "cut": float(cut) if has_weights else float("nan"), "cut_unit": "sequences" if seq_mode else "tokens",
            "cut_share": float(cut) / len(units) if has_weights else float("nan"),
            "mean_lag": lags.mean(), "max_lag": lags.max()})
    return pd.DataFrame.from_records(records, columns=list(STEP_COLUMNS))
