"""What a diff starts from: two traces that can be compared (same algorithm, schema version,
shapes), their step files paired, the tolerances given by the caller, and the names they use."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Mapping

from tracer.formulas.derived import DERIVED_FIELDS, derivable, derivation_inputs
from tracer.diff.locations import StepId, step_label
from tracer.diff.stats import coarseness
from tracer.errors import TraceError, TraceFormatError
from tracer.format.integrity import check_step_header, open_step_file
from tracer.read import StepKey, Trace
from tracer.format.schema import FIELDS
from tracer.format.metadata_codec import decode_metadata
from tracer.format.tolerances import parse_tolerances  # noqa: F401  (its home is torch-free; re-exported)


class DiffInputError(TraceError):
    """Two traces that cannot be compared: different algorithms or schema versions, a field whose
    shape or kind differs, or a field name that neither trace has."""


def schema_version(trace: Trace) -> str | None:
    version = trace.manifest.get("schema_version")
    for key in trace.steps() if version is None else []:
        try:
            version = trace.metadata(key).get("schema_version")
        except TraceFormatError:
            continue
        break
    return None if version is None else str(version)


def check_compatible(trace_a: Trace, trace_b: Trace) -> None:
    """Raise DiffInputError for traces of different algorithms or schema versions."""
    algo_a, algo_b = trace_a.algorithm, trace_b.algorithm
    if algo_a and algo_b and algo_a != algo_b:
        raise DiffInputError(
            f"cannot diff a {algo_a} trace ({trace_a.path}) with a {algo_b} trace ({trace_b.path}): their "
            "fields and metadata mean different things; compare two traces of the same algorithm")
    ver_a, ver_b = schema_version(trace_a), schema_version(trace_b)
    if ver_a and ver_b and ver_a != ver_b:
        raise DiffInputError(
            f"cannot diff schema version {ver_a} ({trace_a.path}) with schema version {ver_b} "
            f"({trace_b.path}): field names and layouts can change between versions; re-record the "
            "older trace with the current tracer")


def step_id(key: StepKey) -> StepId:
    return (key.step, key.inner_step, key.micro_batch, key.rank)


def pair_steps(trace_a: Trace, trace_b: Trace):
    """``(pairs, only_a, only_b)``: step files matched by ``(step, inner_step, micro_batch, rank)``
    (two single step files pair whatever their numbers), and the step ids on one side only."""
    keys_a, keys_b = trace_a.steps(), trace_b.steps()
    if trace_a.path.is_file() and trace_b.path.is_file():
        for trace, keys in ((trace_a, keys_a), (trace_b, keys_b)):
            if not keys:  # a single step file whose header does not open
                raise TraceFormatError(next(iter(trace.scan().values()), f"{trace.path}: no readable step file"))
        return [(keys_a[0], keys_b[0])], [], []
    by_b = {step_id(k): k for k in keys_b}
    ids_a = {step_id(k) for k in keys_a}
    pairs = [(k, by_b[step_id(k)]) for k in keys_a if step_id(k) in by_b]
    only_a = [step_id(k) for k in keys_a if step_id(k) not in by_b]
    only_b = [step_id(k) for k in keys_b if step_id(k) not in ids_a]
    return pairs, only_a, only_b


def comparable(a: str | Path, b: str | Path) -> str | None:
    """Why traces ``a`` and ``b`` cannot be diffed, from headers only (algorithm, schema version,
    shared step files, shapes of the first shared step pair), or None when they can. For a UI that
    picks a pair to open on; :func:`tracer.diff` says the same with an error."""
    try:
        trace_a, trace_b = Trace(a), Trace(b)
        check_compatible(trace_a, trace_b)
        pairs, _, _ = pair_steps(trace_a, trace_b)
        if not pairs:
            return "no step file in common"
        heads = [trace_a.fields(pairs[0][0]), trace_b.fields(pairs[0][1])]
        algorithm = trace_a.algorithm or trace_b.algorithm
        check_batch(trace_a, trace_b, step_id(pairs[0][0]), heads[0], heads[1], algorithm)
        for name in set(heads[0]) & set(heads[1]):
            check_pair(name, step_id(pairs[0][0]), heads[0][name], heads[1][name], algorithm)
    except TraceError as err:
        return str(err)
    return None


def per_field(value: float | Mapping[str, float] | None, what: str) -> dict[str, float]:
    """A tolerance given as one number or ``{field: number}``, as ``{field or "*": float}``."""
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
def open_checked(path: Path, trace: Trace | None = None):
    """Open a step file (bounded header read); with ``trace``, also check its header against the
    schema. Raises TraceFormatError naming the file."""
    with open_step_file(path) as fh:
        if trace is not None:
            algorithm = decode_metadata(fh.metadata()).get("algorithm", trace.manifest.get("algorithm"))
            check_step_header(path, fh, algorithm if isinstance(algorithm, str) else None)
        yield fh


def check_names(pairs: list[tuple[StepKey, StepKey]], wanted, atols, rtols, scalars: Iterable[str] = ()) -> None:
    """Raise DiffInputError when ``fields`` or a tolerance names a field neither trace has (the
    fields of the first step pair whose files open, and the ``scalars/<name>`` of ``scalars``)."""
    names: set[str] = set()
    for pair in pairs:  # the first pair whose files open
        try:
            for key in pair:
                with open_checked(key.path) as fh:
                    names |= set(fh.keys())
        except TraceFormatError:
            names = set()
            continue
        break
    scalars = set(scalars)
    for what, asked in (("fields", wanted or []), ("atol", atols), ("rtol", rtols)):
        unknown = sorted(set(asked) - names - scalars - {"*"})
        if unknown:
            logged = f"; scalars: {sorted(scalars)}" if scalars else ""
            raise DiffInputError(
                f"{what} names {unknown}, which neither trace has (fields of the first step: "
                f"{sorted(names)}{logged}); check the spelling")


def sampling_of(trace: Trace) -> dict:
    """The trace manifest's ``sampling`` (``every_n_steps``, ``first_k_sequences``...); {} when absent."""
    sampling = trace.manifest.get("sampling")
    return dict(sampling) if isinstance(sampling, dict) else {}


