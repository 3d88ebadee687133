"""``tracer check``: run the checks of SPEC.md section 6 on a trace (:func:`tracer.checks.run_checks`)
and print the findings (a table, or ``--json``)."""

from __future__ import annotations

import argparse
import json
import sys

from tracer.commands.trace_paths import refuse_a_folder_of_traces
from tracer.errors import TraceError


def main(args: argparse.Namespace) -> int:
    """1 when a finding is an error (or a warning with ``--fail-on warning``, or a bug class not
    checked with ``--strict-coverage``), else 0. The options are checked before the checks (and
    torch) are imported.

    Raises:
        TraceError: ``--sampler-ratio-bound`` <= 1, a malformed ``--threshold``, no trace given, a
            path that is not a trace or is a folder of traces.
    """
    if not args.sampler_ratio_bound > 1:
        raise TraceError(f"--sampler-ratio-bound must be > 1, got {args.sampler_ratio_bound}")
    thresholds = parse_thresholds(args.threshold)
    if args.path is None and not args.select:
        raise TraceError("no trace given: tracer check PATH [--select ID ...]")
    _select_and_path(args)
    refuse_a_folder_of_traces(args.path, "check")
    from tracer.read import Trace

    Trace(args.path)  # a path that is not a trace is refused here, before the checks (and torch) are imported
    from rich.console import Console

    from tracer.checks import ERROR, WARNING, CheckOptions, has_errors, run_checks
    from tracer.checks.coverage import NOT_CHECKED
    from tracer.checks.guard_records import LAST_REUSE
    from tracer.checks.report import render_findings
    options = CheckOptions(sampler_ratio_bound=args.sampler_ratio_bound).with_thresholds(thresholds)
    LAST_REUSE.clear()  # what this run reuses, not an earlier one's (--fresh reuses nothing)
    findings = run_checks(args.path, select=args.select, options=options, reuse_guard=not args.fresh)
    _say_what_was_reused(LAST_REUSE)
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2, default=str))
    else:
        # into a pipe or file, one finding's message stays on its line (grep finds it whole); on a
        # terminal it wraps to the window
        Console().print(render_findings(findings, title=str(args.path), max_per_check=args.max_per_check),
                        soft_wrap=not sys.stdout.isatty())
    failing = (ERROR, WARNING) if args.fail_on == "warning" else (ERROR,)
    unchecked = args.strict_coverage and any(f.check == NOT_CHECKED for f in findings)
    return 1 if has_errors(findings) or any(f.severity in failing for f in findings) or unchecked else 0


def parse_thresholds(items: list[str]) -> dict[str, float]:
    """``--threshold NAME=VALUE`` items as ``{name: value}``, each name and value checked against
    :mod:`tracer.checks.catalogue` (no torch).

    Raises:
        TraceError: an item without ``=``, whose value is not a number, whose name is no threshold or
            whose value is out of its range.
    """
    from tracer.checks.catalogue import threshold_problem

    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise TraceError(f"--threshold {item!r}: expected NAME=VALUE with a number, e.g. --threshold ref_kl=2.0")
        problem = threshold_problem(name.strip(), out[name.strip()])
        if problem is not None:
            raise TraceError(problem)
    return out


def _select_and_path(args: argparse.Namespace) -> None:
    """``--select`` ids split at commas; a path written after them (``tracer check --select masks RUN``,
    which argparse hands to --select) taken back as the path when it names no check. The names are
    checked against :data:`tracer.checks.catalogue.CHECK_IDS` (no torch).

    Raises:
        TraceError: no path, or a name that is neither a check id nor a family."""
    from tracer.checks.catalogue import CHECK_IDS, unknown_check_names
    from tracer.checks.finding import FAMILIES

    names = [part for item in (args.select or []) for part in item.split(",") if part]
    if args.path is None and names and names[-1] not in CHECK_IDS and names[-1] not in FAMILIES:
        args.path = names.pop()
    if args.path is None:
        raise TraceError("no trace given: tracer check PATH [--select ID ...]")
    unknown = unknown_check_names(names, FAMILIES)
    if unknown:  # the registry's own words (tracer.checks.runner.select_checks)
        families = sorted({c.split(".", 1)[0] for c in CHECK_IDS})
        raise TraceError(f"unknown check {unknown[0]!r}; known checks: {', '.join(CHECK_IDS)} "
                         f"(or a family: {', '.join(families)})")
    args.select = names or None


def _say_what_was_reused(reuse: dict) -> None:
    """One line on stderr when ``run_checks`` took step-check results from the live guard's findings
    file (``reuse``: :data:`tracer.checks.guard_records.LAST_REUSE`), so a user knows what was not
    recomputed."""
    if reuse.get("reused"):
        rerun = reuse.get("rerun")
        print(f"tracer check: reused the live guard's step-check results for {reuse['reused']} of "
              f"{reuse['files']} step files (findings.rank_N.jsonl; --fresh recomputes them)"
              + (f"; checks that read other step files ran again on {rerun}" if rerun else ""), file=sys.stderr)
