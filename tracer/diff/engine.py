"""The comparison: ``diff(a, b) -> DiffReport``: every paired step file verified against its
checksum, then every step pair compared field by field, streaming tensor by tensor (one step pair's
tensors in memory at a time). Rules: ``tracer.diff``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from tqdm import tqdm

from tracer.formulas.derived import derivation_inputs, derive_fields
from tracer.diff.inputs import (check_batch, check_compatible, check_names, check_pair, derive_missing, open_checked,
                                pair_steps, per_field, producers_of, sampling_of, step_id)
from tracer.diff.locations import EXACT, FLOAT, MASK, StepId, step_label
from tracer.diff.report import DiffReport
from tracer.diff.result import UPDATE_GROUPS_KEPT, FieldDiff, StepDifference
from tracer.diff.scalars import ScalarPairs, compare_scalars
from tracer.diff.stats import FieldStats, coarseness, field_tolerance
from tracer.diff.tokens import ID_FIELDS, TokenAlignment, account, prompt_rows_same, same_context
from tracer.errors import ChecksumError, TraceFormatError
from tracer.format.integrity import verify_step_file
from tracer.read import StepKey, Trace
from tracer.format.schema import FIELDS, flow_rank
from tracer.format.metadata_codec import decode_metadata

PROGRESS_MIN_PAIRS = 20
IGNORED_METADATA = frozenset({"content_sha256", "source_dtype", "summary", "step", "inner_step", "micro_batch", "rank"})
_MASKS = ("completion_mask", "chosen_mask", "rejected_mask", "prompt_mask")
_SHOWN_CORRUPT = 5


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
        fields: compare only these fields (masks and ids are still read to select positions).
        ignore_metadata: step metadata keys whose differences are not findings.
        drift: report one-sided drifts (see ``tracer.diff`` for the rule).
        labels: names of a and b in the report header, e.g. ``("expected", "actual")``.
        progress: a tqdm bar over step pairs; default: on a TTY with ≥ 20 pairs.

    Returns:
        A DiffReport; ``report.equal`` is True when nothing differs beyond tolerance.

    Raises:
        TraceFormatError: a path is not a trace.
        ChecksumError: a paired step file's bytes disagree with its recorded ``content_sha256``
            (corrupt); the message names every such file. Nothing is compared then.
        DiffInputError: different algorithms or schema versions, a field with different shapes or
            kinds on the two sides, or ``fields``/tolerances naming a field that neither trace has.
    """
    trace_a, trace_b = Trace(a), Trace(b)
    check_compatible(trace_a, trace_b)
    pairs, only_a, only_b = pair_steps(trace_a, trace_b)
    report = DiffReport(str(a), str(b), tuple(labels), trace_a.algorithm or trace_b.algorithm,
                        step_pairs=len(pairs), only_in_a=only_a, only_in_b=only_b,
                        sampling={"a": sampling_of(trace_a), "b": sampling_of(trace_b)},
                        producers={"a": producers_of(trace_a), "b": producers_of(trace_b)},
                        compared_steps=[step_id(key_a) for key_a, _ in pairs], fields_selected=fields is not None)
    atols, rtols = per_field(atol, "atol"), per_field(rtol, "rtol")
    wanted = None if fields is None else list(fields)
    scalars = ScalarPairs(trace_a, trace_b, pairs)
    if pairs:
        check_names(pairs, wanted, atols, rtols, scalars.names())
    show = progress if progress is not None else (len(pairs) >= PROGRESS_MIN_PAIRS and sys.stderr.isatty())
    checksums = _verify(pairs, report, show)
    engine = _Engine(report, trace_a, trace_b, atols, rtols, wanted,
                     IGNORED_METADATA | set(ignore_metadata), drift, checksums)
    for key_a, key_b in tqdm(pairs, desc="tracer diff", unit="step", disable=not show, leave=False):
        try:
            engine.diff_step(key_a, key_b)
        except TraceFormatError as err:  # a corrupt step file: say which and why, diff the others
            report.unreadable[step_label(step_id(key_a))] = str(err)
    engine.diff_scalars(scalars)
    report.fields = {name: acc.finish() for name, acc in engine.accs.items()}
    return report