def producers_of(trace: Trace) -> dict[str, str]:
    """The trace manifest's ``producers`` (package versions, ``cpu_kernels``...) as strings; {} when
    absent (a single step file, a trace from another tool)."""
    found = trace.manifest.get("producers")
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def batch_size(heads: Mapping[str, tuple], algorithm: str | None) -> int | None:
    """B of one step file: the first dimension of its first schema field whose dims start with B."""
    for name in sorted(heads):
        spec = FIELDS.get(name)
        dims = spec.dims_for(algorithm) if spec else ()
        shape = heads[name][0]
        if dims[:1] == ("B",) and len(shape) == len(dims):
            return int(shape[0])
    return None


def check_batch(trace_a: Trace, trace_b: Trace, step: StepId, heads_a, heads_b, algorithm: str | None) -> None:
    """Raise DiffInputError when the two step files hold different numbers of sequences (B): no
    per-sequence field can then be compared row by row. The message names a side's
    ``first_k_sequences`` sampling (its manifest) when it explains the difference."""
    sizes = batch_size(heads_a, algorithm), batch_size(heads_b, algorithm)
    if None in sizes or sizes[0] == sizes[1]:
        return
    text = (f"a has {sizes[0]} sequences (B) per step file but b has {sizes[1]} at {step_label(step)}, so no "
            "per-sequence field ([B], [B, T], [B, L], [B, F]) can be compared row by row")
    sampled = []
    for side, trace, size, other in (("a", trace_a, *sizes), ("b", trace_b, *sizes[::-1])):
        k = sampling_of(trace).get("first_k_sequences")
        if isinstance(k, int) and size <= k < other:  # the other side kept more rows than this one may
            sampled.append(f"{side} was recorded with first_k_sequences={k} (its manifest's sampling: only the "
                           f"first {k} sequences of each step are written)")
    if sampled:
        text += (f": {'; '.join(sampled)}. tracer diff has no option to compare only the first rows of the "
                 "other trace; record both traces with the same first_k_sequences (or both without it), then "
                 "diff again")
    else:
        text += (": the runs used different batch sizes (B = prompts x num_generations; pairs for DPO); re-run "
                 "both with the same batch size")
    raise DiffInputError(text)


