"""Advantages and the named advantage rules (SPEC.md section 10): group z-scores (the seed's
population std, TRL's and verl's Bessel std), group mean only (Dr. GRPO), RLOO leave-one-out,
PPO's token rewards and GAE, batch whitening, and the zero-variance group count the writer thread
computes for every step (plain loops or numpy). No I/O; every mask is True = keep.

Sources: MiniMind ``train_grpo.py`` and ``train_ppo.py`` (the seed lesson); TRL 1.16; verl 0.9.1
``core_algos.py``; Schulman et al. (2016) for GAE.
"""

from __future__ import annotations

import numpy as np
import torch

from tracer.formulas.logprobs import ref_kl
from tracer.formulas.reductions import host_array, masked_mean


GROUP_STD_EPS = 1e-4  # MiniMind train_grpo.py: (r - mean) / (std + 1e-4)


def group_advantages(rewards: torch.Tensor, num_generations: int, eps: float = GROUP_STD_EPS) -> torch.Tensor:
    """GRPO group-relative advantages ``(r - mean_g) / (std_g + eps)`` with population std.

    Args:
        rewards: ``[B]`` with B = P * G; G consecutive rows form one group.
        num_generations: G.
    Returns:
        ``[B]`` float advantages; a zero-variance group gets all zeros.
    Raises:
        ValueError: when B is not a multiple of G.
    Source: MiniMind ``train_grpo.py:121-124`` (``std(unbiased=False)``, eps 1e-4).
    """
    (B,) = rewards.shape
    if num_generations <= 0 or B % num_generations:
        raise ValueError(f"rewards has B = {B} rows, not a multiple of num_generations = {num_generations}")
    grouped = rewards.float().view(-1, num_generations)  # (P, G)
    mean_r = grouped.mean(dim=1).repeat_interleave(num_generations)  # (B,)
    std_r = grouped.std(dim=1, unbiased=False).repeat_interleave(num_generations)  # (B,)
    return (rewards.float() - mean_r) / (std_r + eps)


ZERO_VARIANCE_LOOP_VALUES = 4096  # up to this many rewards, zero_variance_groups counts in a plain loop


def zero_variance_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``S`` stacked steps: the number of groups and of zero-variance groups, each ``[S]``
    int64, from ``rewards`` ``[S, B]`` and ``group_ids`` ``[S, B]`` (rows of one id form a group).

    A group has zero variance when every reward in it equals its first (row order) reward, so its
    group-relative advantages are all 0 and it adds no policy gradient (GRPO, Shao et al. 2024,
    eq. 3; DAPO, Yu et al. 2025, section 3.2, "dynamic sampling"). A NaN reward equals nothing, so
    a group holding one never counts. Up to :data:`ZERO_VARIANCE_LOOP_VALUES` rewards are counted
    in a plain loop (the writer thread counts a batch of small steps: a loop over a few dozen values
    costs less than the array calls, which the training loop's work between batches leaves cold);
    more are sorted by id (stably) once for all S steps, with no loop over groups (numpy).
    """
    groups, zero = zero_variance_counts(rewards, group_ids)
    return torch.tensor(groups, dtype=torch.long), torch.tensor(zero, dtype=torch.long)


def zero_variance_counts(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[list[int], list[int]]:
    """:func:`zero_variance_groups` as two lists of S ints (what the writer's summaries store)."""
    S, B = rewards.shape
    if B == 0:
        return [0] * S, [0] * S
    if S * B <= ZERO_VARIANCE_LOOP_VALUES:
        groups, zero = [], []
        for values, ids in zip(rewards.tolist(), group_ids.tolist()):
            first: dict[int, float] = {}
            varied = set()
            for group, value in zip(ids, values):
                if value != first.setdefault(group, value):  # the first itself too, when NaN
                    varied.add(group)
            groups.append(len(first))
            zero.append(len(first) - len(varied))
        return groups, zero
    ids_, rewards_ = host_array(group_ids), host_array(rewards)
    rows = np.arange(S)[:, None]
    order = np.argsort(ids_, axis=1, kind="stable")  # (S, B)
    ids, values = ids_[rows, order], rewards_[rows, order]  # (S, B) each
    starts = np.ones((S, B), dtype=bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]  # the first row of each group
    first_row = np.maximum.accumulate(np.where(starts, np.arange(B), 0), axis=1)  # (S, B): its group's first row
    differs = values != values[rows, first_row]  # (S, B); NaN != NaN
    segment = np.cumsum(starts, axis=1) - 1  # (S, B): the group's index within its step
    slots = (rows * B + segment).ravel()  # (step, group) as one index
    varied_groups = np.bincount(slots, weights=differs.ravel(), minlength=S * B).reshape(S, B) > 0  # (S, B)
    counts = starts.sum(axis=1)
    return counts.tolist(), (counts - varied_groups.sum(axis=1)).tolist()


def last_kept_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last kept position of each row, ``[B]`` int64; -1 for a row that keeps nothing."""
    B, T = mask.shape
    keep = mask.bool()
    last = (T - 1) - keep.flip(dims=[1]).int().argmax(dim=1)  # (B,)
    return torch.where(keep.any(dim=1), last, torch.full_like(last, -1))


def token_rewards_from_sequence(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PPO: put each sequence reward ``[B]`` on its last kept completion token, ``[B, T]`` zeros elsewhere.

    Rows that keep no token get no reward. Source: MiniMind ``train_ppo.py:140-155`` (seed 4.5 A).
    """
    token_rewards = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)  # (B, T)
    last = last_kept_index(mask)  # (B,)
    valid = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)
    token_rewards[rows[valid], last[valid]] = rewards[valid]
    return token_rewards


