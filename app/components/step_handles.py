"""Open step files kept open between script runs: a bounded LRU of ``safe_open`` handles shared by
every session of the app (one per process, through ``st.cache_resource``).

A handle is keyed by the file's identity (path, inode, size, modification time in ns), taken with
one ``stat`` on every lease: a step file rewritten under the same name (a new inode, size or
mtime) gets a new handle and the old one is closed, so a rewritten file is never served stale.
Two bounds: the number of open handles and the total size of the files they hold open. Each
handle memory-maps its file: the pages a read touches (and the kernel's fault-around, 64 KB about
each) count in the server's RSS as file-backed pages, shared with the page cache and reclaimable,
not in its heap; so the byte bound caps that part of the RSS. The least recently used handle is
closed when a new one would exceed either bound (one handle always stays, however large). A handle in use by another script run (another session's thread) when it is
evicted is closed when that run gives it back: leases are counted, so a read never meets a closed
file. safetensors' ``safe_open`` reads are safe from several threads at once (it reads an mmap).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from tracer.format.integrity import open_step_file

FileId = tuple[str, int, int, int]  # (path, inode, size, mtime_ns)


def file_id(path: str | os.PathLike) -> FileId:
    """The identity of the file at ``path``: (path, inode, size, mtime_ns). Raises OSError when it is gone."""
    st = os.stat(path)
    return str(path), st.st_ino, st.st_size, st.st_mtime_ns


def open_numpy(path: Path) -> Any:
    """:func:`tracer.format.integrity.open_step_file` for numpy (``framework="np"``): the handle
    :meth:`tracer.read.Trace.load_step` reads numpy arrays from (torch tensors made from them
    without a copy when a caller asks for tensors; bfloat16 and float8 fields read through torch)."""
    return open_step_file(path, framework="np")


@dataclass
class _Entry:
    handle: Any
    size: int
    users: int = 0
    evicted: bool = False
    notes: dict[str, Any] = field(default_factory=dict)  # per-handle memo (e.g. its header was checked)


class StepHandles:
    """At most ``max_handles`` open step files of at most ``max_bytes`` together, least recently
    used closed first.

    Args:
        max_handles: the bound on open handles (>= 1).
        max_bytes: the bound on the summed size of the open files (the most recent one is kept
            even when it alone is larger).
        opener: opens one file and returns a handle with ``__exit__`` (default
            :func:`open_numpy`: bounds, element budget, then ``safe_open`` for numpy, as the reader
            opens its files: a handle for torch would import torch at its first open).

    Raises:
        ValueError: ``max_handles`` < 1.
    """

    def __init__(self, max_handles: int = 64, max_bytes: int = 2**30,
                 opener: Callable[[Path], Any] | None = None) -> None:
        if max_handles < 1:
            raise ValueError(f"max_handles must be >= 1, got {max_handles}")
        self.max_handles = max_handles
        self.max_bytes = max_bytes
        self.open_bytes = 0  # summed size of the files open here
        self._opener = opener or open_numpy
        self._lock = threading.Lock()
        self._entries: OrderedDict[FileId, _Entry] = OrderedDict()
        self._by_handle: dict[int, _Entry] = {}  # id(handle) -> entry, for the handles open here
        self.opened = 0  # counters, for tests and the benchmark
        self.closed = 0

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.contextmanager
    def lease(self, path: str | os.PathLike) -> Iterator[Any]:
        """The open handle of the file at ``path`` for the duration of a ``with`` block (never call
        its ``__exit__``). Raises what the opener raises (TraceFormatError for an unreadable step
        file; an unreadable file is not cached), OSError when the file is gone."""
        try:
            key = file_id(path)
        except OSError:  # gone, or no permission: the opener raises its own TraceFormatError
            with self._opener(Path(path)) as handle:  # (and should the file be back, it is read uncached)
                yield handle
            return
        entry = self._acquire(key, Path(path))
        try:
            yield entry.handle
        finally:
            with self._lock:
                entry.users -= 1
                if entry.evicted and entry.users == 0:
                    self._close(entry)

    def notes(self, handle: Any) -> dict[str, Any] | None:
        """The memo dict of a handle open here (None for another handle): lives as long as the handle."""
        entry = self._by_handle.get(id(handle))
        return None if entry is None or entry.handle is not handle else entry.notes

    def _acquire(self, key: FileId, path: Path) -> _Entry:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                entry.users += 1
                return entry
        handle = self._opener(path)  # outside the lock: another session's reads go on meanwhile
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:  # another thread opened it meanwhile: use that one
                handle.__exit__(None, None, None)
            else:
                entry = _Entry(handle, size=key[2])
                self.opened += 1
                for old in [k for k in self._entries if k[0] == key[0]]:  # the same path, rewritten
                    self._evict(old)
                self._entries[key] = entry
                self._by_handle[id(handle)] = entry
                self.open_bytes += entry.size
                while len(self._entries) > 1 and (len(self._entries) > self.max_handles
                                                  or self.open_bytes > self.max_bytes):
                    self._evict(next(iter(self._entries)))
            entry.users += 1
            return entry

    def _evict(self, key: FileId) -> None:
        entry = self._entries.pop(key)
        self.open_bytes -= entry.size
        entry.evicted = True
        if entry.users == 0:
            self._close(entry)

    def _close(self, entry: _Entry) -> None:
        self._by_handle.pop(id(entry.handle), None)
        entry.handle.__exit__(None, None, None)
        self.closed += 1

    def clear(self) -> None:
        """Close every handle not in use now (those in use close when given back)."""
        with self._lock:
            for key in list(self._entries):
                self._evict(key)
