"""The viewer in a real browser on big traces: first paint, step change and sequence change of the
Tokens, Step, Groups, Steps and Overview pages, as browser wall time and as server script time,
and the server's memory per browser session; this checkout's app and main's (``--before``) side
by side in one run.

    python -m bench.viewer_browser [--steps 200 2000] [--B 64] [--T 256] [--rounds 3]
                                   [--sessions 10] [--visits 100] [--before 046c1e1 | --before none]
                                   [--pages tokens step groups steps overview] [--json FILE]

About 13 minutes on 2 cores with the defaults (not in ``bench.run_all``). Traces:
:mod:`bench.viewer_traces` (GRPO, every canonical field, cached under /tmp by version; the
2,000-step one is 1.5 GB and takes ~15 s to write). Each app is started with ``streamlit run``
headless on 127.0.0.1 (``browser.gatherUsageStats=false``) through ``bench/streamlit_timed.py``,
which logs every script run (start, end, session) without changing the app. Both apps run at once
on the same trace; every measurement is taken on each in turn, the order alternating, ``--rounds``
times on distinct steps, and the medians are printed side by side. Headless Chromium
(/usr/bin/chromium through Playwright, never ``playwright install``) opens each page in a new
browser context (a new session):

- first paint: from ``page.goto`` until the page's own content (a text naming the chosen step or
  sequence) is visible and the app is idle: no status widget, nothing stale, and no script run
  still going in the server's log; ``cold``: the first session of a fresh server (imports,
  ``tokens.json``, every step header checked once, empty caches); ``first view``: the page's first
  session on the server (it computes the run-level tables that later sessions find cached), not a
  median; ``first``: the median over the rounds;
- step change / sequence change: from the Enter that picks another entry in the sidebar's Step
  file / Sequence box until the new content is visible and the app is idle.

Server time is the sum of the script runs that started after the action (or the navigation), up
to the moment it was visible: what Streamlit spent running the page (entry script, sidebar, page),
without the network and the browser's drawing. Sessions (on the biggest trace): the server's RSS
(``/proc/PID/status``) with 1 session open on the Tokens page and with ``--sessions`` open at once,
one step change in all of them at the same time, then RSS while one session visits ``--visits``
distinct steps (more than the caches hold: RSS must level off). Before = ``app/`` and ``tracer/``
of ``--before`` (``git archive``, extracted under the cache; the repository is not touched).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import io
import time
import urllib.request
from pathlib import Path

from bench import viewer_traces
from bench.common import machine, median

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
TIMEOUT_MS = 180_000
# What each page shows once it has run: a text that names the chosen step or sequence.
PAGES = {
    "tokens": ("tokens", "Tokens", "{label} · sequence {seq}"),
    "step": ("step", "Step", "step {step} · inner 0 ·"),
    "groups": ("groups", "Groups", "{label} ·"),
    "steps": ("steps", "Steps", "step files"),
    "overview": ("overview", "Run overview", "{label} ·"),
}


def extract_app(ref: str) -> Path:
    """``app/`` and ``tracer/`` of git ``ref`` in a directory of their own (read through
    ``git archive``: the repository is not changed), reused when already there."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", ref], check=True, capture_output=True,
                         text=True).stdout.strip()
    out = viewer_traces.CACHE / "apps" / sha
    if not (out / ".done").is_file():
        data = subprocess.run(["git", "-C", str(REPO), "archive", sha, "app", "tracer"], check=True,
                              capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(out, filter="data")
        (out / ".done").write_text(sha)
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """``streamlit run`` of the app under ``app_repo`` on ``root`` (headless, 127.0.0.1), its
    script runs logged to ``log``; a context manager that stops it (process group) on exit.
    ``script`` runs another Streamlit script instead (no ``--root``: a bare page for comparison).
    ``launched`` and ``ready`` are the ``time.time()`` of the launch and of the first answer of
    ``/_stcore/health`` (polled every 20 ms)."""

    def __init__(self, app_repo: Path, root: Path | None, log: Path, script: Path | None = None) -> None:
        self.app_repo, self.root, self.log, self.script = app_repo, root, log, script

    def __enter__(self) -> "Server":
        self.log.unlink(missing_ok=True)
        port = _free_port()
        env = {**os.environ, "PYTHONPATH": str(self.app_repo), "HF_HUB_OFFLINE": "1",
               "TRACER_BENCH_TIMING": str(self.log)}
        script = self.script or self.app_repo / "app" / "streamlit_app.py"
        cmd = [sys.executable, str(REPO / "bench" / "streamlit_timed.py"), "run",
               str(script), "--server.address", "127.0.0.1",
               "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
               "--server.fileWatcherType", "none"]
        if self.root is not None:
            cmd += ["--", "--root", str(self.root)]
        self.out = open(self.log.with_suffix(".out"), "w")
        self.launched = time.time()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"streamlit exited: {self.log.with_suffix('.out').read_text()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/_stcore/health", timeout=2):
                self.ready = time.time()
                return self
            if time.monotonic() > deadline:
                raise RuntimeError("streamlit did not answer in 90 s")
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.out.close()

    def runs(self) -> list[dict]:
        """The script runs logged so far (one dict per finished run)."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def rss_mb(self, field: str = "VmRSS") -> float:
        """The server's resident memory (``VmRSS``, or ``RssAnon`` / ``RssFile``), MiB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(field + r":\s+(\d+)", status).group(1)) / 1024

    def rss_split_mb(self) -> tuple[float, float]:
        """(anonymous, file-backed) resident MiB: mapped step files' pages are file-backed, shared
        with the page cache and reclaimable; the heap (tables, caches) is anonymous."""
        return self.rss_mb("RssAnon"), self.rss_mb("RssFile")


