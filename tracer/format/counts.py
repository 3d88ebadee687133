"""``manifest.counts``: the manifest's live counts where a full disk cannot hide them.

The manifest is rewritten atomically (a temporary file, then a rename), which needs new blocks: on a
disk the trace's own step files filled to 0 bytes free it cannot be rewritten, and the copy on disk
keeps the counts of the last rewrite that fitted (``dropped_steps: 0``, status ``running``) while the
writer drops every later step. So the writer reserves this file when the trace starts (rank 0, next to
the manifest: :data:`COUNTS_BYTES` of real bytes, fsync'd, so its blocks are allocated) and, whenever a
manifest rewrite fails, writes the counts into it in place (``pwrite`` over those blocks: no new block
is needed, on a full disk as on any other).

Layout: two slots of :data:`SLOT_BYTES`; each holds one JSON object (``format``
``tracer-counts``, ``version`` 1, ``revision``, ``status``, ``steps_written``, ``dropped_steps``,
``skipped_steps``, ``drop_reasons``, ``manifest_error``: why the manifest could not be rewritten), a
newline, the SHA-256 of that JSON's bytes in hex, a newline, then spaces. A write replaces the slot with
the lower revision, so a write torn by a kill leaves the other slot whole. ``revision`` is
``time.time_ns()`` at the write, as the manifest's own ``revision`` key is: a reader takes the slot with
the highest revision and uses it only when it is newer than the manifest (:func:`newer_counts`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

COUNTS_NAME = "manifest.counts"
COUNTS_FORMAT = "tracer-counts"
SLOT_BYTES = 8192
COUNTS_BYTES = 2 * SLOT_BYTES
MAX_REASON_CHARS = 300  # one drop reason kept in a slot (the manifest keeps it whole)
COUNT_KEYS = ("status", "steps_written", "dropped_steps", "skipped_steps", "drop_reasons")


def reserve_counts(root: Path) -> None:
    """Create ``root/manifest.counts`` with :data:`COUNTS_BYTES` of spaces (no valid slot), fsync'd:
    its blocks are allocated now, while the disk has room. Raises OSError."""
    fd = os.open(root / COUNTS_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        _write_at(fd, b" " * COUNTS_BYTES, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _slot(body: dict[str, Any]) -> bytes:
    """One slot's bytes: the JSON, its SHA-256, spaces to :data:`SLOT_BYTES`. Reasons that do not fit
    are left out (the count stays whole)."""
    body = dict(body, drop_reasons=[r[:MAX_REASON_CHARS] for r in body.get("drop_reasons", [])])
    while True:
        text = json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")
        if len(text) + 66 <= SLOT_BYTES or not body["drop_reasons"]:
            break
        body["drop_reasons"] = body["drop_reasons"][:-1]
    data = text + b"\n" + hashlib.sha256(text).hexdigest().encode("ascii") + b"\n"
    return data[:SLOT_BYTES].ljust(SLOT_BYTES, b" ")


def write_counts(root: Path, body: dict[str, Any], fsync: bool = True) -> None:
    """Write ``body`` (the :data:`COUNT_KEYS`, ``revision``, ``manifest_error``) in place over the older
    slot of ``root/manifest.counts`` (a file :func:`reserve_counts` made: never created or grown here).
    An exclusive ``flock`` keeps the writer process and the training process off the same slot.
    Raises OSError (the file is missing, or the write failed)."""
    fd = os.open(root / COUNTS_NAME, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    try:
        try:
            import fcntl
            fcntl.flock(fd, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - not POSIX
            pass
        if os.fstat(fd).st_size < COUNTS_BYTES:
            raise OSError(f"{root / COUNTS_NAME} was not reserved ({COUNTS_BYTES} bytes)")
        slots = [_parse_slot(os.pread(fd, SLOT_BYTES, i * SLOT_BYTES)) for i in range(2)]
        older = min(range(2), key=lambda i: -1 if slots[i] is None else slots[i]["revision"])
        _write_at(fd, _slot({"format": COUNTS_FORMAT, "version": 1, **body}), older * SLOT_BYTES)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)  # releases the flock


def _write_at(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _parse_slot(raw: bytes) -> dict[str, Any] | None:
    """The slot's body when its checksum matches and its keys have their types, else None."""
    text, _, rest = raw.partition(b"\n")
    digest = rest.partition(b"\n")[0]
    if not text.startswith(b"{") or hashlib.sha256(text).hexdigest().encode("ascii") != digest:
        return None
    try:
        body = json.loads(text)
    except ValueError:
        return None
    ints = ("revision", "steps_written", "dropped_steps", "skipped_steps")
    if (not isinstance(body, dict) or body.get("format") != COUNTS_FORMAT
            or any(not isinstance(body.get(k), int) or isinstance(body.get(k), bool) or not 0 <= body[k] < 2**62
                   for k in ints)
            or len(body["status"] if isinstance(body.get("status"), str) else "") > 64
            or not isinstance(body.get("status"), str) or not isinstance(body.get("drop_reasons"), list)
            or not all(isinstance(r, str) for r in body["drop_reasons"])):
        return None
    return body


def read_counts(root: Path) -> dict[str, Any] | None:
    """The newest valid slot of ``root/manifest.counts``, or None (no file, never written, torn)."""
    path = root / COUNTS_NAME
    try:
        if not path.is_file() or path.stat().st_size > 4 * COUNTS_BYTES:
            return None
        with open(path, "rb") as fh:
            raw = fh.read(COUNTS_BYTES)
    except OSError:
        return None
    slots = [s for s in (_parse_slot(raw[i * SLOT_BYTES:(i + 1) * SLOT_BYTES]) for i in range(2)) if s]
    return max(slots, key=lambda s: s["revision"]) if slots else None


def newer_counts(root: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The counts of ``root/manifest.counts`` when they are newer than ``manifest`` (its ``revision``,
    0 when it has none), else None."""
    counts = read_counts(root)
    revision = manifest.get("revision")
    revision = revision if isinstance(revision, int) and not isinstance(revision, bool) else 0
    return counts if counts is not None and counts["revision"] > revision else None
