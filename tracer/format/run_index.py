"""The run's summary index: one append-only JSON-lines file per rank at the trace root
(``summary_index.rank_N.jsonl``, SPEC.md section 5), so that a run overview of many steps reads
one file instead of one header per step file.

The writer thread appends one line per step file it has written, after the file's rename:

    {"format": "tracer-summary-index", "version": 1, "rank": 0, "writer": "5f0c..."}   (first line)
    {"file": "step_00000003.inner_0.mb_0.rank_0.safetensors", "step": 3, "inner_step": 0,
     "micro_batch": 0, "rank": 0, "size": 50312, "content_sha256": "9f...", "derived": [],
     "summary": {"version": 1, "kept_tokens": 412, "mean_ratio": 1.0, ...}}

``summary`` is the very JSON text stored under the header's ``summary`` key (:mod:`tracer.format.summary`),
``derived`` the fields the reader derives for that file (:func:`tracer.formulas.derived.derivable` of its
tensor names and decoded metadata), ``size`` its size in bytes. Lines are buffered and appended
at most every :data:`FLUSH_INTERVAL_S` seconds (and at ``flush()`` / ``close()``), never fsync'd:
the index is an accelerator, not a record. A step file is vouched for by the index only when its
name is listed, its coordinates agree and its size on disk is the size listed; everything else
(no index, an unknown format, a torn last line, a file not listed or of another size) is read from
its header as before (:meth:`tracer.read.reader.Trace.step_summary`). A file replaced by another of
exactly the same size is not detected here (``tracer check`` / ``info --verify`` compare bytes).

At close the index is also compacted into the rank's summary columns (:mod:`tracer.format.summary_store`,
``summary_index.rank_N.columns``): a reader that finds columns of the same writer token loads them
as arrays and parses only the lines written after them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

from tracer.format import summary_store
from tracer.format.names import SUMMARY_INDEX_GLOB, summary_index_name, summary_store_name
from tracer.format.metadata_codec import decode_metadata
from tracer.format.summary import SUMMARY_KEY, read_summary

log = logging.getLogger(__name__)

INDEX_FORMAT = "tracer-summary-index"
INDEX_VERSION = 1
FLUSH_INTERVAL_S = 1.0  # buffered lines are appended at most this often (and at flush / close)
MAX_INDEX_BYTES = 1 << 30  # a larger index file is ignored (the headers are read instead)
MIN_COMPACT_LINES = 4096  # a forced flush compacts the index into columns from this many new lines (each
# line is parsed once in the whole run, at a flush or at close: ~30-100 us a line on this machine)
COORDINATES = ("step", "inner_step", "micro_batch", "rank")


class IndexWriter:
    """Appends the index lines of one rank (the writer thread calls :meth:`add` after each step
    file is written and :meth:`flush` on its tick; ``TraceWriter.flush`` / ``close`` flush it too).

    Never raises: the first failure (directory gone, disk full) is logged once and the index is
    abandoned for the rest of the run, so later step files are simply not listed (readers read
    their headers). The file is created (truncated) when the writer starts: a writer for a rank
    starts only when that rank has no step files (``refuse_existing_trace``), so an older index of
    the rank lists nothing that still exists.

    At :meth:`close` (and at a forced :meth:`flush` once the index has grown by at least as many
    lines as the columns hold, and by :data:`MIN_COMPACT_LINES`) the index is compacted into the
    rank's summary columns (:mod:`tracer.format.summary_store`); a failure there is logged and leaves the
    index as the only accelerator.
    """

    def __init__(self, root: Path, rank: int, resume: bool = False) -> None:
        """``resume``: go on with the rank's index as another writer of this run left it (a writer
        process that died: :meth:`_resume`) instead of starting it again."""
        self.path = Path(root) / summary_index_name(rank)
        self.store_path = Path(root) / summary_store_name(rank)
        self.rank = rank
        self._lock = threading.Lock()
        # the token tells a reader that the file was started again (same inode, truncated, rewritten)
        self.token = uuid.uuid4().hex
        head = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "rank": rank, "writer": self.token}
        self._lines = [json.dumps(head) + "\n"]
        self._flushed_at = time.monotonic()
        self._fd: int | None = None
        self._failed = False
        self._written = 0  # bytes of the index written so far
        self._stored_bytes = self._stored_rows = self._unstored_lines = 0  # what the columns hold
        try:
            os.unlink(self.store_path)  # an older run's columns (another token: readers ignore them anyway)
        except OSError:
            pass
        if resume and self._resume():
            return
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
        except OSError as err:
            self._fail(err)
        self.flush()  # the first line at once: a reader then never mixes this run's lines with an older run's

    def _resume(self) -> bool:
        """Append to the index file as it is, under its writer token, when its first line is this
        format's (False: start it again). A torn last line (the other writer died appending it) is
        ended, so it stays one line that readers skip; lines that writer had not yet appended are
        missing (readers read those files' headers). The columns are compacted from the start."""
        try:
            with open(self.path, "rb") as fh:
                head = json.loads(fh.readline())
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                if size:
                    fh.seek(size - 1)
                    torn = fh.read(1) != b"\n"
            if head.get("format") != INDEX_FORMAT or head.get("version") != INDEX_VERSION:
                return False
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except (OSError, ValueError, AttributeError):
            return False
        self.token, self._lines, self._written = head["writer"], ["\n"] if torn else [], size
        return True

    def add(self, path: Path, derived: list[str], metadata: Mapping[str, str],
            decoded: Mapping[str, Any] | None = None, size: int | None = None) -> None:
        """Queue the line of step file ``path``, just written, whose fields ``derived`` the reader derives
        (:func:`tracer.formulas.derived.derivable` of its tensors and header), with the encoded
        header ``metadata`` (``tracer.format.metadata_codec.encode_metadata``'s ``{key: str}``); nothing when it
        holds no summary. ``decoded``: the same header as values, when the caller has it (the writer
        does), so it is not decoded again. ``size``: the file's size in bytes when the caller knows
        it (``tracer.format.files.save_atomic`` wrote it from memory), else it is read from the file."""
        if self._failed or SUMMARY_KEY not in metadata:
            return
        try:
            if decoded is None:
                decoded = decode_metadata({k: v for k, v in metadata.items() if k != SUMMARY_KEY})
            if size is None:
                size = os.stat(path).st_size
            head = {"file": path.name, **{k: decoded.get(k) for k in COORDINATES}, "size": size,
                    "content_sha256": decoded.get("content_sha256"),
                    "derived": list(derived)}
            line = json.dumps(head)[:-1] + f', "summary": {metadata[SUMMARY_KEY]}}}\n'
        except Exception as err:  # noqa: BLE001  (the index is an optimisation; the file is on disk)
            log.warning("tracer: %s not listed in %s (%s: %s)", path.name, self.path.name, type(err).__name__, err)
            return
        with self._lock:
            self._lines.append(line)
            self._unstored_lines += 1

    def flush(self, due_only: bool = False) -> None:
        """Append the queued lines (when ``due_only``, only if :data:`FLUSH_INTERVAL_S` has passed);
        a forced flush also compacts the index into columns when it has grown enough (see above)."""
        if due_only and time.monotonic() - self._flushed_at < FLUSH_INTERVAL_S:
            return
        with self._lock:
            self._append()
            if not due_only and self._unstored_lines >= max(MIN_COMPACT_LINES, self._stored_rows):
                self._compact()

    def _append(self) -> None:
        if not self._lines or self._fd is None:
            return
        data, self._lines = "".join(self._lines).encode(), []
        self._flushed_at = time.monotonic()
        try:
            while data:  # os.write may write less than asked (a signal, a nearly full disk)
                n = os.write(self._fd, data)
                self._written += n
                data = data[n:]
        except OSError as err:
            self._fail(err)

    def close(self) -> None:
        """Flush, compact the index into columns and close the file (idempotent)."""
        with self._lock:
            self._append()
            if self._unstored_lines:
                self._compact()
            self._close_fd()

    def _compact(self) -> None:
        """Rewrite the columns with the index lines written since they were last written (read
        back from the file: the writer keeps no copy). Never raises."""
        if self._fd is None or self._failed:
            return
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._stored_bytes)
                data = fh.read(self._written - self._stored_bytes)
            lines = data.split(b"\n")[:-1]
            if self._stored_bytes == 0:
                lines = lines[1:]  # the first line (format, writer token)
            old = summary_store.read_store(self.store_path) if self._stored_rows else None
            if self._stored_rows and (old is None or old.writer != self.token):
                self._stored_bytes = self._stored_rows = 0  # our columns are gone: compact from the start
                return self._compact()
            columns = summary_store.merged(old, summary_store.build_columns(_entries(lines).values()))
            if columns is not None:
                summary_store.write_store(self.store_path, columns, self.rank, self.token, self._written)
                self._stored_rows = len(columns)
            self._stored_bytes, self._unstored_lines = self._written, 0
        except Exception as err:  # noqa: BLE001  (the columns are an optimisation; the index is on disk)
            log.warning("tracer: summary columns %s not written (%s: %s); readers read the index instead",
                        self.store_path.name, type(err).__name__, err)
            self._unstored_lines = 0  # not retried at every flush

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _fail(self, err: OSError) -> None:
        if not self._failed:
            log.warning("tracer: the summary index %s is abandoned (%s); readers read the step headers instead",
                        self.path, err)
        self._failed = True
        self._lines = []
        self._close_fd()


