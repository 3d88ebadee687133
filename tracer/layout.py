"""The on-disk layout of a trace (SPEC.md section 5): file names, the manifest and token strings,
atomic JSON, the content checksum. Shared by the writer (which produces it) and the reader.

    manifest.json          run-level facts (schema version, algorithm, producers, tokenizer, config, status)
    tokens.json            {"tokens": [text of id 0, text of id 1, ...]}, stored once per trace
    steps/step_00000003.inner_0.mb_0.rank_0.safetensors
    summary_index.rank_0.jsonl   one JSON line per step file written by rank 0: its name, size,
                           coordinates and summary (an accelerator for run overviews; tracer.run_index)
    capture_report.rank_0.json   zero-edit tracing only: what rank 0's watcher captured (tracer.capture_report)
    summary_index.rank_0.columns  the same, compacted into columns at close (safetensors format; tracer.summary_store)
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import re
import sys
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import serialize, serialize_file
from safetensors.torch import save_file

try:  # safetensors >= 0.7: serialise from raw pointers
    from safetensors import TensorSpec
except ImportError:  # pragma: no cover - older safetensors
    TensorSpec = None

from tracer.errors import TraceError

MANIFEST_NAME = "manifest.json"
TOKENS_NAME = "tokens.json"
STEPS_DIR = "steps"
FORMAT_NAME = "tracer-trace"
SUMMARY_INDEX_GLOB = "summary_index.rank_*.jsonl"
CAPTURE_REPORT_GLOB = "capture_report.rank_*.json"
# A step file named by its coordinates (what step_file_name writes; any number of digits).
STEP_FILE_RE = re.compile(r"^step_([0-9]+)\.inner_([0-9]+)\.mb_([0-9]+)\.rank_([0-9]+)\.safetensors$")


def step_file_name(step: int, inner_step: int = 0, micro_batch: int = 0, rank: int = 0) -> str:
    """The file name of one step file, sortable by step."""
    return f"step_{step:08d}.inner_{inner_step}.mb_{micro_batch}.rank_{rank}.safetensors"


def step_label(step: int, inner_step: int = 0, micro_batch: int = 0) -> str:
    """``step 3``, ``step 3, inner step 1``, ``step 3, inner step 1, micro-batch 2``: the coordinates of
    one step file as messages name it (the parts that are 0 left out)."""
    return (f"step {step}" + (f", inner step {inner_step}" if inner_step else "")
            + (f", micro-batch {micro_batch}" if micro_batch else ""))


def summary_index_name(rank: int = 0) -> str:
    """The file name of one rank's summary index at the trace root (:mod:`tracer.run_index`)."""
    return f"summary_index.rank_{rank}.jsonl"


def capture_report_name(rank: int = 0) -> str:
    """The file name of one rank's capture report at the trace root (:mod:`tracer.capture_report`)."""
    return f"capture_report.rank_{rank}.json"
def summary_store_name(rank: int = 0) -> str:
    """The file name of one rank's summary columns at the trace root (:mod:`tracer.summary_store`)."""
    return f"summary_index.rank_{rank}.columns"


def listed_step_files(folder: Path) -> list[Path]:
    """The ``*.safetensors`` entries of ``folder`` (one ``os.listdir``), sorted by name; [] when it
    cannot be listed."""
    try:
        names = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    except OSError:
        return []
    # CPython's pathlib (3.10-3.12) joins a name read from the folder without parsing it again:
    # a quarter of the cost of ``folder / name`` (10,000 step files: 2.6 ms instead of 9.4)
    child = getattr(folder, "_make_child_relpath", None)
    return [child(name) for name in names] if child is not None else [folder / name for name in names]


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
    (``tracer.integrity.verify_step_file``). Tensors must be contiguous and on CPU, as
    ``validate_tensors`` returns them. ``buffers``: their :func:`tensor_bytes`, when the caller has
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


# safetensors dtype names -> str(torch dtype), as content_sha256 hashes them.
_TORCH_DTYPE_NAMES = {name: str(getattr(torch, attr)) for name, attr in {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
}.items() if hasattr(torch, attr)}
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