Timing = tuple[float, float, int]  # (browser wall s, server script s, script runs)


def wait_shown(page, server: Server, t0: float, text: str) -> Timing:
    """Block until ``text`` is in the main area, the app is idle in the browser (no status widget,
    nothing stale) and no run that started after ``t0`` is still going on the server.
    Returns (browser wall seconds since ``t0``, server script seconds, script runs)."""
    page.wait_for_function(
        """text => { const main = document.querySelector('[data-testid=stMain]');
                     return main && main.innerText.includes(text)
                       && !document.querySelector('[data-testid=stStatusWidget]')
                       && !document.querySelector('[data-stale=true]'); }""", arg=text, timeout=TIMEOUT_MS)
    shown = time.time()
    while True:  # the browser is idle; the server's run ended (it is logged when it ends)
        runs = [r for r in server.runs() if r["start"] >= t0 and not r["fragment"]]
        if runs and max(r["end"] for r in runs) <= time.time():
            break
        time.sleep(0.02)
    shown = max(shown, max(r["end"] for r in runs))
    return shown - t0, sum(r["end"] - r["start"] for r in runs), len(runs)


def type_choice(page, label: str, option: str) -> None:
    """Open the sidebar selectbox ``label`` and type ``option`` until its entry is listed (no Enter yet)."""
    box = page.get_by_role("combobox", name=label)
    box.click()
    box.fill(option)
    page.get_by_role("option").filter(has_text=option).first.wait_for()


def choose(page, label: str, option: str) -> float:
    """Type ``option`` into the sidebar selectbox ``label`` and press Enter; the time of the Enter."""
    type_choice(page, label, option)
    t0 = time.time()
    page.keyboard.press("Enter")
    return t0


_ARM = """text => { window.__shownAt = null;
    const poll = () => { const main = document.querySelector('[data-testid=stMain]');
        if (main && main.innerText.includes(text) && !document.querySelector('[data-testid=stStatusWidget]')
            && !document.querySelector('[data-stale=true]')) { window.__shownAt = Date.now(); }
        else { requestAnimationFrame(poll); } };
    requestAnimationFrame(poll); }"""


def concurrent_change(pages: list, server: Server, steps: list[int]) -> dict[str, float]:
    """One step change in every session at once: each box typed first, then Enter pressed in each in
    turn; each page notes (its own clock, ms) when its new step is shown and idle. Returns the
    median and max of the per-session latencies, the spread of the Enters and the server time."""
    for (_, page), step in zip(pages, steps):
        type_choice(page, "Step file", step_label(step))
    starts = []
    for (_, page), step in zip(pages, steps):
        page.evaluate(_ARM, f"{step_label(step)} · sequence 0")
        starts.append(time.time())
        page.keyboard.press("Enter")
    latencies = []
    for (_, page), t0 in zip(pages, starts):
        page.wait_for_function("window.__shownAt !== null", timeout=TIMEOUT_MS)
        latencies.append(page.evaluate("window.__shownAt") / 1000 - t0)
    runs = [r for r in server.runs() if r["start"] >= starts[0] and not r["fragment"]]
    return {"concurrent_median_s": median(latencies), "concurrent_max_s": max(latencies),
            "concurrent_enter_spread_s": starts[-1] - starts[0],
            "concurrent_server_s": sum(r["end"] - r["start"] for r in runs),  # overlapping runs add up
            "concurrent_server_span_s": max(r["end"] for r in runs) - min(r["start"] for r in runs),
            "concurrent_slowest_run_s": max(r["end"] - r["start"] for r in runs)}


