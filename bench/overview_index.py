"""The run overview at 10,000 vs 10 steps, with the run's summary index (``summary_index.rank_0.jsonl``,
:mod:`tracer.format.run_index`) and without it (every step file's header read, as for traces written
before the index existed), and the Steps page opening and drawing its curves on both traces.

Timed in alternating rounds (the order rotates each round), on two GRPO traces of 8 x 64 tokens
(14 fields) written by the real writer, each under its own app root:

- ``step_summary()`` of a freshly opened ``Trace`` (the Steps page's curves, ``tracer info``'s
  overview), with the index and with the index hidden (``run_index.index_paths`` patched to find
  none, so the reader takes the header path);
- the Steps page, server side: Streamlit's ``AppTest`` runs the real app script on the Steps page
  of a new session with the app's caches cleared (``trace_cache.clear_caches``), i.e. the trace is
  opened, listed, summarised and the figure built and serialised; the run checks that the figure
  holds one point per step in each panel;
- the Groups page's first view, the same way (its zero-variance share over steps), with the
  counts from the step summaries and with them hidden (every step's rewards read, as before the
  summaries held them); the run checks one share per step.

Since the third pass the writer also compacts the index into columns at close
(``summary_index.rank_0.columns``, :mod:`tracer.format.summary_store`): "with the index" reads those, and
"headers, no index" hides both. ``--cpu`` also prints the script thread's CPU time of each page
(``time.thread_time``: what the page costs apart from AppTest's own work and other processes).

Target: the 10,000-step trace opens and draws its curves within 2x the 10-step one.

    python -m bench.overview_index [--big 10000] [--rounds 5] [--cpu]
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

from bench.common import machine, median
from bench.overview_scale import build, spread
from tracer.format import run_index
from tracer.read import Trace

REPO = Path(__file__).resolve().parents[1]


def no_index():
    """A context in which readers find no summary index (the header path of older traces)."""
    return mock.patch.object(run_index, "index_paths", return_value=[])


def summary_seconds(run: Path, indexed: bool) -> float:
    t0 = time.perf_counter()
    if indexed:
        frame = Trace(run).step_summary()
    else:
        with no_index():
            frame = Trace(run).step_summary()
    seconds = time.perf_counter() - t0
    assert frame.attrs["from_index"] == (len(frame) if indexed else 0), frame.attrs
    assert (frame["summary_source"] == "header").all()
    return seconds


CPU: dict[str, float] = {}  # the last page run's script-thread CPU seconds (--cpu)


def _timed_script_thread() -> None:
    """Record the script thread's CPU time of every AppTest run in :data:`CPU`."""
    from streamlit.testing.v1 import local_script_runner

    real = local_script_runner.LocalScriptRunner._run_script_thread
    if getattr(real, "_timed", False):
        return

    def timed(self):
        t0 = time.thread_time()
        try:
            real(self)
        finally:
            CPU["last"] = time.thread_time() - t0

    timed._timed = True
    local_script_runner.LocalScriptRunner._run_script_thread = timed


def _app(run: Path, page: str):
    from streamlit.testing.v1 import AppTest

    from app.components import trace_cache

    os.environ["TRACER_ROOT"] = str(run.parent)
    at = AppTest.from_file(str(REPO / "app" / "streamlit_app.py"), default_timeout=600)
    at.query_params.update({"run": run.name})
    trace_cache.clear_caches()
    return at.switch_page(page)


def page_seconds(run: Path, indexed: bool) -> float:
    """Server time of the Steps page of ``run`` in a new session with cold caches."""
    at = _app(run, "app_pages/steps.py")
    t0 = time.perf_counter()
    if indexed:
        at.run()
    else:
        with no_index():
            at.run()
    seconds = time.perf_counter() - t0
    assert not at.exception, [e.value for e in at.exception]
    charts = at.get("plotly_chart")
    assert len(charts) == 1, "the Steps page drew no figure"
    steps = len(Trace(run).steps())
    curves = json.loads(charts[0].proto.spec)["data"]
    assert curves and all(_points(c["x"]) == steps for c in curves), "a curve lacks points"
    return seconds


