"""``tracer info``: summarise a trace from its headers (:func:`tracer.read.trace_info.trace_info`),
without importing torch."""

from __future__ import annotations

import argparse
import json
import sys

from tracer.commands.trace_paths import refuse_a_folder_of_traces


def main(args: argparse.Namespace) -> int:
    """Print the trace's summary (a table, or ``--json``); 2 when no step file reads (or, with
    ``--verify``, one is corrupt), else 0.

    Raises:
        TraceError: the path is missing, not a trace, or a folder of traces.
    """
    from tracer.read.trace_info import info_problem, print_info, trace_info

    refuse_a_folder_of_traces(args.path, "info")
    info = trace_info(args.path, verify=args.verify)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print_info(info)
    problem = info_problem(info)
    if problem is not None:
        print(f"tracer info: error: {problem}", file=sys.stderr)
        return 2
    return 0