def kl_reward_token_rewards(rewards: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                            mask: torch.Tensor, kl_coef: float, kl_estimator: str = "k1") -> torch.Tensor:
    """PPO's per-token rewards with the reference-KL penalty in the reward, ``[B, T]`` float32:
    ``-kl_coef * KL(old || ref)`` on every kept token (``kl_estimator``, k1 by default: ``old - ref``;
    :func:`tracer.formulas.ref_kl`) plus the sequence reward ``rewards`` ``[B]`` on the last kept
    token (:func:`token_rewards_from_sequence`); 0 on masked tokens. ``old_logprobs`` are the
    rollout policy's (the one the actions were sampled from). Raises ValueError for an unknown estimator.
    Source: Ouyang et al. (2022) eq. 2; TRL ``PPOTrainer`` (``non_score_reward = -kl_coef * kl``, the
    score added at the last token); OpenRLHF ``compute_reward``; verl ``apply_kl_penalty``."""
    keep = mask.bool()
    kl = ref_kl(old_logprobs.float(), ref_logprobs.float(), kl_estimator)  # (B, T)
    penalty = torch.where(keep, -kl_coef * kl, torch.zeros_like(kl))
    return penalty + token_rewards_from_sequence(rewards.float(), keep)


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the completion tokens.

    ``delta_t = r_t + γ V_{t+1} - V_t``, ``A_t = delta_t + γλ A_{t+1}``, ``returns = A + V``; values
    and rewards at masked positions count as 0, so nothing flows back from padding (MiniMind masks
    them afterwards; masking first keeps the last kept token's advantage free of padded values).

    Args:
        token_rewards, values: ``[B, T]`` float. mask: ``[B, T]`` True = kept.
    Returns:
        ``(advantages, returns)``, each ``[B, T]``, 0 at masked positions.
    Source: MiniMind ``train_ppo.py:140-155``; Schulman et al., "High-Dimensional Continuous
    Control Using GAE" (2016).
    """
    B, T = values.shape
    keep = mask.to(values.dtype)
    values = values * keep  # (B, T)
    token_rewards = token_rewards * keep
    lastgaelam = torch.zeros(B, dtype=values.dtype, device=values.device)
    advs_rev = []
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t < T - 1 else torch.zeros_like(lastgaelam)
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advs_rev.append(lastgaelam)
    advantages = torch.stack(advs_rev[::-1], dim=1) * keep  # (B, T)
    return advantages, (advantages + values) * keep


def trl_group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = GROUP_STD_EPS
) -> torch.Tensor:
    """GRPO advantages as TRL computes them: group-centred, scaled by the *unbiased* std.

    ``A = (r - mean_g) / (std + eps)`` where std is Bessel-corrected (``count / (count - 1)``) and
    taken per group (``scale_rewards="group"``, TRL's default) or over the whole batch (``"batch"``);
    ``"none"`` only centres. Differs from :func:`group_advantages` (the seed: population std).

    Args:
        rewards: ``[B]`` with B = P * G; G consecutive rows form one group.
        num_generations: G (≥ 2 for a defined std).
        scale_rewards: ``"group" | "batch" | "none"``.
    Returns:
        ``[B]`` float advantages.
    Raises:
        ValueError: B not a multiple of G, or an unknown ``scale_rewards``.
    Source: TRL 1.16 ``grpo_trainer.py`` (``_generate_and_score_completions``, ``sum_then_normalize``)
    and ``trl/trainer/utils.py:nanstd`` (Bessel's correction).
    """
    (B,) = rewards.shape
    if num_generations <= 0 or B % num_generations:
        raise ValueError(f"rewards has B = {B} rows, not a multiple of num_generations = {num_generations}")
    grouped = rewards.float().view(-1, num_generations)  # (P, G)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)  # (B,)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = grouped.std(dim=1, unbiased=True).repeat_interleave(num_generations)  # (B,)
    elif scale_rewards == "batch":
        std = rewards.float().std(unbiased=True).expand(B)  # (B,)
    else:
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    return centred / (std + eps)


def rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """RLOO leave-one-out advantages ``A_i = r_i - mean_{j != i} r_j`` within each group, ``[B]``.

    G consecutive rows form one group (G ≥ 2); each group's advantages sum to 0.
    Source: Ahmadian et al., "Back to Basics: Revisiting REINFORCE..." (2024); TRL 1.16
    ``rloo_trainer.py`` (``baselines = (grouped_sum - grouped_rewards) / (count - 1)``).
    """
    (B,) = rewards.shape
    if num_generations < 2 or B % num_generations:
        raise ValueError(f"rewards has B = {B} rows; RLOO needs num_generations >= 2 dividing B, got {num_generations}")
    grouped = rewards.float().view(-1, num_generations)  # (P, G)
    baselines = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)  # (P, G)
    return (grouped - baselines).reshape(-1)  # (B,)


WHITEN_EPS = 1e-8  # MiniMind train_ppo.py and verl masked_whiten: (A - mean) * rsqrt(var + 1e-8)


def whiten(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = False, eps: float = WHITEN_EPS,
           zero_masked: bool = True) -> torch.Tensor:
    """Standardise ``values`` over the kept positions of the whole batch: ``(x - mean) * rsqrt(var + eps)``.

    Mean and variance are taken over every kept position of ``values`` (all rows together), the
    variance with Bessel's correction when ``unbiased``. ``zero_masked`` sets masked positions to 0
    afterwards (MiniMind multiplies by the mask; verl leaves them at ``-mean * rsqrt(var + eps)``).

    Args:
        values: ``[B, T]`` float (e.g. raw GAE advantages). mask: ``[B, T]`` True = kept.
    Returns:
        ``[B, T]`` float64 whitened values.
    Source: MiniMind ``trainer/train_ppo.py`` (``adv_mean``, ``adv_var`` over ``resp_policy_mask``,
    population variance, ``torch.rsqrt(adv_var + 1e-8) * resp_policy_mask``); verl
    ``verl/utils/torch_functional.py:masked_whiten`` (``masked_var(unbiased=True)``); OpenRLHF.
    """
    keep = mask.bool()
    x = values.double()
    n = int(keep.sum())
    mean = masked_mean(x, keep)
    var = masked_mean((x - mean) ** 2, keep)
    if unbiased and n > 1:
        var = var * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    return torch.where(keep, out, torch.zeros_like(out)) if zero_masked else out


def group_mean_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Group-centred advantages without any std scaling, ``A = r - mean_g``, ``[B]``.

    G consecutive rows form one group. Source: Liu et al., "Understanding R1-Zero-Like Training"
    (Dr. GRPO, 2025); TRL ``scale_rewards="none"``. Raises ValueError when B is not a multiple of G.
    """
    return trl_group_advantages(rewards, num_generations, scale_rewards="none")


# The advantage rules tracer knows (SPEC.md section 10): name -> what it computes and where it comes from.
# A trace declares one with metadata ``advantage_rule``; tracer.checks.recompute names the one that matches.
ADVANTAGE_RULES: dict[str, str] = {
    "gae": "raw GAE(γ, λ) from token_rewards and values (tracer.formulas.gae; the seed)",
    "gae_whitened": "GAE(γ, λ), then whitened over the batch's kept tokens, (A - mean) * rsqrt(var + 1e-8) "
                    "(tracer.formulas.whiten; MiniMind train_ppo.py, OpenRLHF, verl)",
    "group_zscore": "(r - mean_g) / (std_g + 1e-4), population std (tracer.formulas.group_advantages; "
                    "the seed, MiniMind train_grpo.py)",
    "group_zscore_unbiased": "(r - mean_g) / (std_g + 1e-4), Bessel's std per group "
                             "(tracer.formulas.trl_group_advantages; TRL scale_rewards='group')",
    "batch_zscore_unbiased": "(r - mean_g) / (std_batch + 1e-4), Bessel's std over the batch (TRL scale_rewards='batch')",
    "group_mean": "r - mean_g, no std (tracer.formulas.group_mean_advantages; Dr. GRPO, TRL scale_rewards='none')",
    "verl_grpo": "(r - mean_g) / (std_g + 1e-6), Bessel's std per uid (tracer.formulas.verl_grpo_advantages; "
                 "verl core_algos.compute_grpo_outcome_advantage)",
    "rloo": "r_i - mean of the other G - 1 rewards of the group (tracer.formulas.rloo_advantages)",
    "rloo_kl": "leave-one-out on rewards - β·Σ_t(old - ref) (TRL RLOOTrainer with β > 0)",
}
# advantage_rule of one of verl's estimators that has no rule here: "verl_<adv_estimator>"
# (tracer.integrations.verl_record); "verl_grpo" above is the one that has.
VERL_RULE_PREFIX = "verl_"
# Older and trainer-specific spellings of the same rules.
ADVANTAGE_RULE_ALIASES: dict[str, str] = {
    "seed": "group_zscore", "grpo": "group_zscore", "trl_group": "group_zscore_unbiased",
    "trl_batch": "batch_zscore_unbiased", "trl_none": "group_mean", "dr_grpo": "group_mean",
    "gae_raw": "gae", "whitened_gae": "gae_whitened",
}


def advantage_rule_name(name: str) -> str:
    """The canonical name of an advantage rule (aliases resolved); ValueError for an unknown one."""
    canonical = ADVANTAGE_RULE_ALIASES.get(name, name)
    if canonical not in ADVANTAGE_RULES:
        raise ValueError(f"unknown advantage rule {name!r}; known rules: {', '.join(ADVANTAGE_RULES)} "
                         f"(aliases: {', '.join(ADVANTAGE_RULE_ALIASES)})")
    return canonical


VERL_GRPO_EPS = 1e-6  # verl core_algos.compute_grpo_outcome_advantage: epsilon=1e-6


def verl_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
                         eps: float = VERL_GRPO_EPS) -> torch.Tensor:
    """GRPO advantages as verl computes them, ``[B]``: rows sharing a ``group_ids`` value form a group
    (in any order); ``A = (r - mean_g) / (std_g + eps)`` with Bessel's std (``torch.std``), or only
    ``r - mean_g`` when ``norm_by_std`` is False (Dr. GRPO); a group of one row gets mean 0, std 1.

    Args:
        rewards: ``[B]`` sequence rewards (verl: ``token_level_rewards.sum(-1)``).
        group_ids: ``[B]`` int64 (verl's ``uid`` strings numbered).
    Source: verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` ``compute_grpo_outcome_advantage``.
    """
    rewards = rewards.double()
    out = torch.empty_like(rewards)
    for gid in torch.unique(group_ids).tolist():
        rows = group_ids == gid
        scores = rewards[rows]
        mean, std = (scores.mean(), scores.std()) if scores.numel() > 1 else (scores.new_tensor(0.0), scores.new_tensor(1.0))
        out[rows] = (scores - mean) / (std + eps) if norm_by_std else scores - mean
    return out.float()
