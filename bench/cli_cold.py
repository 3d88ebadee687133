"""The command line's cold start, measured side by side in one run (issue 49): a bare interpreter
start against ``tracer --help``, ``tracer diff --help``, a bad argument, and ``tracer info`` (table
and ``--json``) on a 200-step run, each a fresh process, the commands interleaved round by round so
that they share the machine's load.

    python -m bench.cli_cold [RUN] [--rounds 5] [--compare DIR]

RUN defaults to the cached 200 x 64 x 256 GRPO trace of :mod:`bench.viewer_traces` (written on first
use, minutes). Wall time from the launch to the exit (``time.perf_counter`` around the child) and the
command's peak RSS (GNU time's ``%M``); medians and minima over ``--rounds``.
``--compare DIR`` also runs the tracer commands from another copy of the package (a folder holding
``tracer/``, e.g. ``git archive <commit> tracer | tar -x -C DIR``), in the same rounds: before and
after, side by side. ``bench/cold_path.py`` imports :func:`measure_cli`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIME = "/usr/bin/time"  # GNU time: the child's peak RSS


def commands(run_dir: Path, compare: Path | None = None) -> dict[str, tuple[list[str], Path]]:
    """Name -> (argv, working folder) of each measured command; the first two are the bare starts.
    With ``compare``, each tracer command once more from that folder (``python -m tracer`` imports
    the ``tracer/`` of its working folder first)."""
    cmds = {name: (argv, REPO) for name, argv in _argvs(run_dir).items()}
    if compare is not None:
        cmds.update({f"[{compare.name}] {name}": (argv, compare) for name, argv in _argvs(run_dir).items()
                     if name.startswith("tracer")})
    return cmds


def _argvs(run_dir: Path) -> dict[str, list[str]]:
    py = sys.executable
    return {"bare python -c pass": [py, "-c", "pass"],
            "bare python -c 'import json, argparse'": [py, "-c", "import json, argparse"],
            "tracer --help": [py, "-m", "tracer", "--help"],
            "tracer diff --help": [py, "-m", "tracer", "diff", "--help"],
            "tracer info (bad argument, exit 2)": [py, "-m", "tracer", "info"],
            "tracer info RUN": [py, "-m", "tracer", "info", str(run_dir)],
            "tracer info RUN --json": [py, "-m", "tracer", "info", str(run_dir), "--json"]}


def run_once(cmd: list[str], cwd: Path = REPO) -> tuple[float, float, int]:
    """(wall s, peak RSS MiB, exit code) of one fresh process running ``cmd`` (output discarded).
    The peak RSS is GNU time's ``%M`` of the command: a child's own ``ru_maxrss`` would count the
    pages it shared with this process when it was forked (this process may hold torch)."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        t0 = time.perf_counter()
        code = subprocess.call([TIME, "-q", "-o", rss.name, "-f", "%M", *cmd], cwd=cwd,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        return wall, int(rss.read().split()[-1]) / 1024, code


def measure_cli(run_dir: Path, rounds: int) -> dict[str, tuple[float, float]]:
    """``{command: (median wall s, median peak RSS MiB)}`` of :func:`commands`, ``rounds`` fresh
    processes each, interleaved (one of each per round). Raises RuntimeError for a command whose
    exit code is not the expected one (0; 2 for the bad argument)."""
    return {name: (stats["wall_median"], stats["rss_median"])
            for name, stats in measure(run_dir, rounds).items()}


def measure(run_dir: Path, rounds: int, compare: Path | None = None) -> dict[str, dict[str, float]]:
    """Per command: ``wall_median``, ``wall_min``, ``rss_median`` (MiB), ``rss_max`` over ``rounds``."""
    cmds = commands(run_dir, compare)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cmds}
    for _ in range(rounds):
        for name, (cmd, cwd) in cmds.items():
            wall, rss, code = run_once(cmd, cwd)
            expected = 2 if "bad argument" in name else 0
            if code != expected:
                raise RuntimeError(f"{name}: {cmd} exited {code}, expected {expected}")
            samples[name].append((wall, rss))
    return {name: {"wall_median": statistics.median(w for w, _ in xs), "wall_min": min(w for w, _ in xs),
                   "rss_median": statistics.median(r for _, r in xs), "rss_max": max(r for _, r in xs)}
            for name, xs in samples.items()}


def report(figures: dict[str, dict[str, float]], rounds: int) -> list[str]:
    """The printed table: each command against the bare ``python -c pass``."""
    bare = figures["bare python -c pass"]
    lines = [f"  {'command (fresh process each, ' + str(rounds) + ' rounds)':56s} {'wall med':>8s} {'min':>6s} "
             f"{'+ vs bare':>9s} {'RSS MiB':>8s} {'max':>6s}"]
    for name, f in figures.items():
        lines.append(f"  {name:56s} {f['wall_median']:8.3f} {f['wall_min']:6.3f} "
                     f"{f['wall_median'] - bare['wall_median']:+9.3f} {f['rss_median']:8.1f} {f['rss_max']:6.1f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", type=Path, help="trace to run tracer info on (default: the 200-step bench trace)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", type=Path, help="a folder holding another tracer/ to run the same commands from")
    args = parser.parse_args()
    run_dir = args.run
    if run_dir is None:
        from bench import viewer_traces

        run_dir = viewer_traces.ensure(200, 64, 256, log=print)
    from bench.common import machine

    steps = len(list((run_dir / "steps").glob("*.safetensors")))
    print(f"Machine: {machine()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"Run: {run_dir} ({steps} step files)")
    print("\n".join(report(measure(run_dir, args.rounds, args.compare), args.rounds)))
    print("Goal (issue 49): tracer --help and tracer info <= bare + 0.4 s and < 100 MB.")


if __name__ == "__main__":
    main()
