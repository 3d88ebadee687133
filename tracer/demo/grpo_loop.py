"""A hand-written GRPO / CISPO loop that follows the seed (MiniMind ``train_grpo.py``) exactly and
traces every update through the explicit API (``tracer.Tracer``).

Per step: sample G completions per prompt with the policy (old logprobs saved at sampling time),
score them (rules + a clipped scorer), group-normalise the rewards, compute the reference logprobs,
then ``num_iterations`` passes of the clipped (GRPO) or clamped-and-detached (CISPO) loss with
``beta * ref_kl_k3``, reduced per sequence and then averaged over sequences.
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
class GRPOConfig:
    """Hyperparameters of the demo GRPO/CISPO loop."""

    loss_type: str = "grpo"
    """``grpo`` (clipped surrogate) or ``cispo`` (clamped, detached ratio times policy logprob)."""
    steps: int = 2
    """Optimizer steps with fresh rollouts."""
    num_prompts: int = 2
    """P, prompts per step."""
    num_generations: int = 4
    """G, completions per prompt."""
    num_iterations: int = 2
    """Passes over each rollout (inner steps); > 1 makes policy differ from old."""
    max_new_tokens: int = 8
    """T, the completion budget."""
    temperature: float = 1.0
    """Sampling temperature; logprobs are computed with the same temperature."""
    clip_epsilon: float = 0.2
    """GRPO clip: ratio kept in [1 - eps, 1 + eps]."""
    epsilon_high: float = 5.0
    """CISPO: the ratio is clamped at this maximum (MiniMind ``args.epsilon_high``)."""
    beta: float = 0.04
    """Coefficient of ref_kl_k3 in the loss."""
    learning_rate: float = 1e-3
    """AdamW learning rate."""
    scorer_clip: float = 3.0
    """The scorer's reward is clipped to [-scorer_clip, scorer_clip] (the seed clips its reward model at 3;
    the bundled diff pair changes it: ``tracer.demo.diff_pair``)."""
    seed: int = 0
    """Seeds prompts, sampling and the model build."""
    rollout: str = "hf"
    """Who samples: ``hf`` (the policy's ``generate``, old logprobs saved while sampling) or ``vllm``
    (a colocated vLLM engine synced each step, :mod:`tracer.demo.vllm_rollout`; needs the ``vllm`` extra)."""


def _record(tr: Tracer, cfg: GRPOConfig, step: int, inner: int, batch: ro.Rollout, rewards, components,
            advantages, ref_logprobs, policy_logprobs, per_token_loss, sampler_settings=None, scalars=None) -> None:
    policy = policy_logprobs.detach()
    tr.record(
        step=step, inner_step=inner, metadata=sampler_settings or None, scalars=scalars,
        prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
        completion_ids=batch.completion_ids, completion_mask=batch.completion_mask,
        policy_logprobs=policy, old_logprobs=batch.old_logprobs, ref_logprobs=ref_logprobs,
        ratio=formulas.ratio(policy, batch.old_logprobs),
        ref_kl_k3=formulas.ref_kl_k3(policy, ref_logprobs),
        approx_kl_k2=formulas.approx_kl_k2(policy, batch.old_logprobs),
        rewards=rewards, reward_components=components, advantages=advantages, group_ids=batch.group_ids,
        per_token_loss=per_token_loss.detach(),
        loss=formulas.sequence_mean_loss(per_token_loss.detach(), batch.completion_mask),
        **({} if batch.sampler_logprobs is None else {"sampler_logprobs": batch.sampler_logprobs}),
    )


def train(model, ref_model, tokenizer, cfg: GRPOConfig, tr: Tracer, progress=None, sampler=None) -> None:
    """Run ``cfg.steps`` GRPO/CISPO steps on ``model``, tracing each inner step into ``tr``;
    ``sampler`` (a :class:`~tracer.demo.vllm_rollout.VLLMSampler`) samples instead of ``generate``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    rng = random.Random(cfg.seed)
    for step in range(cfg.steps):
        prompts = ro.arithmetic_prompts(cfg.num_prompts, rng)
        model.eval()
        policy = getattr(model, "module", model)  # sample with the bare model under DistributedDataParallel
        sample = ro.rollout if sampler is None else sampler.rollout
        batch = sample(policy, tokenizer, prompts, cfg.num_generations, cfg.max_new_tokens, cfg.temperature)
        completions = tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
        components = ro.reward_components(batch.prompts, completions, cfg.scorer_clip)  # (B, F)
        rewards = components.sum(dim=1)  # (B,)
        advantages = formulas.group_advantages(rewards, cfg.num_generations)  # (B,)
        L = batch.prompt_ids.shape[1]
        with torch.no_grad():
            ref_logprobs = ro.completion_logprobs(ref_model, batch.input_ids, batch.attention_mask, L,
                                                  cfg.temperature)  # (B, T)
        model.train()
        for inner in range(cfg.num_iterations):
            per_token_logps = ro.completion_logprobs(model, batch.input_ids, batch.attention_mask, L,
                                                     cfg.temperature)  # (B, T), carries the gradient
            if cfg.loss_type == "cispo":
                per_token_loss = formulas.cispo_per_token_loss(
                    per_token_logps, batch.old_logprobs, advantages, cfg.epsilon_high, cfg.beta, ref_logprobs)
            else:
                per_token_loss = formulas.grpo_per_token_loss(
                    per_token_logps, batch.old_logprobs, advantages, cfg.clip_epsilon, cfg.clip_epsilon,
                    cfg.beta, ref_logprobs)
            loss = formulas.sequence_mean_loss(per_token_loss, batch.completion_mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            _record(tr, cfg, step, inner, batch, rewards, components, advantages, ref_logprobs,
                    per_token_logps, per_token_loss, None if sampler is None else sampler.settings,
                    ro.step_scalars(optimizer, loss))
            optimizer.step()
        if progress is not None:
            progress.update(1)


def hyperparameters(cfg: GRPOConfig) -> dict:
    """Step metadata (SPEC.md section 4 keys) of this loop."""
    # clip_epsilon_high means "ratio clipped at 1 + eps"; CISPO's epsilon_high is the bound itself.
    eps_high = cfg.epsilon_high - 1.0 if cfg.loss_type == "cispo" else cfg.clip_epsilon
    return {
        "num_generations": cfg.num_generations, "beta": cfg.beta, "temperature": cfg.temperature,
        "top_p": 1.0, "top_k": 0, "clip_epsilon_low": cfg.clip_epsilon, "clip_epsilon_high": eps_high,
        "loss_reduction": "sequence_mean", "advantage_rule": "group_zscore",
        "old_logprobs_source": "sampler_forward" if cfg.rollout == "hf" else "trainer_forward",
        # the engine's settings in effect (sampler_temperature, sampler_dtype, ...) come per step from
        # VLLMSampler.settings, read from the SamplingParams of each generate call
        **({"sampler_engine": "vllm"} if cfg.rollout == "vllm" else {}),
        "reward_component_names": ro.REWARD_COMPONENT_NAMES,
        **({"cispo_epsilon_high": cfg.epsilon_high} if cfg.loss_type == "cispo" else {}),
    }


def run(out_dir, cfg: GRPOConfig, model_dir: str | Path, progress=None, config: dict | None = None) -> Path:
    """Load the tiny model from ``model_dir``, train with ``cfg``, trace into ``out_dir``; ``config``
    adds keys to the manifest's run config (e.g. ``diff_baseline``)."""
    tokenizer, model = load_policy(model_dir, cfg.seed)
    ref_model = frozen_copy(model)
    with Tracer(out_dir, algorithm=cfg.loss_type, tokenizer=tokenizer,
                config={**asdict(cfg), "model_dir": str(model_dir), "trainer": "tracer.demo.grpo_loop", **(config or {})},
                hyperparameters=hyperparameters(cfg)) as tr:
        if cfg.rollout == "vllm":
            from tracer.demo.vllm_rollout import VLLMSampler

            with VLLMSampler(model_dir, seed=cfg.seed) as sampler:
                train(model, ref_model, tokenizer, cfg, tr, progress, sampler)
        else:
            train(model, ref_model, tokenizer, cfg, tr, progress)
    return Path(out_dir)
