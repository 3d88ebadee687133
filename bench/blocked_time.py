"""Time the training thread spends inside record() per step vs a plain copy of the same bytes.

record() validates shapes, builds the step metadata, clones the tensors and enqueues them; the
background thread does the rest. Target: <= 2x a plain ``clone()`` of the same tensors.

Two regimes are measured. "spaced": steps ``gap_s`` apart, as in a training loop whose step takes
longer than the writer needs (the target). "back-to-back": record() called in a tight loop, so the
writer thread is always busy beside it and competes for the GIL and the cores (reported).

``--writer thread,process`` measures the writer thread and the writer process
(``TraceWriter(writer=...)``) in one run, one after the other, each against its own plain copies.

    python -m bench.blocked_time [--writer thread,process] [--steps 60]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from bench.common import grpo_step_tensors, machine, median, nbytes, trace_dir_line
from tracer.record.writer import TraceWriter


def _run(tensors, steps: int, gap_s: float, writer: str = "thread") -> tuple[list[float], list[float]]:
    inside, copy = [], []
    with tempfile.TemporaryDirectory() as tmp:
        # a queue large enough that record() never waits for the disk: we time the staging itself
        with TraceWriter(tmp + "/run", "grpo", max_queue_steps=steps + 1, max_queue_bytes=2**34,
                         writer=writer) as writer:
            writer.record(10**6, tensors)  # the writer process starts (1-2 s) before the timed steps
            writer.flush()
            for step in range(steps):
                # alternate which of the two runs first after the gap: the first one meets cold caches
                for first in ((True, False) if step % 2 else (False, True)):
                    if gap_s:
                        time.sleep(gap_s / 2)  # the rest of the training step
                    t0 = time.perf_counter()
                    if first:
                        writer.record(step, tensors)
                        inside.append(time.perf_counter() - t0)
                    else:
                        _ = {k: v.clone() for k, v in tensors.items()}
                        copy.append(time.perf_counter() - t0)
    return inside, copy


def measure(steps: int = 60, B: int = 32, T: int = 256, gap_s: float = 0.02, writer: str = "thread") -> dict:
    tensors = grpo_step_tensors(B, T)
    inside, copy = _run(tensors, steps, gap_s, writer)
    tight_inside, tight_copy = _run(tensors, steps, 0.0, writer)
    return {"record_us": 1e6 * median(inside), "copy_us": 1e6 * median(copy),
            "ratio": median(inside) / median(copy), "bytes": nbytes(tensors), "gap_ms": 1e3 * gap_s,
            "tight_ratio": median(tight_inside) / median(tight_copy)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writer", default="thread", help="comma-separated: thread, process (default thread)")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    print(machine())
    print(trace_dir_line())
    for kind in args.writer.split(","):
        r = measure(steps=args.steps, writer=kind)
        print(f"blocked time, writer {kind}: record() {r['record_us']:.0f} us vs plain copy {r['copy_us']:.0f} us of "
              f"{r['bytes'] / 1e6:.2f} MB, steps {r['gap_ms']:.0f} ms apart -> ratio {r['ratio']:.2f} (target <= 2); "
              f"back-to-back: {r['tight_ratio']:.2f}")
