"""What ``tracer check`` reuses of the live guard's work: the step-check results the guard wrote into
the trace's findings files (:mod:`tracer.format.findings_log`) while the run went on.

A step file's record is reused only when it is complete (its ``checked`` line, written after its
finding lines, counts as many finding lines as there are), the file is the one the guard checked (same
size and modification time), what the checks read of the trace's own files is the same (the manifest's
algorithm, hyperparameters, config and tokenizer, and ``tokens.json``: :func:`context_digest`) and the
guard ran with the same check options. The checks whose result on
that file read other step files (``depends``: a neighbour micro-batch, the run's latest files) are run
again, because those files may have changed since. Trace checks are never reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, replace
from dataclasses import fields as dataclass_fields
from typing import Any

from tracer.checks.context import CheckOptions
from tracer.checks.finding import ALL_ALGORITHMS, Check, Finding
from tracer.format.findings_log import findings_paths, read_lines
from tracer.format.names import TOKENS_NAME
from tracer.read import StepKey, Trace

log = logging.getLogger(__name__)
LAST_REUSE: dict[str, Any] = {}  # what the last run_checks reused: {"reused", "files", "rerun", "paths"}
_FINDING_FIELDS = {f.name for f in dataclass_fields(Finding)}


def finding_of(line: dict[str, Any]) -> Finding:
    """A :class:`Finding` from its JSON line (the extra keys ``family``, ``kind``, ``scope``, ``file``
    dropped). Raises TypeError when a required key is missing."""
    return Finding(**{k: v for k, v in line.items() if k in _FINDING_FIELDS})


def context_digest(trace: Trace) -> str:
    """A digest of what step checks read of a trace besides the step file: the manifest's ``algorithm``,
    ``hyperparameters``, ``config`` and ``tokenizer`` (not its live counts or status, which the writer
    rewrites while the run goes on), and ``tokens.json``'s size and modification time."""
    manifest = trace.manifest
    try:
        stat = os.stat(trace.root / TOKENS_NAME)
        tokens = [stat.st_size, stat.st_mtime_ns]
    except OSError:
        tokens = None
    seen = {k: manifest.get(k) for k in ("algorithm", "hyperparameters", "config", "tokenizer")}
    text = json.dumps([seen, tokens], sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:32]


def options_key(options: CheckOptions) -> dict[str, Any]:
    """The check options as the findings file's ``guard`` line stores them (JSON values)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(options).items()}


class GuardRecords:
    """The reusable step records of ``trace``'s findings files, for checks run with ``options``."""

    def __init__(self, trace: Trace, options: CheckOptions) -> None:
        self.trace = trace
        self.records: dict[str, tuple[dict[str, Any], list[Finding]]] = {}
        self.paths = [] if trace.path.is_file() else findings_paths(trace.root)
        self.reused = self.rerun = 0
        self.files = 0
        wanted = options_key(options)
        self._context = context_digest(trace) if self.paths else None
        for path in self.paths:
            same_options, pending = False, {}
            for line in read_lines(path):
                kind = line.get("kind")
                if kind == "guard":
                    same_options = line.get("options") == wanted
                elif not same_options:
                    continue
                elif kind == "finding" and line.get("scope") == "step" and isinstance(line.get("file"), str):
                    try:
                        pending.setdefault(line["file"], []).append(finding_of(line))
                    except TypeError:
                        continue
                elif kind == "checked" and isinstance(line.get("file"), str):
                    found = pending.pop(line["file"], [])
                    if line.get("findings") == len(found):
                        self.records[line["file"]] = (line, found)

    def step(self, key: StepKey, checks: Iterable[Check]
             ) -> tuple[list[Finding], list[str], dict[str, str], list[str], set[str], str, set[str]] | None:
        """``(findings, ran, skipped, depends, fields, algorithm, conditions)`` of the step file ``key``
        as the guard found them, restricted to ``checks``; None when there is no usable record (the
        caller checks the file afresh). ``depends``: the checks of ``checks`` to run again."""
        self.files += 1
        record = self.records.get(key.path.name)
        if record is None:
            return None
        line, found = record
        if line.get("algorithm") not in ALL_ALGORITHMS:
            return None  # an unknown algorithm's warning is the runner's to make
        try:
            stat = os.stat(key.path)
        except OSError:
            return None
        if line.get("size") != stat.st_size or line.get("mtime_ns") != stat.st_mtime_ns:
            return None
        if line.get("context") != self._context:
            return None  # the manifest or the token strings changed since (or an older findings file)
        ids = {c.id for c in checks}
        step_ids = {c.id for c in checks if c.scope == "step"}
        if not step_ids <= set(line.get("ran", [])) | set(line.get("skipped", {})) | _not_applicable(line, checks):
            return None  # a check the guard did not run (a newer tracer, a check it left out)
        depends = [c for c in line.get("depends", []) if c in ids]
        again = set(depends)
        path = str(key.path)
        findings = [f if f.path is None or os.path.basename(f.path) != key.path.name else replace(f, path=path)
                    for f in found if f.check in ids and f.check not in again]
        ran = [c for c in line.get("ran", []) if c in ids and c not in again]
        skipped = {c: r for c, r in line.get("skipped", {}).items() if c in ids and c not in again}
        self.reused += 1
        self.rerun += bool(depends)
        return (findings, ran, skipped, depends, set(line.get("fields", [])), str(line.get("algorithm", "")),
                set(line.get("conditions", [])))

    def report(self) -> None:
        """Keep and log what was reused (:data:`LAST_REUSE`)."""
        LAST_REUSE.clear()
        LAST_REUSE.update(reused=self.reused, files=self.files, rerun=self.rerun, paths=[str(p) for p in self.paths])
        if self.reused:
            log.info("reused the live guard's step-check results for %d of %d step files (%s)%s", self.reused,
                     self.files, ", ".join(p.name for p in self.paths),
                     f"; checks that read other step files ran again on {self.rerun}" if self.rerun else "")


def _not_applicable(line: dict[str, Any], checks: Iterable[Check]) -> set[str]:
    """The step checks that do not apply to the record's algorithm (neither ran nor were skipped)."""
    algorithm = str(line.get("algorithm", ""))
    return {c.id for c in checks if c.scope == "step" and algorithm not in c.algorithms}