def derive_missing(heads: dict[str, dict[str, tuple]], metas: dict[str, dict], names: Iterable[str]) -> dict[str, str]:
    """``{field: side}`` for the fields of ``names`` that one side records and the other side
    (``side``) lacks but derives from its own recorded inputs, as the reader does
    (:mod:`tracer.formulas.derived`: ``ratio``, ``ref_kl_k3``, ``approx_kl_k2``). Adds their header
    ``(shape, dtype)`` to ``heads[side]`` (float32, float64 when an input is float64), so they are
    compared by value like a recorded field."""
    out = {}
    for name in names:
        sides = [s for s in ("a", "b") if name in heads[s]]
        if len(sides) != 1 or name not in DERIVED_FIELDS:
            continue
        side = "b" if sides[0] == "a" else "a"
        if name not in derivable(heads[side], metas[side]):
            continue
        inputs = [heads[side][f] for f in derivation_inputs(heads[side], metas[side], [name])]
        if any(shape != inputs[0][0] or not coarseness(dtype) for shape, dtype in inputs):
            continue  # the reader does not derive from inputs of different shapes or kinds either
        recorded = heads[sides[0]][name][0]
        if len(recorded) != len(inputs[0][0]) or recorded[:1] != inputs[0][0][:1]:
            continue  # recorded otherwise (a sequence-level ratio [B]): not the derived quantity, stays "only in"
        heads[side][name] = (inputs[0][0], "F64" if any(d == "F64" for _, d in inputs) else "F32")
        out[name] = side
    return out


def check_pair(name: str, step: StepId, head_a, head_b, algorithm: str | None = None) -> None:
    """Raise DiffInputError when a field's shapes (other than the T/L widths) or kinds differ."""
    (shape_a, dtype_a), (shape_b, dtype_b) = head_a, head_b
    spec = FIELDS.get(name)
    dims = spec.dims_for(algorithm) if spec else ()
    if (shape_a != shape_b and tuple(dims) in (("B", "T"), ("B", "L")) and len(shape_a) == len(shape_b) == 2
            and shape_a[0] == shape_b[0]):
        pass  # completions (prompts) of different widths: compared over the wider one, extra positions not kept
    elif shape_a != shape_b:
        where = f"field {name!r} has shape {shape_a} in a but {shape_b} in b at {step_label(step)}"
        if dims[:1] == ("B",) and len(shape_a) == len(shape_b) and shape_a[0] != shape_b[0]:
            raise DiffInputError(
                f"{where}: the two step files hold different numbers of sequences (B), so no per-sequence "
                "field can be compared row by row; re-run both with the same batch size (and the same "
                "first_k_sequences sampling)")
        differ = [d for d, x, y in zip(dims or ("?",) * len(shape_a), shape_a, shape_b) if x != y]
        which = f" ({', '.join(differ)} differs)" if len(shape_a) == len(shape_b) and differ else ""
        raise DiffInputError(
            f"{where}: diff compares position by position, so every dimension but the widths T and L must "
            f"agree{which}; record the field with the same shape on both sides, or leave it out (fields=/--fields)")
    kinds = {d: ("float" if coarseness(d) else "integer/bool") for d in (dtype_a, dtype_b)}
    if kinds[dtype_a] != kinds[dtype_b]:
        raise DiffInputError(
            f"field {name!r} is {kinds[dtype_a]} ({dtype_a}) in a but {kinds[dtype_b]} ({dtype_b}) in b at "
            f"{step_label(step)}: values of different kinds cannot be compared; record the field with "
            "the same dtype kind on both sides")
