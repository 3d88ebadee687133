"""Writing a trace's files safely: atomic JSON and step files (a temporary name, then a rename, so a
file appears complete or not at all), the mode new files get, and the per-rank writer lock that
keeps two writers off one rank of a trace."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import serialize, serialize_file

if TYPE_CHECKING:
    import torch

try:  # safetensors >= 0.7: serialise from raw pointers
    from safetensors import TensorSpec
except ImportError:  # pragma: no cover - older safetensors
    TensorSpec = None

from tracer.errors import TraceError
from tracer.format.names import FORMAT_NAME, MANIFEST_NAME, STEPS_DIR, TOKENS_NAME


def write_json_atomic(path: Path, payload: Any, tmp_name: str | None = None) -> None:
    """Write JSON to ``path`` through a temporary file (``tmp_name``, default ``<name>.partial``, in
    the same directory) and a rename (never a half-written file). UTF-8; a string UTF-8 cannot hold
    (a lone surrogate: a token's bytes decoded with ``surrogateescape``) makes the whole file ASCII
    with JSON ``\\u`` escapes, which JSON readers turn back into the same string."""
    tmp = path.with_name(tmp_name or path.name + ".partial")
    text = json.dumps(payload, indent=1, ensure_ascii=False, default=repr)  # non-JSON config values: repr
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (bytes decoded with surrogateescape): JSON escapes instead
        data = json.dumps(payload, indent=1, ensure_ascii=True, default=repr).encode("ascii")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:  # a full disk must not also keep the half-written bytes
            os.unlink(tmp)
        except OSError:
            pass
        raise


def refuse_existing_trace(out_dir: str | os.PathLike, rank: int | None = None) -> None:
    """Raise TraceError when ``out_dir`` already holds step files (of ``rank``, or of any rank when
    None), or a ``manifest.json`` / ``tokens.json`` that is not a tracer trace's (the user's own files,
    which the trace's would replace): nothing the user had is overwritten. Checking only the own
    rank's files lets ranks start in any order; a trace's own manifest (another rank's, or a run that
    stopped before its first step) is no obstacle."""
    steps_dir = Path(out_dir) / STEPS_DIR
    pattern = "*.safetensors" if rank is None else f"*.rank_{rank}.safetensors"
    if steps_dir.is_dir() and any(steps_dir.glob(pattern)):
        raise TraceError(
            f"{out_dir} already holds a trace ({steps_dir} has step files); "
            "choose a new output directory or move the old trace away"
        )
    manifest, tokens = Path(out_dir) / MANIFEST_NAME, Path(out_dir) / TOKENS_NAME
    ours = manifest.is_file() and _is_trace_manifest(manifest)
    for path in (manifest, tokens):  # a file of the user's own that a trace's would overwrite
        if path.is_file() and not ours:
            why = f'has no "format": "{FORMAT_NAME}"' if manifest.is_file() else "is missing"
            raise TraceError(
                f"{out_dir} holds a {path.name} that is not a tracer trace's (its manifest.json {why}); "
                f"the trace would overwrite {path}: choose a new output directory or move that file away")


def _is_trace_manifest(path: Path) -> bool:
    """Whether ``path`` is the manifest of a tracer trace (``"format": "tracer-trace"``): read with a
    size bound; an unreadable or foreign file is not."""
    try:
        if path.stat().st_size > 16 * 2**20:
            return False
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT_NAME


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


FILE_MODE = _new_file_mode()
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
    specs when the caller made them already (:mod:`tracer.record.step_bytes`).

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
            from safetensors.torch import save_file  # the writer's path: torch is imported already

            save_file(tensors, tmp, metadata=metadata)
        else:
            serialize_file(specs, tmp, metadata=metadata)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fchmod(fd, FILE_MODE)  # safetensors creates 0600 files; others must read a shared trace
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)  # a full disk must not also keep the half-written bytes
        raise
    return None
