"""A real TRL ``GRPOTrainer`` run on CPU with the tracer attached: the tiny local model of
:mod:`tracer.demo.tiny_model` learns small sums (``"3 + 4 ="`` -> ``" 7"``) for a few steps.

Used by ``python -m tracer demo --algo grpo``, by the tests, and to make the committed sample
trace. Offline: nothing is downloaded (set ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from tracer.demo.trl_demo import cpu_trainer, run_traced

NUM_GENERATIONS = 4
PROMPTS_PER_STEP = 2
MAX_COMPLETION_LENGTH = 10
BETA = 0.04
LEARNING_RATE = 1e-3  # large for RL: a 29k-parameter model moves visibly in one step (ratio ~0.3-1.5)


def make_dataset(seed: int = 0, size: int = 32):
    """``datasets.Dataset`` of ``{"prompt": "a + b =", "answer": "a+b"}`` with one-digit a, b."""
    from datasets import Dataset

    rng = random.Random(seed)
    pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(size)]
    return Dataset.from_dict({"prompt": [f"{a} + {b} =" for a, b in pairs],
                              "answer": [str(a + b) for a, b in pairs]})


def correct_answer(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion, stripped, starts with the right sum and the sum is a whole number
    there (``" 7"``, ``" 7 is ..."``; not ``" 71"``), else 0.0."""
    out = []
    for text, expected in zip(completions, answer):
        head = text.strip().split(" ", 1)[0]
        out.append(1.0 if head == expected else 0.0)
    return out


def brevity(completion_ids: list[list[int]], answer: list[str], **kwargs: Any) -> list[float]:
    """A small length term: -0.1 per token beyond the ideal completion (a space, one token per
    digit of the answer, EOS), 0.0 otherwise."""
    out = []
    for ids, expected in zip(completion_ids, answer):
        excess = len(ids) - (len(expected) + 2)
        out.append(-0.1 * excess if excess > 0 else 0.0)
    return out


def make_trainer(model_dir: str | os.PathLike, output_dir: str | os.PathLike, steps: int = 3, seed: int = 0,
                 progress: bool = True, num_iterations: int = 2, **config_overrides: Any):
    """A ``trl.GRPOTrainer`` on CPU for the tiny model at ``model_dir`` (passed as a path).

    ``output_dir`` is TRL's scratch directory: nothing is saved there (no checkpoints, no logs).
    ``config_overrides`` go to ``GRPOConfig`` as they are.
    """
    from trl import GRPOConfig, GRPOTrainer

    fields = dict(num_iterations=num_iterations, beta=BETA,
                  loss_type="grpo")  # the seed's reduction (sequence mean); TRL 1.16 defaults to "dapo"
    return make_group_trainer(GRPOConfig, GRPOTrainer, model_dir, output_dir, steps, seed, progress,
                              **{**fields, **config_overrides})


def make_group_trainer(config_class: type, trainer_class: type, model_dir: str | os.PathLike,
                       output_dir: str | os.PathLike, steps: int, seed: int, progress: bool, **fields: Any):
    """A TRL trainer of the GRPO family (``GRPOTrainer``, ``RLOOTrainer``) on CPU, on the demo's sum
    task: G = ``NUM_GENERATIONS`` completions of ``PROMPTS_PER_STEP`` prompts per step, the two
    reward functions, the model passed as a path. ``fields`` go to ``config_class`` (and win)."""
    base = dict(per_device_train_batch_size=NUM_GENERATIONS * PROMPTS_PER_STEP, num_generations=NUM_GENERATIONS,
                max_completion_length=MAX_COMPLETION_LENGTH, temperature=1.0, learning_rate=LEARNING_RATE)
    return cpu_trainer(trainer_class, config_class, model_dir, output_dir, steps, seed, progress, {**base, **fields},
                       reward_funcs=[correct_answer, brevity], train_dataset=make_dataset(seed))


def sum_task_build(seed: int) -> dict[str, Any]:
    """The sum task's facts for the manifest's ``config.model_build``: its reward functions and dataset."""
    return {"reward_functions": ["tracer.demo.grpo_trl.correct_answer", "tracer.demo.grpo_trl.brevity"],
            "dataset": f"tracer.demo.grpo_trl.make_dataset(seed={seed})"}


def run_grpo_demo(out_dir: str | os.PathLike, steps: int = 3, seed: int = 0, progress: bool = True,
                  model_dir: str | os.PathLike | None = None, *, num_iterations: int = 2) -> Path:
    """Build the tiny model, train it with ``GRPOTrainer`` for ``steps`` optimizer steps with the
    tracer attached, and return the trace directory.

    Args:
        out_dir: the trace directory to write (must not already hold a trace).
        steps: optimizer steps (``max_steps``). With ``num_iterations = 2`` a rollout is used for
            two steps: inner step 0 (policy == old) then inner step 1 (policy moved).
        seed: seeds the model build, the dataset, sampling and TRL.
        progress: show the trainer's tqdm progress bar.
        model_dir: a tiny model saved by ``build_tiny_model`` (used as it is), or where to build
            one (kept); a temporary directory when None.
        num_iterations: TRL's ``num_iterations`` (1 = no old logprobs; ratio 1 by construction).

    Returns:
        ``Path(out_dir)``.
    """
    return run_traced(out_dir, make_trainer, sum_task_build(seed), "tracer.demo.grpo_trl.run_grpo_demo", steps, seed,
                      progress, model_dir, num_iterations=num_iterations)
