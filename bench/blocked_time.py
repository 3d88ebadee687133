"""Time the training thread spends inside record() per step vs a plain copy of the same bytes.

record() validates shapes, builds the step metadata, clones the tensors and enqueues them; the
background thread does the rest. Target: <= 2x a plain ``clone()`` of the same tensors.
"""

from __future__ import annotations

import tempfile
import time

import torch

from bench.common import grpo_step_tensors, machine, median, nbytes
from tracer.writer import TraceWriter


def measure(steps: int = 60, B: int = 32, T: int = 256) -> dict:
    tensors = grpo_step_tensors(B, T)
    inside, copy = [], []
    with tempfile.TemporaryDirectory() as tmp:
        # a queue large enough that record() never waits for the disk: we time the staging itself
        with TraceWriter(tmp + "/run", "grpo", max_queue_steps=steps + 1, max_queue_bytes=2**34) as writer:
            for step in range(steps):
                t0 = time.perf_counter()
                writer.record(step, tensors)
                inside.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                _ = {k: v.clone() for k, v in tensors.items()}
                copy.append(time.perf_counter() - t0)
    return {"record_us": 1e6 * median(inside), "copy_us": 1e6 * median(copy),
            "ratio": median(inside) / median(copy), "bytes": nbytes(tensors)}


if __name__ == "__main__":
    print(machine())
    r = measure()
    print(f"blocked time: record() {r['record_us']:.0f} us vs plain copy {r['copy_us']:.0f} us of "
          f"{r['bytes'] / 1e6:.2f} MB -> ratio {r['ratio']:.2f} (target <= 2)")
