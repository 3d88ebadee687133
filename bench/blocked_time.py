"""Time the training thread spends inside record() per step vs a plain copy of the same bytes.

record() validates shapes, builds the step metadata, clones the tensors and enqueues them; the
background thread does the rest. Target: <= 2x a plain ``clone()`` of the same tensors.

Two regimes are measured. "spaced": steps ``gap_s`` apart, as in a training loop whose step takes
longer than the writer needs (the target). "back-to-back": record() called in a tight loop, so the
writer thread is always busy beside it and competes for the GIL and the cores (reported).
"""

from __future__ import annotations

import tempfile
import time

import torch

from bench.common import grpo_step_tensors, machine, median, nbytes
from tracer.writer import TraceWriter


def _run(tensors, steps: int, gap_s: float) -> tuple[list[float], list[float]]:
    inside, copy = [], []
    with tempfile.TemporaryDirectory() as tmp:
        # a queue large enough that record() never waits for the disk: we time the staging itself
        with TraceWriter(tmp + "/run", "grpo", max_queue_steps=steps + 1, max_queue_bytes=2**34) as writer:
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


def measure(steps: int = 60, B: int = 32, T: int = 256, gap_s: float = 0.02) -> dict:
    tensors = grpo_step_tensors(B, T)
    inside, copy = _run(tensors, steps, gap_s)
    tight_inside, tight_copy = _run(tensors, steps, 0.0)
    return {"record_us": 1e6 * median(inside), "copy_us": 1e6 * median(copy),
            "ratio": median(inside) / median(copy), "bytes": nbytes(tensors), "gap_ms": 1e3 * gap_s,
            "tight_ratio": median(tight_inside) / median(tight_copy)}


if __name__ == "__main__":
    print(machine())
    r = measure()
    print(f"blocked time: record() {r['record_us']:.0f} us vs plain copy {r['copy_us']:.0f} us of "
          f"{r['bytes'] / 1e6:.2f} MB, steps {r['gap_ms']:.0f} ms apart -> ratio {r['ratio']:.2f} (target <= 2); "
          f"back-to-back: {r['tight_ratio']:.2f}")
