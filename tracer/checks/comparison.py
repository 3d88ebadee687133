"""Recorded vs recomputed: the one error finding every recompute check gives when a tensor the
trainer recorded differs from its recomputation with :mod:`tracer.formulas` from the recorded inputs.

Tolerance: ``|recorded - recomputed| <= atol + rtol * |recomputed|`` with the step's dtype
tolerances (:class:`tracer.checks.context.Tolerance`), compared in float64 at kept, finite positions
only (non-finite values are the ``nonfinite.values`` check's business).
"""

from __future__ import annotations

import torch

from tracer.checks.context import StepContext, where_text
from tracer.checks.finding import ERROR


def compare(ctx: StepContext, check: str, name: str, recorded: torch.Tensor, expected: torch.Tensor,
            keep: torch.Tensor, formula: str, ids_field: str = "completion_ids"):
    """One error finding when ``recorded`` and ``expected`` differ beyond the dtype tolerance at a
    kept, finite position (non-finite values are nonfinite.values' business); else [].

    ``recorded``, ``expected`` and ``keep`` share one shape (``[]``, ``[B]`` or ``[B, T]``); the
    finding is located at the worst position and names ``formula`` as the fix."""
    recorded, expected = recorded.double(), expected.double()
    diff = (recorded - expected).abs()
    tol = ctx.tol.atol + ctx.tol.rtol * expected.abs()
    bad = (diff > tol) & keep & torch.isfinite(recorded) & torch.isfinite(expected)
    if not bool(bad.any()):
        return []
    flat = int(diff.masked_fill(~bad, -1.0).argmax())
    idx = torch.unravel_index(torch.tensor(flat), diff.shape)
    b = int(idx[0]) if diff.dim() >= 1 else None
    t = int(idx[1]) if diff.dim() >= 2 else None
    r, e = float(recorded[idx]), float(expected[idx])
    message = (
        f"recorded {name} differs from {formula} recomputed from the recorded inputs at {int(bad.sum())} of "
        f"{int(keep.sum())} kept positions; worst at {where_text(b, t) or 'the scalar'}: recorded {r:.6g}, "
        f"recomputed {e:.6g} (|Δ| {abs(r - e):.3g} > {ctx.tol.atol:g} + {ctx.tol.rtol:g}·|recomputed| for "
        f"{ctx.dtype}). Why it matters: the trainer computes {name} differently from the textbook formula, or "
        f"records a tensor other than the one it trains with. Likely fix: compute it with {formula}."
    )
    return [ctx.finding(check, ERROR, message, b, t, field=name, ids_field=ids_field, recorded=r, recomputed=e,
                        positions=int(bad.sum()))]
