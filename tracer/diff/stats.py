"""The statistics of one field over the step pairs of a diff: the tolerance test, the minimal
passing tolerances, the drift rule and the shift test (rules in ``tracer.diff``'s docstring)."""

from __future__ import annotations

import math

import torch

from tracer.diff.locations import FLOAT, MASK, Location, StepId, Tolerance
from tracer.diff.result import FieldDiff, StepDifference

# Defaults of torch.testing.assert_close, keyed by the safetensors dtype name.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "F64": Tolerance(1e-7, 1e-7), "F32": Tolerance(1e-5, 1.3e-6),
    "F16": Tolerance(1e-5, 1e-3), "BF16": Tolerance(1e-5, 1.6e-2),
}
FALLBACK_TOLERANCE = Tolerance(1e-5, 0.125)  # float8 and other narrow formats
DRIFT_FRACTION, DRIFT_SIGN_SHARE, DRIFT_MIN_POSITIONS = 0.05, 0.9, 8
SHIFT_IMPROVEMENT = 0.1
MAX_LOCATIONS = 50  # differing positions kept per field


def coarseness(dtype: str) -> float:
    """Default rtol of a safetensors dtype name (0 for integer and bool dtypes)."""
    return DEFAULT_TOLERANCES.get(dtype, FALLBACK_TOLERANCE).rtol if dtype.startswith(("F", "BF")) else 0.0


def default_tolerance(dtype_a: str, dtype_b: str) -> Tolerance:
    """The default tolerance of the coarser of two float dtypes."""
    return max((DEFAULT_TOLERANCES.get(d, FALLBACK_TOLERANCE) for d in (dtype_a, dtype_b)), key=lambda t: t.rtol)


def field_tolerance(name: str, dtype_a: str, dtype_b: str, atols: dict[str, float],
                    rtols: dict[str, float]) -> Tolerance:
    """The tolerance of float field ``name``: the caller's ``atols``/``rtols`` for it (key ``"*"``: every
    other float field), else the default of the coarser of its two dtypes."""
    default = default_tolerance(dtype_a, dtype_b)
    return Tolerance(atols.get(name, atols.get("*", default.atol)), rtols.get(name, rtols.get("*", default.rtol)))


def mismatch(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor, tol: Tolerance):
    """``|b - a|`` (0 where equal, NaN equal to NaN; inf where only one side is NaN) and the
    positions in ``keep`` that fail ``tol``. a, b: float64 of one shape."""
    same = (a == b) | (a.isnan() & b.isnan())
    absd = (b - a).abs()
    absd = torch.where(same, 0.0, torch.where(absd.isnan(), math.inf, absd))
    finite = a.isfinite() & b.isfinite()
    fail = keep & ~same & (~finite | (absd > tol.atol + tol.rtol * a.abs()))
    return absd, fail


