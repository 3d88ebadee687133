"""A real multi-turn, tool-calling TRL ``GRPOTrainer`` run on CPU with the tracer attached: the tiny
model of :mod:`tracer.demo.agent_model` answers "What is 3 + 4 + 5?" by calling the ``add`` tool
(``GRPOTrainer(tools=[add])``) once per ``+``, reading each result, and stating the sum.

Every completion row is a packed episode: assistant turn 1 (a tool call), the tool result TRL
appended (``tool_mask`` 0: not trained on), assistant turn 2, ... The trace records
``turn_ids``, ``token_roles`` and ``mask_reasons`` for it (:mod:`tracer.integrations.trl_tools`).

``leak_tool_output=True`` injects the classic agentic-RL bug: the tool results stay in the loss
(TRL's ``tool_mask`` replaced by ones before the loss sees it), so the policy is trained to
"predict" text the tool wrote. The roles still say ``tool``, so the trace shows tool tokens kept.

Used by ``python -m tracer demo agent``, by the tests and to make the committed sample trace.
Offline: nothing is downloaded (set ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import functools
import os
import random
import re
from pathlib import Path
from typing import Any

from tracer.demo.agent_model import add, build_agent_model, question, random_numbers
from tracer.demo.trl_demo import cpu_trainer, run_traced

NUM_GENERATIONS = 4
PROMPTS_PER_STEP = 2
MAX_COMPLETION_LENGTH = 96  # three tool calls, two tool results and an answer fit in ~75 tokens
MAX_TOOL_CALLS = 3  # TRL's max_tool_calling_iterations
LEARNING_RATE = 1e-3
BETA = 0.04
NUM_ITERATIONS = 2  # two optimizer steps per rollout: TRL keeps old logprobs, so the ratio moves on inner step 1


def make_dataset(seed: int = 0, size: int = 32):
    """``datasets.Dataset`` of ``{"prompt": [system, user messages], "answer": "12"}``: sums of two or
    three one-digit numbers."""
    from datasets import Dataset

    rng = random.Random(seed + 1)  # not the warm-up's conversations
    numbers = [random_numbers(rng) for _ in range(size)]
    return Dataset.from_dict({"prompt": [question(ns) for ns in numbers], "answer": [str(sum(ns)) for ns in numbers]})


def correct_sum(completions: list[list[dict[str, Any]]], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the episode's last assistant message (after its tool calls) names the right sum as a
    whole number, else 0.0. ``completions``: TRL's messages per episode (assistant and tool)."""
    out = []
    for messages, expected in zip(completions, answer):
        final = next((m for m in reversed(messages) if m.get("role") == "assistant"), {})
        numbers = re.findall(r"\d+", str(final.get("content") or ""))
        out.append(1.0 if expected in numbers and not final.get("tool_calls") else 0.0)
    return out


def leak_tool_output(trainer: Any) -> None:
    """Inject the bug: ``trainer._generate_and_score_completions`` returns ``tool_mask`` all ones, so
    TRL's loss (``completion_mask * tool_mask``) trains on the tool results. Install before
    ``tracer.attach`` so the tracer records what the loss used."""
    original = trainer._generate_and_score_completions

    @functools.wraps(original)
    def generate_and_score(*args, **kwargs):
        output = original(*args, **kwargs)
        if output.get("tool_mask") is not None:
            output["tool_mask"] = output["tool_mask"].new_ones(output["tool_mask"].shape)
        return output

    trainer._generate_and_score_completions = generate_and_score


def make_trainer(model_dir: str | os.PathLike, output_dir: str | os.PathLike, steps: int = 3, seed: int = 0,
                 progress: bool = True, leak: bool = False, **config_overrides: Any):
    """A ``trl.GRPOTrainer(tools=[add])`` on CPU for the agent model at ``model_dir`` (a path).

    ``output_dir`` is TRL's scratch directory (nothing saved). ``leak``: see :func:`leak_tool_output`.
    ``config_overrides`` go to ``GRPOConfig`` as they are."""
    from trl import GRPOConfig, GRPOTrainer

    fields = dict(per_device_train_batch_size=NUM_GENERATIONS * PROMPTS_PER_STEP, num_generations=NUM_GENERATIONS,
                  max_completion_length=MAX_COMPLETION_LENGTH, max_tool_calling_iterations=MAX_TOOL_CALLS,
                  temperature=1.0, learning_rate=LEARNING_RATE, beta=BETA, loss_type="grpo",
                  num_iterations=NUM_ITERATIONS)
    trainer = cpu_trainer(GRPOTrainer, GRPOConfig, model_dir, output_dir, steps, seed, progress,
                          {**fields, **config_overrides}, reward_funcs=[correct_sum], tools=[add],
                          train_dataset=make_dataset(seed))
    if leak:
        leak_tool_output(trainer)
    return trainer


def run_agent_demo(out_dir: str | os.PathLike, steps: int = 3, seed: int = 0, progress: bool = True,
                   model_dir: str | os.PathLike | None = None, leak: bool = False) -> Path:
    """Build the agent model, train it with ``GRPOTrainer(tools=[add])`` for ``steps`` optimizer steps
    with the tracer attached, and return the trace directory.

    Args:
        out_dir: the trace directory to write (must not already hold a trace).
        steps: optimizer steps (``max_steps``); each samples ``PROMPTS_PER_STEP`` x ``NUM_GENERATIONS``
            episodes of up to ``MAX_TOOL_CALLS`` tool calls.
        seed: seeds the model build, the dataset, sampling and TRL.
        model_dir: an agent model saved by ``build_agent_model`` (used as it is), or where to build
            one (kept); a temporary directory when None.
        leak: inject the tool-output leak (:func:`leak_tool_output`).

    Returns:
        ``Path(out_dir)``.
    """
    build = {"builder": "tracer.demo.agent_model.build_agent_model", "tools": ["tracer.demo.agent_model.add"],
             "reward_functions": ["tracer.demo.agent_trl.correct_sum"],
             "dataset": f"tracer.demo.agent_trl.make_dataset(seed={seed})", "leak_tool_output": leak}
    return run_traced(out_dir, make_trainer, build, "tracer.demo.agent_trl.run_agent_demo", steps, seed, progress,
                      model_dir, build_model=build_agent_model, leak=leak)
