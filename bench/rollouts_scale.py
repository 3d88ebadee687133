"""The Rollouts page on a 2,000-step x 64-row GRPO run (128,000 completions) against the same page on a
20-step x 64-row run (1,280 completions), side by side in one run, and the rollout table read from the
writer's row summaries against the same table computed from the step files' tensors.

Both runs are written by the real ``TraceWriter`` with the canonical GRPO fields of
``bench.viewer_traces.step_tensors`` (left-padded prompts, completions of varying length ending in EOS,
every logprob field, rewards with 3 components, group z-score advantages, a 4,096-word vocabulary), and
cached under ``<TMPDIR>/tracer-rollouts-bench/<VERSION>`` so that a second run skips the writing.

Measured on each run, through ``streamlit.testing.v1.AppTest`` on the real app (sidebar, navigation
and page, one script run each; the wall time of ``AppTest.run``):
  open (cold)   a new session on ``/rollouts?run=…``: the rollout table is read (from the summaries)
  open (warm)   another new session: the table is the process's cached one
  sort          sort by reward, descending (every row of the run, then page 1 sent)
  search        full-text search of a word over every row's text
  page          page 5 of the search result
The findings are left unchecked on both runs (``app.components.runs.MAX_CHECKED_BYTES`` set to -1: the
budget under which the Runs page, the sidebar and this page run ``tracer check`` on their own) so that
the same work is timed; what ``tracer check`` adds to the first open of a run under the bound is timed
apart (``run_checks`` on every step file of the small run), and so is, without
the app, ``rollout_frame`` from the summaries vs from the tensors (``source`` checked).
Ratios big / small are printed; the page is responsive when a sort, a search and a page change on
the big run each stay within about a second on this machine.

    python -m bench.rollouts_scale [--steps 2000] [--small 20] [--B 64] [--T 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from unittest import mock

from bench.common import machine, median
from bench.viewer_traces import HYPER, WordTokenizer, step_tensors

from app.components import runs as runs_component
from tracer.checks import run_checks
from tracer.format import rollout_store
from tracer.read import Trace
from tracer.read.rollouts import rollout_frame
from tracer.record.writer import TraceWriter

VERSION = "v1"  # bump when the generated content changes: the cache is keyed by it
CACHE = Path(os.environ.get("TRACER_BENCH_CACHE", tempfile.gettempdir())) / "tracer-rollouts-bench" / VERSION
APP = Path(__file__).resolve().parents[1] / "app" / "streamlit_app.py"
WORD = "kato"  # a word of the toy vocabulary (" ka" + "to" + ...): found in part of the completions


def ensure(steps: int, B: int, T: int, log=print) -> Path:
    """The cached run of ``steps`` steps of ``B`` x ``T`` under its own root folder, written first when
    missing (a ``.done`` marker says a previous write finished)."""
    out = CACHE / f"root_{steps}x{B}x{T}" / f"grpo_{steps}"
    if (out / ".done").is_file():
        return out
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    variants = [step_tensors(B, T, seed) for seed in range(8)]
    with TraceWriter(out, "grpo", tokenizer=WordTokenizer(), hyperparameters=HYPER, max_queue_steps=8) as writer:
        for step in range(steps):
            writer.record(step, variants[step % len(variants)])
    (out / ".done").write_text(f"{VERSION} {steps}x{B}x{T}\n")
    log(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return out


def _timed_run(at) -> float:
    t0 = time.perf_counter()
    at.run()
    elapsed = time.perf_counter() - t0
    if at.exception:
        raise RuntimeError(f"the page raised: {[e.value for e in at.exception]}")
    return elapsed


def page_operations(run: Path) -> dict[str, float]:
    """Seconds of each page operation (module doc) on ``run``, in one sequence of AppTest sessions."""
    from streamlit.testing.v1 import AppTest

    os.environ["TRACER_ROOT"] = str(run.parent)

    def session() -> AppTest:
        at = AppTest.from_file(str(APP), default_timeout=600)
        at.query_params.update({"run": run.name})
        at.switch_page("app_pages/rollouts.py")
        return at

    out = {"open (cold)": _timed_run(session())}
    at = session()
    out["open (warm)"] = _timed_run(at)
    at.selectbox(key="ro_sort").set_value("reward")
    at.toggle(key="ro_descending").set_value(True)
    out["sort"] = _timed_run(at)
    at.text_input(key="ro_search").set_value(WORD)
    out["search"] = _timed_run(at)
    at.number_input(key="ro_page").set_value(5)
    out["page"] = _timed_run(at)
    return out


def clear_app_caches() -> None:
    """Forget the process's cached traces and rollout frames (the next open is cold again)."""
    import streamlit as st

    st.cache_resource.clear()
    st.cache_data.clear()


