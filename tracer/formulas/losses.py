"""Losses: the loss reductions (sequence mean, token mean, constant divisor) and each token's
share of the reduced loss, the PPO clip fractions, the per-token policy losses (GRPO's clipped
surrogate, token or sequence level (GSPO), with dual clip; CISPO; PPO with its KL penalty), the
entropy bonus and the DPO terms. Torch (numpy for the host-side clip
fractions), no I/O. Every mask is True = keep; logprobs are nats.

Sources: MiniMind ``train_ppo.py``, ``train_grpo.py``, ``train_dpo.py`` (the seed lesson); TRL 1.16
``grpo_trainer.py``; Rafailov et al. (2023) for DPO; Zheng et al. (2025, arXiv 2507.18071) for GSPO; Ye
et al. (2020, arXiv 1912.09729) for dual-clip PPO.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tracer.formulas.logprobs import ratio, ref_kl, sequence_log_ratio
from tracer.formulas.reductions import masked_mean, masked_sum


def sequence_mean_loss(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence masked mean, then the mean over sequences (the seed's GRPO reduction).

    ``per_token_loss`` ``[B, T]`` -> scalar. Source: seed section 6
    (``((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()``).
    """
    return masked_mean(per_token_loss, mask, dim=1).mean()


def kept_rows_sequence_mean_loss(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`sequence_mean_loss` over the rows that keep at least one token (0 when none does): rows
    the mask empties do not count in the mean over sequences. ``[B, T]`` -> scalar. Source: MiniMind
    ``trainer/train_agent.py`` (``valid_rows = token_counts > 0``; ``(... .sum(dim=1)[valid_rows] /
    token_counts[valid_rows].clamp(min=1)).mean()``)."""
    rows = mask.bool().any(dim=1)  # (B,)
    if not bool(rows.any()):
        return per_token_loss.sum() * 0.0
    return masked_mean(per_token_loss[rows], mask[rows], dim=1).mean()


def token_mean_loss(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over all kept tokens of the batch (DAPO / TRL ``bnpo`` style), scalar."""
    return masked_mean(per_token_loss, mask)


def constant_divisor_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, divisor: float) -> torch.Tensor:
    """Masked sum divided by a constant (Dr. GRPO: ``B * max_completion_length``), scalar."""
    return masked_sum(per_token_loss, mask) / divisor


def unmasked_mean_loss(per_token_loss: torch.Tensor) -> torch.Tensor:
    """The plain mean over all ``B * T`` positions of ``per_token_loss`` ``[B, T]``, padding and every
    other masked position included: ``per_token_loss.mean()``. Scalar, in the loss's dtype.

    No RL loss means this: it is the bug of a loop that forgets its mask in the reduction (the seed's
    lesson 25 warns against it: "do not average over every token of the batch"). It is here so that a
    check can recognise a recorded loss taken this way. Where the per-token loss is 0 at every masked
    position it equals :func:`constant_divisor_loss` with divisor ``B * T``.
    Source: seed section 6 (the correct form ``((loss * mask).sum(1) / mask.sum(1)).mean()`` and the
    warning); the unmasked mean is ``torch.Tensor.mean``.
    """
    return per_token_loss.mean()


def loss_contributions(per_token_loss: torch.Tensor, mask: torch.Tensor, reduction: str,
                       divisor: float | None = None) -> torch.Tensor:
    """Each token's share of the scalar loss, ``[B, T]``: ``per_token_loss`` times the weight the
    reduction gives it (0 where the mask drops it), so the shares sum to the reduced loss.

    ``sequence_mean``: ``1 / (B * kept tokens of the row)`` (:func:`sequence_mean_loss`);
    ``token_mean``: ``1 / kept tokens of the batch`` (:func:`token_mean_loss`); ``constant``:
    ``1 / divisor`` (:func:`constant_divisor_loss`, divisor required). Raises ValueError for
    another reduction or a constant one without a divisor.
    """
    keep = mask.bool()
    if reduction == "sequence_mean":
        weight = 1.0 / (keep.sum(dim=1, keepdim=True).clamp(min=1) * keep.shape[0])
    elif reduction == "token_mean":
        weight = 1.0 / keep.sum().clamp(min=1)
    elif reduction == "constant" and divisor:
        weight = 1.0 / float(divisor)
    else:
        raise ValueError(f"loss_contributions: no rule for reduction {reduction!r} (divisor {divisor!r})")
    return torch.where(keep, per_token_loss * weight, torch.zeros_like(per_token_loss))


