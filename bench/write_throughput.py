"""Write throughput of the writer's pipeline vs ``safetensors.torch.save_file`` of the same tensors.

The writer's per-step work (on its background thread): normalise dtypes, mark non-finite fields,
checksum the data (sha256), serialise, write to ``.partial``, fsync, rename. ``save_file`` only
serialises and writes (no checksum, no fsync), so the ratio shows what durability and the checksum
cost. Both are measured synchronously here (``async_write=False``) to time the work itself.
"""

from __future__ import annotations

import tempfile
import time

from safetensors.torch import save_file

from bench.common import grpo_step_tensors, machine, median, nbytes
from tracer.record.writer import TraceWriter


def measure(steps: int = 40, B: int = 64, T: int = 512) -> dict:
    tensors = grpo_step_tensors(B, T)
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        with TraceWriter(tmp + "/run", "grpo", async_write=False) as writer:
            for step in range(steps):
                t0 = time.perf_counter()
                writer.record(step, tensors)
                ours.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                save_file(tensors, f"{tmp}/plain_{step}.safetensors")
                theirs.append(time.perf_counter() - t0)
    size = nbytes(tensors)
    return {"ours_mb_s": size / median(ours) / 1e6, "save_file_mb_s": size / median(theirs) / 1e6,
            "ratio": median(theirs) / median(ours), "bytes": size}


if __name__ == "__main__":
    print(machine())
    r = measure()
    print(f"write throughput: writer {r['ours_mb_s']:.0f} MB/s vs save_file {r['save_file_mb_s']:.0f} MB/s "
          f"({r['bytes'] / 1e6:.1f} MB steps) -> writer at {r['ratio']:.2f}x save_file's speed")
