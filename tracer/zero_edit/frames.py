"""Read canonical fields out of a training loop's frame through a name map (zero-edit tracing).

Rules (documented in docs/zero-edit.md):

* The calling frame is the first frame, walking out from ``backward``, whose module is not part of
  torch, accelerate, deepspeed or tracer (``tracer.demo`` counts as user code).
* Tensors and step metadata are read from that frame's locals, then its globals (``args.beta``
  finds a module-level ``args``). Indices (step, epoch, inner step, micro-batch) are read from the
  calling frame, then from up to ``INDEX_DEPTH`` callers.
* For each field the map's candidates are tried in order; the first that is a tensor of the field's
  rank and agrees with the fields already read (the schema's B, T, L, F) wins. A tensor no field can
  take (:func:`unusable`: nested, sparse, meta, quantized, a subclass running its own code) is
  rejected like any other candidate that does not fit, before any operation on it. The policy logprobs
  are read first: without them the frame holds nothing to trace.
* Fields the loop lacks are computed only when the map's ``derive`` lists them, with
  :mod:`tracer.formulas`, from fields that were read.
* A backward from a line seen before is read by that line's plan (:mod:`tracer.zero_edit.site_plans`), made
  from the :class:`Probe` list of a full read; it gives what the full read gives.

Looking values up (the calling frame, expressions, indices, metadata) is :mod:`tracer.zero_edit.frame_lookup`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Mapping

import torch

from tracer import formulas
from tracer.formulas.derived import for_maths
from tracer.errors import SchemaError
from tracer.zero_edit.frame_lookup import (_MISSING, read_indices,
                                           read_metadata, resolve_in, scopes_of)
from tracer.zero_edit.name_maps import STACKED_STEMS, Expression, NameMap
from tracer.format.schema import BOOL, FIELDS, check_tensors

GROUPED = ("grpo", "cispo", "rloo")


@dataclass
class FrameCapture:
    """What one backward's frame gave: fields ready for ``record``, indices, step metadata."""

    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # field -> expression or "derived"
    sizes: dict[str, tuple[int, str]] = field(default_factory=dict)  # dims of the fields picked (check_tensors)
    scopes: tuple | None = None  # scopes_of the calling frame, taken once per capture
    indices: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # step metadata read from the frame
    rejected: dict[tuple[str, str], str] = field(default_factory=dict)  # (field, expression) -> why
    anchor: torch.Tensor | None = None  # the policy logprobs tensor as the loop holds it
    owned: set[str] = field(default_factory=set)  # fields made here (indexed rows, derived): no copy needed
    checks: dict | None = None  # schema-check outcomes by signature (a CheckMemo's dict), shared across captures
    probes: list | None = None  # the candidates tried (Probe), when the caller builds a call-site plan
    read: tuple | None = None  # (fields' names, sources, owned, rejected) as read_fields left them, with probes
    derive: list[str] = field(default_factory=list)  # fields the writer derives from the ones read (derive_fields)
    signature: tuple | None = None  # (name, shape, dtype, device) of ``fields`` in order, when a plan knows it


MAX_CHECK_MEMO = 4096  # schema-check outcomes a watcher remembers (cleared when full)


def _check(produced: dict[str, torch.Tensor], algorithm: str | None, sizes: dict, memo: dict | None) -> None:
    """:func:`tracer.format.schema.check_tensors` of ``produced`` against ``sizes`` (updated in place), its
    outcome remembered in ``memo`` by signature (names, shapes, dtypes, devices, the sizes so far):
    the check depends on nothing else, except the values of a non-bool mask, which are checked every
    time. A loop's backward frames repeat their signatures, so later captures skip the check.
    Raises SchemaError as the check does."""
    if memo is None or value_checked(produced):
        check_tensors(produced, algorithm, sizes=sizes)
        return
    key = (tuple((k, v.shape, v.dtype, v.device.type) for k, v in produced.items()), algorithm,
           tuple(sizes.items()))
    outcome = memo.get(key)
    if outcome is None:
        before = dict(sizes)
        try:
            check_tensors(produced, algorithm, sizes=sizes)
            outcome = {d: v for d, v in sizes.items() if d not in before}
        except SchemaError as err:
            outcome = err
        if len(memo) >= MAX_CHECK_MEMO:
            memo.clear()
        memo[key] = outcome
    if isinstance(outcome, SchemaError):
        raise SchemaError(str(outcome))
    sizes.update(outcome)


def anchor_field(algorithm: str) -> str:
    """The field whose presence makes a backward traceable."""
    return "chosen_policy_logprobs" if algorithm == "dpo" else "policy_logprobs"


