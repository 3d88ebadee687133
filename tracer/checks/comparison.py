"""Recorded vs recomputed: the one error finding every recompute check gives when a tensor the
trainer recorded differs from its recomputation with :mod:`tracer.formulas` from the recorded inputs,
and, for a derived tensor with known wrong variants (an inverted ratio, k3 with its arguments
swapped, k2 without its 0.5), the one variant that reproduces the recorded values.

Tolerance: ``|recorded - recomputed| <= atol + rtol * |recomputed|`` with the step's dtype
tolerances (:class:`tracer.checks.context.Tolerance`), compared in float64 at kept, finite positions
only (non-finite values are the ``nonfinite.values`` check's business).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracer.checks.context import StepContext, where_text
from tracer.checks.finding import ERROR
from tracer.checks.text import count


@dataclass(frozen=True)
class Variant:
    """A known wrong way to compute a derived tensor.

    Attributes:
        cause: the bug in a few words, opening the message (e.g. ``"ratio inverted"``).
        formula: what the variant computes, in the message's words (e.g. ``"exp(old − policy)"``).
        values: the variant evaluated on the recorded inputs, the recorded tensor's shape.
    """

    cause: str
    formula: str
    values: torch.Tensor


def _outside(ctx: StepContext, recorded: torch.Tensor, expected: torch.Tensor, keep: torch.Tensor):
    """(|recorded - expected| in float64, bool: beyond tolerance at a kept position where both are finite)."""
    recorded, expected = recorded.double(), expected.double()
    diff = (recorded - expected).abs()
    tol = ctx.tol.atol + ctx.tol.rtol * expected.abs()
    return diff, (diff > tol) & keep & torch.isfinite(recorded) & torch.isfinite(expected)


def compare(ctx: StepContext, check: str, name: str, recorded: torch.Tensor, expected: torch.Tensor,
            keep: torch.Tensor, formula: str, ids_field: str = "completion_ids"):
    """One error finding when ``recorded`` and ``expected`` differ beyond the dtype tolerance at a
    kept, finite position (non-finite values are nonfinite.values' business); else [].

    ``recorded``, ``expected`` and ``keep`` share one shape (``[]``, ``[B]`` or ``[B, T]``); the
    finding is located at the worst position and states the measured difference against ``formula``
    (callers that can tell the cause prepend it)."""
    diff, bad = _outside(ctx, recorded, expected, keep)
    if not bool(bad.any()):
        return []
    recorded, expected = recorded.double(), expected.double()
    flat = int(diff.masked_fill(~bad, -1.0).argmax())
    idx = torch.unravel_index(torch.tensor(flat), diff.shape)
    b = int(idx[0]) if diff.dim() >= 1 else None
    t = int(idx[1]) if diff.dim() >= 2 else None
    r, e = float(recorded[idx]), float(expected[idx])
    message = (
        f"recorded {name} differs from {formula} recomputed from the recorded inputs at {int(bad.sum())} of "
        f"{int(keep.sum())} kept positions; worst at {where_text(b, t) or 'the scalar'}: recorded {r:.6g}, "
        f"recomputed {e:.6g} (|Δ| {abs(r - e):.3g} > {ctx.tol.atol:g} + {ctx.tol.rtol:g}·|recomputed| for "
        f"{ctx.dtype})."
    )
    return [ctx.finding(check, ERROR, message, b, t, field=name, ids_field=ids_field, recorded=r, recomputed=e,
                        positions=int(bad.sum()))]


def compare_with_variants(ctx: StepContext, check: str, name: str, recorded: torch.Tensor, expected: torch.Tensor,
                          keep: torch.Tensor, formula: str, variants: list[Variant]):
    """:func:`compare`, then the cause: when exactly one of ``variants`` reproduces ``recorded`` to the
    dtype tolerance at every kept position where it is finite, the message opens with that variant's
    cause, its max |Δ| and how far ``formula`` is off; when none does, it says which were tried and how
    far each is off. No fix list: the cause is the fix. ``details`` gain ``cause`` (the variant's
    cause, or None) and ``max_abs_diff`` per formula tried."""
    findings = compare(ctx, check, name, recorded, expected, keep, formula)
    if not findings:
        return findings
    kept = keep & torch.isfinite(recorded.double())
    n = int(kept.sum())

    def off(values: torch.Tensor) -> float:
        gap = (recorded.double() - values.double()).abs()[kept]
        return float(gap.max()) if gap.numel() else 0.0

    matching = [v for v in variants if not bool(_outside(ctx, recorded, v.values, kept)[1].any())
                and bool(torch.isfinite(v.values.double())[kept].all())]
    finding = findings[0]
    if len(matching) == 1:
        v = matching[0]
        lead = (f"{v.cause}: recorded {name} equals {v.formula} on all {count(n, 'kept token')} (max |Δ| "
                f"{off(v.values):.2g}); {formula} is off by up to {off(expected):.2g}. ")
    elif matching:
        lead = (f"recorded {name} equals each of {', '.join(v.formula for v in matching)} on all "
                f"{count(n, 'kept token')}: the data cannot tell {' and '.join(v.cause for v in matching)} apart. ")
    else:
        tried = "; ".join(f"{v.formula} (off by up to {off(v.values):.2g})" for v in variants)
        lead = (f"recorded {name} matches none of: {formula} (off by up to {off(expected):.2g}); {tried}. The "
                f"trainer computes {name} another way, or records a tensor other than the one it trains with. ")
    finding.message = lead + finding.message
    finding.details.update(cause=matching[0].cause if len(matching) == 1 else None,
                           max_abs_diff={formula: off(expected), **{v.formula: off(v.values) for v in variants}})
    return findings