def write_json_atomic(path: Path, payload: Any, tmp_name: str | None = None) -> None:
    """Write JSON to ``path`` through a temporary file (``tmp_name``, default ``<name>.partial``, in
    the same directory) and a rename (never a half-written file)."""
    tmp = path.with_name(tmp_name or path.name + ".partial")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=1, ensure_ascii=False, default=repr)  # non-JSON config values: repr
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:  # a full disk must not also keep the half-written bytes
            os.unlink(tmp)
        except OSError:
            pass
        raise


def token_strings(tokenizer: Any) -> list[str]:
    """Text of every token id of ``tokenizer`` (a transformers tokenizer or a ``tokenizers.Tokenizer``).

    Each id is decoded on its own with special tokens kept, so ``tokens[i]`` is what id i shows as.
    """
    if hasattr(tokenizer, "batch_decode"):  # transformers PreTrainedTokenizer(Fast)
        n = len(tokenizer)
        return tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
    if hasattr(tokenizer, "decode_batch"):  # tokenizers.Tokenizer
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        return tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    raise TraceError(
        f"tokenizer of type {type(tokenizer).__name__} has neither batch_decode nor decode_batch; "
        "pass a transformers tokenizer or a tokenizers.Tokenizer"
    )


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """Class, name and special token ids of ``tokenizer`` (kept in the manifest)."""
    ident: dict[str, Any] = {"class": type(tokenizer).__name__}
    for key in ("name_or_path", "eos_token_id", "pad_token_id", "bos_token_id", "padding_side"):
        value = getattr(tokenizer, key, None)
        if isinstance(value, (str, int)):
            ident[key] = value
    return ident


def producers() -> dict[str, str]:
    """Versions of the packages that produced a trace, and the CPU kernels torch computes with.

    ``cpu_kernels`` is ``torch.backends.cpu.get_cpu_capability()`` (``AVX512``, ``AVX2``,
    ``DEFAULT``...: the vector width of ATen's CPU kernels on this machine, or what
    ``ATEN_CPU_CAPABILITY`` pinned) and ``mkl_cbwr`` the ``MKL_CBWR`` code path when one is pinned.
    float32 results differ in the last bits between kernel paths, and training amplifies that, so
    ``tracer diff`` says when two traces differ in them (docs/regression-testing.md).
    """
    versions = {"python": platform.python_version()}
    for pkg in ("tracer", "torch", "transformers", "trl", "safetensors"):
        try:
            versions[pkg] = importlib_metadata.version(pkg)
        except importlib_metadata.PackageNotFoundError:
            pass
    try:
        versions["cpu_kernels"] = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # a torch too old to say: the trace just does not record it
        pass
    if os.environ.get("MKL_CBWR"):
        versions["mkl_cbwr"] = os.environ["MKL_CBWR"]
    return versions


def refuse_existing_trace(out_dir: str | os.PathLike, rank: int | None = None) -> None:
    """Raise TraceError when ``out_dir`` already holds step files (of ``rank``, or of any rank when
    None): nothing the user had is overwritten. Checking only the own rank's files lets ranks
    start in any order."""
    steps_dir = Path(out_dir) / STEPS_DIR
    pattern = "*.safetensors" if rank is None else f"*.rank_{rank}.safetensors"
    if steps_dir.is_dir() and any(steps_dir.glob(pattern)):
        raise TraceError(
            f"{out_dir} already holds a trace ({steps_dir} has step files); "
            "choose a new output directory or move the old trace away"
        )


