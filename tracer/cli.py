"""Command line: ``python -m tracer {demo, info, view, diff, check, run}`` (also installed as ``tracer``).

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
import errno
import importlib
import importlib.util
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from tracer.demo.sampler_faults import VLLM_BUGS
from tracer.errors import TraceError

# Only the standard library and light modules above: `tracer --help` and a mistyped option answer
# without importing torch, pandas or the reader (seconds of start-up); each command imports what it uses
# (even importlib.metadata, for --version, and the view server's urllib: ~40 ms of a 0.1 s start).

REPO_ROOT = Path(__file__).resolve().parent.parent
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
    (tests/scripts/fuzz_headers.py does), without importing the reader for every command; so does
    ``serve`` (:func:`tracer.view_server.serve`, urllib's import paid by ``tracer view`` only)."""
    if name in ("trace_info", "print_info"):
        return getattr(importlib.import_module("tracer.read.trace_info"), name)
    if name == "serve":
        return importlib.import_module("tracer.view_server").serve
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
    view.add_argument("--port", type=int, default=8501, help="port (default 8501)")
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
                          description="Compare two traces field by field, mask-aware (docs/regression-testing.md). "
                                      "Exit code: 0 equal within tolerance, 1 different, 2 unusable input.")
    diff.add_argument("a", help="reference trace directory or step file (the baseline)")
    diff.add_argument("b", help="candidate trace directory or step file")
    diff.add_argument("--json", action="store_true", help="print the report as JSON")
    diff.add_argument("--atol", action="append", default=[], metavar="[FIELD=]X",
                      help="absolute tolerance for FIELD (or every float field); repeatable")
    diff.add_argument("--rtol", action="append", default=[], metavar="[FIELD=]X",
                      help="relative tolerance (of |a|) for FIELD (or every float field); repeatable")
    diff.add_argument("--fields", action="append", default=[], metavar="F1,F2",
                      help="compare only these fields (comma-separated; repeatable)")
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


