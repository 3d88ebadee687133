"""The messages between the training process and its writer process (:mod:`tracer.record.process.parent`,
:mod:`tracer.record.process.child`): each a 4-byte little-endian length, then a body. A body is JSON
(configuration, layouts, counts, flush / close, results), or, for a step staged in the shared
ring, ``S`` and a fixed struct (:data:`STEP`) with the step's own metadata as JSON after it when it
has any: the message sent at every ``record`` costs no JSON encoding in the common case.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

FRAME = struct.Struct("<I")  # the length before each body
STEP = struct.Struct("<qqqqBIQ")  # seq, step, inner_step, micro_batch, sampled, layout, ring offset


def frame(message: dict[str, Any]) -> bytes:
    """A message as the pipes carry it: 4-byte little-endian length, then JSON."""
    body = json.dumps(message, allow_nan=True, default=repr).encode()
    return FRAME.pack(len(body)) + body


_last_metadata: list = [None, b""]  # the metadata object last encoded, and its JSON bytes


def step_frame(seq: int, coordinates: tuple[int, int, int], sampled: bool, layout: int, offset: int,
               metadata: dict[str, Any] | None) -> bytes:
    """The frame of a step in the ring: ``S``, :data:`STEP`'s fields, then its metadata's JSON (if any).
    ``metadata`` must not change once passed: the JSON of the object last passed is reused when the
    same object comes again (the writer passes one JSON form for as long as the metadata stays the
    same: :class:`tracer.record.validation.MetadataCache`)."""
    body = b"S" + STEP.pack(seq, *coordinates, sampled, layout, offset)
    if metadata:
        if _last_metadata[0] is not metadata:
            _last_metadata[:] = [metadata, json.dumps(metadata, allow_nan=True, default=repr).encode()]
        body += _last_metadata[1]
    return FRAME.pack(len(body)) + body


def parse_body(body: bytes) -> dict[str, Any]:
    """A frame's body as a message (:func:`frame`, :func:`step_frame`)."""
    if body[:1] != b"S":
        return json.loads(body)
    seq, step, inner_step, micro_batch, sampled, layout, offset = STEP.unpack_from(body, 1)
    message = {"k": "step", "q": seq, "c": (step, inner_step, micro_batch), "p": bool(sampled), "l": layout,
               "o": offset}
    if len(body) > 1 + STEP.size:
        message["x"] = json.loads(body[1 + STEP.size:])
    return message


def unframe(buffer: bytearray) -> list[dict[str, Any]]:
    """The complete messages at the head of ``buffer`` (removed from it)."""
    out, at = [], 0
    while len(buffer) - at >= 4:
        (size,) = FRAME.unpack_from(buffer, at)
        if len(buffer) - at - 4 < size:
            break
        out.append(json.loads(bytes(buffer[at + 4:at + 4 + size])))
        at += 4 + size
    del buffer[:at]
    return out


ALIGN = 64  # each tensor starts on a 64-byte boundary of the ring


def align(n: int) -> int:
    """``n`` rounded up to the next multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class RingLayout:
    """Where each tensor of one field signature lies in a step's region of the ring."""

    def __init__(self, ident: int, tensors: dict[str, torch.Tensor], source_dtype: str,
                 derive: tuple[str, ...] = ()) -> None:
        self.ident, self.fields, self.source_dtype, self.derive, at = ident, [], source_dtype, derive, 0
        for name, t in tensors.items():
            self.fields.append((name, t.dtype, tuple(t.shape), at, t.nbytes))
            at = align(at + t.nbytes)
        self.size = max(at, ALIGN)
        self.nbytes = sum(field[4] for field in self.fields)
        self.dense = all(field[4] for field in self.fields)  # every field holds bytes: each has a view

    def message(self) -> dict[str, Any]:
        return {"k": "layout", "id": self.ident, "size": self.size, "d": self.source_dtype, "v": list(self.derive),
                "fields": [[n, str(d).removeprefix("torch."), list(s), o, b] for n, d, s, o, b in self.fields]}
