"""The policy a hand-written demo loop trains (:mod:`~tracer.demo.grpo_loop`, :mod:`~tracer.demo.ppo_loop`,
:mod:`~tracer.demo.dpo_loop`, :mod:`~tracer.demo.async_grpo`): its tokenizer and causal LM loaded from a
model directory after the loop's seed is set, and the frozen copies the loops keep beside it (the
reference policy, a trailing rollout worker)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch


def load_policy(model_dir: str | Path, seed: int) -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, model)`` from ``model_dir`` (``AutoTokenizer`` / ``AutoModelForCausalLM``
    ``.from_pretrained``), loaded after ``torch.manual_seed(seed)`` so that everything the loop draws
    from torch's global generator afterwards (a value head's initialisation, sampling) repeats with the
    seed.

    Raises:
        OSError: ``model_dir`` holds no loadable tokenizer or model (from transformers).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return tokenizer, model


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` in eval mode with no gradients: the reference policy, or a rollout worker
    whose weights the loop sets itself. Draws nothing from torch's generator."""
    return copy.deepcopy(model).eval().requires_grad_(False)