# -- reading ----------------------------------------------------------------------------------------


def index_paths(root: Path) -> list[Path]:
    """The index files at a trace root, one per rank that wrote one, sorted (one listing of the root)."""
    return sorted(Path(root).glob(SUMMARY_INDEX_GLOB))


def read_index(paths: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """``{step file name: entry}`` from the index files ``paths`` (a later line for the same name
    wins); in each entry ``summary`` is :func:`tracer.format.summary.read_summary` of the stored one
    (None when this reader does not know it) and ``derived`` the derived field names joined by
    ", ". A file that cannot be read, is larger than :data:`MAX_INDEX_BYTES`, or whose first line
    is not this format and version gives nothing; a line that is not a complete JSON object of the
    expected types (the torn last line of a crash, or one a live writer is appending) is skipped."""
    entries: dict[str, dict[str, Any]] = {}
    for path in paths:
        state = _IndexFile()
        state.update(Path(path))
        entries.update(state.entries)
    return entries


class IndexReader:
    """The summary index files of one trace root, read again only where they grew: a live writer
    appends, and each call parses only the lines added since the last (a file started again by a
    new writer, truncated or replaced, is read whole). :meth:`entries` as :func:`read_index`, for
    the lines that the rank's summary columns (:mod:`tracer.format.summary_store`) do not hold: an index
    read from its start with columns of the same writer token that compact a prefix of it is read
    only after that prefix, and :meth:`columns` gives those rows."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._files: dict[str, _IndexFile] = {}
        self._signature: list[tuple] | None = None
        self._entries: dict[str, dict[str, Any]] = {}
        self._columns: summary_store.SummaryColumns | None = None

    def entries(self) -> dict[str, dict[str, Any]]:
        """``{step file name: entry}``; one listing of the root and one ``stat`` per index file
        when nothing changed."""
        paths, signature = [], []
        for path in index_paths(self.root):
            try:
                st = os.stat(path)
            except OSError:
                continue
            paths.append(path)
            signature.append((path.name, st.st_ino, st.st_size, st.st_mtime_ns))
        if signature == self._signature:
            return self._entries
        files = {}
        for path in paths:
            state = self._files.get(path.name) or _IndexFile()
            state.update(path)
            files[path.name] = state
        self._files, self._signature = files, signature
        self._entries, self._columns = {}, None
        for state in files.values():
            self._entries.update(state.entries)
            self._columns = summary_store.merged(self._columns, state.columns)
        return self._entries

    def columns(self) -> summary_store.SummaryColumns | None:
        """The rows of the summary columns used with the index files (every rank's, together), as
        of the last :meth:`entries`; a file :meth:`entries` lists is not to be taken from here."""
        return self._columns


class _IndexFile:
    """What has been read of one index file: its inode, first line, bytes consumed, entries, and
    the summary columns that stand for its first ``columns.index_bytes`` bytes (or None)."""

    def __init__(self) -> None:
        self.inode: int | None = None
        self.head = b""
        self.consumed = 0
        self.entries: dict[str, dict[str, Any]] = {}
        self.columns: summary_store.SummaryColumns | None = None

    def update(self, path: Path) -> None:
        try:
            with open(path, "rb") as fh:
                st = os.fstat(fh.fileno())
                if st.st_size > MAX_INDEX_BYTES:
                    log.info("tracer: summary index %s is over %d bytes; reading step headers", path, MAX_INDEX_BYTES)
                    self.__init__()
                    return
                if self.inode != st.st_ino or st.st_size < self.consumed or fh.read(len(self.head)) != self.head:
                    self.__init__()  # a new file, or one started again: read it whole
                    self.inode = st.st_ino
                if self.consumed == 0 and not self._start(path, fh, st.st_size):
                    return
                fh.seek(self.consumed)
                data = fh.read(MAX_INDEX_BYTES + 1 - self.consumed)
        except OSError as err:
            log.info("tracer: summary index %s not read (%s); reading step headers", path, err)
            self.__init__()
            return
        end = data.rfind(b"\n") + 1  # what follows the last newline is torn or being written
        self.consumed += end
        self.entries.update(_entries(data[:end].split(b"\n")[:-1]))

    def _start(self, path: Path, fh: Any, size: int) -> bool:
        """Read the first line (False when it is incomplete, or not this format and version: the
        headers are read) and take the rank's columns when they compact a prefix of this file."""
        first = fh.readline(1 << 16)
        head = _parse(first) if first.endswith(b"\n") else {}
        if head.get("format") != INDEX_FORMAT or head.get("version") != INDEX_VERSION:
            return False
        self.head, self.consumed = first, len(first)
        rank, token = head.get("rank"), head.get("writer")
        if not _count(rank) or not isinstance(token, str):
            return True
        columns = summary_store.read_store(path.with_name(summary_store_name(rank)))
        if columns is None or columns.writer != token or not len(first) <= columns.index_bytes <= size:
            return True
        fh.seek(columns.index_bytes - 1)
        if fh.read(1) == b"\n" and (columns.coordinates[:, 3] == rank).all():  # the end of a line
            self.columns, self.consumed = columns, columns.index_bytes
        return True


def _entries(lines: list[bytes]) -> dict[str, dict[str, Any]]:
    """The well-formed entries of complete index lines, as the reader uses them (the summary
    checked as a header's would be, derived fields as text)."""
    try:  # one parse of all lines is a third cheaper than one per line; any bad line: one at a time
        parsed = json.loads(b"[" + b",".join(lines) + b"]") if lines else []
    except (ValueError, RecursionError):
        parsed = [_parse(raw) for raw in lines]
    out = {}
    for entry in parsed:
        if isinstance(entry, dict) and _well_formed(entry):
            entry["summary"] = read_summary(entry)
            entry["derived"] = ", ".join(entry["derived"])
            out[entry["file"]] = entry
    return out


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, hostile nesting
        return {}
    return value if isinstance(value, dict) else {}


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62


def _well_formed(entry: dict[str, Any]) -> bool:
    derived = entry.get("derived")
    return (isinstance(entry.get("file"), str) and all(_count(entry.get(k)) for k in (*COORDINATES, "size"))
            and isinstance(derived, list) and all(isinstance(d, str) for d in derived)
            and isinstance(entry.get("summary"), dict))


def vouched(entry: Mapping[str, Any] | None, coordinates: tuple[int, int, int, int], size: int) -> bool:
    """True when index ``entry`` describes a step file of these ``(step, inner_step, micro_batch,
    rank)`` and this ``size`` in bytes (the cheap check that the listed file is the file on disk)."""
    return (entry is not None and entry["size"] == size
            and tuple(entry[k] for k in COORDINATES) == tuple(coordinates))


def summary_row(index: Mapping[str, dict[str, Any]], key: Any, steps_folder: str) -> dict[str, Any] | None:
    """The ``step_summary()`` columns of step file ``key`` (a :class:`tracer.read.reader.StepKey`) from
    ``index`` (the summary, ``summary_source = "header"``, ``derived``), or None when the index does
    not vouch for the file: not listed, listed under other coordinates, not in ``steps_folder``, of
    another size on disk now, or with a summary this reader does not know."""
    entry = index.get(key.path.name)
    if (entry is None or entry["summary"] is None or entry["step"] != key.step
            or entry["inner_step"] != key.inner_step or entry["micro_batch"] != key.micro_batch
            or entry["rank"] != key.rank or os.path.dirname(str(key.path)) != steps_folder):
        return None
    try:
        if os.stat(key.path).st_size != entry["size"]:
            return None
    except OSError:
        return None
    return {**entry["summary"], "summary_source": "header", "derived": entry["derived"]}
