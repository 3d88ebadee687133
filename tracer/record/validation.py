"""What ``record`` checks on the training thread before a step is staged (:class:`RecordChecks`): its
coordinates (each recorded once), its tensors against the schema once per field signature
(:class:`SignatureCache`), and its metadata (:class:`MetadataCache`: not a key the writer sets, JSON,
a header readers accept)."""

from __future__ import annotations

from math import copysign
from typing import Any, Mapping

import torch

from tracer.errors import SchemaError, TraceError
from tracer.formulas.derived import DERIVED_FIELDS
from tracer.format import summary as summary_format
from tracer.format.names import step_label
from tracer.format.schema import BOOL, FIELDS, check_mask_field, check_tensors
from tracer.format.metadata_codec import encode_metadata, jsonable
from tracer.format.integrity import MAX_METADATA_BYTES, MAX_METADATA_KEYS  # what readers decode

MAX_SIGNATURES = 256  # field signatures (names, shapes, dtypes, devices) whose schema check is cached
# Step metadata keys the writer sets itself; a caller passing one would be silently overridden.
WRITER_KEYS = frozenset({"schema_version", "algorithm", "step", "inner_step", "micro_batch", "rank", "world_size",
                         "source_dtype", "content_sha256", "nonfinite_fields", "anomaly", summary_format.SUMMARY_KEY,
                         summary_format.RECORDED_KEY})


def check_scalars(scalars: Any) -> dict[str, float]:
    """The user's per-step scalars (``record(..., scalars={"grad_norm": 0.3, ...})``) as
    ``{"scalars/<name>": float}``, the summary keys they are stored under (:mod:`tracer.format.summary`).

    A value is a real number (Python or numpy, or a one-element tensor: read with ``.item()``, which
    waits for a CUDA tensor), NaN and infinities included: an infinite gradient norm
    (``clip_grad_norm_`` of an overflowing step) is the value a debugger most wants kept. Raises
    SchemaError naming the scalar, what was expected and what was given: a name that is not a string
    of 1 to 100 characters, a bool, or anything else."""
    if not isinstance(scalars, Mapping):
        raise SchemaError(f"scalars: expected a dict {{name: number}}, got {type(scalars).__name__}")
    out: dict[str, float] = {}
    for name, value in scalars.items():
        if not isinstance(name, str) or not 0 < len(name) <= summary_format.MAX_NAME_CHARS:
            raise SchemaError(f"scalars: the name {name!r} is not a string of 1 to {summary_format.MAX_NAME_CHARS} "
                              "characters")
        if isinstance(value, torch.Tensor) and value.numel() == 1 and (value.is_floating_point() or not value.is_complex()) \
                and value.dtype != torch.bool:
            value = value.item()
        elif hasattr(value, "item") and getattr(value, "shape", None) == () and not isinstance(value, (bool, str)):
            value = value.item()  # a numpy scalar
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            shown = f"tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise SchemaError(f"scalars[{name!r}]: expected a number (a float, an int or a one-element tensor; "
                              f"NaN and infinities are kept), got {shown}")
        out[summary_format.SCALAR_PREFIX + name] = float(value)
    return out


def coordinate(name: str, value: Any) -> int:
    """``step`` / ``inner_step`` / ``micro_batch`` as an int >= 0 (numpy and torch integers accepted)."""
    if type(value) is int and 0 <= value < 2**62:
        return value
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
        # the same when it is cached and every tensor is on the CPU, or every one on one CUDA device, else None
        self.group_key: tuple | None = None
        self._given: tuple = (None, None)  # (the signature a caller last passed, its cached entry)

    def check(self, tensors: dict[str, Any], signature: tuple | None = None) -> str:
        """Check ``tensors`` against the schema (:func:`tracer.format.schema.check_tensors`) once per
        signature (names, shapes, dtypes, devices); a signature seen before costs one tuple and a
        set lookup. Data-dependent checks (the values of a float or integer mask on the CPU) run
        every time. Returns the ``source_dtype`` metadata of the signature, and sets :attr:`last` and
        :attr:`group_key` (the key of the step's staging buffers, :meth:`tracer.record.capture.BufferPool.take_group`,
        when every tensor is on the CPU, or every one on one CUDA device). ``signature``: the tuple of
        ``(name, shape, dtype, device)`` of ``tensors``, in order, when the caller knows it already (a call-site
        plan's capture, :mod:`tracer.zero_edit.site_plans`, whose guards checked each tensor's); it must be
        exactly what would be built here. Raises SchemaError."""
        if signature is not None:  # the same tuple as the last one given: the same entry (a plan's own tuple)
            cached = self._given[1] if signature is self._given[0] else self.get(signature)
            if cached is not None:
                self._given = (signature, cached)
        else:
            try:  # t.device, hashable, is cheaper than building t.device.type for each tensor
                signature = tuple([(name, t.shape, t.dtype, t.device) for name, t in tensors.items()])
                cached = self.get(signature)
            except (AttributeError, TypeError):  # a non-tensor value or an unhashable name: the full check names it
                cached, signature = None, None
        self.last, self.group_key = signature, None
        if cached is None:
            check_tensors(tensors, self.algorithm)
            source = ",".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()
                                      if t.is_floating_point()}))
            value_checked = tuple(name for name, t in tensors.items() if name in FIELDS and FIELDS[name].kind == BOOL
                                  and t.dtype != torch.bool and t.device.type == "cpu")
            devices = {t.device for t in tensors.values()}
            grouped = len(devices) == 1 and next(iter(devices)).type in ("cpu", "cuda")
            cached = (source, value_checked, grouped)
            if signature is not None and len(self) < MAX_SIGNATURES:
                self[signature] = cached
                self.group_key = signature if grouped else None
            return source
        for name in cached[1]:  # 0/1 values of a non-bool mask: read from the data, so checked every step
            check_mask_field(name, tensors[name])
        self.group_key = signature if cached[2] else None
        return cached[0]


