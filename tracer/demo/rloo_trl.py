"""A real TRL ``RLOOTrainer`` run on CPU with the tracer attached: the GRPO demo's task (the tiny
local model of :mod:`tracer.demo.tiny_model` learns small sums, ``"3 + 4 ="`` -> ``" 7"``), its
dataset and reward functions, trained with RLOO's leave-one-out baseline for a few steps.

Used by ``python -m tracer demo --algo rloo-trl``, by the tests, and to make the committed sample
trace. Offline: nothing is downloaded (set ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tracer.demo.grpo_trl import NUM_GENERATIONS, PROMPTS_PER_STEP, make_group_trainer, sum_task_build
from tracer.demo.trl_demo import run_traced

BETA = 0.05  # RLOOConfig's default: the KL penalty enters the rewards, so advantages use the rloo_kl rule

__all__ = ["BETA", "NUM_GENERATIONS", "PROMPTS_PER_STEP", "make_trainer", "run_rloo_demo"]


def make_trainer(model_dir: str | os.PathLike, output_dir: str | os.PathLike, steps: int = 3, seed: int = 0,
                 progress: bool = True, num_iterations: int = 2, **config_overrides: Any):
    """A ``trl.RLOOTrainer`` on CPU for the tiny model at ``model_dir`` (passed as a path).

    ``output_dir`` is TRL's scratch directory: nothing is saved there (no checkpoints, no logs).
    ``config_overrides`` go to ``RLOOConfig`` as they are.
    """
    from trl import RLOOConfig, RLOOTrainer

    return make_group_trainer(RLOOConfig, RLOOTrainer, model_dir, output_dir, steps, seed, progress,
                              **{"num_iterations": num_iterations, "beta": BETA, **config_overrides})


def run_rloo_demo(out_dir: str | os.PathLike, steps: int = 3, seed: int = 0, progress: bool = True,
                  model_dir: str | os.PathLike | None = None, *, num_iterations: int = 2) -> Path:
    """Build the tiny model, train it with ``RLOOTrainer`` for ``steps`` optimizer steps with the
    tracer attached, and return ``Path(out_dir)``. The arguments are those of
    :func:`tracer.demo.grpo_trl.run_grpo_demo`, except that RLOO has real old logprobs whatever
    ``num_iterations`` (TRL recomputes them at rollout time)."""
    return run_traced(out_dir, make_trainer, sum_task_build(seed), "tracer.demo.rloo_trl.run_rloo_demo", steps, seed,
                      progress, model_dir, num_iterations=num_iterations)