def _cmd_demo(args: argparse.Namespace) -> int:
    from tracer.demo.runner import run_demo

    if args.name is not None and args.algo is not None and args.name != args.algo:
        raise TraceError(f"demo {args.name} --algo {args.algo}: name one demo, either as `tracer demo {args.name}` "
                         f"or with --algo {args.name}")
    args.algo = args.name or args.algo or "grpo"
    if args.steps < 1:
        raise TraceError(f"--steps must be >= 1, got {args.steps}")
    if args.leak_tool_output and args.algo != "agent":
        raise TraceError(f"--leak-tool-output applies to the agent demo only, not {args.algo}")
    if args.bug is not None and args.algo != "grpo-vllm":
        raise TraceError(f"--bug applies to --algo grpo-vllm only, not {args.algo}")
    if args.rollout != "hf" and args.algo not in ("grpo", "cispo"):
        raise TraceError(f"--rollout {args.rollout} applies to --algo grpo and cispo only, not {args.algo}")
    if (args.algo == "grpo-vllm" or args.rollout == "vllm") and importlib.util.find_spec("vllm") is None:
        what = "--algo grpo-vllm" if args.algo == "grpo-vllm" else "--rollout vllm"
        raise TraceError(f"{what} needs vLLM in this environment: `make .venv-vllm` builds one "
                         "(torch 2.13.0 first, then pip install -e '.[vllm]'); see docs/vllm.md")
    missing = [m for m in ("transformers", "tokenizers")
               + (("trl",) if args.algo.endswith(("-trl", "-vllm")) or args.algo == "agent" else ())
               if importlib.util.find_spec(m) is None]
    if missing:
        raise TraceError(f"--algo {args.algo} needs {', '.join(missing)} (its tiny model is a transformers model"
                         f"{', trained by TRL' if 'trl' in missing else ''}): install the trl extra, "
                         "pip install 'tracer[trl]' (from a checkout: pip install -e '.[trl]')")
    out_path = Path(args.out)
    blocker = next((p for p in (out_path, *out_path.parents) if (p.exists() or p.is_symlink()) and not p.is_dir()),
                   None)
    if blocker is not None:
        what = "a link to nothing" if blocker.is_symlink() and not blocker.exists() else "a file"
        raise TraceError(f"--out {args.out}: {blocker} is {what}, not a folder; pass a folder for the demo's "
                         "trace (and its tiny model)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = run_demo(args.algo, args.out, steps=args.steps, seed=args.seed, progress=True, bug=args.bug,
                   rollout=args.rollout, leak_tool_output=args.leak_tool_output)
    print(f"wrote trace to {out}; browse it with: python -m tracer view {out}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from tracer.read.trace_info import info_problem, print_info, trace_info

    _refuse_a_folder_of_traces(args.path, "info")
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


def _require_app_dependencies() -> None:
    missing = [name for name in ("streamlit", "plotly") if importlib.util.find_spec(name) is None]
    if missing:
        raise TraceError(f"the web UI needs {' and '.join(missing)}, which this environment lacks; "
                         "install the app extra from your checkout of tracer (the web UI lives in its app/ folder): "
                         "pip install -e '.[app]' (the 'tracer' package on PyPI is another project)")
    if not APP_ENTRY.is_file():
        raise TraceError(f"the web UI's files are not installed ({APP_ENTRY} is missing): the app lives in the "
                         "repository's app/ folder; install tracer from a checkout in editable mode: "
                         "pip install -e '/path/to/tracer[app]'")


def _require_free_port(port: int) -> None:
    """Fail before starting Streamlit when 127.0.0.1:``port`` is taken (Streamlit would otherwise
    print a traceback, or silently move to another port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Streamlit's server does
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise TraceError(f"port {port} is in use; pass --port, e.g. --port {port + 1}") from None
            raise TraceError(f"cannot listen on 127.0.0.1:{port} ({err.strerror}); pass another --port") from None


def _cmd_view(args: argparse.Namespace) -> int:
    from tracer.read import Trace, find_traces

    _require_app_dependencies()
    root = Path(args.path)
    if not root.exists():
        raise TraceError(f"{root} does not exist: expected a trace directory, a directory of traces or a step file")
    if root.is_dir() and not find_traces(root):
        raise TraceError(
            f"{root} holds no trace: expected a directory with manifest.json and steps/*.safetensors "
            "(written by tracer), or a directory of such directories")
    if root.is_file():
        Trace(root)  # validates a single step file
    _require_free_port(args.port)
    # -P (Python 3.11+): the current directory is not put on sys.path, so a click.py there cannot shadow Streamlit's
    isolate = ["-P"] if sys.version_info >= (3, 11) else []
    cmd = [sys.executable, *isolate, "-m", "streamlit", "run", str(APP_ENTRY), *STREAMLIT_OPTIONS,
           "--server.address", "127.0.0.1", "--server.port", str(args.port),
           "--", "--root", str(root.resolve())]
    return _serve(cmd, args.port, f"tracer: serving {root.resolve()} at http://127.0.0.1:{args.port} (Ctrl+C to stop)",
                  start_timeout_s=args.start_timeout)


def _echo(line: str) -> None:
    """Pass one line of the server's output on to tracer view's stdout (quietly, if that is gone)."""
    try:
        sys.stdout.write(line)
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


def _serve(cmd: list[str], port: int, announcement: str, start_timeout_s: float = 60.0) -> int:
    """Run the Streamlit server ``cmd`` (:func:`tracer.view_server.serve`): print ``announcement``
    (the URL) once it answers, then its output; report on stderr, exit code 1, a server that exits
    during start-up or does not answer within ``start_timeout_s`` seconds, with what it printed."""
    from tracer.view_server import EXITED, HEALTH_PATH, STOPPED, TIMED_OUT

    serve = globals().get("serve") or __getattr__("serve")  # a test may have put its own here
    run = serve(cmd, port, lambda: print(announcement, flush=True), _echo, start_timeout_s=start_timeout_s)
    if run.state in (EXITED, TIMED_OUT):
        what = (f"exited with code {run.code} before it answered" if run.state == EXITED else
                f"did not answer within {start_timeout_s:g} s (stopped it; a slow machine may need "
                f"--start-timeout {max(2 * start_timeout_s, 120):g})")
        print(f"tracer view: error: the Streamlit server {what} on http://127.0.0.1:{port}{HEALTH_PATH}; "
              f"it printed:\n{run.printed.rstrip() or '(nothing)'}", file=sys.stderr)
        return 1
    return 0 if run.state == STOPPED else run.code


def _cmd_diff(args: argparse.Namespace) -> int:
    from tracer.diff import diff, parse_tolerances

    fields = [f for group in args.fields for f in group.split(",") if f] or None
    report = diff(args.a, args.b, atol=parse_tolerances(args.atol, "--atol"),
                  rtol=parse_tolerances(args.rtol, "--rtol"), fields=fields, ignore_metadata=args.ignore_metadata)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format(args.max_locations, args.verbose))
    return 0 if report.equal else 1


def _refuse_a_folder_of_traces(path: str, command: str) -> None:
    """A folder that is not a trace but holds some (``runs/``): say which, rather than 'not a trace'
    (TraceError naming the first five and how to pass one to ``tracer <command>``)."""
    from tracer.read import find_traces

    folder = Path(path)
    if not folder.is_dir() or (folder / "manifest.json").exists() or (folder / "steps").is_dir():
        return
    inside = [t for t in find_traces(folder) if t != folder]
    if inside:
        shown = ", ".join(str(t) for t in inside[:5]) + (f" and {len(inside) - 5} more" if len(inside) > 5 else "")
        raise TraceError(f"{folder} is a folder of {len(inside)} trace(s), not a trace: pass one of them, "
                         f"e.g. tracer {command} {inside[0]} ({shown})")


def _select_and_path(args: argparse.Namespace) -> None:
    """``--select`` ids split at commas; a path written after them (``tracer check --select masks RUN``,
    which argparse hands to --select) taken back as the path when it names no check."""
    from tracer.checks import CHECKS, FAMILIES

    names = [part for item in (args.select or []) for part in item.split(",") if part]
    if args.path is None and names and names[-1] not in CHECKS and names[-1] not in FAMILIES:
        args.path = names.pop()
    if args.path is None:
        raise TraceError("no trace given: tracer check PATH [--select ID ...]")
    args.select = names or None


def _cmd_check(args: argparse.Namespace) -> int:
    if not args.sampler_ratio_bound > 1:
        raise TraceError(f"--sampler-ratio-bound must be > 1, got {args.sampler_ratio_bound}")
    thresholds = _thresholds(args.threshold)
    if args.path is None and not args.select:
        raise TraceError("no trace given: tracer check PATH [--select ID ...]")
    from rich.console import Console

    from tracer.checks import ERROR, WARNING, CheckOptions, has_errors, run_checks
    from tracer.checks.coverage import NOT_CHECKED
    from tracer.checks.report import render_findings

    _select_and_path(args)
    _refuse_a_folder_of_traces(args.path, "check")
    options = CheckOptions(sampler_ratio_bound=args.sampler_ratio_bound).with_thresholds(thresholds)
    from tracer.checks.guard_records import LAST_REUSE

    LAST_REUSE.clear()  # what this run reuses, not an earlier one's (--fresh reuses nothing)
    findings = run_checks(args.path, select=args.select, options=options, reuse_guard=not args.fresh)
    _say_what_was_reused()
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


def _say_what_was_reused() -> None:
    """One line on stderr when ``run_checks`` took step-check results from the live guard's findings
    file (:data:`tracer.checks.guard_records.LAST_REUSE`), so a user knows what was not recomputed."""
    from tracer.checks.guard_records import LAST_REUSE

    if LAST_REUSE.get("reused"):
        rerun = LAST_REUSE.get("rerun")
        print(f"tracer check: reused the live guard's step-check results for {LAST_REUSE['reused']} of "
              f"{LAST_REUSE['files']} step files (findings.rank_N.jsonl; --fresh recomputes them)"
              + (f"; checks that read other step files ran again on {rerun}" if rerun else ""), file=sys.stderr)


def _thresholds(items: list[str]) -> dict[str, float]:
    """``--threshold NAME=VALUE`` items as ``{name: value}``; TraceError for one without ``=`` or a number."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise TraceError(f"--threshold {item!r}: expected NAME=VALUE with a number, e.g. --threshold ref_kl=2.0")
    return out


def _cmd_run(args: argparse.Namespace) -> int:
    from tracer.zero_edit.script_runner import run_script
    from tracer.zero_edit.watch import Watcher, summary_logger

    meta = {}
    for text in args.meta:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise TraceError(f"--meta {text!r}: expected KEY=VALUE, e.g. --meta loss_reduction=token_mean")
        try:
            meta[key] = json.loads(value)
        except ValueError:
            meta[key] = value
    watcher = Watcher(args.algo, args.out, args.map, strict=args.strict, hyperparameters=meta, nothing_traced="ignore",
                      config={"script": args.script, "script_args": args.script_args}, guard=args.guard)
    summary_logger(always=True)  # the end-of-run summary reaches stderr whatever the script does with warnings
    code = run_script(args.script, args.script_args, watcher)
    if code == 0 and watcher.steps_recorded == 0:
        print(watcher.nothing_traced_message(), file=sys.stderr)
        return 3
    return code


COMMANDS = {"demo": _cmd_demo, "info": _cmd_info, "view": _cmd_view, "diff": _cmd_diff, "check": _cmd_check,
            "run": _cmd_run}


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
        return COMMANDS[args.command](args)
    except TraceError as err:
        print(f"tracer {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `tracer diff A B | head`: the reader went away; exit quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit must not fail again
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
