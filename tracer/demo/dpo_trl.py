"""A real TRL ``DPOTrainer`` run on CPU with the tracer attached: the tiny local model of
:mod:`tracer.demo.tiny_model` is taught to prefer the right sum (prompt ``"3 + 4 ="``, chosen
``" 7"``, rejected ``" 8"``) on a small preference dataset built in code.

Used by ``python -m tracer demo --algo dpo-trl``, by the tests, and to make the committed sample
trace. Offline: nothing is downloaded (set ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from tracer.demo.dpo_loop import preference_pairs
from tracer.demo.trl_demo import cpu_trainer, run_traced

PAIRS_PER_STEP = 4
BETA = 0.1
LEARNING_RATE = 1e-3  # large: a 29k-parameter model moves visibly in one step

__all__ = ["BETA", "PAIRS_PER_STEP", "make_dataset", "make_trainer", "run_dpo_demo"]


def make_dataset(seed: int = 0, size: int = 32):
    """``datasets.Dataset`` of ``{"prompt": "3 + 4 =", "chosen": " 7", "rejected": " 8"}``-like pairs
    (the rejected answer is a wrong sum; see :func:`tracer.demo.dpo_loop.preference_pairs`)."""
    from datasets import Dataset

    prompts, chosen, rejected = zip(*preference_pairs(size, random.Random(seed)))
    return Dataset.from_dict({"prompt": list(prompts), "chosen": list(chosen), "rejected": list(rejected)})


def make_trainer(model_dir: str | os.PathLike, output_dir: str | os.PathLike, steps: int = 3, seed: int = 0,
                 progress: bool = True, **config_overrides: Any):
    """A ``trl.DPOTrainer`` on CPU for the tiny model at ``model_dir`` (passed as a path, so TRL
    loads a separate frozen reference model from the same files).

    ``output_dir`` is TRL's scratch directory: nothing is saved there. The loss is logged every
    step into ``trainer.state.log_history`` (nothing is printed). ``config_overrides`` go to
    ``DPOConfig`` as they are (e.g. ``precompute_ref_log_probs=True``).
    """
    from trl import DPOConfig, DPOTrainer

    fields = dict(
        per_device_train_batch_size=PAIRS_PER_STEP,
        beta=BETA,
        loss_type=["sigmoid"],
        learning_rate=LEARNING_RATE,
        logging_strategy="steps",
        logging_steps=1,
    )
    return cpu_trainer(DPOTrainer, DPOConfig, model_dir, output_dir, steps, seed, progress,
                       {**fields, **config_overrides}, train_dataset=make_dataset(seed))


def run_dpo_demo(out_dir: str | os.PathLike, steps: int = 3, seed: int = 0, progress: bool = True,
                 model_dir: str | os.PathLike | None = None) -> Path:
    """Build the tiny model, train it with ``DPOTrainer`` for ``steps`` optimizer steps with the
    tracer attached, and return the trace directory.

    Args:
        out_dir: the trace directory to write (must not already hold a trace).
        steps: optimizer steps (``max_steps``), ``PAIRS_PER_STEP`` pairs each.
        seed: seeds the model build, the dataset and TRL (which shuffles the pairs).
        progress: show the trainer's tqdm progress bar.
        model_dir: a tiny model saved by ``build_tiny_model`` (used as it is), or where to build
            one (kept); a temporary directory when None.

    Returns:
        ``Path(out_dir)``.
    """
    build = {"dataset": f"tracer.demo.dpo_trl.make_dataset(seed={seed})"}
    return run_traced(out_dir, make_trainer, build, "tracer.demo.dpo_trl.run_dpo_demo", steps, seed, progress,
                      model_dir)
