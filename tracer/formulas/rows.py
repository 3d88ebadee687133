"""Per-completion (per-row) statistics of one step: the numbers a rollout table shows for each of the
B sequence rows (:mod:`tracer.read.rollouts`). The writer thread computes them once per step file
(:mod:`tracer.format.rollout_store`) and the reader computes them from the tensors of a file the store
does not list, with this one function, so both paths give the same numbers.

Per row b (``completion_mask`` True = the token enters the loss; means over the row's kept tokens by
:func:`tracer.formulas.reductions.masked_mean`, 0 for a row that keeps nothing, as the loss would see it):

    length             completion_mask[b].sum()                          (tokens)
    reward             rewards[b]                                        (as recorded)
    reward_components  reward_components[b, :]                           [F]
    advantage          advantages[b] ([B]), or masked mean over the row's kept tokens ([B, T], PPO)
    mean_ratio         masked mean of ratio = exp(policy - old)
    mean_ref_kl_k3     masked mean of ref_kl_k3 (nats)
    mean_abs_mismatch  masked mean of |old_logprobs - sampler_logprobs| (nats)
    mean_entropy       masked mean of entropy (nats)
    group              group_ids[b], else b // num_generations (the seed's G consecutive rows), else -1

A field the step lacks (or whose shape does not fit ``[B]`` / ``[B, T]``) gives NaN (-1 for group).
Computed in float32 from the stored tensors (float64 stays float64), ratio and ref_kl_k3 derived by
:func:`tracer.formulas.derived.derive_fields` when only their inputs are recorded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tracer.formulas import reductions
from tracer.formulas.derived import derive_fields
from tracer.formulas.summaries import consecutive_groups

# The per-row number columns, in the order a rollout table shows them.
ROW_STATS = ("length", "reward", "advantage", "mean_ratio", "mean_ref_kl_k3", "mean_abs_mismatch", "mean_entropy")
# Fields the row statistics read (the reader loads only these, plus the inputs of derived ratio / k3).
ROW_FIELDS = ("completion_ids", "completion_mask", "rewards", "reward_components", "advantages", "group_ids",
              "ratio", "ref_kl_k3", "old_logprobs", "sampler_logprobs", "entropy")


def _float(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _row_mean(values: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """``[B]`` masked mean of ``values`` ``[B, T]`` over each row's kept tokens, None when absent or
    of another shape."""
    if values is None or values.shape != mask.shape or not values.is_floating_point():
        return None
    return reductions.masked_mean(_float(values), mask, dim=1)


def row_count(tensors: Mapping[str, torch.Tensor]) -> int:
    """B: the rows of ``completion_ids`` (else ``completion_mask``, else ``rewards``); 0 when none."""
    for name in ("completion_ids", "completion_mask", "rewards"):
        t = tensors.get(name)
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0])
    return 0


def row_statistics(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The statistics of the module docstring for each row of one step.

    Args:
        tensors: the step's stored tensors (CPU; SPEC.md section 4 names and shapes).
        metadata: its decoded header (``num_generations`` for the groups when ``group_ids`` is absent).

    Returns:
        ``{name: float64 [B]}`` for each of :data:`ROW_STATS`, ``group`` (int64 ``[B]``) and, when
        ``reward_components [B, F]`` is recorded, ``reward_components`` (float64 ``[B, F]``).
    """
    B = row_count(tensors)
    data = dict(tensors)
    data.update(derive_fields(data, dict(metadata), wanted=("ratio", "ref_kl_k3")))
    ids = data.get("completion_ids")
    mask = data.get("completion_mask")
    if mask is None and isinstance(ids, torch.Tensor) and ids.dim() == 2:
        mask = torch.ones_like(ids, dtype=torch.bool)  # no mask recorded: every token enters the loss
    mask = mask.bool() if mask is not None and mask.dim() == 2 and mask.shape[0] == B else None
    nan = torch.full((B,), math.nan, dtype=torch.float64)
    out: dict[str, torch.Tensor | None] = {name: None for name in ROW_STATS}
    if mask is not None:
        out["length"] = mask.sum(dim=1)
        out["mean_ratio"] = _row_mean(data.get("ratio"), mask)
        out["mean_ref_kl_k3"] = _row_mean(data.get("ref_kl_k3"), mask)
        out["mean_entropy"] = _row_mean(data.get("entropy"), mask)
        old, sampler = data.get("old_logprobs"), data.get("sampler_logprobs")
        if old is not None and sampler is not None and old.shape == sampler.shape:
            out["mean_abs_mismatch"] = _row_mean((_float(old) - _float(sampler)).abs(), mask)
    rewards = data.get("rewards")
    if isinstance(rewards, torch.Tensor) and rewards.shape == (B,) and rewards.is_floating_point():
        out["reward"] = rewards
    adv = data.get("advantages")
    if isinstance(adv, torch.Tensor) and adv.is_floating_point():
        if adv.shape == (B,):
            out["advantage"] = adv
        elif mask is not None:
            out["advantage"] = _row_mean(adv, mask)  # PPO: per token
    result = {name: (nan if v is None else v.double()).numpy() for name, v in out.items()}
    result["group"] = _groups(data, metadata, B)
    components = data.get("reward_components")
    if isinstance(components, torch.Tensor) and components.dim() == 2 and components.shape[0] == B \
            and components.is_floating_point():
        result["reward_components"] = components.double().numpy()
    return result


def _groups(data: Mapping[str, torch.Tensor], metadata: Mapping[str, Any], B: int) -> np.ndarray:
    """``int64 [B]``: ``group_ids`` when recorded, else G consecutive rows per group from
    ``num_generations`` (as :func:`tracer.formulas.summaries` counts groups), else -1."""
    group_ids = data.get("group_ids")
    if isinstance(group_ids, torch.Tensor) and group_ids.shape == (B,) and not group_ids.is_floating_point() \
            and group_ids.dtype != torch.bool:
        return group_ids.long().numpy().copy()
    G = metadata.get("num_generations")
    if type(G) is int and G >= 1 and B % G == 0:
        return consecutive_groups(B, G).copy()
    return np.full(B, -1, dtype=np.int64)


def kept_ids(tensors: Mapping[str, torch.Tensor]) -> list[list[int]]:
    """The kept completion token ids of each row (``completion_ids`` where ``completion_mask`` keeps,
    in order), ``[B][n_b]``; [] per row when no ``completion_ids [B, T]`` is recorded."""
    ids = tensors.get("completion_ids")
    B = row_count(tensors)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return [[] for _ in range(B)]
    mask = tensors.get("completion_mask")
    if mask is None or mask.shape != ids.shape:
        return ids.tolist()
    mask = mask.bool()
    flat = ids[mask].tolist()  # the kept ids of every row, in row order: one call, then sliced
    ends = mask.sum(dim=1).cumsum(0).tolist()
    return [flat[start:end] for start, end in zip([0, *ends[:-1]], ends)]