def frame_sources(run: Path) -> dict[str, float]:
    """Seconds of ``rollout_frame`` from the row summaries and from the tensors (store ignored)."""
    t0 = time.perf_counter()
    frame = rollout_frame(Trace(run))
    summaries = time.perf_counter() - t0
    assert (frame["source"] == "summary").all(), frame["source"].value_counts()
    with mock.patch.object(rollout_store, "read_store", return_value={}):
        t0 = time.perf_counter()
        frame = rollout_frame(Trace(run))
        tensors = time.perf_counter() - t0
    assert (frame["source"] == "tensors").all()
    return {"rows": len(frame), "summaries": summaries, "tensors": tensors}


def checks_seconds(run: Path) -> tuple[float, int]:
    """Seconds of ``run_checks`` on every step file of ``run`` and the bytes of those files."""
    trace = Trace(run)
    size = sum(key.path.stat().st_size for key in trace.steps())
    t0 = time.perf_counter()
    run_checks(trace)
    return time.perf_counter() - t0, size


def measure(steps: int, small: int, B: int, T: int, rounds: int) -> dict:
    big_run, small_run = ensure(steps, B, T), ensure(small, B, T)
    times: dict[str, dict[str, list[float]]] = {"big": {}, "small": {}}
    with contextlib.ExitStack() as unchecked:
        unchecked.enter_context(mock.patch.object(runs_component, "MAX_CHECKED_BYTES", -1))
        for r in range(rounds):  # alternate the runs; every round starts cold
            for name, run in (("big", big_run), ("small", small_run))[:: 1 if r % 2 == 0 else -1]:
                clear_app_caches()
                for op, seconds in page_operations(run).items():
                    times[name].setdefault(op, []).append(seconds)
    return {"times": times, "sources": frame_sources(big_run), "small_sources": frame_sources(small_run),
            "checks": checks_seconds(small_run)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--small", type=int, default=20)
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--T", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(machine())
    t0 = time.perf_counter()
    r = measure(args.steps, args.small, args.B, args.T, args.rounds)
    big, small = r["times"]["big"], r["times"]["small"]
    print(f"Rollouts page, {args.steps} x {args.B} rows ({args.steps * args.B:,}) vs {args.small} x {args.B} "
          f"({args.small * args.B:,}), T = {args.T}; median (min-max) seconds of {args.rounds} rounds, AppTest:")
    print(f"  {'operation':<12} {'big':>18} {'small':>18} {'big/small':>10}")
    for op in big:
        b, s = big[op], small[op]
        print(f"  {op:<12} {median(b):8.3f} ({min(b):.2f}-{max(b):.2f}) {median(s):8.3f} ({min(s):.2f}-{max(s):.2f}) "
              f"{median(b) / median(s):9.1f}x")
    for label, src in (("big", r["sources"]), ("small", r["small_sources"])):
        print(f"rollout_frame of the {label} run ({src['rows']:,} rows): from summaries {src['summaries']:.2f} s, "
              f"from tensors {src['tensors']:.2f} s -> {src['tensors'] / src['summaries']:.1f}x faster from summaries")
    seconds, size = r["checks"]
    print(f"tracer check (run_checks) on the small run's {args.small} step files ({size / 1e6:.1f} MB): {seconds:.2f} s "
          f"({seconds / (size / 1e6):.2f} s per MB; {runs_component.budget_text()}, and pay it at their first open)")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
