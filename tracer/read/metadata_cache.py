"""Step metadata decoded once per step file: :class:`MetadataCache`, an LRU of decoded headers keyed by
path and checked against the file's inode, size and modification time (a live run renames new files
into place; a file replaced under the same name is decoded again).

The reader, the checks' contexts, the KL and micro-batch checks and the run overview all ask for a
step's metadata, several times per file: decoding a header's metadata each time made a check pass over
a few files decode it dozens of times. The cache holds at most :data:`MAX_CACHED_CHARS` characters of
raw metadata (its keys and values, bounded per file by
:data:`tracer.format.integrity.MAX_METADATA_BYTES`), so its memory is bounded whatever the files hold.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

from tracer.format.metadata_codec import decode_metadata

MAX_CACHED_CHARS = 64 * 2**20  # raw metadata characters held in all; a real step's header holds a few KB


class MetadataCache:
    """Decoded step metadata by file, least recently used dropped first. ``decodes`` counts the
    decodes it made (what a test pins: one per file version)."""

    def __init__(self, max_chars: int = MAX_CACHED_CHARS) -> None:
        self._entries: collections.OrderedDict[Path, tuple[tuple, int, dict[str, Any]]] = collections.OrderedDict()
        self._chars = 0
        self.max_chars = max_chars
        self.decodes = 0

    def get(self, path: Path, handle: Any) -> dict[str, Any]:
        """The decoded metadata of the step file ``path``, open as ``handle`` (a ``safe_open`` handle);
        decoded from ``handle.metadata()`` only when not cached for this version of the file. The
        dict is shared: callers must not change it (``Trace.metadata`` hands out copies)."""
        stamp = _stamp(path)
        entry = self._entries.get(path)
        if entry is not None and stamp is not None and entry[0] == stamp:
            self._entries.move_to_end(path)
            return entry[2]
        raw = handle.metadata() or {}
        decoded = decode_metadata(raw)
        self.decodes += 1
        if stamp is not None:
            self._put(path, stamp, sum(len(k) + len(v) for k, v in raw.items()), decoded)
        return decoded

    def peek(self, path: Path) -> dict[str, Any] | None:
        """The decoded metadata of ``path`` when cached for the file's current version (one ``stat``,
        no open), else None. Shared, as :meth:`get`'s."""
        entry = self._entries.get(path)
        if entry is None:
            return None
        stamp = _stamp(path)
        if stamp is None or entry[0] != stamp:
            return None
        self._entries.move_to_end(path)
        return entry[2]

    def _put(self, path: Path, stamp: tuple, chars: int, decoded: dict[str, Any]) -> None:
        old = self._entries.pop(path, None)
        if old is not None:
            self._chars -= old[1]
        self._entries[path] = (stamp, chars, decoded)
        self._chars += chars
        while self._chars > self.max_chars and len(self._entries) > 1:
            _, (_, dropped, _) = self._entries.popitem(last=False)
            self._chars -= dropped


def _stamp(path: Path) -> tuple | None:
    """What tells one version of a file from another: inode, size, modification time (None: gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)
