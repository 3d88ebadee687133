"""Each rank's capture report of zero-edit tracing (``tracer run``, ``tracer.watch``; SPEC.md section 5).

A watcher ends with a report of what it captured (:meth:`tracer.zero_edit.watch.Watcher.report`: backward
calls, step files recorded, drops, the variable each field came from, map entries not used). The
manifest is written by rank 0 only, so under torchrun (one writer per ``RANK``, one trace) a report
kept only in the manifest would lose every other rank's. Each rank therefore writes its own,
``capture_report.rank_<r>.json`` at the trace root (the report object, as JSON), when its watcher
ends; the manifest's ``capture_report`` stays rank 0's, as before, for readers older than these
files. :func:`read_capture_reports` gives ``tracer info`` every rank's report.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any, Mapping

from tracer.errors import TraceError, TraceFormatError
from tracer.errors import user_stacklevel
from tracer.format.integrity import read_json
from tracer.format.names import CAPTURE_REPORT_GLOB, capture_report_name
from tracer.format.files import write_json_atomic

log = logging.getLogger(__name__)

MAX_REPORT_BYTES = 4 * 2**20  # a report lists at most a few dozen fields and map entries: a few KB
MAX_REPORTS_READ = 4096  # ranks whose report files are read; a trace with more has the rest skipped
_RANK = re.compile(r"capture_report\.rank_(\d{1,9})\.json")


def write_capture_report(root: str | Path, rank: int, report: Mapping[str, Any], strict: bool = False) -> None:
    """Write ``report`` (JSON-able) to ``root/capture_report.rank_<rank>.json`` (atomic).

    A failure to write is warned about (training goes on), or raised as TraceError when ``strict``.
    """
    path = Path(root) / capture_report_name(rank)
    try:
        write_json_atomic(path, dict(report))
    except OSError as err:
        if strict:
            raise TraceError(f"could not write the capture report {path}: {err}") from err
        warnings.warn(f"tracer: could not write the capture report {path} ({err}); `tracer info` will not "
                      "show this rank's capture report", RuntimeWarning, stacklevel=user_stacklevel())


def read_capture_reports(root: str | Path, manifest: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """Every rank's capture report, by rank (ascending); {} for a trace not written by zero-edit tracing.

    From the per-rank files at ``root``; a trace from before them has only the manifest's
    ``capture_report``, which is rank 0's. A file that cannot be used (not a regular file, over
    :data:`MAX_REPORT_BYTES`, not a JSON object) gives ``{"unreadable": reason}`` for its rank.
    """
    reports: dict[int, dict[str, Any]] = {}
    paths = sorted((int(m.group(1)), path) for path in Path(root).glob(CAPTURE_REPORT_GLOB)
                   if (m := _RANK.fullmatch(path.name)))
    if len(paths) > MAX_REPORTS_READ:
        log.warning("tracer: %s holds %d capture reports; reading the first %d", root, len(paths), MAX_REPORTS_READ)
    for rank, path in paths[:MAX_REPORTS_READ]:
        try:
            report = read_json(path, "capture report", MAX_REPORT_BYTES)
        except TraceFormatError as err:
            reports[rank] = {"unreadable": str(err)}
            continue
        reports[rank] = report if isinstance(report, dict) else {
            "unreadable": f"{path}: expected a JSON object, got {type(report).__name__}"}
    if 0 not in reports and isinstance(manifest.get("capture_report"), dict):
        reports[0] = manifest["capture_report"]
    return dict(sorted(reports.items()))


def describe_capture_reports(reports: Mapping[str, Mapping[str, Any]], ranks: list[int]) -> list[str]:
    """Lines of text for ``tracer info``: what zero-edit tracing captured on each rank.

    Args:
        reports: :func:`read_capture_reports` with string keys (as ``tracer info --json`` gives it).
        ranks: the ranks that wrote step files; one with no report is named (it ended without
            writing one, or the trace predates per-rank reports). [] when ``reports`` is empty.
    """
    if not reports:
        return []
    every = sorted({int(r) for r in reports} | set(ranks))
    lines = []
    for rank in every:
        where = f", rank {rank}" if len(every) > 1 else ""
        report = reports.get(str(rank))
        if report is None:
            lines.append(f"capture{where}: no capture report (the rank ended without writing one, or the trace "
                         "predates per-rank reports)")
        elif "unreadable" in report:
            lines.append(f"capture{where}: report unreadable: {report['unreadable']}")
        else:
            lines += _report_lines(report, where)
    return lines


def _report_lines(report: Mapping[str, Any], where: str) -> list[str]:
    dropped = report.get("dropped_steps")
    lines = [f"capture{where}: {report.get('steps_recorded')} step file(s) from {report.get('backward_calls')} "
             f"backward call(s), {report.get('unmatched_calls')} without policy logprobs, "
             f"{report.get('failures')} failed" + (f", {dropped} dropped" if dropped else "")]
    mapped = report.get("fields_mapped")
    if isinstance(mapped, dict) and mapped:
        lines.append("  fields mapped: " + ", ".join(f"{k} <- {v}" for k, v in mapped.items()))
    entries = report.get("map_entries_unused")
    lines += [f"  not recorded: {entry}" for entry in (entries if isinstance(entries, list) else [])[:10]]
    return lines
