"""Command line: ``python -m tracer {demo, info, view, diff, check, run}`` (also installed as ``tracer``).

This module holds the argument parser and the dispatch; each subcommand's implementation is a module
of :mod:`tracer.commands` (``main(args) -> exit code``), imported only when that subcommand runs.

Exit codes: 0 success, 2 unusable input (missing or non-trace path, bad arguments, step files none of
which can be read, a step file whose bytes disagree with its recorded checksum in ``diff`` and
``info --verify``); ``diff`` exits 1
when the traces differ beyond tolerance, ``check`` when any finding is an error; ``run`` exits with
the script's own exit code, 3 when the script succeeded but nothing was traced, 4 when the live
guard stopped it (``--guard stop``: a check found an error in a step written); ``view`` exits
1 when its Streamlit server exits or does not answer during start-up (``--start-timeout``).
"""

from __future__ import annotations

import argparse
import collections.abc
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tracer.demo.sampler_faults import VLLM_BUGS
from tracer.errors import TraceError

# Only the standard library and light modules above: `tracer --help` and a mistyped option answer
# without importing torch, pandas or the reader (seconds of start-up); each subcommand lives in its own
# module of tracer.commands, imported when it runs, and imports what it uses (even importlib.metadata,
# for --version, and the view server's urllib: ~40 ms of a 0.1 s start).

REPO_ROOT = Path(__file__).resolve().parent.parent
# The entry script itself, not app/server.py (st.App: a cold start to the first token view of 1.4-1.5x a
# bare Streamlit page's against 1.8x, BENCHMARKS.md): under st.App Streamlit's own lines (its "Stopping..."
# at SIGTERM, a user's STREAMLIT_LOGGER_LEVEL=info) no longer come through tracer view
# (tests/cli/test_view_signals.py).
APP_ENTRY = REPO_ROOT / "app" / "streamlit_app.py"
DEFAULT_VIEW_ROOT = REPO_ROOT / "sample_traces"
# Streamlit settings of every `tracer view` server (mirrored by .streamlit/config.toml for a plain
# `streamlit run app/streamlit_app.py` from the checkout): no browser to open, no usage statistics,
# and the toolbar in viewer mode (no Deploy / Rerun / Clear cache: a local debugger deploys nothing).
STREAMLIT_OPTIONS = ("--server.headless", "true", "--browser.gatherUsageStats", "false",
                     "--client.toolbarMode", "viewer")


