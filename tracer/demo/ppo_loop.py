"""A hand-written PPO loop (actor + critic + frozen reference) that follows the seed (MiniMind
``train_ppo.py``) and traces every minibatch update through the explicit API.

Per step: sample one completion per prompt (old logprobs saved at sampling time), score it (rules +
a scorer clipped to [-3, 3]), put the reward on the last kept token, take the critic's values,
GAE(γ, λ) -> advantages and returns; then several PPO epochs over shuffled minibatches. Each
minibatch records its epoch (``inner_step``), minibatch index (``micro_batch``) and ``row_ids``
(rows of the rollout). An epoch stops early when the minibatch's masked mean ``approx_kl_k2``
exceeds ``target_kl``; that minibatch is recorded with ``early_stop = true`` and not applied.
"""

from __future__ import annotations

import copy
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from tracer import formulas
from tracer.demo import rollout as ro
from tracer.demo.policy import frozen_copy, load_policy
from tracer.record.writer import Tracer


@dataclass
class PPOConfig:
    """Hyperparameters of the demo PPO loop."""

    steps: int = 2
    """Optimizer steps with fresh rollouts."""
    batch_size: int = 8
    """B, prompts (= sequences) per rollout."""
    minibatch_size: int = 4
    """Rows per PPO minibatch."""
    ppo_epochs: int = 3
    """Passes over each rollout (inner steps)."""
    max_new_tokens: int = 8
    """T, the completion budget."""
    temperature: float = 1.0
    """Sampling temperature."""
    clip_epsilon: float = 0.2
    """PPO clip."""
    kl_coef: float = 0.02
    """Coefficient of the masked mean ref_kl_k3 in the policy loss."""
    target_kl: float = 0.1
    """Early stop: the epoch ends when a minibatch's mean approx_kl_k2 exceeds this."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    vf_coef: float = 0.5
    """Weight of the critic's squared error."""
    learning_rate: float = 1e-3
    """AdamW learning rate (actor and critic)."""
    seed: int = 0
    """Seeds prompts, sampling, minibatch order and the value head."""


class Critic(nn.Module):
    """The actor's transformer body (a copy) with a scalar value head."""

    def __init__(self, actor) -> None:
        super().__init__()
        self.body = copy.deepcopy(actor.model)
        self.value_head = nn.Linear(actor.config.hidden_size, 1)

    def forward(self, input_ids, attention_mask, prompt_len: int) -> torch.Tensor:
        """Values ``[B, T]``: the value of the state before completion token j is read at position
        ``prompt_len - 1 + j``, like the token's logprob."""
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids).last_hidden_state  # (B, L + T, H)
        return self.value_head(hidden[:, prompt_len - 1 : -1]).squeeze(-1)  # (B, T)


