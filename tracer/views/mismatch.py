"""Sampler vs trainer, token by token: the tables the app's Mismatch page shows.

The trainer side is ``old_logprobs`` when recorded, else ``policy_logprobs`` (a fresh inner step,
where policy == old), as in the ``sampler.mismatch`` check. The maths (``old - sampler``,
``|p_old - p_sampler|``) comes from :mod:`tracer.formulas`; what the importance-sampling cap did is
read from the weights the trainer recorded (``is_weights`` / ``sequence_is_weights``), not
recomputed: a weight at a cap (``*_truncate``) or 0 (``*_mask``) is a cut.

- :func:`mismatch_tokens`: one row per kept token of a step file.
- :func:`mismatch_steps`: one row per step file (mean/max of both conventions, tokens cut).
- :func:`correction_settings`: the engine and correction settings of a step, for display.
"""

from __future__ import annotations

from typing import Any, Iterable

import pandas as pd
import torch

from tracer import formulas
from tracer.read import StepKey, Trace

__all__ = ["SAMPLER_FIELDS", "trainer_field", "mismatch_tokens", "mismatch_steps", "correction_settings",
           "TOKEN_COLUMNS", "STEP_COLUMNS"]

SAMPLER_FIELDS = ("sampler_logprobs", "completion_mask", "completion_ids")
TOKEN_COLUMNS = ("sequence", "token", "token_id", "token_text", "trainer_logprob", "sampler_logprob", "log_diff",
                 "abs_log_diff", "prob_diff", "entropy", "is_weight", "cut")
STEP_COLUMNS = ("step", "inner_step", "micro_batch", "rank", "path", "tokens", "mean", "mean_abs", "max_abs",
                "prob_diff_mean", "prob_diff_max", "cut", "cut_unit")
_SETTINGS = ("sampler_engine", "vllm_mode", "sampler_logprobs_mode", "temperature", "top_p", "top_k",
             "is_correction", "is_mode", "is_clip_min", "is_clip_max")


def trainer_field(fields: Iterable[str]) -> str | None:
    """The trainer-side logprobs to compare with the sampler's, or None when the step lacks one."""
    names = set(fields)
    if "sampler_logprobs" not in names:
        return None
    return next((n for n in ("old_logprobs", "policy_logprobs") if n in names), None)


def correction_settings(metadata: dict[str, Any]) -> dict[str, Any]:
    """The sampler and importance-sampling settings recorded in a step's metadata (absent keys left out)."""
    return {k: metadata[k] for k in _SETTINGS if metadata.get(k) is not None}


def _cut(weights: torch.Tensor, metadata: dict[str, Any]) -> torch.Tensor:
    """Where the recorded importance weights were cut by the cap: 0 in ``*_mask`` modes, at a cap
    in ``*_truncate`` modes (bool, the shape of ``weights``)."""
    mode = str(metadata.get("is_mode") or "")
    if mode.endswith("mask"):
        return weights == 0
    cut = torch.zeros_like(weights, dtype=torch.bool)
    for cap in (metadata.get("is_clip_min"), metadata.get("is_clip_max")):
        if cap is not None:
            cut |= torch.isclose(weights, torch.tensor(float(cap), dtype=weights.dtype), rtol=1e-6, atol=0.0)
    return cut


def _load(trace: Trace, key: StepKey) -> tuple[dict[str, torch.Tensor], str] | None:
    fields = trace.fields(key)
    name = trainer_field(fields)
    if name is None or "completion_mask" not in fields:
        return None
    wanted = [*SAMPLER_FIELDS, name] + [f for f in ("entropy", "is_weights", "sequence_is_weights") if f in fields]
    return trace.load_step(key, [f for f in wanted if f in fields]), name


def mismatch_tokens(trace: Trace, key: StepKey) -> pd.DataFrame:
    """One row per kept token (``completion_mask`` and both logprobs finite) of the step file ``key``
    with :data:`TOKEN_COLUMNS`: ``log_diff`` = trainer - sampler (nats), ``prob_diff`` =
    ``|p_trainer - p_sampler|``, ``entropy`` (nats, NaN when not recorded), ``is_weight`` (the
    token's weight, or its sequence's in sequence modes; NaN when not recorded), ``cut`` (the cap
    truncated or masked it). Empty when the step file has no sampler logprobs."""
    loaded = _load(trace, key)
    if loaded is None:
        return pd.DataFrame(columns=list(TOKEN_COLUMNS))
    data, name = loaded
    trainer, sampler = data[name].double(), data["sampler_logprobs"].double()  # (B, T)
    keep = data["completion_mask"].bool() & torch.isfinite(trainer) & torch.isfinite(sampler)
    rows, cols = keep.nonzero(as_tuple=True)
    meta = trace.metadata(key)
    nan = torch.full(trainer.shape, float("nan"), dtype=torch.float64)
    weights, cut = nan, torch.zeros(trainer.shape, dtype=torch.bool)
    if "is_weights" in data:
        weights = data["is_weights"].double()
        cut = _cut(weights, meta)
    elif "sequence_is_weights" in data:
        per_seq = data["sequence_is_weights"].double()  # (B,)
        weights = per_seq.unsqueeze(1).expand_as(trainer)
        cut = _cut(per_seq, meta).unsqueeze(1).expand_as(trainer)
    log_diff = formulas.sampler_log_ratio(trainer, sampler)
    ids = data["completion_ids"]
    entropy = data["entropy"].double() if "entropy" in data else nan
    frame = pd.DataFrame({
        "sequence": rows.numpy(), "token": cols.numpy(), "token_id": ids[rows, cols].numpy(),
        "token_text": trace.token_text(ids[rows, cols].tolist()) if trace.tokens is not None else None,
        "trainer_logprob": trainer[rows, cols].numpy(), "sampler_logprob": sampler[rows, cols].numpy(),
        "log_diff": log_diff[rows, cols].numpy(), "abs_log_diff": log_diff[rows, cols].abs().numpy(),
        "prob_diff": formulas.sampler_prob_diff(trainer, sampler)[rows, cols].numpy(),
        "entropy": entropy[rows, cols].numpy(), "is_weight": weights[rows, cols].numpy(),
        "cut": cut[rows, cols].numpy()})
    frame.attrs["trainer_field"] = name
    return frame


def mismatch_steps(trace: Trace, keys: Iterable[StepKey]) -> pd.DataFrame:
    """One row per step file of ``keys`` that has sampler logprobs, with :data:`STEP_COLUMNS`
    (``cut``: tokens, or sequences in sequence modes, whose importance weight the cap cut; NaN
    when no weights are recorded)."""
    records = []
    for key in keys:
        tokens = mismatch_tokens(trace, key)
        if tokens.empty:
            continue
        seq_mode = str(trace.metadata(key).get("is_mode") or "").startswith("sequence")
        has_weights = bool(tokens["is_weight"].notna().any())
        cut = tokens.drop_duplicates("sequence")["cut"].sum() if seq_mode else tokens["cut"].sum()
        records.append({
            "step": key.step, "inner_step": key.inner_step, "micro_batch": key.micro_batch, "rank": key.rank,
            "path": str(key.path), "tokens": len(tokens), "mean": tokens["log_diff"].mean(),
            "mean_abs": tokens["abs_log_diff"].mean(), "max_abs": tokens["abs_log_diff"].max(),
            "prob_diff_mean": tokens["prob_diff"].mean(), "prob_diff_max": tokens["prob_diff"].max(),
            "cut": float(cut) if has_weights else float("nan"), "cut_unit": "sequences" if seq_mode else "tokens"})
    return pd.DataFrame.from_records(records, columns=list(STEP_COLUMNS))
