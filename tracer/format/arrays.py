"""Arrays of either kind: the read side hands numpy arrays (safetensors' numpy API: no torch needed
to read a trace), the write side, the checks and the formulas torch tensors. The few operations the
format and read stages apply to both (masks as bool, ids as int64, placeholders as NaN, a field's
dtype from a step file's header) live here, so that one function serves both kinds and torch is
never imported to read a file.

A value is a torch tensor only if torch has been imported by someone (:func:`is_torch`): nothing
here imports torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

# safetensors dtype names numpy can hold (no bfloat16, no float8): fields of other dtypes are read
# through torch (tracer.read.reader).
NUMPY_DTYPES = frozenset({"BOOL", "U8", "I8", "I16", "I32", "I64", "U16", "U32", "U64", "F16", "F32", "F64"})


def is_torch(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (False, without importing torch, when torch is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


@dataclass(frozen=True)
class HeaderTensor:
    """A field as a step file's header describes it: its shape and safetensors dtype name
    (``F32``, ``BF16``, ``I64``, ``BOOL``...), no data. :func:`tracer.format.schema.check_tensors`
    checks these like tensors (ranks, shared dimensions, dtype kinds), so a header is checked
    against the schema without reading data or importing torch."""

    shape: tuple[int, ...]
    dtype: str

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.startswith(("F", "BF"))

    def is_complex(self) -> bool:
        return self.dtype.startswith("C")


def is_bool(value: Any) -> bool:
    """Whether ``value`` (a numpy array, torch tensor or :class:`HeaderTensor`) holds bools."""
    dtype = value.dtype
    return dtype == "BOOL" if isinstance(value, HeaderTensor) else str(dtype) in ("bool", "torch.bool")


def is_floating(value: Any) -> bool:
    """Whether ``value`` (numpy array or torch tensor) holds floating-point numbers."""
    if is_torch(value):
        return bool(value.is_floating_point())
    return bool(np.issubdtype(np.asarray(value).dtype, np.floating))


def as_bool(value: Any) -> Any:
    """``value != 0`` as bools, of the same kind (a bool array is returned as it is)."""
    if is_torch(value):
        return value.bool()
    return value if value.dtype == np.bool_ else value.astype(bool)


def as_int64(value: Any) -> Any:
    """``value`` as int64, of the same kind (an int64 array is returned as it is)."""
    if is_torch(value):
        return value.long()
    return value if value.dtype == np.int64 else value.astype(np.int64)


def keep_mask(data: Any, name: str, ids: Any) -> Any:
    """``data[name]`` as a bool mask, or an all-True mask shaped like ``ids`` when ``data`` lacks it
    (of ``ids``' kind)."""
    mask = data.get(name)
    if mask is not None:
        return as_bool(mask)
    if is_torch(ids):
        return ids.new_ones(ids.shape).bool()
    return np.ones(ids.shape, dtype=bool)


def like(values: Any, reference: Any, dtype: str = "int64") -> Any:
    """``values`` (nested lists or an array) as an array of ``reference``'s kind with ``dtype``
    (``"int64"``, ``"bool"``, ``"float32"``)."""
    if is_torch(reference):
        torch = sys.modules["torch"]
        return torch.as_tensor(np.asarray(values, dtype=dtype))
    return np.asarray(values, dtype=dtype)


def nan_where(condition: Any, value: Any) -> Any:
    """``value`` with NaN where ``condition`` holds (a new array of ``value``'s kind and dtype)."""
    if is_torch(value):
        torch = sys.modules["torch"]
        return torch.where(condition, torch.full_like(value, float("nan")), value)
    return np.where(condition, np.array(np.nan, dtype=value.dtype), value)


def float32_numpy(value: Any) -> np.ndarray:
    """``value`` as a float32 numpy array (a torch tensor detached and moved to the CPU first)."""
    if is_torch(value):
        return value.detach().float().cpu().numpy()
    return np.asarray(value, dtype=np.float32)


def to_numpy(value: Any) -> np.ndarray:
    """``value`` as a numpy array; a torch tensor of a dtype numpy lacks (bfloat16, float8) as float32."""
    if not is_torch(value):
        return np.asarray(value)
    value = value.detach().cpu()
    if value.is_floating_point() and value.dtype.itemsize <= 2 and str(value.dtype) != "torch.float16":
        value = value.float()
    return value.numpy()


def to_torch(value: Any) -> Any:
    """``value`` as a torch tensor (imports torch: the caller does maths in torch). A numpy array is
    shared, not copied (``torch.from_numpy``; a read-only one is copied)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    array = np.asarray(value)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)