def candidate(key: str, value: Any) -> dict[str, torch.Tensor] | None:
    """``{field: tensor}`` that ``value`` gives for ``key`` (a field, or ``stacked:<stem>`` for DPO:
    rows split in halves), or None when it is no candidate (not a tensor; stacked: no even rows)."""
    if not isinstance(value, torch.Tensor):
        return None
    if key.startswith("stacked:"):
        if value.dim() >= 1 and value.shape[0] % 2 == 0 and value.shape[0]:
            stem, half = key[len("stacked:"):], value.shape[0] // 2
            return {f"chosen_{stem}": value[:half], f"rejected_{stem}": value[half:]}
        return None
    return {key: value}


def expressions(key: str, name_map: NameMap) -> tuple[Expression, ...]:
    """The candidate expressions of ``key`` (a field, or ``stacked:<stem>``), in the order tried."""
    if key.startswith("stacked:"):
        return name_map.stacked.get(key[len("stacked:"):], ())
    return name_map.fields.get(key, ())


_READABLE = {torch.Tensor: True, torch.nn.Parameter: True}  # tensor class -> whether it runs no code of its own
NESTED = ("a nested tensor (torch.nested): its rows have different lengths and no [B, T] shape; pad it "
          "(`x.to_padded_tensor(0.0)`) or map the padded tensor the loop also holds")


def _readable_class(cls: type) -> bool:
    """True for ``torch.Tensor`` and the subclasses that run no code of their own in torch's functions
    (``nn.Parameter``, ``nn.Buffer``, a subclass defining no ``__torch_function__`` or
    ``__torch_dispatch__``): reading their shape or copying them is reading a tensor (remembered per class)."""
    known = _READABLE.get(cls)
    if known is None:
        function = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
        known = (function is torch.Tensor.__torch_function__.__func__
                 or function is torch._C._disabled_torch_function_impl) and (
                     cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__)
        if len(_READABLE) < 256:
            _READABLE[cls] = known
    return known


def unusable(value: torch.Tensor) -> str | None:
    """Why no field can take the tensor ``value`` (the text of its rejection), or None when it is a dense
    tensor with values: a nested tensor, a sparse / mkldnn (non-strided) one, one on the ``meta`` device
    (no values), a quantized one, and a tensor subclass with its own ``__torch_function__`` /
    ``__torch_dispatch__`` (its operations run its own code: a DTensor, a jagged nested tensor, an
    uninitialized parameter) are refused here, before the schema check, whose operations they break.
    Reads no attribute of such a subclass; never raises."""
    cls = type(value)
    if not _readable_class(cls):
        if cls.__module__.startswith("torch.nested"):
            return NESTED
        return (f"a tensor subclass ({cls.__module__}.{cls.__qualname__}) with its own __torch_function__ or "
                "__torch_dispatch__; tracer records plain tensors: map a variable holding "
                "`x.as_subclass(torch.Tensor)` (or the local tensor of a DTensor, `x.to_local()`)")
    try:
        if value.is_nested:
            return NESTED
        if value.layout is not torch.strided:
            return f"a {value.layout} tensor; tracer records dense tensors: map a variable holding `x.to_dense()`"
        if value.is_meta:
            return "a tensor on the meta device, which holds no values"
        if value.is_quantized:
            return f"a quantized tensor ({value.dtype}); map a variable holding `x.dequantize()`"
        value.shape  # noqa: B018  (a tensor whose shape cannot be read is no field)
    except Exception as err:  # noqa: BLE001  (whatever reading it raises, it is no field; tracing goes on)
        return f"a tensor that cannot be read ({type(err).__name__}: {err})"
    return None


_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


def tensor_signature(value: Any) -> tuple | None:
    """What the field rules read of a value: ``(shape, dtype, device, layout)`` of a tensor a field can
    take, ``(class, why)`` of one none can (:func:`unusable`), None for what is no tensor. Never raises."""
    if type(value) in _PLAIN_TENSORS:  # the common case: four reads
        try:
            return value.shape, value.dtype, value.device, value.layout
        except Exception:  # noqa: BLE001  (a nested tensor of strided layout has no shape)
            return torch.Tensor, unusable(value)
    if value is _MISSING or not isinstance(value, torch.Tensor):  # most candidates name no variable
        return None
    why = unusable(value)
    return (type(value), why) if why is not None else (value.shape, value.dtype, value.device, value.layout)


def value_checked(produced: Mapping[str, torch.Tensor]) -> bool:
    """True when checking ``produced`` reads data (a mask field that is not bool: its 0/1 values)."""
    return any(k in FIELDS and FIELDS[k].kind == BOOL and v.dtype != torch.bool for k, v in produced.items())


@dataclass
class Probe:
    """One candidate expression the full read tried, what it found and what became of it (a call
    site's plan replays these, :mod:`tracer.zero_edit.site_plans`). ``outcome``: ``none`` (no candidate),
    ``skip`` (its fields were read already), ``rejected`` (``message``), ``picked``. ``names``: the
    fields it was checked as (``rejected``, ``picked``): of a DPO stacked candidate, only the sides not
    read already."""

    key: str
    expr: Expression
    signature: tuple | None
    outcome: str = "none"
    names: tuple[str, ...] = ()
    sizes: dict | None = None  # the sizes it was checked against, kept when the check reads data
    message: str = ""


