"""Derived fields: when a step file records the inputs of ``ratio``, ``ref_kl_k3`` or
``approx_kl_k2`` but not the field itself (the README's hand-written loop records only policy and
old logprobs), the reader adds it, computed by :mod:`tracer.formulas`. Pages, views and summaries
mark such fields as derived (:meth:`tracer.read.reader.Trace.derived_fields`); the recompute checks,
which compare a recorded tensor with its formula, skip a derived one (nothing was recorded).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from tracer.formulas import logprobs

# Fields the reader derives when a step file records their inputs but not them: name -> (inputs, formula).
DERIVED_FIELDS: dict[str, tuple[tuple[str, ...], str]] = {
    "ratio": (("policy_logprobs", "old_logprobs"), "tracer.formulas.ratio"),
    "ref_kl_k3": (("policy_logprobs", "ref_logprobs"), "tracer.formulas.ref_kl_k3"),
    "approx_kl_k2": (("policy_logprobs", "old_logprobs"), "tracer.formulas.approx_kl_k2"),
}


def _inputs(name: str, meta: dict[str, Any]) -> tuple[str, ...]:
    """The recorded fields ``name`` is derived from; old = policy when the metadata says old is
    the detached policy (``old_logprobs_source = policy_detached``)."""
    inputs = DERIVED_FIELDS[name][0]
    if "old_logprobs" in inputs and meta.get("old_logprobs_source") == "policy_detached":
        inputs = tuple(dict.fromkeys("policy_logprobs" if f == "old_logprobs" else f for f in inputs))
    return inputs


def derivable(present: Iterable[str], meta: dict[str, Any]) -> list[str]:
    """The names of :data:`DERIVED_FIELDS` absent from ``present`` whose inputs are all present. The
    ratio is per token only: none when ``importance_sampling_level`` is not ``token``."""
    present = set(present)
    out = []
    for name in DERIVED_FIELDS:
        if name == "ratio" and meta.get("importance_sampling_level", "token") != "token":
            continue
        if name not in present and all(f in present for f in _inputs(name, meta)):
            out.append(name)
    return out


def derivation_inputs(present: Iterable[str], meta: dict[str, Any], wanted: Iterable[str]) -> list[str]:
    """The recorded fields needed to derive those of ``wanted`` that can be derived."""
    names = [n for n in derivable(present, meta) if n in set(wanted)]
    return list(dict.fromkeys(f for n in names for f in _inputs(n, meta)))


def derive_fields(data: dict[str, torch.Tensor], meta: dict[str, Any],
                  wanted: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The derived tensors ``data`` lacks but can give, computed by :mod:`tracer.formulas` in float32
    (float64 inputs stay float64), same shape as the inputs (``[B, T]``, or ``[T]`` for one row):
    ``ratio = exp(policy - old)``, ``ref_kl_k3 = exp(ref - policy) - (ref - policy) - 1``,
    ``approx_kl_k2 = 0.5 (policy - old)^2`` (SPEC.md section 4). Inputs of different shapes are
    left alone (the schema check reports them). ``wanted``: derive only these names (None = all)."""
    out: dict[str, torch.Tensor] = {}
    names = derivable(data, meta)
    for name in names if wanted is None else [n for n in names if n in set(wanted)]:
        inputs = [data[f] for f in _inputs(name, meta)]
        if any(t.shape != inputs[0].shape or not t.is_floating_point() for t in inputs):
            continue
        a = inputs[0] if inputs[0].dtype == torch.float64 else inputs[0].float()
        b = inputs[-1] if len(inputs) > 1 else a
        b = b if b.dtype == torch.float64 else b.float()
        out[name] = getattr(logprobs, name)(a.detach(), b.detach())  # looked up at call time (patchable)
    return out


def derive_recorded(data: dict[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The fields a zero-edit capture asked to be recorded as derived (its name map's ``derive``:
    :func:`tracer.zero_edit.frames.derive_fields`), computed by the writer from the step's staged copies of
    their inputs, as the capture would have on the training thread: by :mod:`tracer.formulas`, in
    the inputs' own dtype (float8 ones in float32: torch promotes no float8 dtype with another), same
    shape (``[B, T]``). A name whose inputs are absent is skipped."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        inputs = DERIVED_FIELDS[name][0]
        if name not in data and all(f in data for f in inputs):
            a, b = (for_maths(data[f]) for f in (inputs[0], inputs[-1]))
            with torch.no_grad():
                out[name] = getattr(logprobs, name)(a, b)
    return out


def for_maths(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, a float8 one as float32: torch promotes no float8 dtype with another, so
    float8 inputs (old logprobs kept in float8) could not be combined with the policy's."""
    if tensor.requires_grad:  # a staged copy never does: no detach() (each torch call lets the training thread's lock go)
        tensor = tensor.detach()
    return tensor.float() if tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point else tensor