class MetadataCache:
    """The last step metadata ``record`` checked, with its header encoding
    (:func:`tracer.format.metadata_codec.encode_metadata`) and, once asked for, its JSON form
    (:func:`tracer.format.metadata_codec.jsonable`, what the writer process is sent). A zero-edit capture passes
    the same values at every step (the hyperparameters it reads from the loop's ``args``), which
    then cost one comparison instead of an encoding. The same ``str`` keys with values of the same
    types that compare equal are the same metadata, except floats of another sign (``-0.0 == 0.0``,
    yet JSON writes them apart) and a NaN (never equal: encoded again); only metadata of ``str``
    keys and scalar values is remembered (a list could change in place; ``{True: x}`` has the
    keys of ``{1: x}``, yet another header key)."""

    def __init__(self) -> None:
        self._last: dict[str, Any] | None = None  # the metadata last encoded, when all scalars
        self._encoded: dict[str, str] = {}
        self._json: dict[str, Any] | None = None
        self._keys: list[str] = []  # of _last, in order, with its values' types
        self._types: list[type] = []
        self._key_types: list[type] = []
        self._unsure = False  # _last holds a float 0.0, -0.0 or NaN: compared key by key

    def encoded(self, metadata: Mapping[str, Any]) -> dict[str, str]:
        """``encode_metadata(metadata)``. Raises SchemaError (a value that is not JSON)."""
        last = self._last
        if last is not None and self._same(last, metadata):
            return self._encoded
        encoded = encode_metadata(metadata)
        scalars = all(type(k) is str and type(v) in _SCALARS for k, v in metadata.items())
        self._last, self._encoded, self._json = (dict(metadata) if scalars else None), encoded, None
        if scalars:
            self._keys, self._types = list(metadata), list(map(type, metadata.values()))
            self._key_types = [str] * len(metadata)
            self._unsure = any(type(v) is float and (v == 0.0 or v != v) for v in metadata.values())
        return encoded

    def _same(self, last: dict[str, Any], metadata: Mapping[str, Any]) -> bool:
        """True when ``metadata`` is the metadata ``last`` as :class:`MetadataCache` means it: the
        keys in the same order with values equal and of the same types (compared in C when
        ``metadata`` is a dict in ``last``'s key order and ``last`` holds no float zero, whose sign
        ``==`` ignores, nor a NaN, which ``==`` of dicts takes for equal to itself), else key by key."""
        if type(metadata) is dict and not self._unsure and metadata == last and list(metadata) == self._keys:
            return list(map(type, metadata)) == self._key_types and list(map(type, metadata.values())) == self._types
        return last.keys() == metadata.keys() and all(
            type(k) is str and type(v) is type(last[k]) and v == last[k]
            and (type(v) is not float or copysign(1.0, v) == copysign(1.0, last[k]))
            for k, v in metadata.items())

    def json_form(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """``jsonable(metadata)`` of the metadata :meth:`encoded` was last given."""
        if self._last is None:
            return jsonable(dict(metadata))
        if self._json is None:
            self._json = jsonable(self._last)
        return self._json


_SCALARS = frozenset({int, float, str, bool, type(None)})
_NO_METADATA: dict[str, str] = {}
DERIVABLE = frozenset(DERIVED_FIELDS)


class RecordChecks:
    """The checks of one writer's ``record`` calls, with what they remember: the coordinates recorded,
    the field signatures checked (:attr:`signatures`), the last metadata encoded. ``hyperparameters``:
    the writer's, encoded once here (a non-JSON value raises SchemaError, naming it)."""

    def __init__(self, algorithm: str, hyperparameters: Mapping[str, Any]) -> None:
        self.signatures = SignatureCache(algorithm)
        self._metadata = MetadataCache()
        self._recorded: set[tuple[int, int, int]] = set()
        self._hyperparameter_bytes = sum(len(k) + len(v) for k, v in encode_metadata(hyperparameters).items())
        self._hyperparameter_keys = len(encode_metadata(hyperparameters))
        self._metadata_size: tuple = (None, 0)  # (an encoded metadata dict, its header bytes with the hyperparameters')

    def step(self, step: Any, inner_step: Any, micro_batch: Any, tensors: dict[str, Any],
             metadata: Mapping[str, Any] | None, signature: tuple | None) -> tuple[tuple[int, int, int], str]:
        """Check one step's coordinates, tensors and metadata keys; returns ``((step, inner_step,
        micro_batch), source_dtype)`` and leaves the step's signature and staging key in
        :attr:`signatures` (``last``, ``group_key``). Raises SchemaError: a coordinate that is not an
        int >= 0, a metadata key the writer sets, a tensor the schema refuses, coordinates recorded before."""
        coordinates = (coordinate("step", step), coordinate("inner_step", inner_step),
                       coordinate("micro_batch", micro_batch))
        reserved = WRITER_KEYS.intersection(metadata or {})
        if reserved:
            raise SchemaError(f"metadata keys {sorted(reserved)} are set by the writer; pass step=, inner_step=, "
                              "micro_batch= as arguments and leave the others out")
        source_dtype = self.signatures.check(tensors, signature)
        if coordinates in self._recorded:
            raise SchemaError(
                f"{step_label(*coordinates)} was already recorded by this writer (its file would "
                "be replaced); record each (step, inner_step, micro_batch) once, e.g. pass micro_batch= for each "
                "micro-batch of a step")
        self._recorded.add(coordinates)
        return coordinates, source_dtype

    def metadata(self, metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The JSON form of a step's metadata (None for none), checked: JSON-able, and a header of at most
        :data:`MAX_METADATA_BYTES` with the hyperparameters. Raises SchemaError."""
        # a non-JSON value raises here, on the caller's thread (the hyperparameters were checked once)
        encoded = self._metadata.encoded(metadata) if metadata else _NO_METADATA
        if encoded is not self._metadata_size[0]:  # the cache gives the same dict for the same metadata
            self._metadata_size = (encoded, self._hyperparameter_bytes + sum(len(k) + len(v) for k, v in encoded.items()))
        size = self._metadata_size[1]
        keys = len(encoded) + self._hyperparameter_keys + len(WRITER_KEYS)
        if keys > MAX_METADATA_KEYS:
            raise SchemaError(f"step metadata of {keys} keys (with the hyperparameters and the writer's own) exceeds "
                              f"{MAX_METADATA_KEYS} keys; readers refuse headers with that many: keep metadata to "
                              "hyperparameters and small values (a dict under one key counts as one)")
        if size > MAX_METADATA_BYTES:
            raise SchemaError(f"step metadata of {size} bytes exceeds {MAX_METADATA_BYTES} bytes; readers refuse "
                              "headers that large: keep metadata to hyperparameters and small values")
        return self._metadata.json_form(metadata) if metadata else None


def check_captured(tensors: Any, derive: Any, signature: tuple | None) -> None:
    """What :meth:`tracer.record.writer.TraceWriter.record_captured` checks before ``record``'s own
    checks: ``tensors`` a dict, ``derive`` a tuple of derivable field names
    (:data:`tracer.formulas.derived.DERIVED_FIELDS`), and a given ``signature`` naming the tensors'
    fields, shapes and dtypes in order (it stands in for the schema check of a signature seen
    before, so one that does not describe the tensors would let them through unchecked). Costs a
    few attribute reads per field. Raises TraceError (tensors, derive) or SchemaError (signature)."""
    if type(tensors) is not dict:
        raise TraceError(f"CapturedStep.tensors must be a dict of field name -> tensor, got {type(tensors).__name__}")
    if derive and (type(derive) is not tuple or not DERIVABLE.issuperset(derive)):
        raise TraceError(f"CapturedStep.derive must be a tuple of field names among {sorted(DERIVABLE)}, "
                         f"got {derive!r}")
    if signature is None:
        return
    try:
        if len(signature) != len(tensors):
            raise ValueError
        for entry, (name, t) in zip(signature, tensors.items()):
            if entry[0] != name or entry[1] != t.shape or entry[2] is not t.dtype:
                raise ValueError
    except (ValueError, TypeError, IndexError, AttributeError):
        raise SchemaError("CapturedStep.signature does not describe its tensors (the (name, shape, dtype, device) of "
                          "each, in order); pass signature=None to have the step checked in full") from None
