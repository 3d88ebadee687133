"""A hand-written asynchronous GRPO loop: the rollouts of step ``s`` are sampled by the policy of
``lag`` updates earlier (a rollout worker that trails the trainer, as in AReaL, verl's fully-async
recipe, slime or miles), and the trainer corrects for it, traced through the explicit API.

Each step is one optimizer update, so the policy version of the trainer at step ``s`` is ``s``
(``trainer_version``) and the rows it trains on were sampled by version ``max(0, s - lag)``
(``policy_version [B]``); their ``policy_lag`` is the difference.

Two textbook ways to train on stale rows (``old_source``):

- ``recomputed`` (decoupled PPO, AReaL; verl with ``rollout_is``): ``old_logprobs`` are recomputed
  with the trainer's current weights, so the first-pass ratio is 1, and the gap to the behaviour
  policy (the stale sampler, ``sampler_logprobs``) is corrected by importance-sampling weights
  ``is_weights`` (token modes) or ``sequence_is_weights`` (sequence modes) that multiply the clipped
  policy-gradient term (TRL's and verl's placement), in the recorded ``is_mode`` with its caps;
- ``behaviour`` (plain off-policy PPO): ``old_logprobs`` are the stale sampler's own logprobs, so the
  ratio already carries the correction and is not 1 on the first pass: the lag explains it.

``fault`` builds the broken forms the checks must name: ``sequence_sum`` (the sequence weight is
exp of the summed log ratio where the run declares the mean, trl#5814), ``mask_not_applied`` (IcePop
declared, its mask not applied: NeMo-RL#24), ``weights_not_applied`` (weights computed and recorded,
the loss not multiplied by them), ``lag_beyond_max`` (the buffer serves rows staler than the declared
``max_policy_lag``: staleness ignored, miles#1829).
"""

from __future__ import annotations

import copy
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tracer import formulas
from tracer.demo import rollout as ro
from tracer.demo.policy import frozen_copy, load_policy
from tracer.formulas import importance
from tracer.record.writer import Tracer

FAULTS = ("", "sequence_sum", "mask_not_applied", "weights_not_applied", "lag_beyond_max")


@dataclass
class AsyncGRPOConfig:
    """Hyperparameters of the asynchronous GRPO demo loop."""

    steps: int = 4
    """Optimizer updates (one per step)."""
    num_prompts: int = 2
    """P, prompts per step."""
    num_generations: int = 4
    """G, completions per prompt."""
    max_new_tokens: int = 8
    """T, the completion budget."""
    lag: int = 2
    """k: the rollouts of step s are sampled by the policy after s - k updates (0 = synchronous)."""
    max_policy_lag: int = 2
    """The largest lag the loop declares acceptable (metadata ``max_policy_lag``)."""
    old_source: str = "recomputed"
    """``recomputed`` (old = current weights, IS weights correct the lag) or ``behaviour`` (old = the sampler's)."""
    is_mode: str = "token_truncate"
    """TRL's importance-sampling mode: token_truncate | token_mask | sequence_truncate | sequence_mask."""
    is_clip_min: float | None = None
    """Lower cap (mask modes zero weights below it; IcePop sets both)."""
    is_clip_max: float = 2.0
    """Upper cap."""
    is_sequence_aggregation: str = "sum"
    """Sequence modes: the sequence log ratio is the sum (TRL, verl) or the mean (GSPO-style) of the token ones."""
    clip_epsilon: float = 0.2
    """GRPO clip."""
    learning_rate: float = 1e-3
    """AdamW learning rate (large enough that a few updates move the policy)."""
    fault: str = ""
    """One of :data:`FAULTS` ('' = healthy)."""
    seed: int = 0
    """Seeds prompts, sampling and the model build."""


def hyperparameters(cfg: AsyncGRPOConfig) -> dict:
    """Step metadata (SPEC.md section 4 keys and the importance-sampling / staleness keys)."""
    corrected = cfg.old_source == "recomputed"
    declared_aggregation = "mean" if cfg.fault == "sequence_sum" else cfg.is_sequence_aggregation
    return {
        "num_generations": cfg.num_generations, "beta": 0.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
        "clip_epsilon_low": cfg.clip_epsilon, "clip_epsilon_high": cfg.clip_epsilon,
        "loss_reduction": "sequence_mean", "advantage_rule": "group_zscore",
        "reward_component_names": ro.REWARD_COMPONENT_NAMES, "max_policy_lag": cfg.max_policy_lag,
        "old_logprobs_source": "trainer_forward" if corrected else "behaviour_policy",
        "is_correction": corrected,  # the pg term after the clip times the weights (TRL's placement)
        **({"is_mode": cfg.is_mode, "is_clip_min": cfg.is_clip_min, "is_clip_max": cfg.is_clip_max,
            "is_sequence_aggregation": declared_aggregation} if corrected else {}),
    }