def _score(batch: ro.Rollout, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    completions = tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
    components = ro.reward_components(batch.prompts, completions)  # (B, F)
    return components.sum(dim=1), components  # (B,), (B, F)


def train(actor, critic, ref_model, tokenizer, cfg: PPOConfig, tr: Tracer, progress=None) -> None:
    """Run ``cfg.steps`` PPO steps, tracing each minibatch into ``tr``."""
    optimizer = torch.optim.AdamW(list(actor.parameters()) + list(critic.parameters()), lr=cfg.learning_rate)
    rng = random.Random(cfg.seed)
    for step in range(cfg.steps):
        actor.eval()
        batch = ro.rollout(actor, tokenizer, ro.arithmetic_prompts(cfg.batch_size, rng), 1,
                           cfg.max_new_tokens, cfg.temperature)
        rewards, components = _score(batch, tokenizer)
        mask, L = batch.completion_mask, batch.prompt_ids.shape[1]
        with torch.no_grad():
            ref_resp_logp = ro.completion_logprobs(ref_model, batch.input_ids, batch.attention_mask, L,
                                                   cfg.temperature)
            old_resp_values = critic(batch.input_ids, batch.attention_mask, L) * mask  # (B, T)
        token_rewards = formulas.token_rewards_from_sequence(rewards, mask)  # (B, T)
        advantages, returns = formulas.gae(token_rewards, old_resp_values, mask, cfg.gamma, cfg.lam)
        actor.train()
        stop = False
        for epoch in range(cfg.ppo_epochs):
            perm = torch.randperm(cfg.batch_size)
            for mb, start in enumerate(range(0, cfg.batch_size, cfg.minibatch_size)):
                inds = perm[start : start + cfg.minibatch_size]
                ids, att, m = batch.input_ids[inds], batch.attention_mask[inds], mask[inds]
                mb_resp_logp = ro.completion_logprobs(actor, ids, att, L, cfg.temperature)  # (b, T)
                approx_kl = formulas.masked_mean(formulas.approx_kl_k2(mb_resp_logp, batch.old_logprobs[inds]), m)
                stop = bool(approx_kl > cfg.target_kl)
                ratio = formulas.ratio(mb_resp_logp, batch.old_logprobs[inds])
                clipped = torch.clamp(ratio, 1 - cfg.clip_epsilon, 1 + cfg.clip_epsilon)
                per_token_loss = -torch.min(ratio * advantages[inds], clipped * advantages[inds])
                kl_ref = formulas.ref_kl_k3(mb_resp_logp, ref_resp_logp[inds])
                per_token_loss = per_token_loss + cfg.kl_coef * kl_ref
                policy_loss = formulas.token_mean_loss(per_token_loss, m)
                values = critic(ids, att, L)
                value_loss = formulas.masked_mean((values - returns[inds]) ** 2, m)
                optimizer.zero_grad(set_to_none=True)
                if not stop:  # the gradient norm of the update this minibatch makes
                    (policy_loss + cfg.vf_coef * value_loss).backward()
                scalars = ro.step_scalars(optimizer, policy_loss, value_loss=float(value_loss.detach()))
                if stop:
                    del scalars["grad_norm"]  # no update: no gradient
                tr.record(
                    step=step, inner_step=epoch, micro_batch=mb, metadata={"early_stop": stop}, scalars=scalars,
                    row_ids=inds, prompt_ids=batch.prompt_ids[inds], prompt_mask=batch.prompt_mask[inds],
                    completion_ids=batch.completion_ids[inds], completion_mask=m,
                    policy_logprobs=mb_resp_logp.detach(), old_logprobs=batch.old_logprobs[inds],
                    ref_logprobs=ref_resp_logp[inds], ratio=ratio.detach(), ref_kl_k3=kl_ref.detach(),
                    approx_kl_k2=formulas.approx_kl_k2(mb_resp_logp.detach(), batch.old_logprobs[inds]),
                    values=old_resp_values[inds], returns=returns[inds], token_rewards=token_rewards[inds],
                    advantages=advantages[inds], rewards=rewards[inds], reward_components=components[inds],
                    per_token_loss=per_token_loss.detach(), loss=policy_loss.detach(),
                )
                if stop:  # the seed's early stop: this minibatch is not applied, the epochs end
                    break
                optimizer.step()
            if stop:
                break
        if progress is not None:
            progress.update(1)


def hyperparameters(cfg: PPOConfig) -> dict:
    """Step metadata (SPEC.md section 4 keys) of this loop."""
    return {
        "clip_epsilon_low": cfg.clip_epsilon, "clip_epsilon_high": cfg.clip_epsilon, "kl_coef": cfg.kl_coef,
        "gamma": cfg.gamma, "lam": cfg.lam, "temperature": cfg.temperature, "top_p": 1.0,
        "top_k": 0, "loss_reduction": "token_mean", "target_kl": cfg.target_kl, "advantage_rule": "gae",
        "old_logprobs_source": "sampler_forward", "reward_component_names": ro.REWARD_COMPONENT_NAMES,
    }


def run(out_dir, cfg: PPOConfig, model_dir: str | Path, progress=None) -> Path:
    """Load the tiny model from ``model_dir``, train actor + critic with ``cfg``, trace into ``out_dir``."""
    tokenizer, actor = load_policy(model_dir, cfg.seed)
    ref_model = frozen_copy(actor)
    critic = Critic(actor)
    with Tracer(out_dir, algorithm="ppo", tokenizer=tokenizer,
                config={**asdict(cfg), "model_dir": str(model_dir), "trainer": "tracer.demo.ppo_loop"},
                hyperparameters=hyperparameters(cfg)) as tr:
        train(actor, critic, ref_model, tokenizer, cfg, tr, progress)
    return Path(out_dir)
