"""The hand-written GRPO loop the guard tests train: :mod:`tracer.demo.grpo_loop`'s, traced through
``tracer.Tracer(..., guard=...)``, with one injected bug that shows from the first update:
``flip_kl`` (MiniMind's ``--bug flip_kl``, tests/scripts/minimind_grpo.py) adds the reference-KL term
to the loss instead of subtracting it, by training with ``-beta`` while the trace records ``beta``."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch

import tracer
from tracer.demo import grpo_loop
from tracer.demo.grpo_loop import GRPOConfig

BETA = GRPOConfig().beta  # the reference-KL coefficient the loop says it runs with (0.04)


def run_loop(out: Path, model_dir: Path, guard: Any, bug: str | None = None, steps: int = 3,
             writer: str = "thread", progress: list[int] | None = None, **config: Any) -> Path:
    """Train ``steps`` GRPO steps of the tiny model into the trace ``out`` with ``guard``; ``progress``
    gets each step number as it starts (a test learns where the run stopped; after the last step, the
    number of steps). ``config``: GRPOConfig fields to change (a larger step: ``num_prompts``,
    ``max_new_tokens``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = GRPOConfig(steps=steps, seed=0, **config)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    trained = dataclasses.replace(cfg, beta=-cfg.beta) if bug == "flip_kl" else cfg  # the loss's own beta
    hyper = grpo_loop.hyperparameters(cfg)  # what the trainer says it runs with: beta = 0.04

    class Progress:  # called after each step: the next one starts
        def update(self, n: int) -> None:
            if progress is not None:
                progress.append(progress[-1] + 1)

    with tracer.Tracer(out, algorithm="grpo", tokenizer=tokenizer, hyperparameters=hyper, guard=guard,
                       writer=writer) as tr:
        if progress is not None:
            progress.append(0)
        grpo_loop.train(model, ref_model, tokenizer, trained, tr, Progress())
    return out