class FieldStats:
    """Running statistics of one field over step pairs; ``finish`` gives its FieldDiff."""

    def __init__(self, result: FieldDiff, dims: tuple[str, ...], drift: bool) -> None:
        self.r, self.dims, self.check_drift = result, dims, drift
        self.tol = result.tolerance or Tolerance(0.0, 0.0)
        self.n, self.sum_d, self.sum_abs_a, self.n_pos, self.n_neg = 0, 0.0, 0.0, 0, 0
        self.unshifted = [0, 0.0]  # positions, sum |Δ| over failing step pairs
        self.shifted = {s: [0, 0, 0.0] for s in (1, -1)}  # positions, failing, sum |Δ|

    def compare(self, step: StepId, ta: torch.Tensor, tb: torch.Tensor,
                keep: torch.Tensor | None) -> StepDifference | None:
        """Add one step pair's values; returns how the field differs in this pair (None: it does not)."""
        r = self.r
        keep = torch.ones(ta.shape, dtype=torch.bool) if keep is None else keep
        if ta.dtype == tb.dtype and torch.equal(ta, tb):  # the same values: nothing below would change but the count
            r.compared += int(keep.sum())
            return None
        a, b = ta.double(), tb.double()
        absd, fail = mismatch(a, b, keep, self.tol)
        if r.kind != FLOAT:  # exact on the stored integers (float64 is exact only below 2**53)
            fail = keep & (ta != tb)
        r.compared += int(keep.sum())
        kept_absd = absd[keep]
        if kept_absd.numel():
            r.max_abs_diff = max(r.max_abs_diff, float(kept_absd.max()))
            rel = torch.where(absd == 0, 0.0, absd / a.abs())[keep]
            r.min_rtol = max(r.min_rtol, float(rel.max()))
        if r.kind == FLOAT and r.max_abs_diff > 0 and bool((kept_absd > 0).any()):
            sel = keep & a.isfinite() & b.isfinite()  # drift statistics skip pairs equal on this field
            d = (b - a)[sel]
            self.n += d.numel()
            self.sum_d += float(d.sum())
            self.sum_abs_a += float(a[sel].abs().sum())
            self.n_pos += int((d > 0).sum())
            self.n_neg += int((d < 0).sum())
        if r.kind == MASK:
            r.kept_only_in_a += int((ta.bool() & ~tb.bool()).sum())
            r.kept_only_in_b += int((tb.bool() & ~ta.bool()).sum())
        n_fail = int(fail.sum())
        if n_fail == 0:
            return None
        r.differing += n_fail
        r.step_pairs_differing += 1
        if len(self.dims) == 2 and self.dims[1] in ("T", "L") and a.dim() == 2:
            self._shift_stats(a, b, keep, absd)
        first = self._locate(step, ta, tb, absd, fail)
        return StepDifference(n_fail, float(absd[fail].max()), first)

    def _shift_stats(self, a, b, keep, absd) -> None:
        finite = keep & absd.isfinite()
        self.unshifted[0] += int(finite.sum())
        self.unshifted[1] += float(absd[finite].sum())
        both = keep[:, 1:] & keep[:, :-1]
        for s, (a_s, b_s) in {1: (a[:, :-1], b[:, 1:]), -1: (a[:, 1:], b[:, :-1])}.items():
            absd_s, fail_s = mismatch(a_s, b_s, both, self.tol)
            acc = self.shifted[s]
            acc[0] += int(both.sum())
            acc[1] += int(fail_s.sum())
            acc[2] += float(absd_s[both & absd_s.isfinite()].sum())

    def _locate(self, step, ta, tb, absd, fail) -> Location:
        """Keep the pair's worst differing positions; returns its first one."""
        r = self.r
        flat = fail.reshape(-1).nonzero().squeeze(1)
        if r.kind == FLOAT:
            flat_top = flat[absd.reshape(-1)[flat].argsort(descending=True, stable=True)[:MAX_LOCATIONS]]
        else:
            flat_top = flat[: max(0, MAX_LOCATIONS - len(r.worst))]
        rows = fail.reshape(fail.shape[0], -1).sum(1).tolist() if fail.dim() else [int(fail)]
        va, vb, vd = ta.reshape(-1), tb.reshape(-1), absd.reshape(-1)

        def location(i: int) -> Location:
            index = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), tuple(ta.shape))) if ta.dim() else ()
            return Location(step, index, self.dims, va[i].item(), vb[i].item(), float(vd[i]),
                            rows[index[0]] if index else rows[0])

        new = [location(int(i)) for i in flat_top]
        first = location(int(flat[0]))
        if r.first is None:
            r.first = first
        key = (lambda l: (-l.abs_diff, l.step, l.index)) if r.kind == FLOAT else (lambda l: (l.step, l.index))
        r.worst = sorted(r.worst + new, key=key)[:MAX_LOCATIONS]
        return first

    def finish(self) -> FieldDiff:
        r = self.r
        if r.kind == FLOAT and r.compared:
            r.mean_diff = self.sum_d / self.n if self.n else 0.0
            if self.n:
                self._drift()
        if r.differing and self.unshifted[0]:
            self._shift()
        return r

    def _drift(self) -> None:
        r, tol = self.r, self.tol
        threshold = DRIFT_FRACTION * (tol.atol + tol.rtol * self.sum_abs_a / self.n)
        same_sign = (self.n_pos if r.mean_diff > 0 else self.n_neg) / self.n
        r.drift = (self.check_drift and self.n >= DRIFT_MIN_POSITIONS and abs(r.mean_diff) > threshold
                   and same_sign >= DRIFT_SIGN_SHARE)
        if r.drift:
            where = "kept positions" if r.mask else "positions"
            within = "" if r.differing else " although every element is within tolerance"
            r.drift_detail = (
                f"drift: mean(b-a)={r.mean_diff:+.1e} over {self.n} {where}, b-a "
                f"{'> 0' if r.mean_diff > 0 else '< 0'} at {same_sign:.0%} of them{within} (rule: |mean| > "
                f"{DRIFT_FRACTION:g}·(atol+rtol·mean|a|) = {threshold:.1e} with ≥ {DRIFT_SIGN_SHARE:.0%} "
                "of one sign)")

    def _shift(self) -> None:
        r = self.r
        base = self.unshifted[1] / self.unshifted[0]
        for s in sorted(self.shifted, key=lambda s: tuple(self.shifted[s][1:])):
            n, n_fail, total = self.shifted[s]
            mean = total / n if n else math.inf
            if n >= 2 and (n_fail == 0 or mean < SHIFT_IMPROVEMENT * base):
                r.shift = s
                rel = "b[t] = a[t-1]" if s == 1 else "b[t] = a[t+1]"
                fit = ("within tolerance at all" if n_fail == 0 else f"mean |Δ| {base:.1e} -> {mean:.1e} over")
                r.shift_detail = (f"shift: b looks like a shifted by {s:+d} along {self.dims[1]} ({rel}): "
                                  f"{fit} {n} positions where both neighbours are kept; a misalignment, not noise")
                return
