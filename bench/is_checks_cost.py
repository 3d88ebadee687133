"""What the importance-sampling and policy-lag checks add to ``tracer check``, per step file.

    python -m bench.is_checks_cost [--rows 64] [--tokens 256] [--steps 20]

Writes one run of ``--steps`` GRPO step files of B = ``--rows`` x T = ``--tokens`` (float32 logprobs,
an asynchronous loop's fields: old, sampler and policy logprobs, ``is_weights`` under IcePop
``token_mask`` [0.8, 1.25], ``per_token_loss`` of the clipped surrogate with the weights, rewards,
advantages, ``policy_version`` with ``trainer_version``), then times ``run_checks`` per step file for
``sampler.is_weights``, ``sampler.policy_lag`` and all checks (median of 3 runs each, the step files
already in the page cache). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tracer import formulas
from tracer.checks import run_checks
from tracer.formulas import importance
from tracer.read import Trace
from tracer.record.writer import TraceWriter


def write_run(root: Path, steps: int, B: int, T: int) -> Path:
    g = torch.Generator().manual_seed(0)
    hyper = {"num_generations": 8, "beta": 0.0, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2,
             "loss_reduction": "sequence_mean", "is_correction": True, "is_mode": "token_mask", "is_clip_min": 0.8,
             "is_clip_max": 1.25, "vllm_importance_sampling_correction": True, "max_policy_lag": 2}
    with TraceWriter(root, "grpo", hyperparameters=hyper) as writer:
        for step in range(steps):
            old = -torch.rand(B, T, generator=g) * 4
            sampler = (old + torch.randn(B, T, generator=g) * 0.1).clamp(max=-1e-4)
            policy = (old + torch.randn(B, T, generator=g) * 0.01).clamp(max=-1e-4)
            mask = torch.ones(B, T, dtype=torch.bool)
            rewards = torch.randn(B, generator=g)
            advantages = formulas.group_advantages(rewards, 8)
            weights = importance.correction_weights(old, sampler, mask, "token_mask", 0.8, 1.25)
            loss = formulas.grpo_per_token_loss(policy, old, advantages, 0.2, 0.2, sampler_weights=weights)
            writer.record(step, {"completion_ids": torch.randint(3, 60, (B, T), generator=g), "completion_mask": mask,
                                 "policy_logprobs": policy, "old_logprobs": old, "sampler_logprobs": sampler,
                                 "is_weights": weights, "per_token_loss": loss, "rewards": rewards,
                                 "advantages": advantages, "group_ids": torch.arange(B) // 8,
                                 "policy_version": torch.full((B,), max(0, step - 2))},
                          metadata={"trainer_version": step})
    return root


def per_step_ms(trace: Trace, select: list[str] | None, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_checks(trace, select=select)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times) / len(trace.steps())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Trace(write_run(Path(tmp) / "run", args.steps, args.rows, args.tokens))
        per_step_ms(trace, None, 1)  # warm: imports, page cache
        rows = [("sampler.is_weights", per_step_ms(trace, ["sampler.is_weights"])),
                ("sampler.policy_lag", per_step_ms(trace, ["sampler.policy_lag"])),
                ("all checks", per_step_ms(trace, None))]
    print(f"| checks (B = {args.rows}, T = {args.tokens}, {args.steps} step files, 1 torch thread) | ms per step file |")
    print("|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
