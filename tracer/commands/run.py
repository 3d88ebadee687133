"""``tracer run -- SCRIPT ARGS``: run an unmodified training script with the zero-edit watcher
(:class:`tracer.zero_edit.watch.Watcher`), tracing each backward."""

from __future__ import annotations

import argparse
import json
import sys

from tracer.errors import TraceError


def parse_meta(items: list[str]) -> dict[str, object]:
    """``--meta KEY=VALUE`` items as step metadata: each value read as JSON, else kept as a string.

    Raises:
        TraceError: an item without ``=`` or with an empty key.
    """
    meta: dict[str, object] = {}
    for text in items:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise TraceError(f"--meta {text!r}: expected KEY=VALUE, e.g. --meta loss_reduction=token_mean")
        try:
            meta[key] = json.loads(value)
        except ValueError:
            meta[key] = value
    return meta


def main(args: argparse.Namespace) -> int:
    """The script's own exit code; 3 when it succeeded but nothing was traced (the watcher's
    message on stderr says why), 4 when the live guard stopped it.

    Raises:
        TraceError: a malformed ``--meta``; the watcher's own errors (an unknown map, an ``--out``
            that holds a trace).
    """
    meta = parse_meta(args.meta)
    from tracer.zero_edit.script_runner import run_script
    from tracer.zero_edit.watch import Watcher, summary_logger

    watcher = Watcher(args.algo, args.out, args.map, strict=args.strict, hyperparameters=meta, nothing_traced="ignore",
                      config={"script": args.script, "script_args": args.script_args}, guard=args.guard)
    summary_logger(always=True)  # the end-of-run summary reaches stderr whatever the script does with warnings
    code = run_script(args.script, args.script_args, watcher)
    if code == 0 and watcher.steps_recorded == 0:
        print(watcher.nothing_traced_message(), file=sys.stderr)
        return 3
    return code
