"""The content checksum of a step (``content_sha256`` in its header): sha256 over each tensor's name,
dtype, shape and raw bytes in name order, computed from tensors when a step is written and from a
file's bytes when it is verified."""

from __future__ import annotations

import ctypes
import hashlib
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch


def digest_head(name: str, torch_dtype: str, shape: list[int]) -> bytes:
    """What :func:`content_sha256` hashes before a tensor's bytes: its name, dtype and shape."""
    return f"{name}\0{torch_dtype}\0{list(shape)}\0".encode()


def _digest_tensor_head(digest: Any, name: str, torch_dtype: str, shape: list[int]) -> None:
    digest.update(digest_head(name, torch_dtype, shape))


def content_sha256(tensors: Mapping[str, torch.Tensor], buffers: Mapping[str, Any] | None = None) -> str:
    """sha256 over each tensor's name, dtype, shape and raw bytes, in name order.

    Stored in step metadata as ``content_sha256`` (a safetensors header cannot hold a hash of the
    file that contains it). :func:`stored_content_sha256` recomputes it from a file's bytes; diff,
    ``check`` (``integrity.checksum``) and ``info --verify`` compare the two
    (``tracer.format.integrity.verify_step_file``). Tensors must be contiguous and on CPU, as
    the writer stores them. ``buffers``: their :func:`tensor_bytes`, when the caller has
    them already.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        _digest_tensor_head(digest, name, str(tensor.dtype), list(tensor.shape))
        digest.update(buffers[name] if buffers is not None else tensor_bytes(tensor))
    return digest.hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> Any:
    """The raw bytes of a contiguous CPU tensor as a buffer (no copy): a ctypes view of its memory,
    valid while ``tensor`` lives. Reading it makes no call into torch (no interpreter-lock hand-off
    per tensor, which is what a small step's checksum used to cost). Raises ValueError for a
    non-contiguous or non-CPU tensor."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"tensor_bytes needs a contiguous CPU tensor, got {tensor.device.type}, "
                         f"contiguous={tensor.is_contiguous()}")
    nbytes = tensor.nbytes
    if nbytes == 0:
        return b""
    return (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())


# safetensors dtype names -> str(torch dtype), as content_sha256 hashes them (``torch.float32``...;
# written out: verifying a file's bytes does not import torch).
_TORCH_DTYPE_NAMES = {name: f"torch.{attr}" for name, attr in {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
}.items()}
HASH_CHUNK_BYTES = 4 * 2**20  # bytes read at a time when hashing a stored tensor (bounded memory)


def stored_content_sha256(fh: Any, header: Mapping[str, Any], data_start: int, file_size: int) -> str:
    """:func:`content_sha256` of the tensors stored in an open safetensors file, from its bytes.

    Args:
        fh: the file, opened in binary mode.
        header: its parsed JSON header (``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": ...}``).
        data_start: where the tensor data begins (8 + header length).
        file_size: the file's size in bytes.
    Returns:
        The hex digest, read ``HASH_CHUNK_BYTES`` at a time (safetensors stores little-endian bytes,
        which are what ``content_sha256`` hashed on the little-endian machines tracer runs on).
    Raises:
        ValueError: a tensor entry that is malformed or points outside the file (the message says which).
    """
    digest = hashlib.sha256()
    for name in sorted(k for k in header if k != "__metadata__"):
        entry = header[name]
        try:
            dtype, shape, (begin, end) = _TORCH_DTYPE_NAMES[entry["dtype"]], list(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"tensor {name!r}: malformed header entry ({type(err).__name__}: {err})") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= file_size - data_start):
            raise ValueError(f"tensor {name!r}: data_offsets {[begin, end]} lie outside the file's "
                             f"{file_size - data_start} data bytes")
        _digest_tensor_head(digest, name, dtype, shape)
        fh.seek(data_start + begin)
        left = end - begin
        while left:
            chunk = fh.read(min(left, HASH_CHUNK_BYTES))
            if not chunk:
                raise ValueError(f"tensor {name!r}: the file ends {left} bytes before the tensor does")
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()
