"""Call-site plans for zero-edit capture: the full read of a backward's frame, remembered per call site.

A loop's ``loss.backward()`` runs from the same line again and again, with locals that hold the
same kinds of tensors each time. The full read (:func:`tracer.zero_edit.frames.read_frame`) tries the map's
candidate expressions of every field in order and checks each against the fields read so far; its
choices depend only on what each expression it tried found: nothing, or a tensor of some shape,
dtype, device and layout, or why no field can take it (:func:`tracer.zero_edit.frames.tensor_signature`), and for a mask that is not bool on the
values it holds. So at the first backward from a code location (code object and line) the
expressions tried and their outcomes are kept as a :class:`Plan`; a later backward from there
resolves the same expressions and, when each finds what it found then (the guard), takes the same
fields, sources, rejections and owned set without the search or the schema checks (a mask that is
not bool is value-checked again, as the full read does). Any difference (a name that appeared or
went, another shape, dtype or device, a mask whose values now pass or fail, another name map) falls
back to the full read, which makes a new plan. Indices, step metadata and derived fields are read as
the full read reads them (:func:`tracer.zero_edit.frames.finish_capture`): their values change every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import FrameType
from typing import Any, Mapping

import torch

from tracer.errors import SchemaError
from tracer.zero_edit.frame_lookup import _MISSING, _lookup, resolve_in, row_index, scopes_of, take_rows
from tracer.zero_edit.frames import (
    FrameCapture,
    Probe,
    _check,
    anchor_field,
    candidate,
    finish_capture,
    read_frame,
    tensor_signature,
)
from tracer.zero_edit.name_maps import NameMap

PLANS_PER_SITE = 4  # plans kept per call site (a last minibatch of another size is another plan)
MAX_SITES = 1024  # call sites remembered (cleared when full)


@dataclass(frozen=True)
class Plan:
    """What the full read of one call site did: the probes in the order tried, the fields' names as
    read (in order), and the sources, owned fields and rejections that went with them."""

    name_map: NameMap
    algorithm: str
    probes: tuple[Probe, ...]
    names: tuple[str, ...]
    sources: Mapping[str, str]
    owned: frozenset[str]
    rejected: Mapping[tuple[str, str], str]  # the rejections, in order, with each data-checked one's latest text
    anchor: str
    steps: tuple = ()  # the probes compiled for replay (:func:`_compile`)
    signature: tuple = ()  # (name, shape, dtype, device) of the fields read, in order: what the guards hold


def build(capture: FrameCapture, name_map: NameMap, algorithm: str) -> Plan | None:
    """The plan of a full read made with ``probes`` (None when it found no policy logprobs)."""
    if capture.anchor is None or capture.read is None or capture.probes is None:
        return None
    names, sources, owned, rejected = capture.read
    probes = tuple(capture.probes)
    fields = capture.fields
    signature = tuple([(n, fields[n].shape, fields[n].dtype, fields[n].device) for n in names])
    return Plan(name_map, algorithm, probes, names, sources, frozenset(owned), rejected, anchor_field(algorithm),
                tuple(_compile(probe) for probe in probes), signature)


_LOOK, _TAKE, _CHECK_PICK, _CHECK_REJECT = 0, 1, 2, 3  # what a replayed probe does with the value found


def _compile(probe: Probe) -> tuple:
    """``(head, index, signature, action, probe)`` of one probe: ``head`` the variable of a one-name
    expression (None: resolved in full by :func:`resolve_in`), ``index`` its row variable, and the
    action: only guard the value (``_LOOK``), take it as the field (``_TAKE``), take it after the
    checks that read data (``_CHECK_PICK``), or check that it still fails them (``_CHECK_REJECT``)."""
    expr = probe.expr
    if probe.outcome == "picked":
        action = _TAKE if probe.sizes is None and probe.names == (probe.key,) else _CHECK_PICK
    elif probe.outcome == "rejected" and probe.sizes is not None:
        action = _CHECK_REJECT
    else:
        action = _LOOK
    head = expr.path[0] if len(expr.path) == 1 and expr.slices is None else None  # slices: resolve_in
    return head, expr.index if head is not None else None, probe.signature, action, probe


def replay(plan: Plan, frame: FrameType, scopes: tuple, checks: dict | None,
           hyperparameters: Mapping[str, Any] | None) -> FrameCapture | None:
    """The capture the full read would give for ``frame``, by ``plan``; None when the frame no longer
    fits the plan (then the caller reads it in full)."""
    local, global_ = scopes
    picked: dict[str, torch.Tensor] = {}
    rejected = plan.rejected  # copied when a value-checked rejection's message changes
    rows: dict[str, Any] = {}  # index variable -> its rows tensor, or _MISSING when it is none
    for head, index_name, signature, action, probe in plan.steps:
        if head is not None:  # `name` or `name[index]`: resolve_in's steps, the index checked once
            value = local.get(head, _MISSING)
            if value is _MISSING:
                value = global_.get(head, _MISSING)
            if index_name is not None and value is not _MISSING:
                index = rows.get(index_name)
                if index is None:
                    index = _lookup(index_name, local, global_)
                    index = rows[index_name] = index if row_index(index) else _MISSING
                value = _MISSING if index is _MISSING else take_rows(value, index)
        else:
            value = resolve_in(probe.expr, local, global_)
        if tensor_signature(value) != signature:  # (shape, dtype, device, layout), a refusal, or None
            return None
        if action == _TAKE:
            picked[probe.key] = value
        elif action == _CHECK_PICK:
            produced = _checked_as(probe, value)
            if probe.sizes is not None and _recheck(probe, produced, plan) is not None:
                return None  # a mask's values that passed now fail
            picked.update(produced)
        elif action == _CHECK_REJECT:
            message = _recheck(probe, _checked_as(probe, value), plan)
            if message is None:
                return None  # it passes now
            if message != rejected[(probe.key, probe.expr.text)]:
                rejected = {**rejected, (probe.key, probe.expr.text): message}
    fields = picked if len(picked) == len(plan.names) else {n: picked[n] for n in plan.names}
    capture = FrameCapture(fields=fields, sources=dict(plan.sources), scopes=scopes, rejected=dict(rejected),
                           anchor=fields[plan.anchor], owned=set(plan.owned), checks=checks)
    finish_capture(capture, frame, plan.name_map, hyperparameters, plan.algorithm)
    if len(capture.fields) == len(plan.names):  # nothing derived here: the fields' signature is the plan's
        capture.signature = plan.signature
    return capture


def _checked_as(probe: Probe, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The fields the full read checked ``value`` as: of a DPO stacked candidate, only the sides not
    read before it (the other side's half is never looked at, so neither its values)."""
    produced = candidate(probe.key, value)
    return {k: produced[k] for k in probe.names}