def _order(name_map: NameMap, algorithm: str) -> tuple[list[str], list[str]]:
    """Keys read first (those that can give the policy logprobs), then the others, in map order."""
    keys = list(name_map.fields)
    if algorithm == "dpo":
        keys += [f"stacked:{s}" for s in STACKED_STEMS if s in name_map.stacked]
        first = ("chosen_policy_logprobs", "rejected_policy_logprobs", "stacked:policy_logprobs")
    else:
        first = ("policy_logprobs",)
    return [k for k in first if k in keys], [k for k in keys if k not in first]


def _pick(key: str, name_map: NameMap, frame: FrameType, algorithm: str, capture: FrameCapture) -> None:
    """Add the first candidate of ``key`` that agrees with the fields already read (each expression
    tried is noted in ``capture.probes`` when that is a list)."""
    picked, probes = capture.fields, capture.probes
    check_algo = None if algorithm == "dpo" else algorithm  # DPO sides are paired at the end
    local, global_ = capture.scopes or scopes_of(frame)
    for expr in expressions(key, name_map):
        value = resolve_in(expr, local, global_)
        probe = None if probes is None else Probe(key, expr, tensor_signature(value))
        if probe is not None:
            probes.append(probe)
        if isinstance(value, torch.Tensor) and _refused(value, key, expr, capture, probe):
            continue  # a nested, sparse, meta... tensor: refused before any operation on it
        produced = candidate(key, value)
        if produced is None:
            continue
        produced = {k: v for k, v in produced.items() if k not in picked}
        if not produced:
            if probe is not None:
                probe.outcome = "skip"
            return
        sizes = dict(capture.sizes)  # the fields picked so far passed together: check the new ones against them
        if probe is not None:
            probe.names = tuple(produced)
            if value_checked(produced):
                probe.sizes = dict(sizes)
        try:
            _check(produced, check_algo, sizes, capture.checks)
        except SchemaError as err:
            _reject(capture, probe, key, expr, str(err))
            continue
        capture.sizes = sizes
        picked.update(produced)
        capture.sources.update({k: expr.text for k in produced})
        if expr.index is not None and not key.startswith("stacked:"):  # ``x[inds]``: a new tensor, not the loop's
            capture.owned.update(produced)
        if probe is not None:
            probe.outcome = "picked"
        return


def _refused(value: torch.Tensor, key: str, expr: Expression, capture: FrameCapture, probe: Probe | None) -> bool:
    """True when no field can take ``value`` (:func:`unusable`); rejected, with the reason, unless the
    fields it would give were all read already (a DPO stacked candidate)."""
    why = unusable(value)
    if why is None:
        return False
    if key.startswith("stacked:"):
        sides = (f"chosen_{key[8:]}", f"rejected_{key[8:]}")
        if all(side in capture.fields for side in sides):
            return True
        what = f"fields {sides[0]!r} and {sides[1]!r} (stacked)"
    else:
        what = f"field {key!r}"
    _reject(capture, probe, key, expr, f"{what}: expected a dense tensor with values, got {why}")
    return True


def _reject(capture: FrameCapture, probe: Probe | None, key: str, expr: Expression, message: str) -> None:
    capture.rejected[(key, expr.text)] = message
    if probe is not None:
        probe.outcome, probe.message = "rejected", message


def read_fields(frame: FrameType, name_map: NameMap, algorithm: str, capture: FrameCapture) -> None:
    """Fill ``capture.fields`` from ``frame``; leaves them empty when the policy logprobs are absent."""
    anchor, picked = anchor_field(algorithm), capture.fields
    first, rest = _order(name_map, algorithm)
    for key in first:
        _pick(key, name_map, frame, algorithm, capture)
    if anchor not in picked:
        picked.clear()
        return
    for key in rest:
        _pick(key, name_map, frame, algorithm, capture)
    if algorithm == "dpo":
        for name in [n for n in picked if n.startswith(("chosen_", "rejected_"))]:
            side, other = ("chosen_", "rejected_") if name.startswith("chosen_") else ("rejected_", "chosen_")
            if other + name[len(side):] not in picked:
                capture.rejected[(name, capture.sources.get(name, ""))] = "its other side was not found"
                del picked[name]
    capture.anchor = picked.get(anchor)
    if capture.anchor is None:
        picked.clear()


_PAIRS = {"ratio": "old_logprobs", "approx_kl_k2": "old_logprobs", "ref_kl_k3": "ref_logprobs"}


