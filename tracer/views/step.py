"""The step-wide view: every completion token of one step (all step files of that step and inner
step: every rank and micro-batch, or one of each) in one long table with the per-token quantities
people sort by to find the bad tokens (|policy - old|, ratio, k3, k2, |old - sampler|, advantage,
entropy, each token's share of the loss).

Pure reading over :class:`tracer.read.reader.Trace`; the maths (ratio and KL estimators when the file
lacks them, the loss shares) comes from :mod:`tracer.formulas` through the reader and
:func:`tracer.formulas.loss_contributions`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from tracer import formulas
from tracer.read import StepKey, Trace
from tracer.read.tables import layout_of, mask_reasons, without_placeholders

# Per-token quantities of the step table: column -> (label, neutral value of its colour scale).
QUANTITIES: dict[str, tuple[str, float]] = {
    "abs_policy_old": ("|policy − old| (nats)", 0.0),
    "ratio": ("ratio = exp(policy − old)", 1.0),
    "ref_kl_k3": ("ref KL k3 (nats)", 0.0),
    "approx_kl_k2": ("approx KL k2 (nats)", 0.0),
    "abs_old_sampler": ("|old − sampler| (nats)", 0.0),
    "advantages": ("advantage", 0.0),
    "entropy": ("entropy (nats)", 0.0),
    "loss_share": ("share of the loss", 0.0),
}
# Columns of every step table, before the quantities.
KEY_COLUMNS = ("rank", "micro_batch", "sequence", "position", "token_id", "token_text", "mask_reason", "kept",
               "turn", "role")
_LOSS_REDUCTIONS = ("sequence_mean", "token_mean", "constant")


def step_files(trace: Trace, step: int, inner_step: int = 0, micro_batch: int | None = None,
               rank: int | None = None) -> list[StepKey]:
    """The step files of ``step`` and ``inner_step`` (one micro-batch / rank, or all), sorted."""
    return [k for k in trace.steps() if k.step == step and k.inner_step == inner_step
            and (micro_batch is None or k.micro_batch == micro_batch) and (rank is None or k.rank == rank)]


def step_token_frame(trace: Trace, step: int, inner_step: int = 0, micro_batch: int | None = None,
                     rank: int | None = None) -> pd.DataFrame:
    """One row per completion position of the step's files, kept or not.

    Columns: :data:`KEY_COLUMNS` (``sequence`` is the row within its own file; ``turn`` and ``role``
    from the recorded ``turn_ids`` / ``token_roles`` or read from the mask), then the
    quantities of :data:`QUANTITIES` the files give (float32; NaN where a file lacks it, and where
    a masked position's old / sampler / ref logprob is a placeholder 0.0:
    :func:`tracer.read.tables.without_placeholders`), plus
    ``old_minus_sampler`` (signed, nats) when sampler logprobs are recorded. ``attrs["derived"]``
    lists the fields the reader derived (:mod:`tracer.formulas.derived`); ``attrs["files"]`` the files read.
    Empty when no file of the step has completion_ids. Raises TraceFormatError for an unreadable file.
    """
    keys = step_files(trace, step, inner_step, micro_batch, rank)
    frames, derived = [], []
    for key in keys:
        frame = _file_frame(trace, key)
        if frame is not None:
            frames.append(frame)
            derived += [d for d in trace.derived_fields(key) if d not in derived]
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(KEY_COLUMNS))
    out.attrs["derived"] = derived
    out.attrs["files"] = [k.path.name for k in keys]
    return out


def _file_frame(trace: Trace, key: StepKey) -> pd.DataFrame | None:
    data = trace.load_step(key)
    ids = data.get("completion_ids")
    if ids is None or ids.dim() != 2:
        return None
    B, T = ids.shape
    mask = data.get("completion_mask", torch.ones_like(ids, dtype=torch.bool)).bool()
    flat_ids = ids.reshape(-1).tolist()
    meta = trace.metadata(key)
    layout = layout_of(data, meta, trace.tokens, trace.eos_token_id, trace.pad_token_id)
    reasons = mask_reasons(ids, mask, trace.eos_token_id, trace.pad_token_id, layout=layout,
                           recorded=data.get("mask_reasons"), metadata=meta)
    frame = pd.DataFrame({
        "rank": key.rank, "micro_batch": key.micro_batch,
        "sequence": np.repeat(np.arange(B), T), "position": np.tile(np.arange(T), B),
        "token_id": flat_ids, "token_text": trace.token_text(flat_ids),
        "mask_reason": [r for row in reasons for r in row], "kept": mask.reshape(-1).numpy(),
    })
    frame["turn"] = layout.turn_ids.reshape(-1).numpy()
    frame["role"] = [r for row in layout.role_rows(mask) for r in row]
    for name, values in _quantities(trace, key, without_placeholders(data), mask).items():
        values = values.float()
        if values.dim() == 1 and values.shape[0] == B:  # [B] (GRPO advantages): one value per row
            values = values.unsqueeze(1).expand(B, T)
        if tuple(values.shape) == (B, T):
            frame[name] = values.reshape(-1).numpy()
    return frame


def _quantities(trace: Trace, key: StepKey, data: dict[str, torch.Tensor], mask: torch.Tensor) -> dict:
    out = {}
    policy, old, sampler = (data.get(n) for n in ("policy_logprobs", "old_logprobs", "sampler_logprobs"))
    if policy is not None and old is not None:
        out["abs_policy_old"] = (policy.double() - old.double()).abs()
    for name in ("ratio", "ref_kl_k3", "approx_kl_k2", "advantages", "entropy"):
        if name in data and data[name].is_floating_point():
            out[name] = data[name]
    if old is not None and sampler is not None:
        out["abs_old_sampler"] = (old.double() - sampler.double()).abs()
        out["old_minus_sampler"] = old.double() - sampler.double()
    share = _loss_share(trace, key, data, mask)
    if share is not None:
        out["loss_share"] = share
    return out


def _loss_share(trace: Trace, key: StepKey, data: dict[str, torch.Tensor], mask: torch.Tensor):
    """Each token's share of its file's loss (needs per_token_loss and a known loss_reduction)."""
    ptl = data.get("per_token_loss")
    meta = trace.metadata(key)
    hyper = trace.manifest.get("hyperparameters") or {}
    reduction = meta.get("loss_reduction", hyper.get("loss_reduction"))
    if ptl is None or ptl.shape != mask.shape or reduction not in _LOSS_REDUCTIONS:
        return None
    divisor = meta.get("loss_divisor", hyper.get("loss_divisor"))
    try:
        return formulas.loss_contributions(ptl.double(), mask, reduction, divisor)
    except ValueError:
        return None


def neutral(quantity: str) -> float:
    """The neutral value of a quantity's colour scale: 1 for the ratio, 0 for the others."""
    return QUANTITIES.get(quantity, ("", 0.0))[1]


def present_quantities(frame: pd.DataFrame) -> list[str]:
    """The quantities of :data:`QUANTITIES` the frame holds with at least one value."""
    return [q for q in QUANTITIES if q in frame and frame[q].notna().any()]
