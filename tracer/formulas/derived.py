"""Derived fields: when a step file records the inputs of ``ratio``, ``ref_kl_k3`` or
``approx_kl_k2`` but not the field itself (the README's hand-written loop records only policy and
old logprobs), the reader adds it, computed by :mod:`tracer.formulas`. Which fields are derived
and from what is the registry :data:`DERIVED_FIELDS` (:mod:`tracer.format.derived_fields`,
torch-free: register a field there and its formula here); torch is imported when a field is
computed. Pages, views and summaries mark such fields as derived (:meth:`tracer.read.reader.Trace.derived_fields`); the recompute checks,
which compare a recorded tensor with its formula, skip a derived one (nothing was recorded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from tracer.format.arrays import is_floating, is_torch, to_torch
from tracer.format.derived_fields import (  # noqa: F401  (the registry's home; re-exported here)
    DERIVED_FIELDS,
    derivable,
    derivation_inputs,
    derivation_sources,
)

if TYPE_CHECKING:
    import torch

_inputs = derivation_sources


def derive_fields(data: dict[str, Any], meta: dict[str, Any],
                  wanted: Iterable[str] | None = None) -> dict[str, Any]:
    """The derived tensors ``data`` lacks but can give, computed by :mod:`tracer.formulas` in float32
    (float64 inputs stay float64), same shape as the inputs (``[B, T]``, or ``[T]`` for one row):
    ``ratio = exp(policy - old)``, ``ref_kl_k3 = exp(ref - policy) - (ref - policy) - 1``,
    ``approx_kl_k2 = 0.5 (policy - old)^2`` (SPEC.md section 4). Inputs of different shapes are
    left alone (the schema check reports them). ``wanted``: derive only these names (None = all).

    ``data``: torch tensors, or numpy arrays (the reader's numpy reads): the results are of the
    inputs' kind; torch is imported only when there is a field to compute (the formulas are torch's)."""
    out: dict[str, Any] = {}
    names = derivable(data, meta)
    for name in names if wanted is None else [n for n in names if n in set(wanted)]:
        inputs = [data[f] for f in _inputs(name, meta)]
        if any(t.shape != inputs[0].shape or not is_floating(t) for t in inputs):
            continue
        import torch

        from tracer.formulas import logprobs

        numpy_in = not is_torch(inputs[0])
        inputs = [to_torch(t) for t in inputs]
        a = inputs[0] if inputs[0].dtype == torch.float64 else inputs[0].float()
        b = inputs[-1] if len(inputs) > 1 else a
        b = b if b.dtype == torch.float64 else b.float()
        value = getattr(logprobs, name)(a.detach(), b.detach())  # looked up at call time (patchable)
        out[name] = value.numpy() if numpy_in else value
    return out


def derive_recorded(data: dict[str, torch.Tensor], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The fields a zero-edit capture asked to be recorded as derived (its name map's ``derive``:
    :func:`tracer.zero_edit.frames.derive_fields`), computed by the writer from the step's staged copies of
    their inputs, as the capture would have on the training thread: by :mod:`tracer.formulas`, in
    the inputs' own dtype (float8 ones in float32: torch promotes no float8 dtype with another), same
    shape (``[B, T]``). A name whose inputs are absent is skipped."""
    import torch

    from tracer.formulas import logprobs

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