def _recheck(probe: Probe, produced: dict[str, torch.Tensor], plan: Plan) -> str | None:
    """The schema check of a probe whose check reads values (a mask that is not bool), run again
    against the sizes it had: None when it passes, else the message."""
    try:
        _check(produced, None if plan.algorithm == "dpo" else plan.algorithm, dict(probe.sizes), None)
    except SchemaError as err:
        return str(err)
    return None


class SitePlans:
    """The plans of one watcher's call sites, and how often they served (``hits``), did not fit
    (``misses``: the frame was read in full) or were made (``built``). ``enabled = False``: every
    frame is read in full, as before plans existed (to compare)."""

    def __init__(self, enabled: bool = True) -> None:
        self._sites: dict[tuple, tuple] = {}  # (id(code), line) -> (code, its plans)
        self.enabled = enabled
        self.hits = self.misses = self.built = 0

    def read(self, frame: FrameType, name_map: NameMap, algorithm: str, checks: dict | None,
             hyperparameters: Mapping[str, Any] | None, verify: list | None = None) -> FrameCapture:
        """:func:`tracer.zero_edit.frames.read_frame` of ``frame``, by a plan of its call site when one fits.
        ``verify``: a list receiving the differences between the plan's capture and a full read,
        both made each time (tests)."""
        scopes = scopes_of(frame)
        if not self.enabled:
            return read_frame(frame, name_map, algorithm, checks, hyperparameters, scopes)
        code = frame.f_code
        site = (id(code), frame.f_lineno)  # by identity: hashing a code object hashes its bytecode each time
        entry = self._sites.get(site)
        plans = entry[1] if entry is not None and entry[0] is code else ()
        for plan in plans:
            if plan.name_map is name_map and plan.algorithm == algorithm:
                capture = replay(plan, frame, scopes, checks, hyperparameters)
                if capture is not None:
                    self.hits += 1
                    if verify is not None:
                        full = read_frame(frame, name_map, algorithm, checks, hyperparameters, scopes)
                        verify.extend(differences(full, capture))
                    return capture
        if plans:
            self.misses += 1
        capture = read_frame(frame, name_map, algorithm, checks, hyperparameters, scopes, probes=[])
        plan = build(capture, name_map, algorithm)
        if plan is not None:
            if site not in self._sites and len(self._sites) >= MAX_SITES:
                self._sites.clear()
            self._sites[site] = (code, [plan, *plans][:PLANS_PER_SITE])  # the entry keeps the code (and its id)
            self.built += 1
        return capture


def differences(full: FrameCapture, planned: FrameCapture) -> list[str]:
    """What differs between a full read and a plan's capture of the same frame (empty: nothing).
    Fields compare by identity when the loop's own tensor (or a view of it), by value otherwise."""
    out = []
    for what in ("sources", "owned", "rejected", "indices", "metadata", "derive"):
        a, b = getattr(full, what), getattr(planned, what)
        if a != b or (isinstance(a, dict) and list(a) != list(b)):
            out.append(f"{what}: full {a!r} != plan {b!r}")
    if list(full.fields) != list(planned.fields):
        out.append(f"fields: full {list(full.fields)} != plan {list(planned.fields)}")
    for name in set(full.fields) & set(planned.fields):
        a, b = full.fields[name], planned.fields[name]
        same_view = (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)
        if name in full.owned:
            if not (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
                out.append(f"field {name}: values differ")
        elif not same_view:
            out.append(f"field {name}: full and plan read different tensors")
    if planned.signature is not None and planned.signature != tuple(
            [(n, t.shape, t.dtype, t.device) for n, t in planned.fields.items()]):
        out.append(f"signature: plan {planned.signature!r} is not its fields'")
    if (full.anchor is None) != (planned.anchor is None) or (
            full.anchor is not None and full.anchor.data_ptr() != planned.anchor.data_ptr()):
        out.append("anchor differs")
    return out
