"""What ``record`` checks on the training thread before a step is staged: its coordinates, and its
tensors against the schema once per field signature (:class:`SignatureCache`)."""

from __future__ import annotations

from typing import Any

import torch

from tracer.errors import SchemaError
from tracer.schema import BOOL, FIELDS, check_mask_field, check_tensors

MAX_SIGNATURES = 256  # field signatures (names, shapes, dtypes, devices) whose schema check is cached


def coordinate(name: str, value: Any) -> int:
    """``step`` / ``inner_step`` / ``micro_batch`` as an int >= 0 (numpy and torch integers accepted)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if hasattr(value, "__index__") and not isinstance(value, bool):
        value = value.__index__()
        if 0 <= value < 2**62:
            return value
    raise SchemaError(f"{name} must be an integer in [0, 2**62), got {value!r:.40} ({type(value).__name__}); "
                      f"pass the {name.replace('_', ' ')} counter as an int")


class SignatureCache(dict):
    """The field signatures of one writer already checked, each with its ``source_dtype`` metadata
    and the names of the masks whose values are checked at every step (at most
    :data:`MAX_SIGNATURES` kept)."""

    def __init__(self, algorithm: str) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.last: tuple | None = None  # the signature of the tensors last checked (None: not hashable)
        self.cpu_key: tuple | None = None  # the same when it is cached and every tensor is on the CPU, else None

    def check(self, tensors: dict[str, Any]) -> str:
        """Check ``tensors`` against the schema (:func:`tracer.schema.check_tensors`) once per
        signature (names, shapes, dtypes, devices); a signature seen before costs one tuple and a
        set lookup. Data-dependent checks (the values of a float or integer mask on the CPU) run
        every time. Returns the ``source_dtype`` metadata of the signature, and sets :attr:`last`
        and :attr:`cpu_key` (the key of the step's staging buffers,
        :meth:`tracer.capture.BufferPool.take_group`). Raises SchemaError."""
        try:  # t.device, hashable, is cheaper than building t.device.type for each tensor
            signature = tuple([(name, t.shape, t.dtype, t.device) for name, t in tensors.items()])
            cached = self.get(signature)
        except (AttributeError, TypeError):  # a non-tensor value or an unhashable name: the full check names it
            cached, signature = None, None
        self.last, self.cpu_key = signature, None
        if cached is None:
            check_tensors(tensors, self.algorithm)
            source = ",".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()
                                      if t.is_floating_point()}))
            value_checked = tuple(name for name, t in tensors.items() if name in FIELDS and FIELDS[name].kind == BOOL
                                  and t.dtype != torch.bool and t.device.type == "cpu")
            cached = (source, value_checked, all(t.device.type == "cpu" for t in tensors.values()))
            if signature is not None and len(self) < MAX_SIGNATURES:
                self[signature] = cached
                self.cpu_key = signature if cached[2] else None
            return source
        for name in cached[1]:  # 0/1 values of a non-bool mask: read from the data, so checked every step
            check_mask_field(name, tensors[name])
        self.cpu_key = signature if cached[2] else None
        return cached[0]
