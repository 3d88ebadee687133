"""Rollout and rewards shared by the hand-written demo loops (MiniMind style, seed section 4.3).

``rollout`` samples completions with the current policy and saves their per-token logprobs at the
same time (the behaviour policy's ``old_logprobs``), exactly as MiniMind's ``rollout_engine.py``
does; ``completion_logprobs`` recomputes token logprobs for any model with the alignment rule of
``tracer.formulas.token_logprobs``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from tracer import formulas

REWARD_COMPONENT_NAMES = ["accuracy", "length", "scorer"]


@dataclass
class Rollout:
    """One batch of sampled completions. B = P * G rows; G consecutive rows share a prompt."""

    prompts: list[str]  # [B] prompt text, repeated G times
    prompt_ids: torch.Tensor  # [B, L] int64, left-padded
    prompt_mask: torch.Tensor  # [B, L] bool
    completion_ids: torch.Tensor  # [B, T] int64, right-padded after EOS
    completion_mask: torch.Tensor  # [B, T] bool, True up to and including the first EOS
    old_logprobs: torch.Tensor  # [B, T] float32, behaviour policy at sampling time
    group_ids: torch.Tensor  # [B] int64
    sampler_logprobs: torch.Tensor | None = None  # [B, T] float32, what an inference engine reported (vLLM)

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # (B, L + T)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1).long()  # (B, L + T)


def arithmetic_prompts(n: int, rng: random.Random) -> list[str]:
    """``n`` prompts like ``"3 + 4 ="`` (the demo's toy task)."""
    return [f"{rng.randint(0, 9)} + {rng.randint(0, 9)} =" for _ in range(n)]


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                        temperature: float = 1.0) -> torch.Tensor:
    """Token logprobs ``[B, T]`` of the completion part of ``input_ids`` under ``model``.

    Position ids follow the attention mask, so left-padded prompts are scored as ``generate`` saw them.
    """
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, L + T)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return formulas.token_logprobs(logits, input_ids, prompt_len, temperature)  # (B, T)


def _mask_after_eos(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """True up to and including the first EOS of each row (all True when there is none)."""
    is_eos = completion_ids == eos_token_id  # (B, T)
    seen_before = (is_eos.int().cumsum(dim=1) - is_eos.int()) > 0  # an EOS strictly earlier
    return ~seen_before


@torch.no_grad()
def rollout(model, tokenizer, prompts: list[str], num_generations: int, max_new_tokens: int,
            temperature: float) -> Rollout:
    """Sample ``num_generations`` completions per prompt (consecutive rows) and their old logprobs."""
    repeated = [p for p in prompts for _ in range(num_generations)]
    enc = tokenizer(repeated, return_tensors="pt", padding=True, padding_side="left")
    prompt_ids, prompt_mask = enc["input_ids"], enc["attention_mask"]  # (B, L)
    output_ids = model.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=temperature,
        top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id)
    L = prompt_ids.shape[1]
    completion_ids = output_ids[:, L:]  # (B, T)
    completion_mask = _mask_after_eos(completion_ids, tokenizer.eos_token_id)  # (B, T)
    completion_ids = completion_ids.masked_fill(~completion_mask, tokenizer.pad_token_id)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=1)
    old_logprobs = completion_logprobs(model, torch.cat([prompt_ids, completion_ids], dim=1),
                                       attention_mask, L, temperature)
    group_ids = torch.arange(len(prompts)).repeat_interleave(num_generations)
    return Rollout(repeated, prompt_ids, prompt_mask.bool(), completion_ids, completion_mask,
                   old_logprobs, group_ids)


def tiny_scorer(answer: str, clip: float = 3.0) -> float:
    """Stands in for MiniMind's reward model: a score clipped to [-clip, clip] (seed section 4.1: 3)."""
    digits = sum(ch.isdigit() for ch in answer)
    return max(min(2.0 * digits - 1.0 - 0.5 * len(answer.strip()), clip), -clip)


def reward_components(prompts: list[str], completions: list[str], scorer_clip: float = 3.0) -> torch.Tensor:
    """``[B, F]`` rule rewards + scorer (seed 4.2: rules added to a clipped reward-model score).

    Columns (``REWARD_COMPONENT_NAMES``): accuracy (1 when the first number is the sum),
    length (+0.5 for 1-4 characters, else -0.5), scorer (``tiny_scorer``, clipped to ±scorer_clip).
    """
    rows = []
    for prompt, completion in zip(prompts, completions):
        a, b = (int(x) for x in re.findall(r"\d+", prompt)[:2])
        found = re.findall(r"\d+", completion)
        accuracy = 1.0 if found and int(found[0]) == a + b else 0.0
        length = 0.5 if 1 <= len(completion.strip()) <= 4 else -0.5
        rows.append([accuracy, length, tiny_scorer(completion, scorer_clip)])
    return torch.tensor(rows, dtype=torch.float32)


def grad_norm(optimizer: torch.optim.Optimizer) -> float:
    """The total L2 norm of the gradients of ``optimizer``'s parameters (what
    ``torch.nn.utils.clip_grad_norm_`` returns), read without changing them; 0.0 when none has one."""
    norms = [torch.linalg.vector_norm(p.grad.detach()) for g in optimizer.param_groups for p in g["params"]
             if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def step_scalars(optimizer: torch.optim.Optimizer, loss: torch.Tensor, **more: float) -> dict[str, float]:
    """The user scalars the demo loops record with each step (``record(..., scalars=...)``): the
    loss, the gradient norm (after ``backward``, before the update) and the learning rate."""
    return {"loss": float(loss.detach()), "grad_norm": grad_norm(optimizer),
            "learning_rate": float(optimizer.param_groups[0]["lr"]), **more}