def _verify(pairs: list[tuple[StepKey, StepKey]], report: DiffReport, show: bool) -> dict[Path, str]:
    """Verify every paired step file against its recorded checksum (``verify_step_file``).

    Returns ``{path: verified checksum}``; a file without one, or whose header does not open
    (then ``diff_step`` reports it unreadable), is left out. Raises ChecksumError naming the
    corrupt files: a trace whose bytes are not what was written cannot be called equal or not."""
    checksums: dict[Path, str] = {}
    corrupt: list[str] = []
    paths = list(dict.fromkeys(key.path for pair in pairs for key in pair))
    for path in tqdm(paths, desc="tracer diff: verify", unit="file", disable=not show, leave=False):
        try:
            sha = verify_step_file(path)
        except ChecksumError as err:
            corrupt.append(str(err))
            continue
        except TraceFormatError:
            continue
        if sha is not None:
            checksums[path] = sha
    report.verified_files = len(checksums)
    if corrupt:
        more = f" … and {len(corrupt) - _SHOWN_CORRUPT} more" if len(corrupt) > _SHOWN_CORRUPT else ""
        raise ChecksumError(f"{len(corrupt)} step file(s) are corrupt, so nothing was compared: "
                            + "; ".join(corrupt[:_SHOWN_CORRUPT]) + more)
    return checksums


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

    def __init__(self, report, trace_a, trace_b, atols, rtols, wanted, ignored, drift, checksums) -> None:
        self.report, self.trace_a, self.trace_b = report, trace_a, trace_b
        self.atols, self.rtols, self.wanted, self.ignored, self.drift = atols, rtols, wanted, ignored, drift
        self.checksums: dict[Path, str] = checksums
        self.algorithm = report.algorithm
        self.accs: dict[str, FieldStats] = {}

    def diff_step(self, key_a: StepKey, key_b: StepKey) -> None:
        step = step_id(key_a)
        with open_checked(key_a.path, self.trace_a) as fa, open_checked(key_b.path, self.trace_b) as fb:
            meta_a, meta_b = decode_metadata(fa.metadata()), decode_metadata(fb.metadata())
            self._diff_metadata(step, meta_a, meta_b)
            sha = self.checksums.get(key_a.path)
            if sha is not None and sha == self.checksums.get(key_b.path):  # both verified against their bytes
                self.report.identical_by_checksum += 1
                return
            heads = {}
            for side, fh in (("a", fa), ("b", fb)):
                heads[side] = {n: (list(fh.get_slice(n).get_shape()), fh.get_slice(n).get_dtype()) for n in fh.keys()}
            names = [n for n in _ordered(set(heads["a"]) | set(heads["b"])) if self.wanted is None or n in self.wanted]
            metas = {"a": meta_a, "b": meta_b}
            derived = derive_missing(heads, metas, names)  # recorded on one side, derived on the other
            for name in names:
                if (name in heads["a"]) != (name in heads["b"]):
                    self._missing(step, name, "a" if name in heads["a"] else "b")
            common = [n for n in names if n in heads["a"] and n in heads["b"]]
            check_batch(self.trace_a, self.trace_b, step, heads["a"], heads["b"], self.algorithm)
            for name in common:
                check_pair(name, step, heads["a"][name], heads["b"][name], self.algorithm)
            masks = {side: {m: fh.get_tensor(m) for m in _MASKS if m in heads[side]}
                     for side, fh in (("a", fa), ("b", fb))}
            for m in set(masks["a"]) & set(masks["b"]):  # completions of different widths: pad, not kept
                masks["a"][m], masks["b"][m] = _pad_pair(masks["a"][m], masks["b"][m], left=_is_prompt(m))
            contexts = self._contexts(step, fa, fb, heads, masks)
            keeps: dict[tuple, torch.Tensor | None] = {}  # (mask, token-aligned, shape) -> positions compared
            for name in common:
                acc = self._accumulator(name, heads["a"][name][1], heads["b"][name][1], len(heads["a"][name][0]))
                if name in derived:
                    acc.r.derived_in = acc.r.derived_in or derived[name]
                ta, tb = (_read(fh, name, masks[side], metas[side], derived.get(name) == side)
                          for side, fh in (("a", fa), ("b", fb)))
                ta, tb = _pad_pair(ta, tb, left=_is_prompt(name))
                which = (acc.r.mask, _token_aligned(name, acc.dims), tuple(ta.shape))
                if which not in keeps:
                    keep = _keep(acc.r.mask, masks, ta.shape)
                    context = contexts.get(acc.r.mask) if which[1] else None
                    if context is not None and context.shape == ta.shape:
                        keep = context if keep is None else keep & context
                    keeps[which] = keep
                difference = acc.compare(step, ta, tb, keeps[which])
                self._token_text(acc, step, fa, fb)
                if difference is not None:
                    self._keep_difference(step, name, difference)

    def diff_scalars(self, scalars: ScalarPairs) -> None:
        """Compare the traces' per-step scalars as ``scalars/<name>`` fields (:mod:`tracer.diff.scalars`),
        after every step pair's tensors (their fields come after the tensors' in ``report.fields``)."""
        stats, missing, not_compared, differences = compare_scalars(scalars, self.atols, self.rtols, self.wanted,
                                                                    self.drift)
        self.accs.update(stats)
        self.report.scalars_only_in = missing
        self.report.scalars_not_compared = not_compared
        for step, name, difference in differences:
            self._keep_difference(step, name, difference)

    def _contexts(self, step: StepId, fa, fb, heads, masks) -> dict[str, torch.Tensor]:
        """``{mask name: [B, T] same-context positions}`` per ids field both sides record, and the
        step's token alignment (``tracer.diff.tokens``)."""
        def pair(name):
            if name not in heads["a"] or name not in heads["b"]:
                return None, None
            return _pad_pair(fa.get_tensor(name), fb.get_tensor(name), left=_is_prompt(name))

        prompt_a, prompt_b = pair("prompt_ids")
        prompts_same = prompt_rows_same(prompt_a, prompt_b, masks["a"].get("prompt_mask"),
                                        masks["b"].get("prompt_mask"))
        contexts = {}
        for ids_name, mask_name in ID_FIELDS.items():
            ids_a, ids_b = pair(ids_name)
            if ids_a is None or ids_a.shape != ids_b.shape or ids_a.dim() != 2:
                continue
            context = same_context(ids_a, ids_b, prompts_same)
            kept = _keep(mask_name, masks, ids_a.shape)
            acc = self.report.token_alignment.setdefault(ids_name, TokenAlignment(ids_name))
            first = account(acc, step, ids_a, ids_b, torch.ones_like(context) if kept is None else kept, context,
                            prompts_same)
            if first is not None:
                first.token_text = self.trace_a.token_text([first.a])[0]
                first.token_text_b = self.trace_b.token_text([first.b])[0] if first.b >= 0 else "<no token>"
            contexts[mask_name] = context
        return contexts

    def _accumulator(self, name: str, dtype_a: str, dtype_b: str, ndim: int) -> FieldStats:
        if name not in self.accs:
            spec = FIELDS.get(name)
            dims = spec.dims_for(self.algorithm) if spec else ()
            dims = dims if len(dims) == ndim else ("?",) * ndim
            kind = _kind(name, dtype_a if dtype_a == dtype_b else max(dtype_a, dtype_b, key=coarseness))
            tol = field_tolerance(name, dtype_a, dtype_b, self.atols, self.rtols) if kind == FLOAT else None
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

    def _keep_difference(self, step: StepId, name: str, difference: StepDifference) -> None:
        """Keep how ``name`` differs in this pair while the pair belongs to one of the earliest
        ``UPDATE_GROUPS_KEPT`` ``(step, inner_step)`` groups that differ (what the update rule reads);
        the scalars, compared after every step pair, may come before the groups kept so far."""
        kept = self.report.step_differences
        groups = sorted({s[:2] for s in kept} | {step[:2]})
        if step[:2] not in groups[:UPDATE_GROUPS_KEPT]:
            return
        kept.setdefault(step, {})[name] = difference
        for late in groups[UPDATE_GROUPS_KEPT:]:
            for s in [s for s in kept if s[:2] == late]:
                del kept[s]

    def _missing(self, step: StepId, name: str, side: str) -> None:
        entry = self.report.missing_fields.setdefault(name, {"only_in": side, "step_pairs": 0, "first_step": step})
        entry["step_pairs"] += 1

    def _diff_metadata(self, step: StepId, meta_a: dict[str, Any], meta_b: dict[str, Any]) -> None:
        for key in sorted((set(meta_a) | set(meta_b)) - self.ignored):
            if meta_a.get(key) != meta_b.get(key):
                only = None if key in meta_a and key in meta_b else ("a" if key in meta_a else "b")
                entry = self.report.metadata.setdefault(key, {"a": meta_a.get(key), "b": meta_b.get(key),
                                                              "only_in": only, "step_pairs": 0, "first_step": step})
                entry["step_pairs"] += 1