def _positive_seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def _port(text: str) -> int:
    """argparse type: a TCP port, 1 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {value}")
    return value


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


class _LazyChoices(collections.abc.Sequence):
    """argparse ``choices`` read from ``module.name`` when first asked (a value checked, an invalid one
    listed, a subcommand's help): the modules that define the demo and algorithm names import torch."""

    def __init__(self, module: str, name: str) -> None:
        self._where = (module, name)

    def _values(self) -> tuple[str, ...]:
        return tuple(getattr(importlib.import_module(self._where[0]), self._where[1]))

    def __getitem__(self, index: Any) -> Any:
        return self._values()[index]

    def __len__(self) -> int:
        return len(self._values())

    def __iter__(self) -> Iterator[str]:
        return iter(self._values())

    def __contains__(self, value: object) -> bool:
        return value in self._values()


DEMO_CHOICES = _LazyChoices("tracer.demo.runner", "DEMO_ALGOS")
ALGORITHM_CHOICES = _LazyChoices("tracer.format.schema", "ALGORITHMS")


def __getattr__(name: str) -> Any:
    """``trace_info`` and ``print_info``, once imported here, stay importable from ``tracer.cli``
    (tests/scripts/fuzz_headers.py does), without importing the reader for every command."""
    if name in ("trace_info", "print_info"):
        return getattr(importlib.import_module("tracer.read.trace_info"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def version_text() -> str:
    """``tracer <version> (<package folder>)``: which copy of tracer runs (the installed distribution's
    version, which is pyproject's; the folder tells one checkout or install from another)."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("tracer")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        version = "(not installed)"
    return f"tracer {version} ({Path(__file__).resolve().parent})"


class _VersionAction(argparse.Action):
    """``--version``: prints :func:`version_text` and exits 0, reading the installed version only
    when asked (argparse's own ``version`` action wants the text when the parser is built)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        parser._print_message(version_text() + "\n", sys.stdout)
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracer", description="Trace, browse, check and diff RL training tensors.")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the version and the folder of the tracer package that runs, and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a tiny real trainer on CPU with the tracer attached")
    demo.add_argument("name", nargs="?", choices=DEMO_CHOICES, default=None, metavar="DEMO",
                      help="the demo to run, as --algo (e.g. `tracer demo agent --out D`)")
    demo.add_argument("--algo", choices=DEMO_CHOICES, default=None, metavar="ALGO",
                      help="%(choices)s: hand-written loop (ppo, grpo, cispo, dpo), TRL trainer (*-trl), or agent "
                           "(TRL GRPO with a calculator tool: multi-turn episodes); default grpo")
    demo.add_argument("--out", required=True, help="trace directory to write (must not hold a trace)")
    demo.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--bug", choices=VLLM_BUGS, default=None,
                      help="grpo-vllm only: inject a sampler/trainer mismatch (the engine reports raw logprobs; "
                           "samples with top_p < 1, top_k 5 or repetition_penalty 1.3 the trainer does not apply; "
                           "or gets no weight sync after step 0)")
    demo.add_argument("--rollout", choices=("hf", "vllm"), default="hf",
                      help="grpo/cispo only: sample with the policy's generate (hf, default) or a colocated "
                           "vLLM engine synced each step (vllm)")
    demo.add_argument("--leak-tool-output", action="store_true",
                      help="agent only: inject the bug that leaves the tool results in the loss mask")

    info = sub.add_parser("info", help="summarise a trace: algorithm, steps, ranks, fields",
                          description="Summarise a trace: algorithm, steps, ranks, fields. "
                                      "Exit code: 0 success (step files that cannot be read beside readable ones are "
                                      "listed under 'problems'; tracer check exits 1 on them), 2 unusable input: "
                                      "no readable step file among those on disk (as tracer check), or with "
                                      "--verify a corrupt or unreadable step file.")
    info.add_argument("path", help="trace directory or one step .safetensors file")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.add_argument("--verify", action="store_true",
                      help="read every step file and check its bytes against its recorded checksum (exit 2 if corrupt)")

    view = sub.add_parser("view", help="open the web UI (Streamlit, bound to 127.0.0.1)")
    view.add_argument("path", nargs="?", default=str(DEFAULT_VIEW_ROOT),
                      help="a trace directory, a directory of traces, or one step file (default: the bundled sample_traces/)")
    view.add_argument("--port", type=_port, default=8501, help="port, 1-65535 (default 8501)")
    view.add_argument("--start-timeout", type=_positive_seconds, default=60.0, metavar="SECONDS",
                      help="how long to wait for the server to answer before giving up (default 60)")

    check = sub.add_parser("check", help="run the invariants of SPEC.md section 6, listed in docs/checks.md "
                                  "(exit 1 on any error, 2 unusable)",
                           description="Find the known RL tensor bugs in a trace (SPEC.md section 6; the checks "
                                       "are listed in docs/checks.md). Exit code: 0 no error finding, 1 at least "
                                       "one error finding (or a warning with --fail-on warning, or a bug class not "
                                       "checked with --strict-coverage), 2 unusable input.")
    check.add_argument("path", nargs="?", help="trace directory or one step .safetensors file")
    check.add_argument("--json", action="store_true", help="print the findings as a JSON list")
    check.add_argument("--select", action="extend", nargs="+", metavar="ID",
                       help="check ids (masks.after_eos) or families (masks) to run, space- or comma-separated; "
                            "default all")
    check.add_argument("--sampler-ratio-bound", type=float, default=2.0, metavar="C",
                       help="sampler.mismatch counts tokens whose exp(old - sampler) is outside [1/C, C] (default 2)")
    check.add_argument("--max-per-check", type=_positive_int, default=10,
                       help="entries shown per check (default 10); findings of one cause that differ only in their "
                            "numbers (the same bug at several steps) are one entry, --json lists each")
    check.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE",
                       help="a health warning's threshold (repeatable): ref_kl (mean k3 nats per kept token, default 2), "
                            "clip_fraction (share of tokens whose gradient the clip removes after the first update, default 0.5; not "
                            "judged under a clip epsilon below 0.1), "
                            "sampler_gap (mean |old - sampler| nats, default 0.1), entropy_floor (nats, default "
                            "0.05), entropy_drop (share of the first step's entropy lost, default 0.9), reward_flat "
                            "(share of groups with zero reward std, default 1); see docs/checks.md")
    check.add_argument("--fail-on", choices=("error", "warning"), default="error",
                       help="exit 1 on an error finding (default), or on an error or warning finding")
    check.add_argument("--fresh", action="store_true",
                       help="run every check afresh instead of reusing the live guard's step-check results "
                            "(findings.rank_N.jsonl) for the step files it checked unchanged")
    check.add_argument("--strict-coverage", action="store_true",
                       help="exit 1 when a common bug class could not be checked for want of a field (the report's "
                            "'not checked: <class> - record <fields>' lines)")

    diff = sub.add_parser("diff", help="compare two traces field by field, mask-aware (exit 0 equal, 1 not, 2 unusable)",
                          description="Compare two traces field by field, mask-aware, and their per-step scalars "
                                      "(scalars/<name>: recorded with each step or logged after it; "
                                      "docs/regression-testing.md). "
                                      "Exit code: 0 equal within tolerance, 1 different, 2 unusable input.")
    diff.add_argument("a", help="reference trace directory or step file (the baseline)")
    diff.add_argument("b", help="candidate trace directory or step file")
    diff.add_argument("--json", action="store_true", help="print the report as JSON")
    diff.add_argument("--atol", action="append", default=[], metavar="[FIELD=]X",
                      help="absolute tolerance for FIELD (a field or scalars/<name>; or every float field); "
                           "repeatable")
    diff.add_argument("--rtol", action="append", default=[], metavar="[FIELD=]X",
                      help="relative tolerance (of |a|) for FIELD (or every float field); repeatable")
    diff.add_argument("--fields", action="append", default=[], metavar="F1,F2",
                      help="compare only these fields (comma-separated, scalars/<name> for a scalar; repeatable)")
    diff.add_argument("--ignore-metadata", action="append", default=[], metavar="KEY",
                      help="step metadata key whose differences are not findings; repeatable")
    diff.add_argument("--verbose", "-v", action="store_true",
                      help="every finding and each differing field's positions (default: the short report)")
    diff.add_argument("--max-locations", type=_positive_int, default=10,
                      help="differing positions shown per field with --verbose")

    run = sub.add_parser("run", help="run an unmodified training script, tracing each backward (zero-edit)",
                         usage="tracer run --algo ALGO --out DIR [--map FILE] [--meta KEY=VALUE] [--guard MODE] "
                               "-- SCRIPT [ARGS...]")
    run.add_argument("--algo", choices=ALGORITHM_CHOICES, required=True, metavar="ALGO",
                     help="the script's algorithm: %(choices)s")
    run.add_argument("--out", required=True, help="trace directory to write (must not hold a trace)")
    run.add_argument("--map", help="name map: a .toml/.yaml file or a shipped map name (default minimind)")
    run.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                     help="step metadata for every step (JSON value, else a string), e.g. loss_reduction=token_mean")
    run.add_argument("--strict", action="store_true", help="a failed capture raises in the script instead of a warning")
    run.add_argument("--guard", choices=("off", "warn", "stop"), default=None,
                     help="the live guard: run the step checks of `tracer check` on each step as it is written; "
                          "warn prints each check's first finding, stop also stops the script at its next traced "
                          "backward after the first error (exit 4); default: $TRACER_GUARD, else warn")
    run.add_argument("script", help="the training script, run as `python SCRIPT ARGS...`")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    """The ``main(args) -> exit code`` of subcommand ``name`` (:mod:`tracer.commands`), its module
    imported now: a command pays only for its own imports."""
    if name == "demo":
        from tracer.commands.demo import main
    elif name == "info":
        from tracer.commands.info import main
    elif name == "view":
        from tracer.commands.view import main as view

        return lambda args: view(args, APP_ENTRY, STREAMLIT_OPTIONS)
    elif name == "diff":
        from tracer.commands.diff import main
    elif name == "check":
        from tracer.commands.check import main
    else:
        from tracer.commands.run import main
    return main


