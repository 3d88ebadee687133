"""A trace's step files: listing them (:func:`list_step_files`), keying them (:func:`keys_of`), and the
listing as arrays (:class:`StepTable`): one name and one row of
coordinates per step file, sorted by (step, inner_step, micro_batch, rank), with no ``Path`` or
:class:`StepKey` object per file until one is asked for.

A run of 10,000 steps is listed, counted, labelled and summarised (:meth:`tracer.read.reader.Trace.step_summary`)
from the arrays; :meth:`StepTable.key` builds the key of the one step file a page shows, and
:meth:`StepTable.keys` every key, once (what :meth:`tracer.read.reader.Trace.steps` returns).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from tracer.errors import TraceFormatError
from tracer.format.names import STEP_FILE_RE, STEPS_DIR, listed_step_files

STEP_LINES = re.compile(r"^step_([0-9]+)\.inner_([0-9]+)\.mb_([0-9]+)\.rank_([0-9]+)\.safetensors$", re.MULTILINE)


def step_label(step: int, inner_step: int, micro_batch: int, rank: int) -> str:
    """How the app names a step file: ``step 3 · inner 0 · mb 1 · rank 0``."""
    return f"step {step} · inner {inner_step} · mb {micro_batch} · rank {rank}"


@dataclass(frozen=True, order=True, slots=True)  # slots: one object per step file, not two (10,000-step runs)
class StepKey:
    """Identifies one step file: (step, inner_step, micro_batch, rank) and where it lies."""

    step: int
    inner_step: int
    micro_batch: int
    rank: int
    path: Path

    @property
    def label(self) -> str:
        return step_label(self.step, self.inner_step, self.micro_batch, self.rank)


def parse_names(names: Sequence[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """``(coordinates int64 [n, 4], order int64 [n])`` of file ``names`` named as the writer names
    them (one regular-expression scan), ``order`` sorting them by coordinates; None when a name is
    not such a name, a number exceeds int64, or two names give the same coordinates."""
    joined = "\n".join(names)
    found = STEP_LINES.findall(joined) if joined.count("\n") == len(names) - 1 else []
    if not names or len(found) != len(names):
        return None
    try:
        coordinates = np.array(found, dtype=np.int64).reshape(len(names), 4)
    except (ValueError, OverflowError):  # a step number beyond int64
        return None
    order = np.lexsort(coordinates.T[::-1])
    ranked = coordinates[order]
    if (ranked[1:] == ranked[:-1]).all(axis=1).any():
        return None
    return coordinates, order


class StepTable:
    """The step files of a trace, sorted by coordinates.

    Attributes:
        names: ``list[str]`` [n], each file's name (its last path component).
        coordinates: ``int64 [n, 4]``: step, inner_step, micro_batch, rank.
        folder: the one folder every file lies in (the trace's ``steps/``), or None when the table
            was made from keys (:meth:`from_keys`: files anywhere, named by the user).
    """

    def __init__(self, names: list[str], coordinates: np.ndarray, folder: Path | None = None,
                 keys: list[StepKey] | None = None) -> None:
        self.names, self.coordinates, self.folder = names, coordinates, folder
        if keys is not None:
            self.__dict__["keys_list"] = keys

    @classmethod
    def of_folder(cls, folder: Path, names: Sequence[str]) -> "StepTable | None":
        """The table of the files ``names`` (any order) of ``folder``; None when they are not all
        named by the writer with distinct coordinates (:func:`parse_names`)."""
        if not names:
            return cls([], np.zeros((0, 4), dtype=np.int64), folder)
        parsed = parse_names(names)
        if parsed is None:
            return None
        coordinates, order = parsed
        return cls([names[i] for i in order.tolist()], coordinates[order], folder)

    @classmethod
    def from_keys(cls, keys: list[StepKey]) -> "StepTable":
        """The table of ``keys`` (sorted, anywhere): what any listing can give."""
        flat = np.fromiter((v for k in keys for v in (k.step, k.inner_step, k.micro_batch, k.rank)),
                           dtype=np.int64, count=4 * len(keys))
        return cls([k.path.name for k in keys], flat.reshape(len(keys), 4), None, list(keys))

    def __len__(self) -> int:
        return len(self.names)

    def path(self, i: int) -> Path:
        """Where the ``i``-th file lies."""
        if self.folder is None:
            return self.keys_list[i].path
        child = getattr(self.folder, "_make_child_relpath", None)  # CPython 3.10-3.12: no re-parse
        return child(self.names[i]) if child is not None else self.folder / self.names[i]

    def key(self, i: int) -> StepKey:
        """The :class:`StepKey` of the ``i``-th file (built when asked for, unless the table holds them)."""
        held = self.__dict__.get("keys_list")
        if held is not None:
            return held[i]
        step, inner, mb, rank = self.coordinates[i].tolist()
        return StepKey(step, inner, mb, rank, self.path(i))

    @cached_property
    def keys_list(self) -> list[StepKey]:
        """Every file's key, built once."""
        child = getattr(self.folder, "_make_child_relpath", None)
        make = child if child is not None else (lambda name: self.folder / name)
        return [StepKey(a, b, c, d, make(name)) for (a, b, c, d), name in zip(self.coordinates.tolist(), self.names)]

    def keys(self) -> list[StepKey]:
        """Every file's key, in the table's order (a new list each call)."""
        return list(self.keys_list)

    @cached_property
    def name_array(self) -> np.ndarray:
        """``str_ [n]``: :attr:`names` as a numpy array (built once)."""
        return np.array(self.names, dtype=str)

    def position(self, path: str) -> int | None:
        """Where the file at ``path`` (a ``str``) is in the table, or None."""
        if self.folder is None:
            return next((i for i, k in enumerate(self.keys_list) if str(k.path) == path), None)
        folder, sep, name = path.rpartition(os.sep)
        if not sep or folder != str(self.folder):
            return None
        try:
            return self.names.index(name)  # one scan in C: ~0.1 ms at 10,000 files
        except ValueError:
            return None

    def take(self, positions: Sequence[int] | np.ndarray) -> "StepTable":
        """The table of the files at ``positions`` (in that order)."""
        positions = np.asarray(positions, dtype=np.int64)
        held = self.__dict__.get("keys_list")
        return StepTable([self.names[i] for i in positions.tolist()], self.coordinates[positions], self.folder,
                         None if held is None else [held[i] for i in positions.tolist()])

    def labels(self) -> list[str]:
        """One label per file (:func:`step_label`); when two files share coordinates (user-named
        files claiming the same step) every label also names its file."""
        labels = [step_label(a, b, c, d) for a, b, c, d in self.coordinates.tolist()]
        if self.folder is None and len(set(labels)) < len(labels):
            labels = [f"{label} · {name}" for label, name in zip(labels, self.names)]
        return labels


QUIET_S = 2.0  # a folder unchanged this long before it was listed keeps its listing until it changes
MAX_NAMED_KEYS = 1_000_000  # step keys kept per trace (parsed from file names once)


def list_step_files(root: Path, cached: tuple | None) -> tuple[list[Path], tuple | None]:
    """The ``*.safetensors`` files of ``root/steps/`` and ``root``, sorted by text, and what to pass as
    ``cached`` next time. Listed again whenever either folder's modification time changed (a file
    added, renamed or removed); a listing is reused only when both folders had been quiet for
    :data:`QUIET_S` seconds before it was taken, so that a change within one tick of the file
    system's clock is never missed (the rule git uses for its racy index)."""
    folders = (root / STEPS_DIR, root)
    before = time.time_ns()
    try:
        signature = tuple(os.stat(folder).st_mtime_ns if folder.is_dir() else 0 for folder in folders)
    except OSError:
        signature = None
    if signature is not None and cached is not None and cached[0] == signature:
        return cached[1], cached
    in_steps, at_root = listed_step_files(folders[0]), listed_step_files(folders[1])  # each sorted by name
    # one folder's files sorted by name are sorted by text (one prefix): the common case, no Path compared
    paths = (in_steps or at_root) if not (in_steps and at_root) else sorted([*in_steps, *at_root], key=str)
    quiet = signature is not None and before - max(signature) > QUIET_S * 1e9
    return paths, ((signature, paths) if quiet else None)


def keys_of(paths: list[Path], named: dict[Path, StepKey], header: Callable[[Path], dict[str, Any]]) -> list[StepKey]:
    """The step keys of ``paths`` (one listing of the directory, so that a file a live writer adds
    meanwhile is either in both or in neither), sorted. When every file is named by its coordinates (as
    the writer names them) the names are parsed by one regular-expression scan and sorted as
    arrays; otherwise one by one: ``named`` remembers ``{path: key}`` of the files named by their
    coordinates, and a file named by the user is keyed by its header's coordinates (``header(path)``;
    one that does not open is left out: ``Trace.scan`` reports it)."""
    parsed = parse_names([p.name for p in paths])
    if parsed is not None:
        coordinates, order = parsed
        return [StepKey(a, b, c, d, paths[i]) for (a, b, c, d), i in zip(coordinates[order].tolist(), order.tolist())]
    keys = []
    for p in paths:
        key = named.get(p)
        if key is not None:
            keys.append(key)
            continue
        m = STEP_FILE_RE.match(p.name)
        if m and all(len(g) < 19 or int(g) < 2**63 for g in m.groups()):  # beyond int64: as user-named
            key = StepKey(*(int(g) for g in m.groups()), path=p)
            if len(named) < MAX_NAMED_KEYS:
                named[p] = key
            keys.append(key)
        else:  # a step file named by the user: its header says which step it is
            try:
                meta = header(p)
            except TraceFormatError:
                continue
            keys.append(StepKey(*(_int_or(meta.get(k)) for k in ("step", "inner_step", "micro_batch", "rank")), path=p))
    return sorted(keys)


def _int_or(value: Any, default: int = 0) -> int:
    """``value`` as an int when it is a JSON number, else ``default`` (hostile metadata)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) < 2**62:
        return int(value)
    return default
