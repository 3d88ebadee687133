"""A small step file made in memory: safetensors' layout of a field signature, learnt once from
safetensors' own ``serialize`` (:func:`image_layout`), then each step's file as its header and its
tensors' bytes joined (:func:`file_image`) and written with one ``write`` to a new file
(:func:`write_new`). Used by :func:`tracer.layout.save_atomic` for the steps of
:mod:`tracer.step_bytes` whose bytes fit :data:`tracer.layout.IMAGE_BYTES`.

Why (issue 16): the writer thread shares the interpreter lock with the training loop. Per step,
safetensors' ``serialize_file`` took a ``TensorSpec`` per field, a write per tensor, and a
``chmod`` (it creates 0600 files) and a ``stat`` (the index lists the size) after it; this makes
the header from the signature's entries and one JSON encoding of the metadata, creates the file
with the mode ``open()`` gives and knows its size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from safetensors import serialize


@dataclass(frozen=True)
class ImageLayout:
    """Where safetensors puts the tensors of one field signature in a file: the header's tensor
    entries (its JSON text, in its order) and the tensor names in the order of their bytes. Learnt
    once per signature from safetensors' own ``serialize`` (:func:`image_layout`), so a file made
    by :func:`file_image` has safetensors' layout without re-implementing it."""

    entries: str
    order: tuple[str, ...]


def image_layout(specs: dict[str, Any]) -> ImageLayout:
    """The :class:`ImageLayout` of tensors with these pointer specs (safetensors ``TensorSpec``)."""
    image = serialize(specs, metadata=None)
    size = int.from_bytes(image[:8], "little")
    text = image[8:8 + size].decode("utf-8").rstrip(" ")  # the header, less its padding
    header = json.loads(text)
    return ImageLayout(entries=text[1:-1], order=tuple(sorted(header, key=lambda k: header[k]["data_offsets"])))


_HEADER_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # as safetensors writes it


@dataclass(frozen=True)
class StepImage:
    """What :func:`tracer.layout.save_atomic` makes a small step file from (not pointer specs): the
    layout of its signature and its tensors' bytes (views, valid while the tensors live)."""

    layout: ImageLayout
    buffers: Mapping[str, Any]


def file_image(step: StepImage, metadata: Mapping[str, str]) -> bytes:
    """The bytes of the safetensors file holding ``step``'s tensors and header ``metadata``: the
    header length (8 bytes, little-endian), the header JSON (``__metadata__`` first, then the
    tensor entries, padded with spaces to a multiple of 8 bytes) and the tensors' bytes, as
    safetensors' ``serialize`` writes them (tested); one JSON encoding and one copy."""
    entries = step.layout.entries
    header = f'{{"__metadata__":{_HEADER_JSON(metadata)}{"," if entries else ""}{entries}}}'.encode("utf-8")
    header += b" " * (-len(header) % 8)
    buffers = step.buffers
    return b"".join([len(header).to_bytes(8, "little"), header, *[buffers[name] for name in step.layout.order]])


def write_new(path: str, data: bytes, fsync: bool) -> None:
    """Write ``data`` to a new file ``path`` (a stale one, left by a crash, is replaced: a file
    created here has the mode ``open()`` gives, never the stale one's)."""
    try:
        fh = open(path, "xb", buffering=0)
    except FileExistsError:
        os.unlink(path)
        fh = open(path, "xb", buffering=0)
    with fh:
        view = memoryview(data)
        while view:  # a raw write may write less than asked (a signal, a nearly full disk)
            view = view[fh.write(view):]
        if fsync:
            os.fsync(fh.fileno())
