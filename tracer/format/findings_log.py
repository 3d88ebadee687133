"""The live guard's findings file: ``findings.rank_N.jsonl`` at the trace root, append-only, one JSON
object a line, written while the run goes on (:mod:`tracer.guard`) and read by ``tracer check`` (which
reuses what it covers), ``tracer view`` and :func:`tracer.read.findings.guard_findings`.

Lines, by their ``kind``:

* ``"guard"``: a guard started checking (``mode``, ``options``: the check options' values, ``checks``:
  the check ids it runs, ``pid`` and ``where`` of the process that checks: ``"checker process"``, ``"writer
  process"`` or ``"thread"`` of the training process).
* ``"finding"``: one finding, :meth:`tracer.checks.finding.Finding.to_dict` plus ``kind``, ``scope``
  (``"step"`` from a step check, ``"trace"`` from a check over the run's step files so far) and ``file``
  (the step file's name, for a step finding).
* ``"checked"``: a step file the step checks have all run on, written after its finding lines: ``file``,
  ``size`` and ``mtime_ns`` of the file then, ``findings`` (how many finding lines it has), ``ran``,
  ``skipped`` (check id -> reason), ``depends`` (the checks whose result read other step files),
  ``fields``, ``algorithm``, ``conditions`` (what ``tracer check``'s coverage needs), ``context`` (a
  digest of the manifest and token strings the checks read: :func:`tracer.checks.guard_records.context_digest`).
* ``"note"``: what the guard did not do and why (``message``): steps it left out when it fell behind,
  trace checks that ran on a schedule.
* ``"stop"``: the finding that stopped the run (``finding``), under ``guard="stop"``.

A line cut short by a crash is skipped by the reader; nothing else is ever rewritten.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FINDINGS_PATTERN = re.compile(r"findings\.rank_(\d+)\.jsonl")
MAX_FINDINGS_BYTES = 256 * 2**20  # a findings file past this is not read (a hostile or runaway file)


def findings_name(rank: int) -> str:
    """``findings.rank_<rank>.jsonl``."""
    return f"findings.rank_{int(rank)}.jsonl"


def findings_paths(root: str | os.PathLike) -> list[Path]:
    """The findings files of the trace at ``root``, by rank."""
    try:
        names = [entry.name for entry in os.scandir(root) if FINDINGS_PATTERN.fullmatch(entry.name)]
    except OSError:
        return []
    return sorted((Path(root) / n for n in names), key=lambda p: int(FINDINGS_PATTERN.fullmatch(p.name).group(1)))


def start_findings(root: str | os.PathLike, rank: int) -> None:
    """Remove the rank's findings file an earlier run into the same directory left (a run that wrote no
    step file, so the directory could be written again): this run's guard starts a new one. Called by
    the writer once it holds the rank's lock; a failure is left for the guard's first write to meet."""
    try:
        os.unlink(Path(root) / findings_name(rank))
    except OSError:
        pass


class FindingsAppender:
    """Appends lines to one findings file (opened on the first line, flushed after each batch of lines so
    that a reader of the live trace sees them). A failure to write is remembered in :attr:`error`, never
    raised: findings are a report, never a reason to stop writing steps."""

    def __init__(self, root: str | os.PathLike, rank: int) -> None:
        self.path = Path(root) / findings_name(rank)
        self._fh = None
        self.error: str | None = None

    def add(self, lines: list[dict[str, Any]]) -> None:
        """Append ``lines`` (JSON objects; non-finite floats written as strings by the caller)."""
        if not lines or self.error is not None:
            return
        try:
            if self._fh is None:
                self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  (open for the run, closed by close())
            self._fh.write("".join(json.dumps(line, allow_nan=False, default=str) + "\n" for line in lines))
            self._fh.flush()
        except (OSError, ValueError, TypeError) as err:
            self.error = f"{type(err).__name__}: {err}"

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None


def read_lines(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The JSON objects of one findings file, in order; a line that is not a JSON object (cut short by a
    crash) is skipped. Nothing when the file is missing, unreadable or over :data:`MAX_FINDINGS_BYTES`."""
    try:
        if os.path.getsize(path) > MAX_FINDINGS_BYTES:
            return
        with open(path, encoding="utf-8", errors="replace") as fh:
            for raw in fh:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict):
                    yield line
    except OSError:
        return
