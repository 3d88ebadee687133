"""Noise floor of the vLLM CPU engine against an fp32 trainer: mean and max |old - sampler| (nats) over
kept tokens per step of a healthy TRL GRPO run (the grpo-vllm demo's settings, the tiny head_dim-64
model, seed 0), with the engine in vLLM's default dtype (``"auto"``: bfloat16 for this float32 model)
and in ``dtype="float32"``. Each run is ``tests/vllm_engine/engine_run.py`` in a subprocess.

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m bench.sampler_noise --steps 3

Prints one line per step and dtype; the figures set ``tracer.checks.sampler_patterns.ENGINE_NOISE``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(run: Path) -> list[tuple[int, str, int, float, float]]:
    """(step, sampler_dtype, kept tokens, mean |old - sampler|, max |old - sampler|) per step file."""
    from tracer import Trace

    trace = Trace(run / "trace")
    rows = []
    for key in sorted(trace.steps(), key=lambda k: k.step):
        data = trace.load_step(key)
        keep = data["completion_mask"].bool()
        gap = (data["old_logprobs"].double() - data["sampler_logprobs"].double())[keep].abs()
        rows.append((key.step, str(trace.metadata(key).get("sampler_dtype")), int(keep.sum()), float(gap.mean()),
                     float(gap.max())))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with tempfile.TemporaryDirectory() as scratch:
        for dtype in ("auto", "float32"):
            run = Path(scratch) / dtype
            extra = [] if dtype == "auto" else ["--engine-dtype", dtype]
            subprocess.run([sys.executable, str(REPO / "tests" / "vllm_engine" / "engine_run.py"), str(run),
                            "--steps", str(args.steps), *extra], env=env, check=True, capture_output=True)
            for step, recorded, n, mean, peak in measure(run):
                print(f"engine dtype {dtype} ({recorded}) step {step}: {n} kept tokens, mean |old - sampler| "
                      f"{mean:.2e} nats, max {peak:.2e}")


if __name__ == "__main__":
    main()
