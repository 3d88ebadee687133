"""Opening a trace and loading one sequence: 10 steps vs 10,000 steps, and vs JSON lines.

Tracer: ``Trace(path)`` reads the manifest; ``step_key`` finds the file by name; ``load_sequence``
reads only that row's bytes (``get_slice``). JSON lines (one line per sequence, all steps in one
file: what existing token viewers read): scan and parse lines until the sequence is found.
Targets: 10,000 steps within 2x of 10 steps; >= 20x faster than JSON lines; files >= 3x smaller.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.common import grpo_step_tensors, machine, median
from tracer import Trace
from tracer.record.writer import TraceWriter

B, T, L = 8, 64, 16


def step_tensors(step: int) -> dict[str, torch.Tensor]:
    """The fields a traced GRPO step carries (common.grpo_step_tensors), small B and T."""
    return grpo_step_tensors(B, T, L, seed=step)


def build(root: Path, steps: int) -> tuple[Path, Path]:
    trace_dir, jsonl = root / f"trace_{steps}", root / f"trace_{steps}.jsonl"
    with TraceWriter(trace_dir, "grpo", max_queue_steps=64) as writer, open(jsonl, "w") as fh:
        for step in range(steps):
            t = step_tensors(step)
            writer.record(step, t)
            for b in range(B):
                row = {k: v[b].tolist() for k, v in t.items()}
                fh.write(json.dumps({"step": step, "sequence": b, **row}) + "\n")
    return trace_dir, jsonl


def open_and_load(trace_dir: Path, step: int, sequence: int) -> torch.Tensor:
    trace = Trace(trace_dir)
    return trace.load_sequence(trace.step_key(step), sequence)["policy_logprobs"]


def jsonl_load(jsonl: Path, step: int, sequence: int) -> list[float]:
    with open(jsonl) as fh:
        for line in fh:
            row = json.loads(line)
            if row["step"] == step and row["sequence"] == sequence:
                return row["policy_logprobs"]
    raise KeyError((step, sequence))


def _time(fn, *args, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t0)
    return median(ts)


def du(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(big: int = 10_000) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        small_dir, _ = build(Path(tmp), 10)
        big_dir, big_jsonl = build(Path(tmp), big)
        mid = big // 2
        assert torch.allclose(open_and_load(big_dir, mid, 3), torch.tensor(jsonl_load(big_jsonl, mid, 3)))
        t_small = _time(open_and_load, small_dir, 5, 3, repeat=50)
        t_big = _time(open_and_load, big_dir, mid, 3, repeat=50)
        t_jsonl = _time(jsonl_load, big_jsonl, mid, 3, repeat=3)
        size_trace, size_jsonl = du(big_dir), du(big_jsonl)
    return {"small_ms": 1e3 * t_small, "big_ms": 1e3 * t_big, "scale_ratio": t_big / t_small,
            "jsonl_ms": 1e3 * t_jsonl, "speedup_vs_jsonl": t_jsonl / t_big,
            "trace_mb": size_trace / 1e6, "jsonl_mb": size_jsonl / 1e6, "size_ratio": size_jsonl / size_trace, "steps": big}


if __name__ == "__main__":
    print(machine())
    r = measure()
    print(f"open + load one sequence: {r['small_ms']:.2f} ms (10 steps) vs {r['big_ms']:.2f} ms ({r['steps']} steps) "
          f"-> {r['scale_ratio']:.2f}x (target <= 2)")
    print(f"vs JSON lines: {r['jsonl_ms']:.0f} ms -> tracer {r['speedup_vs_jsonl']:.0f}x faster (target >= 20); "
          f"size {r['trace_mb']:.1f} MB vs {r['jsonl_mb']:.1f} MB -> {r['size_ratio']:.1f}x smaller (target >= 3)")