def _read(fh, name: str, masks: dict[str, torch.Tensor], meta: dict[str, Any], derive: bool) -> torch.Tensor:
    """One side's tensor of ``name``: its mask already read, the recorded tensor, or (``derive``)
    the value the reader derives from the recorded inputs (``tracer.formulas.derived.derive_fields``)."""
    if name in masks:
        return masks[name]
    if not derive:
        return fh.get_tensor(name)
    inputs = derivation_inputs(fh.keys(), meta, [name])
    return derive_fields({f: fh.get_tensor(f) for f in inputs}, meta)[name]


def _ordered(names: set[str]) -> list[str]:
    """Data-flow order (``tracer.format.schema.DATA_FLOW``: causes first), then other fields by name."""
    return sorted(names, key=lambda n: (flow_rank(n), n))


def _token_aligned(name: str, dims: tuple[str, ...]) -> bool:
    """A ``[B, T]`` value field (not an ids field, not a mask): compared only where tokens agree."""
    return dims == ("B", "T") and name not in ID_FIELDS and not name.endswith("_mask")


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


def _keep(mask_name: str | None, masks: dict[str, dict[str, torch.Tensor]], shape) -> torch.Tensor | None:
    """Positions both sides keep (a side without the mask keeps what the other keeps)."""
    if mask_name is None:
        return None
    found = [masks[s][mask_name].bool() for s in ("a", "b") if mask_name in masks[s]]
    found = [m for m in found if m.shape == shape]
    if not found:
        return None
    return found[0] & found[-1]