def _weights(cfg: AsyncGRPOConfig, old, sampler, mask) -> torch.Tensor:
    """The loop's importance-sampling weights: ``[B, T]`` token modes, ``[B]`` sequence modes."""
    if cfg.fault == "mask_not_applied":  # the raw ratio: the IcePop mask never zeroes anything
        return importance.raw_is_ratio(old, sampler, mask, cfg.is_mode)
    aggregation = "sum" if cfg.fault == "sequence_sum" else cfg.is_sequence_aggregation
    return importance.correction_weights(old, sampler, mask, cfg.is_mode, cfg.is_clip_min, cfg.is_clip_max,
                                         aggregation)


def train(model, tokenizer, cfg: AsyncGRPOConfig, tr: Tracer) -> None:
    """Run ``cfg.steps`` updates on ``model``, sampling each step's rollouts with the weights of
    ``cfg.lag`` updates earlier, tracing each update into ``tr``."""
    if cfg.fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {cfg.fault!r}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    rng = random.Random(cfg.seed)
    versions = [copy.deepcopy(model.state_dict())]  # versions[v]: the weights after v updates
    sampler = frozen_copy(model)  # the trailing rollout worker
    ref_model = frozen_copy(model)  # the initial policy (its KL is logged, beta = 0)
    extra = 2 if cfg.fault == "lag_beyond_max" else 0
    for step in range(cfg.steps):
        version = max(0, step - cfg.lag - extra)
        sampler.load_state_dict(versions[version])
        batch = ro.rollout(sampler, tokenizer, ro.arithmetic_prompts(cfg.num_prompts, rng), cfg.num_generations,
                           cfg.max_new_tokens, 1.0)
        behaviour = batch.old_logprobs  # (B, T) the stale policy's logprobs, saved while sampling
        completions = tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
        components = ro.reward_components(batch.prompts, completions)  # (B, F)
        rewards = components.sum(dim=1)  # (B,)
        advantages = formulas.group_advantages(rewards, cfg.num_generations)  # (B,)
        L, mask = batch.prompt_ids.shape[1], batch.completion_mask
        model.eval()
        with torch.no_grad():
            current = ro.completion_logprobs(model, batch.input_ids, batch.attention_mask, L)  # (B, T)
            ref_logprobs = ro.completion_logprobs(ref_model, batch.input_ids, batch.attention_mask, L)  # (B, T)
        old = current if cfg.old_source == "recomputed" else behaviour
        weights = _weights(cfg, current, behaviour, mask) if cfg.old_source == "recomputed" else None
        model.train()
        policy = ro.completion_logprobs(model, batch.input_ids, batch.attention_mask, L)  # (B, T), with grad
        applied = None if cfg.fault == "weights_not_applied" else weights
        per_token_loss = formulas.grpo_per_token_loss(policy, old, advantages, cfg.clip_epsilon, cfg.clip_epsilon,
                                                      sampler_weights=applied)
        loss = formulas.sequence_mean_loss(per_token_loss, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        is_fields = {} if weights is None else {
            ("sequence_is_weights" if cfg.is_mode.startswith("sequence") else "is_weights"): weights}
        tr.record(
            step=step, metadata={"trainer_version": step}, scalars=ro.step_scalars(optimizer, loss),
            prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask, completion_ids=batch.completion_ids,
            completion_mask=mask, policy_logprobs=policy.detach(), old_logprobs=old, sampler_logprobs=behaviour,
            ratio=formulas.ratio(policy.detach(), old), ref_logprobs=ref_logprobs,
            ref_kl_k3=formulas.ref_kl_k3(policy.detach(), ref_logprobs),
            approx_kl_k2=formulas.approx_kl_k2(policy.detach(), old), rewards=rewards, reward_components=components,
            advantages=advantages, group_ids=batch.group_ids,
            policy_version=torch.full((mask.shape[0],), version, dtype=torch.int64),
            per_token_loss=per_token_loss.detach(), loss=loss.detach(), **is_fields)
        optimizer.step()
        versions.append(copy.deepcopy(model.state_dict()))


def run(out_dir, cfg: AsyncGRPOConfig, model_dir: str | Path) -> Path:
    """Load the tiny model from ``model_dir``, train asynchronously with ``cfg``, trace into ``out_dir``."""
    tokenizer, model = load_policy(model_dir, cfg.seed)
    with Tracer(out_dir, algorithm="grpo", tokenizer=tokenizer,
                config={**asdict(cfg), "model_dir": str(model_dir), "trainer": "tracer.demo.async_grpo"},
                hyperparameters=hyperparameters(cfg)) as tr:
        train(model, tokenizer, cfg, tr)
    return Path(out_dir)
