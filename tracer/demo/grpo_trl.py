"""A real TRL ``GRPOTrainer`` run on CPU with the tracer attached: the tiny local model of
:mod:`tracer.demo.tiny_model` learns small sums (``"3 + 4 ="`` -> ``" 7"``) for a few steps.

Used by ``python -m tracer demo --algo grpo``, by the tests, and to make the committed sample
trace. Offline: nothing is downloaded (set ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import tempfile
import warnings
from pathlib import Path
from typing import Any

from tracer.demo.tiny_model import build_tiny_model, torch_threads

log = logging.getLogger(__name__)

NUM_GENERATIONS = 4
PROMPTS_PER_STEP = 2
MAX_COMPLETION_LENGTH = 10
BETA = 0.04
# TRL 1.16 reads transformers 5's deprecated `is_gradient_checkpointing` on every step.
_TRL_NOISE = r"`is_gradient_checkpointing` is deprecated"
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
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    config = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to=[],
        seed=seed,
        max_steps=steps,
        per_device_train_batch_size=NUM_GENERATIONS * PROMPTS_PER_STEP,
        gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS,
        num_iterations=num_iterations,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=1.0,
        beta=BETA,
        learning_rate=LEARNING_RATE,
        loss_type="grpo",  # the seed's reduction (sequence mean); TRL 1.16 defaults to "dapo"
        bf16=False,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=not progress,
        dataloader_num_workers=0,
    )
    # TRL defaults to checkpointing on; transformers 5.x renamed the flag to activation_checkpointing.
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in GRPOConfig.__dataclass_fields__ \
        else "gradient_checkpointing"
    config[checkpointing] = False
    config.update(config_overrides)
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[correct_answer, brevity],
        args=GRPOConfig(**config),
        train_dataset=make_dataset(seed),
    )
    trainer.remove_callback(PrinterCallback)  # with the progress bar off, nothing is printed
    return trainer


@contextlib.contextmanager
def _quiet_loading():
    """Hide transformers' "Loading weights" / "Writing model shards" bars (not the training bar)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


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
        model_dir: where to build the tiny model (kept); a temporary directory when None. Either
            way the manifest's ``config.model_build`` says how to rebuild it bit for bit.
        num_iterations: TRL's ``num_iterations`` (1 = no old logprobs; ratio 1 by construction).

    Returns:
        ``Path(out_dir)``.
    """
    import tracer

    out = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="tracer-grpo-demo-") as scratch, torch_threads(1):
        with _quiet_loading():
            model_path = build_tiny_model(model_dir if model_dir is not None else Path(scratch) / "model", seed=seed)
            trainer = make_trainer(model_path, Path(scratch) / "trl", steps=steps, seed=seed, progress=progress,
                                   num_iterations=num_iterations)
        build = {"builder": "tracer.demo.tiny_model.build_tiny_model", "seed": seed,
                 "path": str(model_path) if model_dir is not None else None,
                 "reward_functions": ["tracer.demo.grpo_trl.correct_answer", "tracer.demo.grpo_trl.brevity"],
                 "dataset": f"tracer.demo.grpo_trl.make_dataset(seed={seed})"}
        tracer.attach(trainer, out, config={"model_build": build, "demo": "tracer.demo.grpo_trl.run_grpo_demo"})
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_TRL_NOISE, category=FutureWarning)
            trainer.train()
    log.info("GRPO demo trace written to %s", out)
    return out