def lock_rank(out_dir: str | os.PathLike, rank: int) -> int | None:
    """Take the writer lock of (trace, rank): an exclusive ``flock`` on ``.writer.rank_N.lock``,
    released by :func:`unlock_rank` or when the process dies (no stale locks after a crash).

    Returns the lock's file descriptor (None where ``fcntl`` does not exist).
    Raises:
        TraceError: another writer (in this or another process) holds it.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, as before
        return None
    path = Path(out_dir) / f".writer.rank_{rank}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        raise TraceError(
            f"{out_dir}: another writer is already writing rank {rank} of this trace ({path} is locked); "
            "give each run its own output directory (and each process its own rank)") from err
    return fd


def unlock_rank(fd: int | None, out_dir: str | os.PathLike | None = None, rank: int = 0) -> None:
    """Release a lock taken by :func:`lock_rank` (idempotent for None); with ``out_dir``, also remove
    the lock file so a finished trace holds only its own files."""
    if fd is None:
        return
    if out_dir is not None:
        try:
            os.unlink(Path(out_dir) / f".writer.rank_{rank}.lock")
        except OSError:
            pass
    try:
        os.close(fd)  # closing the descriptor releases the flock
    except OSError:
        pass


def _new_file_mode() -> int:
    """0o666 less the process umask (what ``open()`` gives a new file), read without changing the
    umask (``os.umask`` would race with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            umask = next(int(line.split()[1], 8) for line in fh if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = 0o022
    return 0o666 & ~umask


_FILE_MODE = _new_file_mode()
IMAGE_BYTES = 2**20  # a step file up to this size is made in memory and written at once (save_atomic)


def _remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy tensors that share storage with an earlier one (safetensors refuses shared memory, and
    two fields being the same tensor, e.g. old aliasing policy, is exactly what a trace must show)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else -1
        out[name] = tensor.clone() if ptr in seen else tensor
        if ptr != -1:
            seen.add(ptr)
    return out


def _tensor_specs(tensors: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """safetensors' pointer specs of ``tensors`` (CPU, contiguous, non-empty, little-endian host),
    or None when one does not qualify (or safetensors predates ``TensorSpec``): then the caller uses
    ``save_file``. The specs cost no copy and no call into torch beyond ``data_ptr``, so writing a
    small step takes the interpreter lock a few times instead of a few per tensor."""
    if TensorSpec is None or sys.byteorder != "little":
        return None
    specs = {}
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            return None
        specs[name] = TensorSpec(dtype=str(t.dtype)[6:], shape=tuple(t.shape), data_ptr=t.data_ptr(), data_len=t.nbytes)
    return specs


def write_new(path: str, data: bytes, fsync: bool) -> None:
    """Write ``data`` to a new file ``path`` (a stale one, left by a crash, is replaced: a file
    created here has mode 0666 less the umask, what ``open()`` gives, never the stale one's). Plain
    ``os`` calls: open, write, close (``open()`` adds an ``fstat``; each system call lets the
    interpreter lock go, and the training thread waits to take it back)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, flags, 0o666)
    try:
        view = memoryview(data)
        while view:  # a write may write less than asked (a signal, a nearly full disk)
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def save_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                specs: dict[str, Any] | None = None, fsync: bool = True) -> int | None:
    """Write a safetensors file to ``<path>.partial``, then rename: the file appears complete or
    not at all. With ``fsync`` the file is flushed to the device before the rename, so it also
    survives a power loss once renamed; without, it survives a crash or kill of the process (the
    kernel holds the bytes) and reaches the device with the kernel's writeback. ``tensors`` must not
    share storage (:func:`unshare`) and must stay alive during the call. ``specs``: their pointer
    specs when the caller made them already (:mod:`tracer.step_bytes`).

    A step of up to :data:`IMAGE_BYTES` is made in memory by safetensors' ``serialize`` (from
    pointer specs) and written with one ``write`` (:func:`write_new`) to a file created with mode 0666 less the umask (what ``open()`` gives, so
    others can read a shared trace); a larger one is streamed by ``serialize_file`` from the
    tensors' memory (no copy), which creates 0600 files, so it is then given that mode; tensors
    the pointer specs cannot describe go through ``save_file``. Returns the file's size in bytes
    when it was made in memory, else None. Raises OSError (the partial file is removed)."""
    tmp = os.fspath(path) + ".partial"
    try:
        specs = specs if specs is not None else _tensor_specs(tensors)
        if specs is not None and sum(spec.data_len for spec in specs.values()) <= IMAGE_BYTES:
            image = serialize(specs, metadata=metadata)
            write_new(tmp, image, fsync)
            os.replace(tmp, path)
            return len(image)
        if specs is None:
            save_file(tensors, tmp, metadata=metadata)
        else:
            serialize_file(specs, tmp, metadata=metadata)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fchmod(fd, _FILE_MODE)  # safetensors creates 0600 files; others must read a shared trace
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)  # a full disk must not also keep the half-written bytes
        raise
    return None
