"""The run's summary columns: a binary, columnar copy of a prefix of one rank's summary index
(``summary_index.rank_N.columns`` at the trace root, a safetensors file under a name no reader
lists as a step file; SPEC.md section 5), so that a run overview
of N steps loads a few arrays instead of parsing N JSON lines and building N dicts.

The JSON-lines index (:mod:`tracer.format.run_index`) stays the record of what the writer listed (it is
appended after every step file, crash-safe line by line); the columns are a compaction of its first
``index_bytes`` bytes, written by the writer thread at ``close()`` (and at a forced ``flush()`` once
the index has grown by as many lines as the columns hold: each line is converted about twice in all),
to a temporary name and renamed. One safetensors file (raw tensors and JSON metadata only), tensors:

    coordinates   int64 [N, 4]   step, inner_step, micro_batch, rank of each listed step file
    size          int64 [N]      its size in bytes when written
    name          uint8 [N, W]   its file name, UTF-8, zero-padded to the longest (W bytes)
    content_sha256 uint8 [N, 32] its content checksum (zeros when the line held none)
    derived       int32 [N]      index into the metadata's ``derived`` list of texts ("ratio, ...")
    values        float64 [N, K] each summary key (metadata ``keys``, in :func:`tracer.format.summary.ordered_keys` order)
    present       bool [N, K]    whether the step's summary holds that key (a NaN value is present)

and metadata ``format``, ``version``, ``rank``, ``writer`` (the index's writer token: columns of
another writer are ignored), ``index_bytes`` (the length of the index they compact), ``keys``,
``derived`` (JSON lists). A reader uses them only with the index they came from (same writer token,
the index at least ``index_bytes`` long) and parses only the index lines after ``index_bytes``; each
row then vouches for a step file exactly as its index line would (name, coordinates, current size).
A line whose summary this code does not know, or whose counts are beyond 2**53, is left out of the
columns (its file is read from its header, as its line would be).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from tracer.format import summary as summary_format
from tracer.format.files import FILE_MODE as _FILE_MODE

log = logging.getLogger(__name__)

STORE_FORMAT = "tracer-summary-columns"
STORE_VERSION = 2  # the summary's version is not stored per row: bumped with summary.SUMMARY_VERSION
MAX_STORE_BYTES = 1 << 31  # larger columns are ignored (the index is read instead)
MAX_NAME_BYTES = 255
EXACT_COUNT = 2**53  # a count at or beyond this is not exact in float64: its row is left out


@dataclass(frozen=True)
class SummaryColumns:
    """The columns of one rank's store, as arrays (see the module docstring for each)."""

    names: np.ndarray  # str_ [N] (numpy 'U' dtype)
    coordinates: np.ndarray  # int64 [N, 4]
    size: np.ndarray  # int64 [N]
    content_sha256: np.ndarray  # uint8 [N, 32]
    derived: np.ndarray  # int32 [N]
    derived_texts: tuple[str, ...]
    keys: tuple[str, ...]
    values: np.ndarray  # float64 [N, K]
    present: np.ndarray  # bool [N, K]
    writer: str
    index_bytes: int

    def __len__(self) -> int:
        return int(self.size.shape[0])

    @cached_property
    def name_order(self) -> np.ndarray:
        """``int64 [N]``: the rows in the order of their names (a stable sort, done once)."""
        return np.argsort(self.names, kind="stable")


