"""Peak memory held by the tracer's queue vs its configured budget.

A loop records steps faster than the disk takes them (the writer is slowed down artificially by a
delay per file), with ``when_full="block"`` and a small byte budget. The writer's own accounting
(``peak_queued_bytes``: queued steps + the step being written) must stay within the budget, and
the process's RSS growth is shown beside it.
"""

from __future__ import annotations

import resource
import tempfile
import time

from bench.common import grpo_step_tensors, machine, nbytes
from tracer.record import writer as writer_module
from tracer.record.writer import TraceWriter


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(steps: int = 60, budget_mb: float = 4.0, delay_s: float = 0.01) -> dict:
    tensors = grpo_step_tensors(32, 256)
    real_save = writer_module._save_atomic

    def slow_save(*args, **kwargs):  # a slow disk
        time.sleep(delay_s)
        return real_save(*args, **kwargs)

    writer_module._save_atomic = slow_save
    rss0 = _rss_mb()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with TraceWriter(tmp + "/run", "grpo", max_queue_steps=1000, max_queue_bytes=int(budget_mb * 2**20),
                             when_full="block") as w:
                for step in range(steps):
                    w.record(step, tensors)
                peak = w.peak_queued_bytes
    finally:
        writer_module._save_atomic = real_save
    return {"step_mb": nbytes(tensors) / 2**20, "budget_mb": budget_mb, "peak_mb": peak / 2**20,
            "rss_growth_mb": _rss_mb() - rss0, "steps": steps}


if __name__ == "__main__":
    print(machine())
    r = measure()
    print(f"memory: peak queued {r['peak_mb']:.2f} MiB vs budget {r['budget_mb']:.2f} MiB "
          f"({r['step_mb']:.2f} MiB per step, {r['steps']} steps, slow disk); max RSS grew {r['rss_growth_mb']:.1f} MiB")
