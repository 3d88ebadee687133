"""Trace vs trace: ``diff(a, b) -> DiffReport``, mask-aware, streaming tensor by tensor.

Rules (documented in docs/regression-testing.md):

- Step files are matched by ``(step, inner_step, micro_batch, rank)``; two single step files are
  compared with each other whatever their step numbers. Steps on one side only are findings.
- Per-token fields are compared only where both sides keep the position: ``completion_mask`` for
  ``[B, T]`` fields, ``chosen_mask``/``rejected_mask`` for ``chosen_*``/``rejected_*`` fields,
  ``prompt_mask`` for ``[B, L]`` fields. Masks themselves are compared everywhere, exactly. Fields
  outside the schema are compared at every position.
- Integer and bool fields compare exactly. Float fields pass when ``|b - a| <= atol + rtol * |a|``
  (``a`` is the reference), with defaults by the coarser dtype of the two sides (those of
  ``torch.testing.assert_close``, see ``DEFAULT_TOLERANCES``), overridable per field.
- Drift: with ``d = b - a`` over the compared finite positions of a float field, in the step pairs
  where that field's values differ at all, a drift is reported when at least
  ``DRIFT_MIN_POSITIONS`` positions are compared, ``|mean(d)| > DRIFT_FRACTION * (atol + rtol *
  mean|a|)``, and at least ``DRIFT_SIGN_SHARE`` of all those positions have ``d`` of the sign of
  the mean: a one-sided shift fails the diff even when every element is within tolerance, while a
  few outliers (``d = 0`` elsewhere) or symmetric noise do not count as drift.
- Shift: when a ``[B, T]``/``[B, L]`` field differs, ``b[t]`` is compared with ``a[t-1]`` (shift
  +1) and ``a[t+1]`` (shift -1) where both neighbours are kept; a shift is reported when the
  shifted comparison passes everywhere, or its mean ``|Δ|`` is under ``SHIFT_IMPROVEMENT`` times
  the unshifted one.
- Step pairs whose ``content_sha256`` (recorded by TraceWriter) agree are not read.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd
import torch
from tqdm import tqdm

from tracer.diff_report import EXACT, FLOAT, MASK, DiffReport, FieldDiff, Location, StepId, Tolerance, step_label
from tracer.diff_stats import (DEFAULT_TOLERANCES, DRIFT_FRACTION, DRIFT_MIN_POSITIONS, DRIFT_SIGN_SHARE,
                               SHIFT_IMPROVEMENT, FieldStats, coarseness, default_tolerance, mismatch)
from tracer.errors import TraceError, TraceFormatError
from tracer.integrity import check_step_header, open_step_file
from tracer.reader import TOKEN_VALUE_FIELDS, StepKey, Trace
from tracer.schema import FIELDS, decode_metadata

__all__ = ["diff", "token_diff_table", "DiffReport", "FieldDiff", "Location", "Tolerance", "DiffInputError",
           "DEFAULT_TOLERANCES", "DRIFT_FRACTION", "DRIFT_SIGN_SHARE", "DRIFT_MIN_POSITIONS", "SHIFT_IMPROVEMENT"]

PROGRESS_MIN_PAIRS = 20
IGNORED_METADATA = frozenset({"content_sha256", "source_dtype", "summary", "step", "inner_step", "micro_batch", "rank"})
_MASKS = ("completion_mask", "chosen_mask", "rejected_mask", "prompt_mask")


class DiffInputError(TraceError):
    """Two traces that cannot be compared: different algorithms or schema versions, a field whose
    shape or kind differs, or a field name that neither trace has."""


def diff(
    a: str | Path,
    b: str | Path,
    *,
    atol: float | Mapping[str, float] | None = None,
    rtol: float | Mapping[str, float] | None = None,
    fields: Iterable[str] | None = None,
    ignore_metadata: Iterable[str] = (),
    drift: bool = True,
    labels: tuple[str, str] = ("a", "b"),
    progress: bool | None = None,
) -> DiffReport:
    """Compare trace ``b`` with reference trace ``a`` (directories or single step files).

    Args:
        a, b: the reference (baseline, expected) and the candidate (actual).
        atol, rtol: one number for every float field, or ``{field: number}`` (key ``"*"`` = every
            other float field); unset fields get ``DEFAULT_TOLERANCES`` of their coarser dtype.
        fields: compare only these fields (masks are still read to select positions).
        ignore_metadata: step metadata keys whose differences are not findings.
        drift: report one-sided drifts (see the module docstring for the rule).
        labels: names of a and b in the report header, e.g. ``("expected", "actual")``.
        progress: a tqdm bar over step pairs; default: on a TTY with ≥ 20 pairs.

    Returns:
        A DiffReport; ``report.equal`` is True when nothing differs beyond tolerance.

    Raises:
        TraceFormatError: a path is not a trace.
        DiffInputError: different algorithms or schema versions, a field with different shapes or
            kinds on the two sides, or ``fields``/tolerances naming a field that neither trace has.
    """
    trace_a, trace_b = Trace(a), Trace(b)
    _check_compatible(trace_a, trace_b)
    pairs, only_a, only_b = _pair_steps(trace_a, trace_b)
    report = DiffReport(str(a), str(b), tuple(labels), trace_a.algorithm or trace_b.algorithm,
                        step_pairs=len(pairs), only_in_a=only_a, only_in_b=only_b)
    atols, rtols = _per_field(atol, "atol"), _per_field(rtol, "rtol")
    wanted = None if fields is None else list(fields)
    if pairs:
        _check_names(pairs, wanted, atols, rtols)
    engine = _Engine(report, trace_a, trace_b, atols, rtols, wanted,
                     IGNORED_METADATA | set(ignore_metadata), drift)
    show = progress if progress is not None else (len(pairs) >= PROGRESS_MIN_PAIRS and sys.stderr.isatty())
    for key_a, key_b in tqdm(pairs, desc="tracer diff", unit="step", disable=not show, leave=False):
        try:
            engine.diff_step(key_a, key_b)
        except TraceFormatError as err:  # a corrupt step file: say which and why, diff the others
            report.unreadable[step_label(_step_id(key_a))] = str(err)
    report.fields = {name: acc.finish() for name, acc in engine.accs.items()}
    return report


def token_diff_table(
    a: str | Path,
    b: str | Path,
    step: StepId | None = None,
    sequence: int | None = None,
    *,
    atol: float | Mapping[str, float] | None = None,
    rtol: float | Mapping[str, float] | None = None,
) -> pd.DataFrame:
    """Completion tokens of one step pair side by side, for a token view (the app's Diff page).

    Args:
        a, b: the reference and the candidate trace.
        step: ``(step, inner_step, micro_batch, rank)`` present in both, or a step number (inner step,
            micro-batch and rank 0) (default: the first of a;
            two single step files are paired whatever their step numbers).
        sequence: one sequence (reads only that row), or None for the whole step.
        atol, rtol: as for :func:`diff`.

    Returns:
        One row per ``(sequence, position)``: ``token_id_a/_b``, ``token_text_a/_b``, ``kept_a/_b``,
        ``mask_reason_a/_b``, ``mask_differs``, ``id_differs``, and per value field present on both
        sides ``<field>_a``, ``<field>_b``, ``<field>_differs`` (True only where both sides keep the
        token and the values fail the field's tolerance). Masked positions: ``kept_a & kept_b`` False.

    Raises:
        TraceError: a path is not a trace, or ``step`` is not in both traces.
    """
    trace_a, trace_b = Trace(a), Trace(b)
    _check_compatible(trace_a, trace_b)
    pairs, _, _ = _pair_steps(trace_a, trace_b)
    if isinstance(step, StepKey):
        step = (step.step, step.inner_step, step.micro_batch, step.rank)
    elif isinstance(step, int):  # a bare step number: its first inner step, micro-batch and rank
        step = (step, 0, 0, 0)
    pair = next((p for p in pairs if step is None or _step_id(p[0]) == tuple(step)), None)
    if pair is None:
        have = [_step_id(p[0]) for p in pairs][:10]
        raise DiffInputError(f"step {step} is not in both traces; steps in both: {have}")
    frames = [t.token_table(k, sequence) for t, k in ((trace_a, pair[0]), (trace_b, pair[1]))]
    if any("section" not in f for f in frames):
        raise DiffInputError(
            "the side-by-side token view shows completion tokens (completion_ids); these step files have "
            "none (a DPO trace records chosen_* / rejected_* fields): use the per-field report instead")
    frames = [f[f["section"] == "completion"].drop(columns=["section", "step", "inner_step", "rank"]) for f in frames]
    table = frames[0].merge(frames[1], on=["sequence", "position"], how="outer", suffixes=("_a", "_b"))
    table["mask_differs"] = table["kept_a"] != table["kept_b"]
    table["id_differs"] = table["token_id_a"] != table["token_id_b"]
    both = (table["kept_a"] == True) & (table["kept_b"] == True)  # noqa: E712 (NaN rows stay False)
    heads = [trace_a.fields(pair[0]), trace_b.fields(pair[1])]
    atols, rtols = _per_field(atol, "atol"), _per_field(rtol, "rtol")
    for name in TOKEN_VALUE_FIELDS:
        if f"{name}_a" in table and f"{name}_b" in table:
            tol = _tolerance(name, heads[0][name][1], heads[1][name][1], atols, rtols)
            va = torch.tensor(table[f"{name}_a"].to_numpy(dtype="float64"))
            vb = torch.tensor(table[f"{name}_b"].to_numpy(dtype="float64"))
            _, fail = mismatch(va, vb, torch.tensor(both.to_numpy(dtype=bool)), tol)
            table[f"{name}_differs"] = fail.numpy()
    return table


def _tolerance(name: str, dtype_a: str, dtype_b: str, atols: dict[str, float], rtols: dict[str, float]) -> Tolerance:
    default = default_tolerance(dtype_a, dtype_b)
    return Tolerance(atols.get(name, atols.get("*", default.atol)), rtols.get(name, rtols.get("*", default.rtol)))


# -- inputs ------------------------------------------------------------------------------------


def _schema_version(trace: Trace) -> str | None:
    version = trace.manifest.get("schema_version")
    for key in trace.steps() if version is None else []:
        try:
            version = trace.metadata(key).get("schema_version")
        except TraceFormatError:
            continue
        break
    return None if version is None else str(version)


def _check_compatible(trace_a: Trace, trace_b: Trace) -> None:
    algo_a, algo_b = trace_a.algorithm, trace_b.algorithm
    if algo_a and algo_b and algo_a != algo_b:
        raise DiffInputError(
            f"cannot diff a {algo_a} trace ({trace_a.path}) with a {algo_b} trace ({trace_b.path}): their "
            "fields and metadata mean different things; compare two traces of the same algorithm")
    ver_a, ver_b = _schema_version(trace_a), _schema_version(trace_b)
    if ver_a and ver_b and ver_a != ver_b:
        raise DiffInputError(
            f"cannot diff schema version {ver_a} ({trace_a.path}) with schema version {ver_b} "
            f"({trace_b.path}): field names and layouts can change between versions; re-record the "
            "older trace with the current tracer")


def _step_id(key: StepKey) -> StepId:
    return (key.step, key.inner_step, key.micro_batch, key.rank)


def _pair_steps(trace_a: Trace, trace_b: Trace):
    keys_a, keys_b = trace_a.steps(), trace_b.steps()
    if trace_a.path.is_file() and trace_b.path.is_file():
        for trace, keys in ((trace_a, keys_a), (trace_b, keys_b)):
            if not keys:  # a single step file whose header does not open
                raise TraceFormatError(next(iter(trace.scan().values()), f"{trace.path}: no readable step file"))
        return [(keys_a[0], keys_b[0])], [], []
    by_b = {_step_id(k): k for k in keys_b}
    ids_a = {_step_id(k) for k in keys_a}
    pairs = [(k, by_b[_step_id(k)]) for k in keys_a if _step_id(k) in by_b]
    only_a = [_step_id(k) for k in keys_a if _step_id(k) not in by_b]
    only_b = [_step_id(k) for k in keys_b if _step_id(k) not in ids_a]
    return pairs, only_a, only_b


def _per_field(value: float | Mapping[str, float] | None, what: str) -> dict[str, float]:
    if value is None:
        return {}
    if isinstance(value, (int, float)):
        value = {"*": value}
    out = {}
    for name, number in value.items():
        if not isinstance(number, (int, float)) or isinstance(number, bool) or not number >= 0:
            raise DiffInputError(f"{what} for {name!r} is {number!r}; pass a number >= 0")
        out[str(name)] = float(number)
    return out


@contextmanager
def _open(path: Path, trace: Trace | None = None):
    """Open a step file (bounded header read); with ``trace``, also check its header against the
    schema. Raises TraceFormatError naming the file."""
    with open_step_file(path) as fh:
        if trace is not None:
            algorithm = decode_metadata(fh.metadata()).get("algorithm", trace.manifest.get("algorithm"))
            check_step_header(path, fh, algorithm if isinstance(algorithm, str) else None)
        yield fh


def _check_names(pairs: list[tuple[StepKey, StepKey]], wanted, atols, rtols) -> None:
    names: set[str] = set()
    for pair in pairs:  # the first pair whose files open
        try:
            for key in pair:
                with _open(key.path) as fh:
                    names |= set(fh.keys())
        except TraceFormatError:
            names = set()
            continue
        break
    for what, asked in (("fields", wanted or []), ("atol", atols), ("rtol", rtols)):
        unknown = sorted(set(asked) - names - {"*"})
        if unknown:
            raise DiffInputError(
                f"{what} names {unknown}, which neither trace has (fields of the first step: "
                f"{sorted(names)}); check the spelling")


# -- comparison --------------------------------------------------------------------------------


def _kind(name: str, dtype: str) -> str:
    if dtype == "BOOL" or name.endswith("_mask"):
        return MASK if name.endswith("_mask") else EXACT
    return FLOAT if dtype.startswith(("F", "BF")) else EXACT


def _mask_for(name: str, dims: tuple[str, ...]) -> str | None:
    if name.endswith("_mask") or len(dims) != 2:
        return None
    if dims[1] == "L":
        return "prompt_mask"
    if dims[1] != "T":
        return None
    return next((f"{p}_mask" for p in ("chosen", "rejected") if name.startswith(p + "_")), "completion_mask")


def _ids_for(name: str, dims: tuple[str, ...]) -> str | None:
    if len(dims) != 2 or dims[1] not in ("T", "L"):
        return None
    return "prompt_ids" if dims[1] == "L" else next(
        (f"{p}_ids" for p in ("chosen", "rejected") if name.startswith(p + "_")), "completion_ids")


class _Engine:
    """Reads one step pair at a time, tensor by tensor, and feeds the accumulators."""

    def __init__(self, report, trace_a, trace_b, atols, rtols, wanted, ignored, drift) -> None:
        self.report, self.trace_a, self.trace_b = report, trace_a, trace_b
        self.atols, self.rtols, self.wanted, self.ignored, self.drift = atols, rtols, wanted, ignored, drift
        self.algorithm = report.algorithm
        self.accs: dict[str, FieldStats] = {}

    def diff_step(self, key_a: StepKey, key_b: StepKey) -> None:
        step = _step_id(key_a)
        with _open(key_a.path, self.trace_a) as fa, _open(key_b.path, self.trace_b) as fb:
            meta_a, meta_b = decode_metadata(fa.metadata()), decode_metadata(fb.metadata())
            self._diff_metadata(step, meta_a, meta_b)
            sha = meta_a.get("content_sha256")
            if sha and sha == meta_b.get("content_sha256"):
                self.report.identical_by_checksum += 1
                return
            heads = {}
            for side, fh in (("a", fa), ("b", fb)):
                heads[side] = {n: (list(fh.get_slice(n).get_shape()), fh.get_slice(n).get_dtype()) for n in fh.keys()}
            names = [n for n in _ordered(set(heads["a"]) | set(heads["b"])) if self.wanted is None or n in self.wanted]
            for name in names:
                if (name in heads["a"]) != (name in heads["b"]):
                    self._missing(step, name, "a" if name in heads["a"] else "b")
            common = [n for n in names if n in heads["a"] and n in heads["b"]]
            for name in common:
                _check_pair(name, step, heads["a"][name], heads["b"][name], self.algorithm)
            masks = {side: {m: fh.get_tensor(m) for m in _MASKS if m in heads[side]}
                     for side, fh in (("a", fa), ("b", fb))}
            for m in set(masks["a"]) & set(masks["b"]):  # completions of different widths: pad, not kept
                masks["a"][m], masks["b"][m] = _pad_pair(masks["a"][m], masks["b"][m], left=_is_prompt(m))
            for name in common:
                acc = self._accumulator(name, heads["a"][name][1], heads["b"][name][1], len(heads["a"][name][0]))
                ta = masks["a"][name] if name in masks["a"] else fa.get_tensor(name)
                tb = masks["b"][name] if name in masks["b"] else fb.get_tensor(name)
                ta, tb = _pad_pair(ta, tb, left=_is_prompt(name))
                acc.compare(step, ta, tb, _keep(acc.r.mask, masks, ta.shape))
                self._token_text(acc, step, fa, fb)

    def _accumulator(self, name: str, dtype_a: str, dtype_b: str, ndim: int) -> FieldStats:
        if name not in self.accs:
            spec = FIELDS.get(name)
            dims = spec.dims_for(self.algorithm) if spec else ()
            dims = dims if len(dims) == ndim else ("?",) * ndim
            kind = _kind(name, dtype_a if dtype_a == dtype_b else max(dtype_a, dtype_b, key=coarseness))
            tol = _tolerance(name, dtype_a, dtype_b, self.atols, self.rtols) if kind == FLOAT else None
            result = FieldDiff(name, kind, dtype_a, dtype_b, tol, _mask_for(name, dims) if spec else None)
            self.accs[name] = FieldStats(result, dims, self.drift)
        return self.accs[name]

    def _token_text(self, acc: FieldStats, step: StepId, fa, fb) -> None:
        ids_name = _ids_for(acc.r.name, acc.dims)
        todo = [loc for loc in [*acc.r.worst, acc.r.first] if loc and loc.step == step and loc.token_text is None]
        if not todo or ids_name is None or ids_name not in fa.keys():
            return
        ids_a = fa.get_slice(ids_name)
        ids_b = fb.get_slice(ids_name) if ids_name in fb.keys() else ids_a
        rows_a, cols_a = ids_a.get_shape()[:2]
        rows_b, cols_b = ids_b.get_shape()[:2]
        width = max(cols_a, cols_b)
        left = _is_prompt(ids_name)  # prompts were left-padded to the common width: shift back per side
        for loc in todo:
            s, t = loc.index[:2]
            ta, tb = (t - (width - cols_a), t - (width - cols_b)) if left else (t, t)
            # a position past one side's width (completions of different lengths) has no token there
            id_a = int(ids_a[s : s + 1, ta : ta + 1]) if s < rows_a and 0 <= ta < cols_a else None
            id_b = int(ids_b[s : s + 1, tb : tb + 1]) if s < rows_b and 0 <= tb < cols_b else None
            if id_a is None and id_b is None:
                continue
            loc.token_text = self.trace_a.token_text([id_a])[0] if id_a is not None else "<no token>"
            if id_b != id_a:
                loc.token_text_b = self.trace_b.token_text([id_b])[0] if id_b is not None else "<no token>"

    def _missing(self, step: StepId, name: str, side: str) -> None:
        entry = self.report.missing_fields.setdefault(name, {"only_in": side, "step_pairs": 0, "first_step": step})
        entry["step_pairs"] += 1

    def _diff_metadata(self, step: StepId, meta_a: dict[str, Any], meta_b: dict[str, Any]) -> None:
        for key in sorted((set(meta_a) | set(meta_b)) - self.ignored):
            if meta_a.get(key) != meta_b.get(key):
                entry = self.report.metadata.setdefault(
                    key, {"a": meta_a.get(key), "b": meta_b.get(key), "step_pairs": 0, "first_step": step})
                entry["step_pairs"] += 1


def _ordered(names: set[str]) -> list[str]:
    """Masks, then ids, then schema order, then other fields by name (root causes first)."""
    schema = list(FIELDS)
    return sorted(names, key=lambda n: (not n.endswith("_mask"), not n.endswith("_ids"),
                                        schema.index(n) if n in FIELDS else len(schema), n))


def _pad_pair(ta: torch.Tensor, tb: torch.Tensor, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``[B, T]`` (or left-padded ``[B, L]``, ``left=True``) tensors of different widths, padded
    to the wider one: masks with False (not kept), ids with -1 (no token), floats with 0 (never
    compared: not kept)."""
    if ta.shape == tb.shape or ta.dim() != 2 or ta.shape[0] != tb.shape[0]:
        return ta, tb
    width = max(ta.shape[1], tb.shape[1])

    def pad(t: torch.Tensor) -> torch.Tensor:
        value = False if t.dtype == torch.bool else (-1 if not t.is_floating_point() else 0.0)
        extra = width - t.shape[1]
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    return pad(ta), pad(tb)


def _is_prompt(name: str) -> bool:
    return FIELDS[name].dims == ("B", "L") if name in FIELDS else False


def _check_pair(name: str, step: StepId, head_a, head_b, algorithm: str | None = None) -> None:
    (shape_a, dtype_a), (shape_b, dtype_b) = head_a, head_b
    spec = FIELDS.get(name)
    dims = spec.dims_for(algorithm) if spec else ()
    if (shape_a != shape_b and tuple(dims) in (("B", "T"), ("B", "L")) and len(shape_a) == len(shape_b) == 2
            and shape_a[0] == shape_b[0]):
        pass  # completions (prompts) of different widths: compared over the wider one, extra positions not kept
    elif shape_a != shape_b:
        raise DiffInputError(
            f"field {name!r} has shape {shape_a} in a but {shape_b} in b at {step_label(step)}: diff "
            "compares position by position, so both traces need the same B and F (widths T and L may differ); re-run both with "
            "the same batch size and maximum completion length, or leave the field out (fields=/--fields)")
    kinds = {d: ("float" if coarseness(d) else "integer/bool") for d in (dtype_a, dtype_b)}
    if kinds[dtype_a] != kinds[dtype_b]:
        raise DiffInputError(
            f"field {name!r} is {kinds[dtype_a]} ({dtype_a}) in a but {kinds[dtype_b]} ({dtype_b}) in b at "
            f"{step_label(step)}: values of different kinds cannot be compared; record the field with "
            "the same dtype kind on both sides")


def _keep(mask_name: str | None, masks: dict[str, dict[str, torch.Tensor]], shape) -> torch.Tensor | None:
    """Positions both sides keep (a side without the mask keeps what the other keeps)."""
    if mask_name is None:
        return None
    found = [masks[s][mask_name].bool() for s in ("a", "b") if mask_name in masks[s]]
    found = [m for m in found if m.shape == shape]
    if not found:
        return None
    return found[0] & found[-1]
