"""What the live guard (:mod:`tracer.guard`) wrote into a trace while its run went on, for the Health and
Runs pages: the guard's mode, how many step files it checked, its error and warning findings, the notes
on what it left out, and the finding that stopped the run (``guard="stop"``).

Read from the trace's findings files (``findings.rank_N.jsonl``, :mod:`tracer.format.findings_log`:
append-only, a line each) and the manifest's ``guard`` entry (``mode``, ``stopped_at``, ``finding``); the
cache key is the files' sizes and modification times, so a running trace's new lines show at the next
rerun (the sidebar's Reload).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from tracer.format.findings_log import findings_paths, read_lines
from tracer.format.names import MANIFEST_NAME


@dataclass(frozen=True)
class GuardReport:
    """The live guard's work on one trace (module docstring).

    Attributes:
        mode: ``warn``, ``stop`` or ``callable`` (the findings file's ``guard`` line, else the manifest's).
        checked: step files the guard checked (its ``checked`` lines).
        errors, warnings: its error and warning finding lines.
        notes: what it said it left out (a file in n checked, trace checks on a schedule).
        stop: the finding that stopped the run (JSON form), or None.
        stopped_at: ``{"step", "inner_step", "micro_batch"}`` of the record the stop refused, or None.
    """

    mode: str
    checked: int
    errors: int
    warnings: int
    notes: tuple[str, ...] = ()
    stop: dict[str, Any] | None = None
    stopped_at: dict[str, Any] | None = None

    def text(self) -> str:
        """One cell: ``stopped at step 0 (recompute.advantages)``, else ``warn: 1 error, 2 warnings in 12
        step files`` (``no findings`` when it found none)."""
        # imported here, not at the top: the Runs page imports this module for every run
        from tracer.checks import ERROR, WARNING

        if self.stop is not None:
            return f"{self.mode}: stopped at step {self.stop.get('step')} ({self.stop.get('check')})"
        found = ", ".join(f"{n} {name}{'s' if n != 1 else ''}"
                          for n, name in ((self.errors, ERROR), (self.warnings, WARNING)) if n) or "no findings"
        return f"{self.mode}: {found} in {self.checked} step file{'s' if self.checked != 1 else ''}"


def _manifest_guard(root: Path) -> dict[str, Any]:
    try:
        entry = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8")).get("guard")
    except (OSError, ValueError, AttributeError):
        return {}
    return entry if isinstance(entry, dict) else {}


def files_token(trace_path: str) -> tuple:
    """The cache key of :func:`guard_report`: the findings files' and the manifest's sizes and mtimes."""
    root = Path(trace_path)
    out = []
    for path in [*findings_paths(root), root / MANIFEST_NAME]:
        try:
            stat = os.stat(path)
        except OSError:
            continue
        out.append((path.name, stat.st_size, stat.st_mtime_ns))
    return tuple(out)


@st.cache_data(max_entries=256, show_spinner=False)
def guard_report(trace_path: str, token: tuple) -> GuardReport | None:
    """The :class:`GuardReport` of the trace directory ``trace_path`` (``token``: :func:`files_token`),
    or None when no guard ran on it (no findings file, and the manifest says none or ``off``)."""
    root = Path(trace_path)
    if root.is_file():
        return None
    manifest = _manifest_guard(root)
    paths = findings_paths(root)
    if not paths and manifest.get("mode") in (None, "off"):
        return None
    # a guard ran: its findings are counted by severity (the checks imported only then)
    from tracer.checks import ERROR, WARNING

    mode, checked, counts, notes, stop = manifest.get("mode"), 0, {ERROR: 0, WARNING: 0}, [], None
    for path in paths:
        for line in read_lines(path):
            kind = line.get("kind")
            if kind == "guard":
                mode = mode or line.get("mode")
            elif kind == "checked":
                checked += 1
            elif kind == "finding" and line.get("severity") in counts:
                counts[line["severity"]] += 1
            elif kind == "note" and isinstance(line.get("message"), str):
                notes.append(line["message"])
            elif kind == "stop" and isinstance(line.get("finding"), dict):
                stop = line["finding"]
    finding = manifest.get("finding")
    stop = finding if isinstance(finding, dict) else stop
    return GuardReport(str(mode or "warn"), checked, counts[ERROR], counts[WARNING], tuple(notes), stop,
                       manifest.get("stopped_at") if isinstance(manifest.get("stopped_at"), dict) else None)


def report_of(trace_path: str) -> GuardReport | None:
    """:func:`guard_report` of the trace as its files are now."""
    return guard_report(trace_path, files_token(trace_path))