STREAMLIT_OPTION = re.compile(r"^--(server|browser|theme|client|runner|logger|global)\.([A-Za-z]+)")


def _streamlit_options_hint(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> None:
    """``tracer view --server.headless true``: Streamlit's own options are not ``tracer view``'s; say
    how to pass them (``STREAMLIT_*`` variables) instead of argparse's bare 'unrecognized arguments'."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "view":
        return
    wrong = [a for a in args if STREAMLIT_OPTION.match(a)]
    if wrong:
        first = STREAMLIT_OPTION.match(wrong[0])
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", first.group(2)).upper()
        parser.error(f"{wrong[0]} is a Streamlit option, not one of tracer view's: tracer view already serves "
                     f"headless on 127.0.0.1 with usage statistics off; pass other Streamlit options as "
                     f"environment variables, e.g. STREAMLIT_{first.group(1).upper()}_{snake}=... tracer view PATH")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    parser = _parser()
    _streamlit_options_hint(parser, argv)
    args = parser.parse_args(argv)
    for stream in (sys.stdout, sys.stderr):  # a non-UTF-8 file name prints escaped, not as a traceback
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass
    try:
        return _command(args.command)(args)
    except TraceError as err:
        print(f"tracer {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `tracer diff A B | head`: the reader went away; exit quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit must not fail again
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