def build_columns(entries: Iterable[Mapping[str, Any]]) -> SummaryColumns | None:
    """The columns of index entries as :func:`tracer.format.run_index._entries` returns them (summary read
    by :func:`tracer.format.summary.read_summary`, ``derived`` as text), a later entry for the same file
    replacing an earlier one. None when no entry can be kept."""
    rows: dict[str, Mapping[str, Any]] = {}
    for entry in entries:
        summary = entry.get("summary")
        rows.pop(entry["file"], None)
        if summary is None or len(entry["file"].encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES or any(
                summary.get(k, 0) >= EXACT_COUNT for k in summary_format.COUNT_KEYS):
            continue
        rows[entry["file"]] = entry
    if not rows:
        return None
    kept = list(rows.values())
    keys = summary_format.ordered_keys(k for e in kept for k in e["summary"])
    texts = list(dict.fromkeys(e["derived"] for e in kept))
    text_id = {t: i for i, t in enumerate(texts)}
    N, K = len(kept), len(keys)
    nan = math.nan  # one list of K values per row, then one array: no per-value numpy assignment
    values = np.array([[e["summary"].get(k, nan) for k in keys] for e in kept], dtype=np.float64).reshape(N, K)
    present = np.array([[k in e["summary"] for k in keys] for e in kept], dtype=bool).reshape(N, K)
    return SummaryColumns(
        names=np.array([e["file"] for e in kept], dtype=str),
        coordinates=np.array([[e["step"], e["inner_step"], e["micro_batch"], e["rank"]] for e in kept], dtype=np.int64),
        size=np.array([e["size"] for e in kept], dtype=np.int64),
        content_sha256=np.stack([_sha_bytes(e.get("content_sha256")) for e in kept]),
        derived=np.array([text_id[e["derived"]] for e in kept], dtype=np.int32), derived_texts=tuple(texts),
        keys=tuple(keys), values=values, present=present, writer="", index_bytes=0)


def merged(old: SummaryColumns | None, new: SummaryColumns | None) -> SummaryColumns | None:
    """The rows of ``old`` then those of ``new``; a file in both keeps its row of ``new``."""
    if old is None or new is None:
        return new if old is None else old
    keys = tuple(summary_format.ordered_keys([*old.keys, *new.keys]))
    texts = tuple(dict.fromkeys([*old.derived_texts, *new.derived_texts]))
    keep = ~np.isin(old.names, new.names)
    parts = [(old, keep), (new, np.ones(len(new), dtype=bool))]
    values, present = [], []
    for cols, rows in parts:
        v, p = np.full((int(rows.sum()), len(keys)), np.nan), np.zeros((int(rows.sum()), len(keys)), dtype=bool)
        where = [keys.index(k) for k in cols.keys]
        v[:, where], p[:, where] = cols.values[rows], cols.present[rows]
        values.append(v)
        present.append(p)
    new_ids = np.array([texts.index(t) for t in new.derived_texts], dtype=np.int32)
    return SummaryColumns(
        names=np.concatenate([old.names[keep], new.names]),
        coordinates=np.concatenate([old.coordinates[keep], new.coordinates]),
        size=np.concatenate([old.size[keep], new.size]),
        content_sha256=np.concatenate([old.content_sha256[keep], new.content_sha256]),
        derived=np.concatenate([old.derived[keep], new_ids[new.derived]]).astype(np.int32), derived_texts=texts,
        keys=keys, values=np.concatenate(values), present=np.concatenate(present), writer="", index_bytes=0)


def _sha_bytes(value: Any) -> np.ndarray:
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    return np.frombuffer(raw if len(raw) == 32 else bytes(32), dtype=np.uint8)


def write_store(path: Path, columns: SummaryColumns, rank: int, writer: str, index_bytes: int) -> None:
    """Write ``columns`` to ``path`` atomically (a temporary name, then a rename), as the compaction
    of the first ``index_bytes`` bytes of the index of writer token ``writer``. Raises OSError (the
    caller, the index writer, logs it and goes on)."""
    N = len(columns)
    encoded = np.char.encode(columns.names, "utf-8", "surrogateescape")
    width = max(1, encoded.dtype.itemsize)
    tensors = {"coordinates": columns.coordinates, "size": columns.size, "content_sha256": columns.content_sha256,
               "name": np.ascontiguousarray(encoded.astype(f"S{width}")).view(np.uint8).reshape(N, width),
               "derived": columns.derived, "values": columns.values, "present": columns.present}
    metadata = {"format": STORE_FORMAT, "version": str(STORE_VERSION), "rank": str(rank), "writer": writer,
                "index_bytes": str(index_bytes), "keys": json.dumps(list(columns.keys)),
                "derived": json.dumps(list(columns.derived_texts))}
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.chmod(tmp, _FILE_MODE)  # as the index and the step files (the serialiser makes it 0600)
        os.replace(tmp, path)
    except Exception as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise OSError(f"{path}: {type(err).__name__}: {err}") from err


def read_store(path: Path) -> SummaryColumns | None:
    """The columns at ``path``, or None when there are none, they are of another format or version,
    too large, or inconsistent (any shape, dtype, key or value a writer would not have written: a
    hostile or damaged file is ignored, never raised from). A row whose name and coordinates
    disagree is never used by ``step_summary`` (the coordinates of the listed file are compared)."""
    try:
        if os.stat(path).st_size > MAX_STORE_BYTES:
            return None
        with safe_open(str(path), framework="np") as fh:
            meta = fh.metadata() or {}
            if meta.get("format") != STORE_FORMAT or meta.get("version") != str(STORE_VERSION):
                return None
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        return _checked(tensors, meta)
    except Exception as err:  # noqa: BLE001  (missing, torn, foreign: the index is read instead)
        log.debug("tracer: summary columns %s not used (%s: %s)", path, type(err).__name__, err)
        return None


def _checked(t: dict[str, np.ndarray], meta: Mapping[str, str]) -> SummaryColumns | None:
    keys, texts = json.loads(meta["keys"]), json.loads(meta["derived"])
    if not (isinstance(keys, list) and all(summary_format.is_key(k) for k in keys) and len(set(keys)) == len(keys)
            and isinstance(texts, list) and all(isinstance(x, str) for x in texts)):
        return None
    N, K = t["size"].shape[0], len(keys)
    expected = {"coordinates": (np.int64, (N, 4)), "size": (np.int64, (N,)), "content_sha256": (np.uint8, (N, 32)),
                "derived": (np.int32, (N,)), "values": (np.float64, (N, K)), "present": (np.bool_, (N, K))}
    name = t.get("name")
    if set(t) != {*expected, "name"} or name is None or name.dtype != np.uint8 or name.ndim != 2 \
            or name.shape[0] != N or any(t[k].dtype != d or t[k].shape != s for k, (d, s) in expected.items()):
        return None
    if (t["coordinates"] < 0).any() or (t["size"] < 0).any() or ((t["derived"] < 0) | (t["derived"] >= len(texts))).any():
        return None
    counts = [j for j, k in enumerate(keys) if k in summary_format.COUNT_KEYS]
    cv, cp = t["values"][:, counts], t["present"][:, counts]
    if (cp & ~((cv >= 0) & (cv < EXACT_COUNT) & (cv == np.floor(cv)))).any():
        return None
    if name.shape[1] == 0:
        return None
    raw = np.ascontiguousarray(name).view(f"S{name.shape[1]}").reshape(N)
    try:
        names = raw.astype("U")  # the writer's names are ASCII: a plain widening
    except UnicodeDecodeError:
        names = np.char.decode(raw, "utf-8", "surrogateescape")
    return SummaryColumns(names=names, coordinates=t["coordinates"], size=t["size"],
                          content_sha256=t["content_sha256"], derived=t["derived"], derived_texts=tuple(texts),
                          keys=tuple(keys), values=t["values"], present=t["present"],
                          writer=str(meta.get("writer", "")), index_bytes=int(meta["index_bytes"]))
