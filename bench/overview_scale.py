"""The run overview (``Trace.step_summary()``: the Steps page's curves, ``tracer info``) vs reading
every step file's header, and at 10,000 vs 10 steps.

Three things are timed on the same trace, in alternating blocks (the order rotates each round):
``headers`` opens every step file and decodes its header (the floor: an overview must at least list
the steps); ``overview`` is ``step_summary()`` reading the summaries the writer stored in the
headers; ``tensors`` is ``step_summary()`` made to ignore them (what it did for traces without summaries, and
still does for older traces): it loads the summary fields of every step.
Targets: overview <= 3x headers on a 1,000-step 64 x 256 trace; 10,000 steps within 2x of 10 steps
per step file (the overview reads one header per step file, so its total grows with the steps).

    python -m bench.overview_scale [--steps 1000] [--big 10000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from unittest import mock

from bench.common import grpo_step_tensors, machine, median

from tracer.format import summary as summary_format
from tracer.read import Trace
from tracer.record.writer import TraceWriter

HYPER = {"num_generations": 8, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28, "beta": 0.04}


def build(root: Path, steps: int, B: int, T: int) -> Path:
    """A GRPO trace of ``steps`` steps, 14 fields each (a few distinct steps rotated: the values do
    not change the timing)."""
    variants = [grpo_step_tensors(B, T, seed=s) for s in range(4)]
    out = root / f"trace_{steps}_{B}x{T}"
    with TraceWriter(out, "grpo", hyperparameters=HYPER, max_queue_steps=64) as writer:
        for step in range(steps):
            writer.record(step, variants[step % len(variants)])
    return out


def headers(path: Path) -> int:
    trace = Trace(path)
    return sum(len(trace.metadata(key)) for key in trace.steps())


def overview(path: Path) -> int:
    frame = Trace(path).step_summary()
    assert (frame["summary_source"] == "header").all()
    return len(frame)


def from_tensors(path: Path) -> int:
    with mock.patch.object(summary_format, "read_summary", return_value=None):
        frame = Trace(path).step_summary()
    assert (frame["summary_source"] == "tensors").all()
    return len(frame)


def alternate(fns: dict, path: Path, rounds: int) -> dict[str, list[float]]:
    """Each of ``fns`` once per round, in an order that rotates; the seconds of every call."""
    names, times = list(fns), {name: [] for name in fns}
    for name in names:  # warm the page cache and the imports
        fns[name](path)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            fns[name](path)
            times[name].append(time.perf_counter() - t0)
    return times


def spread(xs: list[float]) -> str:
    return f"{1e3 * median(xs):.0f} ms ({1e3 * min(xs):.0f}-{1e3 * max(xs):.0f})"


def measure(steps: int = 1000, big: int = 10_000, rounds: int = 5, B: int = 64, T: int = 256) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        wide = build(root, steps, B, T)
        t = alternate({"headers": headers, "overview": overview, "tensors": from_tensors}, wide, rounds)
        del_wide = sum(p.stat().st_size for p in (wide / "steps").iterdir())
        small, large = build(root, 10, 8, 64), build(root, big, 8, 64)
        s_small = alternate({"overview": overview}, small, max(rounds, 20))["overview"]
        s_large = alternate({"overview": overview}, large, rounds)["overview"]
        h_large = alternate({"headers": headers}, large, rounds)["headers"]
    return {
        "steps": steps, "B": B, "T": T, "trace_mb": del_wide / 1e6, "times": t,
        "overview_vs_headers": median(t["overview"]) / median(t["headers"]),
        "tensors_vs_headers": median(t["tensors"]) / median(t["headers"]),
        "big": big, "small_ms": 1e3 * median(s_small), "large_ms": 1e3 * median(s_large),
        "large_headers_ms": 1e3 * median(h_large),
        "per_file_ratio": (median(s_large) / big) / (median(s_small) / 10),
        "large_vs_its_headers": median(s_large) / median(h_large),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--big", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(machine())
    r = measure(args.steps, args.big, args.rounds)
    t = r["times"]
    print(f"{r['steps']} steps of {r['B']} x {r['T']} ({r['trace_mb']:.0f} MB), median (min-max) of {args.rounds} "
          f"alternating rounds:")
    print(f"  read every header        {spread(t['headers'])}")
    print(f"  overview from headers    {spread(t['overview'])}  -> {r['overview_vs_headers']:.2f}x headers (target <= 3)")
    print(f"  overview from tensors    {spread(t['tensors'])}  -> {r['tensors_vs_headers']:.2f}x headers (before)")
    print(f"overview of {r['big']} vs 10 steps (8 x 64): {r['large_ms']:.0f} ms vs {r['small_ms']:.2f} ms; "
          f"per step file {r['per_file_ratio']:.2f}x (target <= 2); {r['large_vs_its_headers']:.2f}x its headers "
          f"({r['large_headers_ms']:.0f} ms)")


if __name__ == "__main__":
    main()