def clip_fractions(
    ratio_: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_epsilon_low: float,
    clip_epsilon_high: float,
    dim: int | tuple[int, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """Share of kept tokens where the PPO clip binds, counted only for the advantage's sign.

    With A > 0 the clip binds when ``ratio > 1 + eps_high``; with A < 0 when ``ratio < 1 - eps_low``.
    ``advantages`` is ``[B]`` (broadcast over T) or ``[B, T]`` (or anything broadcasting against
    ``ratio_``, with ``dim`` naming the dimensions to reduce: all when None).

    Returns:
        ``{"low": ..., "high": ..., "region": ...}`` scalar shares in [0, 1]; ``region`` is the
        share outside ``[1 - eps_low, 1 + eps_high]`` whatever the sign.
    Numpy arrays in give float32 numpy arrays out, the same values (the writer's summaries; the
    thresholds are compared in ``ratio_``'s dtype, as torch compares a tensor with a Python float).
    Source: TRL ``grpo_trainer.py`` (``is_low_clipped`` / ``is_high_clipped``).
    """
    if isinstance(ratio_, np.ndarray):
        return _clip_fractions_host(ratio_, advantages, mask, clip_epsilon_low, clip_epsilon_high, dim)
    adv = _over_tokens(advantages)  # (B, 1) or (B, T)
    keep = mask.bool()
    below, above = ratio_ < 1 - clip_epsilon_low, ratio_ > 1 + clip_epsilon_high

    def count(hits: torch.Tensor) -> torch.Tensor:  # an exact int64 count, whatever the size
        return hits.sum() if dim is None else hits.sum(dim=dim)

    kept = count(keep).clamp(min=1)
    # masked_mean of the 0/1 indicator, as the share count / kept (a float32 quotient, as masked_mean's)
    return {
        "low": count(below & (adv < 0) & keep) / kept,
        "high": count(above & (adv > 0) & keep) / kept,
        "region": count((below | above) & keep) / kept,
    }


def _clip_fractions_host(ratio_: np.ndarray, advantages: np.ndarray, mask: np.ndarray, clip_epsilon_low: float,
                         clip_epsilon_high: float, dim: int | tuple[int, ...] | None) -> dict[str, np.ndarray]:
    """:func:`clip_fractions` of numpy arrays: the same counts, the same float32 quotients."""
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    keep = mask.astype(bool, copy=False)
    kind = ratio_.dtype.type
    below, above = ratio_ < kind(1 - clip_epsilon_low), ratio_ > kind(1 + clip_epsilon_high)
    kept = np.maximum(keep.sum(axis=dim), 1).astype(np.float32)
    return {"low": (below & (adv < 0) & keep).sum(axis=dim).astype(np.float32) / kept,
            "high": (above & (adv > 0) & keep).sum(axis=dim).astype(np.float32) / kept,
            "region": ((below | above) & keep).sum(axis=dim).astype(np.float32) / kept}


def grpo_per_token_loss(
    policy_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_epsilon_low: float,
    clip_epsilon_high: float,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_importance_weighted: bool = False,
    sampler_weights: torch.Tensor | None = None,
    delta: float | None = None,
    kl_estimator: str = "k3",
    clip_ratio_c: float | None = None,
    sequence_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clipped surrogate per token ``-(min(r*A, clip(r, 1-εl, 1+εh)*A) - β*k3)``, ``[B, T]``.

    ``advantages`` is ``[B]`` (broadcast over T). ``kl_importance_weighted`` multiplies k3 by the
    ratio r (TRL's ``use_bias_correction_kl``: the KL of tokens sampled from old, reweighted to the policy).
    ``sampler_weights`` (``[B, T]`` or ``[B]``) multiply the policy-gradient term only: the capped
    importance weights ``exp(old - sampler)`` of TRL's ``vllm_importance_sampling_correction``.
    ``delta`` (two-sided clipping, TRL's ``GRPOConfig.delta``, from INTELLECT-2): the unclipped term
    uses ``min(r, δ)``, so that a negative advantage cannot push a token's weight past δ; the clipped
    term and the KL's importance weight keep ``r``.
    ``kl_estimator``: the KL term's estimator of KL(policy || ref), k3 by default (MiniMind, TRL);
    ``k1`` or ``k2`` (verl's ``kl`` / ``mse``) where a loop uses those (:func:`tracer.formulas.ref_kl`).
    ``clip_ratio_c`` (dual-clip PPO, verl's ``clip_ratio_c``, > 1): where ``A < 0`` the surrogate is
    floored at ``c * A`` (:func:`dual_clip`), so that a huge ratio on a bad token cannot make the loss
    unbounded. ``sequence_mask`` ``[B, T]`` (GSPO; TRL ``importance_sampling_level="sequence"``): the ratio
    is then the sequence's, ``exp`` of the masked mean log-ratio (:func:`sequence_ratio`), broadcast
    over T and clipped once per sequence; GSPO-token (``s_i * π / sg(π)``) has the same value.
    Source: MiniMind ``train_grpo.py:132-143``; TRL 1.16 ``grpo_trainer.py:_compute_loss``; verl 0.9.1
    ``core_algos.compute_policy_loss_vanilla`` (dual clip).
    """
    if sequence_mask is None:
        r = ratio(policy_logprobs, old_logprobs)  # (B, T)
    else:
        r = sequence_ratio(policy_logprobs, old_logprobs, sequence_mask).unsqueeze(1).expand_as(policy_logprobs)
    adv = _over_tokens(advantages)  # (B, 1) or (B, T)
    unclipped = r if delta is None else torch.clamp(r, max=delta)
    surrogate = torch.min(unclipped * adv, torch.clamp(r, 1 - clip_epsilon_low, 1 + clip_epsilon_high) * adv)
    if clip_ratio_c is not None:
        surrogate = dual_clip(surrogate, adv, clip_ratio_c)
    return _policy_loss(surrogate, r, policy_logprobs, beta, ref_logprobs, kl_importance_weighted, sampler_weights,
                        kl_estimator)


def sequence_ratio(policy_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence importance ratio ``[B]``: ``exp`` of the mean of ``policy - old`` over the kept
    tokens of each row, ``(π(y|x) / π_old(y|x)) ^ (1 / |y|)`` (1 for a row that keeps no token).
    Source: Zheng et al. (2025) "Group Sequence Policy Optimization" eq. 7; TRL 1.16 ``_compute_loss``
    (``importance_sampling_level == "sequence"``); verl 0.9.1 ``compute_policy_loss_gspo`` (which
    also clamps the log-ratio at 10: :func:`tracer.formulas.verl_losses.verl_gspo_per_token_loss`)."""
    return torch.exp(sequence_log_ratio(policy_logprobs - old_logprobs, mask, "mean"))  # (B,)


def dual_clip(surrogate: torch.Tensor, advantages: torch.Tensor, clip_ratio_c: float) -> torch.Tensor:
    """Dual-clip PPO: ``max(surrogate, c * A)`` where ``A < 0``, ``surrogate`` elsewhere, ``[B, T]``.
    ``surrogate`` is the clipped objective ``min(r*A, clip(r)*A)`` (to maximise), ``advantages`` broadcast
    against it; ``c = clip_ratio_c`` > 1. Raises ValueError for ``c <= 1`` (verl asserts the same).
    Source: Ye et al. (2020) "Mastering Complex Control in MOBA Games with Deep RL" eq. 5; verl 0.9.1
    ``core_algos.compute_policy_loss_vanilla`` (``pg_losses3 = -advantages * clip_ratio_c``)."""
    if not clip_ratio_c > 1.0:
        raise ValueError(f"dual-clip PPO needs clip_ratio_c > 1, got {clip_ratio_c}")
    return torch.where(advantages < 0, torch.maximum(surrogate, clip_ratio_c * advantages), surrogate)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, entropy_coef: float,
                  reduction: str = "token_mean") -> torch.Tensor:
    """The entropy bonus a loss subtracts, a scalar: ``entropy_coef * reduce(entropy)``, so that
    ``loss = policy_loss - entropy_bonus(...)`` (a positive coefficient pays the policy for entropy).

    ``entropy`` ``[B, T]`` nats per token, ``mask`` ``[B, T]`` True = keep. ``reduction``:
    ``token_mean`` (masked mean over the batch's kept tokens: TRL 1.16 ``entropy_loss``, verl's
    ``token-mean``) or ``sequence_mean`` (per-row masked mean, then the mean over rows); verl's other
    ``loss_agg_mode`` values: :func:`tracer.formulas.verl_losses.verl_agg_loss`. Raises ValueError for
    another reduction. Source: TRL 1.16 ``grpo_trainer.py:_compute_loss`` (``loss - apply_coef *
    entropy_loss``); verl 0.9.1 ``workers/utils/losses.py:ppo_loss`` (``policy_loss -= entropy_coeff *
    entropy_loss``)."""
    if reduction == "token_mean":
        return entropy_coef * masked_mean(entropy, mask)
    if reduction == "sequence_mean":
        return entropy_coef * masked_mean(entropy, mask, dim=1).mean()
    raise ValueError(f"entropy_bonus: no rule for reduction {reduction!r} (token_mean, sequence_mean)")


def cispo_per_token_loss(
    policy_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_epsilon_high: float,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_importance_weighted: bool = False,
    sampler_weights: torch.Tensor | None = None,
    kl_estimator: str = "k3",
) -> torch.Tensor:
    """CISPO per token ``-(clamp(r, max=ε_high).detach() * A * policy - β*k3)``, ``[B, T]``.

    ``kl_importance_weighted``, ``sampler_weights`` and ``kl_estimator``: as in :func:`grpo_per_token_loss`.

    The clamped ratio is detached: the gradient reaches only ``policy_logprobs`` (and the KL term).
    ``clip_epsilon_high`` is the ratio's upper bound itself, as in MiniMind (``max=args.epsilon_high``).
    Source: MiniMind ``train_grpo.py:132-143`` (``loss_type == "cispo"``); MiniMax-M1 report (2025).
    """
    r = ratio(policy_logprobs, old_logprobs)  # (B, T)
    clamped = torch.clamp(r, max=clip_epsilon_high).detach()  # (B, T)
    objective = clamped * _over_tokens(advantages) * policy_logprobs  # (B, T)
    return _policy_loss(objective, r, policy_logprobs, beta, ref_logprobs, kl_importance_weighted, sampler_weights,
                        kl_estimator)


def _over_tokens(per_row: torch.Tensor) -> torch.Tensor:
    """A ``[B]`` tensor as ``[B, 1]``, so that it broadcasts over T; a ``[B, T]`` one as it is."""
    return per_row.unsqueeze(1) if per_row.dim() == 1 else per_row


def _policy_loss(objective: torch.Tensor, r: torch.Tensor, policy_logprobs: torch.Tensor, beta: float,
                 ref_logprobs: torch.Tensor | None, kl_importance_weighted: bool,
                 sampler_weights: torch.Tensor | None, kl_estimator: str) -> torch.Tensor:
    """What GRPO and CISPO do with their per-token ``objective`` ``[B, T]``: times ``sampler_weights``,
    minus ``beta`` times the reference KL (times ``r`` when ``kl_importance_weighted``), negated."""
    if sampler_weights is not None:
        objective = objective * _over_tokens(sampler_weights)
    if beta and ref_logprobs is not None:
        kl = ref_kl(policy_logprobs, ref_logprobs, kl_estimator)  # (B, T)
        objective = objective - beta * (kl * r if kl_importance_weighted else kl)
    return -objective


def ppo_per_token_loss(
    policy_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_epsilon_low: float,
    clip_epsilon_high: float,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_estimator: str = "k3",
    clip_ratio_c: float | None = None,
) -> torch.Tensor:
    """PPO's policy loss per token with the reference-KL penalty folded in, ``[B, T]``:
    ``-min(r*A, clip(r, 1-εl, 1+εh)*A) + kl_coef * ref_kl_k3`` (``kl_estimator``: as in
    :func:`grpo_per_token_loss`). A loop that puts the penalty in the rewards instead (InstructGPT,
    OpenRLHF, TRL's PPOTrainer: :func:`kl_reward_token_rewards`) has no KL term here: ``kl_coef = 0``.

    ``advantages`` is ``[B, T]`` (GAE). Reduced by the token mean over the kept tokens this equals
    MiniMind's ``masked_ppo_loss + kl_coef * kl_ref_penalty`` (both are masked means over the same
    tokens). It is :func:`grpo_per_token_loss` with β = ``kl_coef``; ``clip_ratio_c``: dual clip (:func:`dual_clip`).
    Source: MiniMind ``trainer/train_ppo.py`` (``policy_loss``); SPEC.md section 3.
    """
    return grpo_per_token_loss(policy_logprobs, old_logprobs, advantages, clip_epsilon_low, clip_epsilon_high,
                               kl_coef, ref_logprobs, kl_estimator=kl_estimator, clip_ratio_c=clip_ratio_c)


def dpo_terms(
    chosen_policy: torch.Tensor,
    rejected_policy: torch.Tensor,
    chosen_ref: torch.Tensor,
    rejected_ref: torch.Tensor,
    beta: float,
) -> dict[str, torch.Tensor]:
    """DPO from per-sequence logprob sums (each ``[B]`` nats).

    ``logits = (π_c - π_r) - (ref_c - ref_r)``, ``loss = -logsigmoid(β·logits)``, implicit rewards
    ``β(π_c - ref_c)`` and ``β(π_r - ref_r)``.

    Returns:
        ``{"dpo_logits", "dpo_loss", "chosen_rewards", "rejected_rewards"}``, each ``[B]``.
    Source: MiniMind ``train_dpo.py:34-49``; Rafailov et al., "Direct Preference Optimization" (2023).
    """
    logits = (chosen_policy - rejected_policy) - (chosen_ref - rejected_ref)  # (B,)
    return {
        "dpo_logits": logits,
        "dpo_loss": -F.logsigmoid(beta * logits),
        "chosen_rewards": beta * (chosen_policy - chosen_ref),
        "rejected_rewards": beta * (rejected_policy - rejected_ref),
    }
