"""Masked reductions and quantiles: masked sum and mean (a NaN at a dropped position never
leaks), quantiles over kept values (linear interpolation, numpy's default), and the host-side
(numpy) row quantiles the writer thread computes for every step. Every mask is True = keep.
"""

from __future__ import annotations

import numpy as np
import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` keeps; positions dropped by the mask never contribute
    (a NaN at a masked slot does not leak)."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask) / mask.sum().clamp(min=1)`` over ``dim`` (all positions when None).

    Source: seed section 5.1.
    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_quantiles(values: torch.Tensor, mask: torch.Tensor | None, qs: tuple[float, ...]) -> torch.Tensor:
    """Quantiles ``qs`` (each in [0, 1]) of ``values`` at the positions ``mask`` keeps (all positions
    when None), NaN values left out; linear interpolation between order statistics (numpy's default
    ``method="linear"``, the same as ``torch.quantile``). Returns float64 ``[len(qs)]``; all NaN
    when no non-NaN value is kept. ``mask`` has the shape of ``values``.
    """
    kept = values.reshape(-1) if mask is None else values[mask.bool()]
    kept = kept[~torch.isnan(kept)]
    if kept.numel() == 0:
        return torch.full((len(qs),), float("nan"), dtype=torch.float64)
    return row_quantiles(kept.unsqueeze(0), qs)[0]


def row_quantiles(rows: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """Quantiles ``qs`` of each row of ``rows`` ``[K, N]`` (N >= 1, no NaN: see
    :func:`masked_quantiles`), linear interpolation as numpy's default. Returns float64 ``[K, len(qs)]``.
    One sort for all K rows."""
    n = rows.shape[1]
    ordered = torch.sort(rows, dim=1).values
    pos = torch.tensor(qs, dtype=torch.float64) * (n - 1)
    lo, hi = pos.floor().long(), pos.ceil().long()
    below, above = ordered[:, lo].double(), ordered[:, hi].double()
    # equal neighbours (an infinite value included) need no interpolation: inf - inf would be NaN
    return torch.where(below == above, below, below + (above - below) * (pos - lo.double()))


_NUMPY_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                           torch.float32, torch.float64})


def host_array(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """``t`` as a numpy array (no copy for an array, or a CPU tensor of a numpy dtype; other float
    dtypes, bfloat16 and float8, are widened to float32 exactly)."""
    if isinstance(t, np.ndarray):
        return t
    if t.dtype in _NUMPY_DTYPES and t.device.type == "cpu" and not t.requires_grad:
        return t.numpy()  # the usual case, in one call
    t = t.detach().cpu()
    if t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.float()
    return t.numpy()


def masked_row_quantiles(values: torch.Tensor | np.ndarray, mask: torch.Tensor | np.ndarray,
                         qs: tuple[float, ...]) -> torch.Tensor:
    """Quantiles ``qs`` of each row of ``values`` ``[R, N]`` (a tensor or a numpy array) at the
    positions ``mask`` (bool, ``[R, N]``) keeps, NaN values left out: row ``r`` equals
    ``masked_quantiles(values[r], mask[r], qs)`` (linear interpolation, numpy's default), with one
    sort for all rows, however many values each keeps.
    Returns float64 ``[R, len(qs)]``; NaN for a row that keeps no non-NaN value.

    Computed with numpy on the host: the writer thread summarises every step with it, and on small
    rows numpy's sort and element-wise calls cost a fraction of torch's; the values are the same
    (a sort orders equal values alike, and each element-wise step is one IEEE operation)."""
    R, N = values.shape
    if N == 0:
        return torch.full((R, len(qs)), float("nan"), dtype=torch.float64)
    v = host_array(values)
    keep = host_array(mask).astype(bool, copy=False) & ~np.isnan(v)
    counts = keep.sum(axis=1)
    ordered = np.where(keep, v, np.inf)  # kept values first, once sorted
    ordered.sort(axis=1)
    pos = np.array(qs, dtype=np.float64) * np.maximum(counts - 1, 0)[:, None]  # (R, Q)
    lo, hi = np.floor(pos).astype(np.int64), np.ceil(pos).astype(np.int64)
    rows = np.arange(R)[:, None]
    below, above = ordered[rows, lo].astype(np.float64), ordered[rows, hi].astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf where below == above: not the value taken
        out = np.where(below == above, below, below + (above - below) * (pos - lo))
    out[counts == 0] = np.nan
    return torch.from_numpy(out)
