"""What verifying a trace's checksums costs, per GB, next to reading the bytes and diffing them.

``tracer diff``, ``tracer check`` (``integrity.checksum``), ``tracer info --verify`` and the pytest
helpers hash every step file's tensor bytes (``tracer.format.integrity.verify_step_file``, sha256 streamed
in 4 MB chunks) and compare the digest with the ``content_sha256`` the writer recorded. Measured side
by side on the same files, page cache warm (the CPU cost; a cold disk adds its read time to all three):

- read: the same bytes read in 4 MB chunks, no hashing (the floor);
- verify: ``verify_step_file`` on every step file;
- diff: ``tracer.diff`` of the trace against a second one whose every step differs slightly (every
  tensor is compared; the time includes verifying both sides), per GB of the step files it reads.

Target (the issue's claim): verifying is cheap next to comparing, verify / diff <= 0.5.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from bench.common import grpo_step_tensors, machine, median
from tracer import diff
from tracer.format.integrity import verify_step_file
from tracer.format.hashing import HASH_CHUNK_BYTES
from tracer.record.writer import TraceWriter

B, T, L = 64, 1024, 64


def build(root: Path, steps: int, offset: float = 0.0) -> Path:
    with TraceWriter(root, "grpo", max_queue_steps=4) as writer:
        for step in range(steps):
            t = grpo_step_tensors(B, T, L, seed=step)
            t["rewards"] = t["rewards"] + offset
            writer.record(step, t)
    return root


def read_all(paths: list[Path]) -> int:
    n = 0
    for path in paths:
        with open(path, "rb") as fh:
            while chunk := fh.read(HASH_CHUNK_BYTES):
                n += len(chunk)
    return n


def verify_all(paths: list[Path]) -> None:
    for path in paths:
        assert verify_step_file(path) is not None


def _time(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def measure(steps: int = 40, rounds: int = 3) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        a = build(Path(tmp) / "a", steps)
        b = build(Path(tmp) / "b", steps, offset=1e-3)  # every step pair differs: diff compares every tensor
        paths = sorted((a / "steps").glob("*.safetensors"))
        gb = read_all(paths) / 1e9
        read_all(sorted((b / "steps").glob("*.safetensors")))  # warm the cache for both sides
        t_read, t_verify, t_diff = [], [], []
        for _ in range(rounds):  # interleaved
            t_read.append(_time(read_all, paths))
            t_verify.append(_time(verify_all, paths))
            t_diff.append(_time(lambda: diff(a, b, progress=False)))
        report = diff(a, b, progress=False)
        assert not report.equal and report.identical_by_checksum == 0 and report.verified_files == 2 * steps
        shutil.rmtree(b)
    r, v = median(t_read) / gb, median(t_verify) / gb
    d = median(t_diff) / (2 * gb)  # diff reads (and verifies) both sides: per GB of step files diffed
    return {"gb": gb, "read_s_per_gb": r, "verify_s_per_gb": v, "diff_s_per_gb": d, "verify_vs_diff": v / d,
            "verify_vs_read": v / r, "verify_gb_per_s": 1 / v}


if __name__ == "__main__":
    print(machine())
    m = measure()
    print(f"{m['gb']:.2f} GB of step files per side: read {m['read_s_per_gb']:.2f} s/GB, verify {m['verify_s_per_gb']:.2f} s/GB "
          f"({m['verify_vs_read']:.1f}x read), diff {m['diff_s_per_gb']:.2f} s/GB -> verify / diff = "
          f"{m['verify_vs_diff']:.2f} (target <= 0.5)")