def step_label(step: int) -> str:
    return f"step {step} · inner 0 · mb 0 · rank 0"


def _new_page(browser):
    context = browser.new_context(viewport={"width": 1600, "height": 1200})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    return context, page


def measure_page(browser, server: Server, name: str, first: int) -> dict[str, Timing]:
    """First paint (``?step=first``), step change (to ``first + 1``) and sequence change (to row 5)
    of one page in a new browser context (a new session)."""
    path, _, marker = PAGES[name]
    second = first + 1
    context, page = _new_page(browser)
    try:
        t0 = time.time()
        page.goto(f"{server.url}/{path}?run=.&step={first}&seq=0")
        out = {"first": wait_shown(page, server, t0, marker.format(label=step_label(first), step=first, seq=0))}
        t0 = choose(page, "Step file", step_label(second))
        out["step"] = wait_shown(page, server, t0, marker.format(label=step_label(second), step=second, seq=0))
        t0 = choose(page, "Sequence", "seq 5 ·")
        out["sequence"] = wait_shown(page, server, t0, marker.format(label=step_label(second), step=second, seq=5))
    finally:
        context.close()
    return out


def measure_sessions(browser, server: Server, steps: int, sessions: int, visits: int) -> dict[str, float]:
    """Memory and concurrency with ``sessions`` sessions on the Tokens page, each on a step of its
    own: server RSS with 1 session and with all open; one step change in every session at once
    (:func:`concurrent_change`); then RSS while one
    session visits ``visits`` more distinct steps, more than the caches hold (64 open files, 64
    token tables): bounded caches make RSS level off."""
    pages, out = [], {}
    try:
        for i in range(sessions):
            context, page = _new_page(browser)
            pages.append((context, page))
            step = (i * 97) % (steps - 1)
            t0 = time.time()
            page.goto(f"{server.url}/tokens?run=.&step={step}&seq=0")
            wait_shown(page, server, t0, f"{step_label(step)} · sequence 0")
            if i == 0:
                out["rss_1_session_mb"] = server.rss_mb()
        out[f"rss_{sessions}_sessions_mb"] = server.rss_mb()
        out["mb_per_extra_session"] = (server.rss_mb() - out["rss_1_session_mb"]) / max(sessions - 1, 1)
        out.update(concurrent_change(pages, server, [(i * 97) % (steps - 1) + 1 for i in range(sessions)]))
        out[f"rss_anon_{sessions}_sessions_mb"], out[f"rss_file_{sessions}_sessions_mb"] = server.rss_split_mb()
        page = pages[0][1]
        marks = {visits // 5, 3 * visits // 5, visits}
        for k in range(1, visits + 1):  # distinct steps (31 is prime to the step count)
            step = (k * 31 + 7) % steps
            t0 = choose(page, "Step file", step_label(step))
            wait_shown(page, server, t0, f"{step_label(step)} · sequence 0")
            if k in marks:
                out[f"rss_after_{k}_steps_mb"] = server.rss_mb()
                out[f"rss_anon_after_{k}_steps_mb"], out[f"rss_file_after_{k}_steps_mb"] = server.rss_split_mb()
    finally:
        for context, _ in pages:
            context.close()
    return out


def measure_trace(sides: dict[str, Path], trace: Path, steps: int, pages: list[str], rounds: int,
                  sessions: int, visits: int, logs: Path, flip: int = 0) -> dict:
    """Every side's server on ``trace`` at once; each measurement taken on every side in turn (the
    order alternating), ``rounds`` times on distinct steps; medians."""
    from playwright.sync_api import sync_playwright

    with contextlib.ExitStack() as stack:
        servers = {side: stack.enter_context(Server(repo, trace, logs / f"{side}_{steps}.jsonl"))
                   for side, repo in sides.items()}
        pw = stack.enter_context(sync_playwright())
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        stack.callback(browser.close)
        out = {side: {"rss_start_mb": server.rss_mb(), "pages": {}} for side, server in servers.items()}
        order = list(servers) if flip % 2 == 0 else list(servers)[::-1]  # who goes first alternates by trace
        for side in order:  # the first session of a fresh server: imports, tokens.json, empty caches
            context, page = _new_page(browser)
            t0 = time.time()
            page.goto(f"{servers[side].url}/tokens?run=.&step=0&seq=0")  # / is the Runs page
            out[side]["cold_first"] = wait_shown(page, servers[side], t0, f"{step_label(0)} · sequence 0")
            context.close()
        for name in pages:
            samples = {side: [] for side in servers}
            for r in range(rounds):
                for side in (order if r % 2 == 0 else order[::-1]):
                    samples[side].append(measure_page(browser, servers[side], name, (steps // 3 + 17 * r) % (steps - 1)))
            for side in servers:
                out[side]["pages"][name] = {what: tuple(median([s[what][i] for s in samples[side]]) for i in range(3))
                                            for what in ("first", "step", "sequence")}
                # the page's first session on this server: the run-level tables (Steps' curves, the
                # Groups page's zero-variance shares) are computed then, and cached for every session
                out[side]["pages"][name]["first view"] = samples[side][0]["first"]
        if sessions:
            for side in order:
                out[side]["sessions"] = measure_sessions(browser, servers[side], steps, sessions, visits)
                out[side]["rss_end_mb"] = servers[side].rss_mb()
    return out


def _cell(value: Timing | None) -> str:
    return "-" if value is None else f"{value[0]:5.2f} / {value[1]:5.2f}"


def report(results: dict, pages: list[str]) -> None:
    """Print one table per trace: browser / server seconds, after vs before and the ratio."""
    for trace, sides in results.items():
        after, before = sides["after"], sides.get("before")
        print(f"\n{trace}: browser wall s / server script s, medians"
              f"{'  (after | before | ratio before/after)' if before else ''}")
        rows = [("first page, cold server", after["cold_first"], before and before["cold_first"])]
        for name in pages:
            for what in ("first view", "first", "step", "sequence"):
                if what in after["pages"][name]:
                    rows.append((f"{name}: {what}", after["pages"][name][what], before and before["pages"][name][what]))
        for label, a, b in rows:
            ratio = f" | {_cell(b)} | {b[0] / a[0]:4.1f}x / {b[1] / max(a[1], 1e-3):4.1f}x" if b else ""
            print(f"  {label:26s} {_cell(a)}{ratio}")
        if "sessions" in after:
            print("  sessions on this trace (after" + (" | before)" if before else ")"))
            print(f"    {'RSS at start, MiB':36s} {after['rss_start_mb']:8.1f}"
                  + (f" | {before['rss_start_mb']:8.1f}" if before else ""))
            for name, value in after["sessions"].items():
                other = before["sessions"].get(name) if before and "sessions" in before else None
                print(f"    {name:36s} {value:8.2f}" + (f" | {other:8.2f}" if other is not None else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[200, 2000])
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--T", type=int, default=256)
    parser.add_argument("--sessions", type=int, default=10, help="concurrent sessions on the biggest trace (0: skip)")
    parser.add_argument("--visits", type=int, default=100, help="distinct steps one session then visits (RSS bound)")
    parser.add_argument("--before", default="046c1e1", help="git ref of the app to compare with, or 'none'")
    parser.add_argument("--pages", nargs="+", default=list(PAGES), choices=list(PAGES))
    parser.add_argument("--rounds", type=int, default=3, help="measurements per page and side (medians)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    print(f"Machine: {machine()}; load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    logs = viewer_traces.CACHE / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sides = {"after": REPO} if args.before == "none" else {"after": REPO, "before": extract_app(args.before)}
    results = {}
    for i, steps in enumerate(args.steps):
        trace = viewer_traces.ensure(steps, args.B, args.T, log=print)
        sessions = args.sessions if steps == max(args.steps) else 0
        results[f"{steps} steps x {args.B} x {args.T}"] = measure_trace(
            sides, trace, steps, args.pages, args.rounds, sessions, args.visits, logs, flip=i)
    report(results, args.pages)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