def groups_seconds(run: Path, from_summaries: bool) -> float:
    """Server time of the Groups page of ``run`` (its first view) in a new session with cold caches;
    without ``from_summaries`` the summaries' group counts are hidden (every step's rewards read)."""
    from tracer.views import groups

    at = _app(run, "app_pages/groups.py")
    t0 = time.perf_counter()
    if from_summaries:
        at.run()
    else:
        with mock.patch.object(groups, "_summarised_group_counts", lambda keys, summary: ([False] * len(keys), {})):
            at.run()
    seconds = time.perf_counter() - t0
    assert not at.exception, [e.value for e in at.exception]
    table = next(d.value for d in at.dataframe if "zero_variance_share" in d.value.columns)
    assert len(table) == len(Trace(run).steps()), "a step lacks its share"
    return seconds


def _points(values) -> int:
    """Number of values in a Plotly JSON array (a list, or a typed array ``{"dtype", "bdata"}``)."""
    if isinstance(values, dict):
        return int(np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).size)
    return len(values)


def measure(big: int = 10_000, rounds: int = 5, groups_big: int = 2_000, cpu: bool = False) -> dict:
    logging.getLogger("streamlit").setLevel(logging.ERROR)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if cpu:
        _timed_script_thread()
    with tempfile.TemporaryDirectory() as tmp:
        sizes = sorted({10, big, groups_big})
        runs = {n: build(Path(tmp) / f"root_{n}", n, 8, 64) for n in sizes}
        cases = {(what, n, indexed): (what, runs[n], indexed)
                 for what in ("summary", "page") for n in (10, big) for indexed in (True, False)}
        cases.update({("groups", n, fast): ("groups", runs[n], fast) for n in (10, groups_big) for fast in (True, False)})
        fns = {"summary": summary_seconds, "page": page_seconds, "groups": groups_seconds}
        for what, run, indexed in cases.values():  # warm the page cache and the imports
            fns[what](run, indexed)
        names, times = list(cases), {name: [] for name in cases}
        cpu_times: dict[tuple, list[float]] = {name: [] for name in cases}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                what, run, indexed = cases[name]
                CPU.pop("last", None)
                times[name].append(fns[what](run, indexed))
                if "last" in CPU:
                    cpu_times[name].append(CPU["last"])
    return {"big": big, "groups_big": groups_big, "rounds": rounds, "times": times, "cpu": cpu_times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big", type=int, default=10_000)
    parser.add_argument("--groups-big", type=int, default=2_000, help="steps of the Groups page's large trace")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="also print each page's script-thread CPU time")
    args = parser.parse_args()
    print(machine())
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    r = measure(args.big, args.rounds, args.groups_big, args.cpu)
    t, c, big, gbig = r["times"], r["cpu"], r["big"], r["groups_big"]
    print(f"large vs 10 steps of 8 x 64, median (min-max) of {r['rounds']} alternating rounds:")
    rows = [("summary", "step_summary()", big, ((True, "with the index"), (False, "headers, no index"))),
            ("page", "Steps page, cold (AppTest)", big, ((True, "with the index"), (False, "headers, no index"))),
            ("groups", "Groups page, cold (AppTest)", gbig, ((True, "summary counts"), (False, "rewards read")))]
    for what, label, n, hows in rows:
        for indexed, how in hows:
            large, small = t[(what, n, indexed)], t[(what, 10, indexed)]
            print(f"  {label:28} {how:18} {n:>6} steps {spread(large):>22} vs {spread(small):>18}  -> "
                  f"{median(large) / median(small):6.2f}x")
            if c[(what, n, indexed)] and c[(what, 10, indexed)]:
                cl, cs = c[(what, n, indexed)], c[(what, 10, indexed)]
                print(f"  {'':28} {'  script CPU':18} {'':>12} {spread(cl):>22} vs {spread(cs):>18}  -> "
                      f"{median(cl) / median(cs):6.2f}x")
    print(f"target: the Steps page at {big} steps within 2x of 10 steps (with the index)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