def derive_fields(capture: FrameCapture, name_map: NameMap, algorithm: str) -> None:
    """The map's ``derive`` fields the frame lacked, from fields that were read: ``ratio``, ``approx_kl_k2``
    and ``ref_kl_k3`` are named in ``capture.derive`` for the writer to compute from its staged copies
    (:func:`tracer.formulas.derived.derive_recorded`: off the training thread); ``group_ids`` and the DPO terms
    are computed here."""
    d = capture.fields  # read only; inputs are detached (float8 made float32) where used
    new: dict[str, torch.Tensor] = {}
    wanted = name_map.derive
    for name, other in _PAIRS.items():
        if name in wanted and name not in d and "policy_logprobs" in d and other in d:
            capture.derive.append(name)
            capture.sources[name] = "derived"
    G = capture.metadata.get("num_generations")
    if ("group_ids" in wanted and "group_ids" not in d and algorithm in GROUPED and "row_ids" not in d
            and isinstance(G, int) and G > 0 and "policy_logprobs" in d and d["policy_logprobs"].shape[0] % G == 0):
        new["group_ids"] = torch.arange(d["policy_logprobs"].shape[0]) // G  # G consecutive rows share a prompt
    if "dpo_terms" in wanted and algorithm == "dpo":
        new.update(_dpo_terms({k: for_maths(v) for k, v in d.items()}, capture.metadata.get("beta")))
    for name, tensor in new.items():
        capture.fields[name] = tensor
        capture.sources[name] = "derived"
        capture.owned.add(name)


def _dpo_terms(d: dict[str, torch.Tensor], beta: Any) -> dict[str, torch.Tensor]:
    needed = [f"{side}_{what}" for side in ("chosen", "rejected") for what in ("policy_logprobs", "ref_logprobs", "mask")]
    terms = ("dpo_logits", "dpo_loss", "chosen_rewards", "rejected_rewards")
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or any(n not in d for n in needed):
        return {}
    seq = {n: formulas.sequence_logprobs(d[n], d[n.split("_")[0] + "_mask"]) for n in needed if not n.endswith("mask")}
    out = formulas.dpo_terms(seq["chosen_policy_logprobs"], seq["rejected_policy_logprobs"],
                             seq["chosen_ref_logprobs"], seq["rejected_ref_logprobs"], float(beta))
    return {k: v for k, v in out.items() if k in terms and k not in d}


def read_frame(frame: FrameType, name_map: NameMap, algorithm: str, checks: dict | None = None,
               hyperparameters: Mapping[str, Any] | None = None, scopes=None,
               probes: list | None = None) -> FrameCapture:
    """Everything one backward's frame gives (fields empty when the policy logprobs are absent);
    ``checks``: a dict the caller keeps across captures, remembering schema-check outcomes;
    ``hyperparameters``: the run's own (``tracer run --meta``), which win over the frame's values,
    also for what is derived from them (``group_ids`` from ``num_generations``, DPO terms from ``beta``);
    ``scopes``: :func:`scopes_of` the frame when the caller took it; ``probes``: a list that receives
    the candidates tried (:class:`Probe`), and then ``capture.read`` what they gave (a call-site plan)."""
    capture = FrameCapture(scopes=scopes or scopes_of(frame), checks=checks, probes=probes)
    read_fields(frame, name_map, algorithm, capture)
    if capture.anchor is None:
        return capture
    if probes is not None:
        capture.read = (tuple(capture.fields), dict(capture.sources), set(capture.owned), dict(capture.rejected))
    finish_capture(capture, frame, name_map, hyperparameters, algorithm)
    return capture


def finish_capture(capture: FrameCapture, frame: FrameType, name_map: NameMap,
                   hyperparameters: Mapping[str, Any] | None, algorithm: str) -> None:
    """Indices, step metadata and derived fields of a capture whose fields were read."""
    capture.indices = read_indices(frame, name_map, capture.scopes)
    metadata = read_metadata(frame, name_map, capture.scopes)
    if hyperparameters:
        metadata.update(hyperparameters)
    capture.metadata = metadata
    derive_fields(capture, name_map, algorithm)


def tensor_variables(frame: FrameType) -> list[str]:
    """``name [shape]`` of the tensors among the frame's locals (for the 'nothing matched' message)."""
    return [f"{k} {list(shape_of(v))}" for k, v in frame.f_locals.items() if isinstance(v, torch.Tensor)][:30]


def shape_of(tensor: torch.Tensor) -> torch.Size | tuple[str]:
    """``tensor.shape``, or ``("?: " + why,)`` for a tensor without one to show (:func:`unusable`: a nested
    tensor, a subclass running its own code, whose shape is not read). Never raises."""
    if _readable_class(type(tensor)):
        try:
            return tensor.shape
        except Exception:  # noqa: BLE001  (a nested tensor of strided layout)
            pass
    return (f"?: {unusable(tensor)}",)
