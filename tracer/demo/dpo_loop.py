"""A hand-written DPO loop that follows the seed (MiniMind ``train_dpo.py``) and traces every step.

Each pair is prompt + chosen answer (the right sum) vs prompt + rejected answer (a wrong one).
Chosen and rejected rows are stacked in one batch, scored by the policy and the frozen reference;
per-token logprobs are read for every target token (``input[:, 1:]``) and the loss mask keeps only
the answer tokens (prompt and padding masked, the same rule on both sides).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tracer import formulas
from tracer.demo import rollout as ro
from tracer.demo.policy import frozen_copy, load_policy
from tracer.record.writer import Tracer


@dataclass
class DPOConfig:
    """Hyperparameters of the demo DPO loop."""

    steps: int = 2
    """Optimizer steps."""
    batch_size: int = 4
    """B, preference pairs per step."""
    beta: float = 0.1
    """DPO beta."""
    learning_rate: float = 1e-3
    """AdamW learning rate."""
    seed: int = 0
    """Seeds the pairs."""


def preference_pairs(n: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """``(prompt, chosen, rejected)``: ``("3 + 4 =", " 7", " 8")``-like pairs."""
    pairs = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        wrong = a + b + rng.choice([-2, -1, 1, 2, 3])
        pairs.append((f"{a} + {b} =", f" {a + b}", f" {max(wrong, 0) if wrong != a + b else a + b + 1}"))
    return pairs


def encode_side(tokenizer, prompts: list[str], answers: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + eos`` as (input_ids [B, S], attention [B, S], loss_mask [B, S])
    where loss_mask keeps the answer and EOS tokens only."""
    rows, masks = [], []
    for prompt, answer in zip(prompts, answers):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    S = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (S - len(r)) for r in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (S - len(r)) for r in rows])
    loss_mask = torch.tensor([m + [0] * (S - len(m)) for m in masks])
    return input_ids, attention, loss_mask


def target_logprobs(model, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Logprob of each target token ``input_ids[:, 1:]``: ``[B, S - 1]`` (logits[:, k] predicts k + 1)."""
    logits = model(input_ids=input_ids, attention_mask=attention).logits  # (B, S, V)
    return formulas.token_logprobs(logits, input_ids, prompt_len=1)  # (B, S - 1)


def train(model, ref_model, tokenizer, cfg: DPOConfig, tr: Tracer, progress=None) -> None:
    """Run ``cfg.steps`` DPO steps, tracing each into ``tr``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    rng = random.Random(cfg.seed)
    model.train()
    for step in range(cfg.steps):
        prompts, chosen, rejected = zip(*preference_pairs(cfg.batch_size, rng))
        c_ids, c_att, c_mask = encode_side(tokenizer, list(prompts), list(chosen))
        r_ids, r_att, r_mask = encode_side(tokenizer, list(prompts), list(rejected))
        S = max(c_ids.shape[1], r_ids.shape[1])  # stack [chosen; rejected] in one batch
        pad = lambda t, v: torch.nn.functional.pad(t, (0, S - t.shape[1]), value=v)  # noqa: E731
        ids = torch.cat([pad(c_ids, tokenizer.pad_token_id), pad(r_ids, tokenizer.pad_token_id)])  # (2B, S)
        att = torch.cat([pad(c_att, 0), pad(r_att, 0)])
        loss_mask = torch.cat([pad(c_mask, 0), pad(r_mask, 0)])[:, 1:]  # (2B, S - 1), on targets
        targets = ids[:, 1:]
        policy_logps = target_logprobs(model, ids, att)  # (2B, S - 1)
        with torch.no_grad():
            ref_logps = target_logprobs(ref_model, ids, att)
        B = cfg.batch_size
        seq_policy = formulas.sequence_logprobs(policy_logps, loss_mask)  # (2B,)
        seq_ref = formulas.sequence_logprobs(ref_logps, loss_mask)
        terms = formulas.dpo_terms(seq_policy[:B], seq_policy[B:], seq_ref[:B], seq_ref[B:], cfg.beta)
        loss = terms["dpo_loss"].mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        tr.record(
            step=step, scalars=ro.step_scalars(optimizer, loss),
            chosen_ids=targets[:B], rejected_ids=targets[B:],
            chosen_mask=loss_mask[:B], rejected_mask=loss_mask[B:],
            chosen_policy_logprobs=policy_logps[:B].detach(), rejected_policy_logprobs=policy_logps[B:].detach(),
            chosen_ref_logprobs=ref_logps[:B], rejected_ref_logprobs=ref_logps[B:],
            **{k: v.detach() for k, v in terms.items()}, loss=loss.detach(),
        )
        optimizer.step()
        if progress is not None:
            progress.update(1)


def run(out_dir, cfg: DPOConfig, model_dir: str | Path, progress=None) -> Path:
    """Load the tiny model from ``model_dir``, train with ``cfg``, trace into ``out_dir``."""
    tokenizer, model = load_policy(model_dir, cfg.seed)
    ref_model = frozen_copy(model)
    with Tracer(out_dir, algorithm="dpo", tokenizer=tokenizer,
                config={**asdict(cfg), "model_dir": str(model_dir), "trainer": "tracer.demo.dpo_loop"},
                hyperparameters={"beta": cfg.beta, "loss_reduction": "sequence_mean"}) as tr:
        train(model, ref_model, tokenizer, cfg, tr, progress)
    return Path(out_dir)
