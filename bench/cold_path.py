"""The cold paths, measured side by side in one run on this machine: the command line (``tracer
--help``, ``tracer info`` on a 200-step run) against a bare interpreter start, and the viewer's
cold start to the first token view (a real browser) against a bare Streamlit page's cold start,
then the viewer's warm step change and its server's RSS.

    python -m bench.cold_path [--steps 200] [--B 64] [--T 256] [--rounds 3] [--changes 5]
                              [--before 370a30e | --before none] [--skip-cli] [--json FILE]

The trace: :mod:`bench.viewer_traces` (GRPO, every canonical field, 200 steps x 64 rows x 256
tokens by default, written once and cached under /tmp). About 2 minutes on 2 cores.

- Command line: ``bench.cli_cold.measure_cli`` (a bare ``python -c pass``, ``tracer --help``,
  ``tracer diff --help``, a bad argument, ``tracer info`` on the trace), or where that module is
  absent :func:`measure_cli` here: each command a fresh process (``python -m tracer ...``), wall
  time from the launch to its exit and its peak RSS (GNU time's ``%M``), medians of ``--rounds``.
- Viewer: a fresh ``streamlit run`` server per round (headless, 127.0.0.1, through
  ``bench/streamlit_timed.py``, which logs every script run), a one-line app's (``st.write``) and
  the app's in turn, the order rotating: the app as ``streamlit run app/streamlit_app.py`` and as
  ``streamlit run app/server.py`` (the same script served by ``st.App``, whose start-up imports the
  first page's modules while the browser loads, :mod:`app.server`); one headless Chromium (/usr/bin/chromium through
  Playwright, ``--headless --no-sandbox --disable-gpu --disable-background-networking``) started
  before either. ``cold start`` = from the launch of ``streamlit run`` until the page's content
  is visible in a new browser context and the app is idle (no status widget, nothing stale, no
  script run still going): for the app, ``/tokens?run=.&step=0&seq=0`` showing
  ``step 0 · inner 0 · mb 0 · rank 0 · sequence 0``; for the bare page, its one line. Split into
  ``server up`` (launch to the first answer of ``/_stcore/health``) and ``first view`` (browser
  navigation to visible). ``server CPU``: user + system seconds of the server process up to then.
- ``--before REF``: the app of commit REF as well (``app/`` and ``tracer/`` through ``git archive``,
  the repository untouched), the same measurements side by side.
- Warm step change (the app's server after its cold start, same session): from the Enter in the
  sidebar's Step file box to the next step's token view shown and idle, median of ``--changes``
  distinct steps. Server RSS (``VmRSS``) after the first view and after the step changes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import viewer_traces
from bench.common import machine, median
from bench.viewer_browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    REPO,
    Server,
    choose,
    extract_app,
    step_label,
    wait_shown,
)

BARE_TEXT = "bare streamlit page"
BARE_APP = f'import streamlit as st\nst.write("{BARE_TEXT}")\n'


def run_process(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds from launch to exit and peak RSS (MiB) of one fresh process; raises when it
    fails. The peak comes from ``/usr/bin/time -f %M`` (a small parent): a child forked straight
    from this process would inherit its high-water mark (Linux keeps ``maxrss`` across exec), and
    this process holds torch. The wall time includes ``time``'s own fork (~1 ms)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        t0 = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-o", rss.name, "-f", "%M", *cmd], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd} exited {proc.returncode}: {proc.stderr[-2000:]}")
        return wall, int(rss.read().split()[-1]) / 1024


def measure_cli(run_dir: Path, rounds: int) -> dict[str, tuple[float, float]]:
    """(median wall s, median peak RSS MiB) of a bare interpreter start, ``tracer --help`` and
    ``tracer info RUN``, each ``rounds`` times, interleaved."""
    commands = {"bare python -c 'import json, argparse'": [sys.executable, "-c", "import json, argparse"],
                "tracer --help": [sys.executable, "-m", "tracer", "--help"],
                "tracer info (200-step run)": [sys.executable, "-m", "tracer", "info", str(run_dir)]}
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, cmd in commands.items():
            samples[name].append(run_process(cmd))
    return {name: (median([s[0] for s in xs]), median([s[1] for s in xs])) for name, xs in samples.items()}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cold_view(browser, server: Server, path: str, text: str) -> tuple[dict[str, float], object, object]:
    """Open ``path`` in a new browser context on a just-started ``server`` and wait until ``text``
    is shown and the app idle. Returns the cold start split and the server's CPU and RSS then,
    and the browser context and page (still open)."""
    context = browser.new_context(viewport={"width": 1600, "height": 1200})
    page = context.new_page()
    t0 = time.time()
    page.goto(f"{server.url}/{path}")
    first_view, script_s, _ = wait_shown(page, server, t0, text)
    shown = t0 + first_view
    return {"cold_s": shown - server.launched, "server_up_s": server.ready - server.launched,
            "first_view_s": first_view, "script_s": script_s, "server_cpu_s": cpu_s(server.proc.pid),
            "rss_mb": server.rss_mb()}, context, page


# The viewer's two entries: the script itself, and app/server.py (st.App whose start-up imports the
# first page's modules while the browser loads; tracer view's entry once it runs it).
ENTRIES = {"tracer streamlit_app.py": "app/streamlit_app.py", "tracer server.py": "app/server.py"}


def measure_viewer(trace: Path, rounds: int, changes: int, steps: int, logs: Path,
                   before: Path | None = None) -> dict[str, dict[str, float]]:
    """Cold starts of the bare page and of each of the app's :data:`ENTRIES` (``rounds`` fresh
    servers each, the order rotating), warm step changes and RSS on each app server of the last
    round. Medians. ``before``: also the app of an earlier commit (``app/`` and ``tracer/``
    extracted there, :func:`bench.viewer_browser.extract_app`), as ``streamlit run
    app/streamlit_app.py``."""
    from playwright.sync_api import sync_playwright

    bare_script = logs / "bare_app.py"
    bare_script.write_text(BARE_APP)
    apps = {side: (REPO, REPO / entry) for side, entry in ENTRIES.items()}
    if before is not None:
        apps["before: streamlit_app.py"] = (before, before / "app" / "streamlit_app.py")
    sides = ["bare", *apps]
    samples: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for r in range(rounds):
                for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                    if side == "bare":
                        with Server(REPO, None, logs / "bare.jsonl", script=bare_script) as server:
                            out, context, _ = cold_view(browser, server, "", BARE_TEXT)
                            context.close()
                    else:
                        repo, script = apps[side]
                        with Server(repo, trace, logs / f"app{list(apps).index(side)}.jsonl", script=script) as server:
                            out, context, page = cold_view(browser, server, "tokens?run=.&step=0&seq=0",
                                                           f"{step_label(0)} · sequence 0")
                            if r == rounds - 1:
                                out.update(warm_changes(page, server, changes, steps))
                            context.close()
                    samples[side].append(out)
        finally:
            browser.close()
    return {side: {k: median([s[k] for s in xs if k in s]) for k in xs[-1]} for side, xs in samples.items()}


def warm_changes(page, server: Server, changes: int, steps: int) -> dict[str, float]:
    """``changes`` step changes on the Tokens page (distinct steps, never visited): median seconds
    from the Enter to the new step shown and idle; the server's RSS after them."""
    times, scripts, runs = [], [], []
    for k in range(1, changes + 1):
        step = (k * 37) % steps
        t0 = choose(page, "Step file", step_label(step))
        wall, script_s, n_runs = wait_shown(page, server, t0, f"{step_label(step)} · sequence 0")
        times.append(wall)
        scripts.append(script_s)
        runs.append(n_runs)
    return {"warm_step_change_s": median(times), "warm_step_change_max_s": max(times),
            "warm_script_s": median(scripts), "warm_runs": max(runs), "rss_after_changes_mb": server.rss_mb()}


