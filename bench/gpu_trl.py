"""TRL's GRPOTrainer and DPOTrainer on a GPU, traced with ``tracer.attach``, then ``tracer check``:
a healthy run on the GPU (bf16 autocast, TF32 and cuBLAS numerics, CUDA tensors through the
integration's capture) must raise no error finding, as on the CPU.

    python -m bench.gpu_trl [--steps 6] [--precision bf16|fp32]   # exit 1 if a check reports an error

It trains the demos' tiny local model (tracer.demo.tiny_model) on the demos' tasks, with the demos'
settings except ``use_cpu=False`` and the precision; run it where a GPU is lent (it needs ``trl``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import machine


def traced_runs(root: Path, steps: int, precision: str) -> dict[str, Path]:
    """One GRPO and one DPO trace under ``root`` from TRL on the GPU."""
    from tracer.demo import dpo_trl, grpo_trl
    from tracer.demo.tiny_model import build_tiny_model
    from tracer.demo.trl_demo import run_traced

    model_dir = build_tiny_model(root / "model", seed=0)
    gpu = {"use_cpu": False, "bf16": precision == "bf16"}
    return {
        "grpo": run_traced(root / "grpo", grpo_trl.make_trainer, {}, "bench.gpu_trl", steps, 0, False, model_dir,
                           num_iterations=2, **gpu),
        "dpo": run_traced(root / "dpo", dpo_trl.make_trainer, {}, "bench.gpu_trl", steps, 0, False, model_dir, **gpu),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a GPU machine")
    from tracer import Trace
    from tracer.cli import main as cli_main

    print(machine())
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for algo, trace_dir in traced_runs(Path(tmp), args.steps, args.precision).items():
            trace = Trace(trace_dir)
            key = trace.steps()[0]
            dtypes = trace.metadata(key).get("source_dtype") or "float32"
            writer = trace.manifest.get("capture", {}).get("writer_choice", "?")  # says whether the tensors were on the GPU
            print(f"== {algo}: {len(trace.steps())} step files ({args.precision}; first step's fields: "
                  f"{', '.join(trace.fields(key))}; source dtypes {dtypes}; writer: {writer})")
            code = cli_main(["check", str(trace_dir)])
            print(f"== {algo}: tracer check exit code {code} (0: no error finding)")
            failed |= code != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
