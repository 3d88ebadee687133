"""A trace's listing of step files as arrays (:class:`StepTable`): one name and one row of
coordinates per step file, sorted by (step, inner_step, micro_batch, rank), with no ``Path`` or
:class:`StepKey` object per file until one is asked for.

A run of 10,000 steps is listed, counted, labelled and summarised (:meth:`tracer.read.reader.Trace.step_summary`)
from the arrays; :meth:`StepTable.key` builds the key of the one step file a page shows, and
:meth:`StepTable.keys` every key, once (what :meth:`tracer.read.reader.Trace.steps` returns).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Sequence

import numpy as np

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
