"""The bytes of one staged step, for the writer thread: each tensor's buffer, the content checksum
(:func:`tracer.format.hashing.content_sha256`'s scheme), the non-finite scan and safetensors' pointer
specs to write the file from, with everything that depends only on the step's field signature (names, dtypes, shapes,
the file layout) worked out once per signature (:class:`StepPlan`).

Why: the writer thread shares the interpreter lock with the training loop, so its Python time per
step is taken from a loop of small steps almost one for one (BENCHMARKS.md, "Writer throughput and CPU"). A step of
14 small fields used to cost four passes over its tensors, each asking torch for shapes, dtypes and
pointers again; a plan makes that one pass of a few attribute reads and buffer views, and a small
step's checksum and float scan one call each over a joined copy of its bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tracer.format.files import IMAGE_BYTES, TensorSpec
from tracer.format.hashing import digest_head, tensor_bytes

_NUMPY_FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
MAX_PLANS = 256  # signatures planned per writer (a run has a handful)
CONCAT_BYTES = 2**20  # float fields up to this size in all are scanned as one concatenated array


def all_finite(t: torch.Tensor) -> bool:
    """All values finite; float8 kinds torch cannot test directly are tested in float32, and a dtype
    that cannot be tested at all (packed float4) counts as finite rather than costing its step."""
    try:
        return bool(torch.isfinite(t).all())
    except (NotImplementedError, RuntimeError):
        try:
            return bool(torch.isfinite(t.float()).all())
        except (NotImplementedError, RuntimeError):
            return True


@dataclass(frozen=True)
class StepPlan:
    """What a field signature fixes: the hashing order and each tensor's hash head, the float fields
    numpy scans (grouped by dtype) and those torch scans, safetensors' dtype names, each tensor's
    shape and the ctypes type of its buffer (None when empty)."""

    order: tuple[str, ...]
    heads: dict[str, bytes]
    nbytes: dict[str, int]
    numpy_floats: dict[Any, tuple[str, ...]]  # numpy dtype -> field names
    torch_floats: tuple[str, ...]
    spec_dtypes: dict[str, str]
    pointer_specs: bool  # every tensor can be written from its pointer (else save_file)
    shapes: dict[str, tuple[int, ...]]
    buffer_types: dict[str, Any]
    small: bool  # all the bytes together within CONCAT_BYTES: hashed and scanned as joined copies


def signature(tensors: dict[str, torch.Tensor]) -> tuple:
    """(name, dtype, shape) of each tensor, in order: what a :class:`StepPlan` depends on."""
    return tuple((name, t.dtype, t.shape) for name, t in tensors.items())


def make_plan(tensors: dict[str, torch.Tensor]) -> StepPlan:
    """The plan of ``tensors`` (contiguous CPU tensors, as the writer stores them)."""
    numpy_floats: dict[Any, list[str]] = {}
    torch_floats = []
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel():
            dtype = _NUMPY_FLOATS.get(t.dtype)
            if dtype is None:
                torch_floats.append(name)
            else:
                numpy_floats.setdefault(dtype, []).append(name)
    pointer_specs = TensorSpec is not None and sys.byteorder == "little" and all(t.numel() for t in tensors.values())
    small = sum(t.nbytes for t in tensors.values()) <= min(CONCAT_BYTES, IMAGE_BYTES)
    return StepPlan(
        order=tuple(sorted(tensors)),
        heads={name: digest_head(name, str(t.dtype), list(t.shape)) for name, t in tensors.items()},
        nbytes={name: t.nbytes for name, t in tensors.items()},
        numpy_floats={k: tuple(v) for k, v in numpy_floats.items()},
        torch_floats=tuple(torch_floats),
        spec_dtypes={name: str(t.dtype)[6:] for name, t in tensors.items()},
        pointer_specs=pointer_specs,
        shapes={name: tuple(t.shape) for name, t in tensors.items()},
        buffer_types={name: ctypes.c_ubyte * t.nbytes if t.nbytes else None for name, t in tensors.items()},
        small=small,
    )


@dataclass
class StepBytes:
    """One step's checksum, non-finite fields and what :func:`tracer.format.files.save_atomic` writes it
    from: safetensors pointer specs, or None
    (write with save_file). ``buffers`` are views of the tensors' memory: valid while the tensors live."""

    content_sha256: str
    nonfinite: list[str]
    specs: dict[str, Any] | None
    buffers: dict[str, Any]


def describe(tensors: dict[str, torch.Tensor], plan: StepPlan) -> StepBytes:
    """One pass over ``tensors`` (contiguous, CPU, matching ``plan``'s signature). The checksum
    equals :func:`tracer.format.hashing.content_sha256` (tested): a small step's heads and bytes are joined
    into one copy and hashed in one call (the same digest as one update per piece), a larger one
    is hashed piece by piece (no copy)."""
    pointers = {name: t.data_ptr() for name, t in tensors.items()}
    kinds = plan.buffer_types
    buffers = {name: kinds[name].from_address(ptr) if kinds[name] is not None else b""
               for name, ptr in pointers.items()}
    if plan.small:
        heads = plan.heads
        digest = hashlib.sha256(b"".join([piece for name in plan.order for piece in (heads[name], buffers[name])]))
    else:
        digest = hashlib.sha256()
        for name in plan.order:
            digest.update(plan.heads[name])
            digest.update(buffers[name])
    specs = None
    if plan.pointer_specs:
        dtypes, shapes, nbytes = plan.spec_dtypes, plan.shapes, plan.nbytes
        specs = {name: TensorSpec(dtype=dtypes[name], shape=shapes[name], data_ptr=ptr, data_len=nbytes[name])
                 for name, ptr in pointers.items()}
    return StepBytes(digest.hexdigest(), nonfinite(tensors, plan, buffers), specs, buffers)


def nonfinite(tensors: dict[str, torch.Tensor], plan: StepPlan | None = None,
              buffers: dict[str, Any] | None = None) -> list[str]:
    """Names of the (contiguous, CPU) float tensors holding a NaN or an infinity, in order.
    float16/32/64 are scanned by numpy over the tensors' own memory (small ones as one array): that
    keeps the interpreter lock instead of handing it to the training loop at each torch call; other
    float dtypes (bfloat16, float8) through torch (:func:`all_finite`). ``plan``/``buffers``: the
    step's, when the caller has them."""
    plan = plan or make_plan(tensors)
    if buffers is None:
        buffers = {n: tensor_bytes(tensors[n]) for names in plan.numpy_floats.values() for n in names}
    bad: set[str] = set()
    for dtype, names in plan.numpy_floats.items():
        # a small step: one scan of the fields' bytes joined (one copy beats a call per field)
        if plan.small and np.isfinite(np.frombuffer(b"".join([buffers[n] for n in names]), dtype=dtype)).all():
            continue
        bad.update(n for n in names if not np.isfinite(np.frombuffer(buffers[n], dtype=dtype)).all())
    bad.update(n for n in plan.torch_floats if not all_finite(tensors[n]))
    return [n for n in tensors if n in bad]
