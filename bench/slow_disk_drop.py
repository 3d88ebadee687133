"""record() latency when the disk is slow and the queue is full: ``when_full="drop"`` must never
make the training thread wait on the disk.

``os.fsync`` is patched to sleep ``fsync_ms`` (a slow or contended disk: network storage, a busy
SSD); the queue holds 2 steps, so most steps are dropped. Each record() is timed, and side by side
a plain ``clone()`` of the same tensors; p50 / p99 / max of both are printed. Earlier, every
drop rewrote and fsynced the manifest on the training thread (p99 about one fsync).

    python -m bench.slow_disk_drop [FSYNC_MS ...]      (default 30 200)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings

from bench.common import grpo_step_tensors, machine
from tracer.record.writer import TraceWriter


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(fsync_ms: float, steps: int = 200, B: int = 32, T: int = 256, gap_s: float = 0.002) -> dict:
    tensors = grpo_step_tensors(B, T)
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(fsync_ms / 1000)
        real_fsync(fd)

    inside, copy = [], []
    os.fsync = slow_fsync
    try:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # one "dropped a step" warning per drop
            with TraceWriter(tmp + "/run", "grpo", max_queue_steps=2, when_full="drop") as writer:
                for step in range(steps):
                    time.sleep(gap_s)  # the rest of the training step: faster than the disk
                    t0 = time.perf_counter()
                    writer.record(step, tensors)
                    inside.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    _ = {k: v.clone() for k, v in tensors.items()}
                    copy.append(time.perf_counter() - t0)
                dropped = writer.dropped_steps
    finally:
        os.fsync = real_fsync
    return {"fsync_ms": fsync_ms, "steps": steps, "dropped": dropped,
            **{f"record_{q}_ms": 1e3 * _quantile(inside, v) for q, v in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))},
            **{f"copy_{q}_ms": 1e3 * _quantile(copy, v) for q, v in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))}}


if __name__ == "__main__":
    print(machine())
    for fsync_ms in [float(a) for a in sys.argv[1:]] or [30.0, 200.0]:
        r = measure(fsync_ms)
        print(f"slow disk ({r['fsync_ms']:.0f} ms fsync), when_full=drop, {r['steps']} steps 2 ms apart, "
              f"{r['dropped']} dropped: record() p50 {r['record_p50_ms']:.2f} / p99 {r['record_p99_ms']:.2f} / "
              f"max {r['record_max_ms']:.2f} ms vs plain copy p50 {r['copy_p50_ms']:.2f} / p99 "
              f"{r['copy_p99_ms']:.2f} / max {r['copy_max_ms']:.2f} ms -> p99 ratio "
              f"{r['record_p99_ms'] / r['copy_p99_ms']:.1f}x")