def report(cli: dict, viewer: dict, args) -> list[str]:
    """The printed table, as lines."""
    lines = [f"Machine: {machine()}", f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", ""]
    bare_wall = next(iter(cli.values()))[0]
    lines += [f"Command line (fresh process each, median of {args.rounds}):",
              f"  {'command':40s} {'wall s':>7s} {'+ vs bare':>9s} {'peak RSS MiB':>12s}"]
    for name, (wall, rss) in cli.items():
        lines.append(f"  {name:40s} {wall:7.3f} {wall - bare_wall:+9.3f} {rss:12.1f}")
    b = viewer["bare"]
    apps = [side for side in viewer if side != "bare"]
    lines += ["", (f"Viewer, {args.steps} steps x {args.B} x {args.T}, cold start to first token view in Chromium "
                   f"(median of {args.rounds} fresh servers each; ratio: to the bare page):"),
              f"  {'':34s} {'bare st.write':>14s}" + "".join(f" {side:>24s} {'ratio':>6s}" for side in apps)]
    for key, label in (("cold_s", "cold start (launch to shown), s"), ("server_up_s", "  server up, s"),
                       ("first_view_s", "  first view (goto to shown), s"), ("script_s", "  script runs, s"),
                       ("server_cpu_s", "server CPU until shown, s"), ("rss_mb", "server RSS when shown, MiB")):
        lines.append(f"  {label:34s} {b[key]:14.2f}" + "".join(
            f" {viewer[side][key]:24.2f} {viewer[side][key] / max(b[key], 1e-3):5.2f}x" for side in apps))
    for side in apps:
        t = viewer[side]
        lines.append(f"  {side}: warm step change (Tokens, median of {args.changes}; max) "
                     f"{t['warm_step_change_s']:.2f} s; {t['warm_step_change_max_s']:.2f} s (script runs "
                     f"{t['warm_script_s']:.2f} s, at most {t['warm_runs']:.0f} a change); server RSS after the "
                     f"step changes {t['rss_after_changes_mb']:.0f} MiB")
    lines += ["", ("Goals (issue 49): CLI <= bare + 0.4 s and < 100 MB; viewer cold start <= 2x the bare page's, "
                   "RSS <= 300 MiB, warm step change <= 0.5 s.")]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--T", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes / servers per side (medians)")
    parser.add_argument("--changes", type=int, default=5, help="warm step changes on the app (median)")
    parser.add_argument("--skip-cli", action="store_true")
    parser.add_argument("--before", default="370a30e", help="git ref of the app to compare with (issue 49's "
                        "starting point), or 'none'")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    trace = viewer_traces.ensure(args.steps, args.B, args.T, log=print)
    cli = {}
    if not args.skip_cli:  # helper module of the CLI's own benchmark when there, else the commands above
        if importlib.util.find_spec("bench.cli_cold") is not None:
            from bench import cli_cold

            cli = cli_cold.measure_cli(trace, args.rounds)
        else:
            cli = measure_cli(trace, args.rounds)
    logs = Path(tempfile.mkdtemp(prefix="cold_path_"))
    before = None if args.before == "none" else extract_app(args.before)
    viewer = measure_viewer(trace, args.rounds, args.changes, args.steps, logs, before)
    lines = report(cli or {"(skipped)": (0.0, 0.0)}, viewer, args)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"cli": cli, "viewer": viewer}, indent=1))


if __name__ == "__main__":
    main()
