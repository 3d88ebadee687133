"""``tracer diff A B``: compare two traces field by field (:func:`tracer.diff.diff`); the report as
text (the short form, or every finding with ``--verbose``) or ``--json``."""

from __future__ import annotations

import argparse
import json


def main(args: argparse.Namespace) -> int:
    """0 when the traces are equal within tolerance, 1 when they differ.

    Raises:
        TraceError: a bad tolerance, traces that cannot be compared (``DiffInputError``), a path
            that is not a trace, a corrupt step file (``ChecksumError``).
    """
    from tracer.format.tolerances import parse_tolerances
    from tracer.read import Trace

    # the arguments first (no torch): a malformed tolerance, a path that is not a trace
    atol, rtol = parse_tolerances(args.atol, "--atol"), parse_tolerances(args.rtol, "--rtol")
    Trace(args.a)
    Trace(args.b)
    from tracer.diff import diff

    fields = [f for group in args.fields for f in group.split(",") if f] or None
    report = diff(args.a, args.b, atol=atol, rtol=rtol, fields=fields, ignore_metadata=args.ignore_metadata)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format(args.max_locations, args.verbose))
    return 0 if report.equal else 1
