"""The RL maths of the seed (SPEC.md section 3), once. Torch (numpy and plain loops inside the two batch
statistics the writer thread computes for every step: :func:`masked_row_quantiles`,
:func:`zero_variance_groups`), no I/O.

Sources: the seed lesson (shared/seed/lesson-25-reward-logprob-kl.txt), which restates MiniMind's
``trainer/rollout_engine.py``, ``trainer/train_ppo.py``, ``trainer/train_grpo.py`` and
``trainer/train_dpo.py``; k2/k3 estimators from J. Schulman, "Approximating KL Divergence" (2020).

Every mask is True/1 = keep. Logprobs are natural-log (nats).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

GROUP_STD_EPS = 1e-4  # MiniMind train_grpo.py: (r - mean) / (std + 1e-4)


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, prompt_len: int, temperature: float = 1.0
) -> torch.Tensor:
    """Completion-token logprobs by log_softmax + gather, with the alignment rule.

    ``logits[:, k]`` predicts ``input_ids[:, k + 1]``, so the j-th completion token
    ``input_ids[:, prompt_len + j]`` is scored at logits position ``prompt_len - 1 + j``
    (``prompt_len`` is the padded prompt width when prompts are left-padded). Logits are divided
    by ``temperature`` before log_softmax, as the sampler did.

    Args:
        logits: ``[B, prompt_len + T, V]`` float, the model output over prompt + completion.
        input_ids: ``[B, prompt_len + T]`` int64.
        prompt_len: padded prompt width L.
        temperature: sampling temperature τ > 0.

    Returns:
        ``[B, T]`` float32 logprobs in nats.

    Raises:
        ValueError: when shapes disagree or ``temperature <= 0``.
    Source: MiniMind ``train_ppo.py`` (``logp_pos = prompt_lens - 1 + resp_idx``), seed section 2.2.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    B, S, V = logits.shape
    if input_ids.shape != (B, S):
        raise ValueError(f"input_ids shape {list(input_ids.shape)} does not match logits [B, S] = {[B, S]}")
    if not 0 < prompt_len < S:
        raise ValueError(f"prompt_len must be in (0, {S}), got {prompt_len}")
    scores = logits[:, prompt_len - 1 : S - 1, :].float() / temperature  # (B, T, V)
    targets = input_ids[:, prompt_len:]  # (B, T)
    return F.log_softmax(scores, dim=-1).gather(2, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)


def ratio(policy_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Importance ratio ``exp(policy - old)``, ``[B, T]``. Source: seed section 2.3."""
    return torch.exp(policy_logprobs - old_logprobs)


def ref_kl_k3(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(policy || ref) per token: ``exp(d) - d - 1`` with ``d = ref - policy``.

    ``[B, T]`` nats, ≥ 0, 0 where the two agree. Source: seed section 2.4; Schulman (2020).
    """
    delta = ref_logprobs - policy_logprobs
    return torch.expm1(delta) - delta  # = exp(d) - 1 - d, without cancellation for small d


def approx_kl_k2(policy_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 estimator ``0.5 * (policy - old)^2`` per token, ``[B, T]`` nats (PPO early stop).

    Source: seed section 2.5 (MiniMind ``train_ppo.py``).
    """
    return 0.5 * (policy_logprobs - old_logprobs) ** 2


def kl_k1(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 estimator ``policy - ref`` per token, ``[B, T]`` nats (unbiased, can be negative)."""
    return policy_logprobs - ref_logprobs


# -- sampler (inference engine) vs trainer ---------------------------------------------------------
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's vllm_importance_sampling_mode


def sampler_log_ratio(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor) -> torch.Tensor:
    """``trainer - sampler`` per token, ``[B, T]`` nats: the log of the importance weight that
    corrects for sampling with the engine. Source: TRL 1.16 ``grpo_trainer.py``
    (``per_token_logps_diff = old_per_token_logps - sampling_per_token_logps``; TRL logs the mean of
    its absolute value as ``sampling/sampling_logp_difference/mean``)."""
    return trainer_logprobs - sampler_logprobs


def sampler_prob_diff(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor) -> torch.Tensor:
    """``|exp(trainer) - exp(sampler)|`` per token, ``[B, T]`` (probabilities, unitless): the
    probability-space convention. Source: verl ``rollout_probs_diff`` (mean/max over the response mask)."""
    return (trainer_logprobs.exp() - sampler_logprobs.exp()).abs()


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, aggregation: str = "sum") -> torch.Tensor:
    """Per-sequence log importance ratio ``[B]`` from token log ratios ``[B, T]`` over kept tokens
    (NaN -> 0, as TRL does).

    ``aggregation``: ``"sum"`` (the product of the token ratios; TRL 1.16 ``sequence_*`` modes) or
    ``"mean"`` (the geometric mean, length-invariant; GSPO, the fix proposed in trl#5814).
    Raises ValueError for another aggregation.
    """
    if aggregation not in ("sum", "mean"):
        raise ValueError(f"aggregation must be 'sum' or 'mean', got {aggregation!r}")
    total = torch.nan_to_num(masked_sum(log_ratio, mask, dim=-1), nan=0.0)
    return total if aggregation == "sum" else total / mask.bool().sum(dim=-1).clamp(min=1)


def is_weights(log_ratio: torch.Tensor, mode: str, clip_min: float | None = None,
               clip_max: float | None = 3.0) -> torch.Tensor:
    """TRL's importance-sampling correction applied to log ratios (``[B, T]`` for token modes,
    ``[B]`` per sequence for sequence modes): ``exp(log_ratio)``, then ``*_truncate`` clamps it to
    ``[clip_min, clip_max]`` and ``*_mask`` sets it to 0 outside. Source: TRL 1.16
    ``grpo_trainer.py`` (``vllm_importance_sampling_mode``). Raises ValueError for an unknown mode."""
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; expected one of {list(IS_MODES)}")
    weights = torch.exp(torch.nan_to_num(log_ratio, nan=0.0))
    if mode.endswith("truncate"):
        return weights if clip_min is None and clip_max is None else torch.clamp(weights, min=clip_min, max=clip_max)
    low = -float("inf") if clip_min is None else clip_min
    high = float("inf") if clip_max is None else clip_max
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` keeps; positions dropped by the mask never contribute
    (a NaN at a masked slot does not leak)."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask) / mask.sum().clamp(min=1)`` over ``dim`` (all positions when None).

    Source: seed section 5.1.
    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_quantiles(values: torch.Tensor, mask: torch.Tensor | None, qs: tuple[float, ...]) -> torch.Tensor:
    """Quantiles ``qs`` (each in [0, 1]) of ``values`` at the positions ``mask`` keeps (all positions
    when None), NaN values left out; linear interpolation between order statistics (numpy's default
    ``method="linear"``, the same as ``torch.quantile``). Returns float64 ``[len(qs)]``; all NaN
    when no non-NaN value is kept. ``mask`` has the shape of ``values``.
    """
    kept = values.reshape(-1) if mask is None else values[mask.bool()]
    kept = kept[~torch.isnan(kept)]
    if kept.numel() == 0:
        return torch.full((len(qs),), float("nan"), dtype=torch.float64)
    return row_quantiles(kept.unsqueeze(0), qs)[0]


def row_quantiles(rows: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """Quantiles ``qs`` of each row of ``rows`` ``[K, N]`` (N >= 1, no NaN: see
    :func:`masked_quantiles`), linear interpolation as numpy's default. Returns float64 ``[K, len(qs)]``.
    One sort for all K rows."""
    n = rows.shape[1]
    ordered = torch.sort(rows, dim=1).values
    pos = torch.tensor(qs, dtype=torch.float64) * (n - 1)
    lo, hi = pos.floor().long(), pos.ceil().long()
    below, above = ordered[:, lo].double(), ordered[:, hi].double()
    # equal neighbours (an infinite value included) need no interpolation: inf - inf would be NaN
    return torch.where(below == above, below, below + (above - below) * (pos - lo.double()))


_NUMPY_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                           torch.float32, torch.float64})


def host_array(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """``t`` as a numpy array (no copy for an array, or a CPU tensor of a numpy dtype; other float
    dtypes, bfloat16 and float8, are widened to float32 exactly)."""
    if isinstance(t, np.ndarray):
        return t
    if t.dtype in _NUMPY_DTYPES and t.device.type == "cpu" and not t.requires_grad:
        return t.numpy()  # the usual case, in one call
    t = t.detach().cpu()
    if t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.float()
    return t.numpy()


def masked_row_quantiles(values: torch.Tensor | np.ndarray, mask: torch.Tensor | np.ndarray,
                         qs: tuple[float, ...]) -> torch.Tensor:
    """Quantiles ``qs`` of each row of ``values`` ``[R, N]`` (a tensor or a numpy array) at the
    positions ``mask`` (bool, ``[R, N]``) keeps, NaN values left out: row ``r`` equals
    ``masked_quantiles(values[r], mask[r], qs)`` (linear interpolation, numpy's default), with one
    sort for all rows, however many values each keeps.
    Returns float64 ``[R, len(qs)]``; NaN for a row that keeps no non-NaN value.

    Computed with numpy on the host: the writer thread summarises every step with it, and on small
    rows numpy's sort and element-wise calls cost a fraction of torch's (issue 16); the values are
    the same (a sort orders equal values alike, and each element-wise step is one IEEE operation)."""
    R, N = values.shape
    if N == 0:
        return torch.full((R, len(qs)), float("nan"), dtype=torch.float64)
    v = host_array(values)
    keep = host_array(mask).astype(bool, copy=False) & ~np.isnan(v)
    counts = keep.sum(axis=1)
    ordered = np.where(keep, v, np.inf)  # kept values first, once sorted
    ordered.sort(axis=1)
    pos = np.array(qs, dtype=np.float64) * np.maximum(counts - 1, 0)[:, None]  # (R, Q)
    lo, hi = np.floor(pos).astype(np.int64), np.ceil(pos).astype(np.int64)
    rows = np.arange(R)[:, None]
    below, above = ordered[rows, lo].astype(np.float64), ordered[rows, hi].astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf where below == above: not the value taken
        out = np.where(below == above, below, below + (above - below) * (pos - lo))
    out[counts == 0] = np.nan
    return torch.from_numpy(out)


def sequence_mean_loss(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence masked mean, then the mean over sequences (the seed's GRPO reduction).

    ``per_token_loss`` ``[B, T]`` -> scalar. Source: seed section 6
    (``((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()``).
    """
    return masked_mean(per_token_loss, mask, dim=1).mean()


def token_mean_loss(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over all kept tokens of the batch (DAPO / TRL ``bnpo`` style), scalar."""
    return masked_mean(per_token_loss, mask)


def constant_divisor_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, divisor: float) -> torch.Tensor:
    """Masked sum divided by a constant (Dr. GRPO: ``B * max_completion_length``), scalar."""
    return masked_sum(per_token_loss, mask) / divisor


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
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
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
) -> torch.Tensor:
    """Clipped surrogate per token ``-(min(r*A, clip(r, 1-εl, 1+εh)*A) - β*k3)``, ``[B, T]``.

    ``advantages`` is ``[B]`` (broadcast over T). ``kl_importance_weighted`` multiplies k3 by the
    ratio r (TRL's ``use_bias_correction_kl``: the KL of tokens sampled from old, reweighted to the policy).
    ``sampler_weights`` (``[B, T]`` or ``[B]``) multiply the policy-gradient term only: the capped
    importance weights ``exp(old - sampler)`` of TRL's ``vllm_importance_sampling_correction``.
    Source: MiniMind ``train_grpo.py:132-143``; TRL 1.16 ``grpo_trainer.py:_compute_loss``.
    """
    r = ratio(policy_logprobs, old_logprobs)  # (B, T)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    surrogate = torch.min(r * adv, torch.clamp(r, 1 - clip_epsilon_low, 1 + clip_epsilon_high) * adv)
    if sampler_weights is not None:
        surrogate = surrogate * (sampler_weights.unsqueeze(1) if sampler_weights.dim() == 1 else sampler_weights)
    if beta and ref_logprobs is not None:
        k3 = ref_kl_k3(policy_logprobs, ref_logprobs)
        surrogate = surrogate - beta * (k3 * r if kl_importance_weighted else k3)
    return -surrogate


def cispo_per_token_loss(
    policy_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_epsilon_high: float,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_importance_weighted: bool = False,
    sampler_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """CISPO per token ``-(clamp(r, max=ε_high).detach() * A * policy - β*k3)``, ``[B, T]``.

    ``kl_importance_weighted`` and ``sampler_weights``: as in :func:`grpo_per_token_loss`.

    The clamped ratio is detached: the gradient reaches only ``policy_logprobs`` (and the KL term).
    ``clip_epsilon_high`` is the ratio's upper bound itself, as in MiniMind (``max=args.epsilon_high``).
    Source: MiniMind ``train_grpo.py:132-143`` (``loss_type == "cispo"``); MiniMax-M1 report (2025).
    """
    r = ratio(policy_logprobs, old_logprobs)  # (B, T)
    clamped = torch.clamp(r, max=clip_epsilon_high).detach()  # (B, T)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    objective = clamped * adv * policy_logprobs
    if sampler_weights is not None:
        objective = objective * (sampler_weights.unsqueeze(1) if sampler_weights.dim() == 1 else sampler_weights)
    if beta and ref_logprobs is not None:
        k3 = ref_kl_k3(policy_logprobs, ref_logprobs)
        objective = objective - beta * (k3 * r if kl_importance_weighted else k3)
    return -objective


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


def sequence_logprobs(token_logprobs_: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked sum of token logprobs per sequence, ``[B, T]`` -> ``[B]`` nats (DPO)."""
    return masked_sum(token_logprobs_, mask, dim=1)


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


def ppo_per_token_loss(
    policy_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_epsilon_low: float,
    clip_epsilon_high: float,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO's policy loss per token with the reference-KL penalty folded in, ``[B, T]``:
    ``-min(r*A, clip(r, 1-εl, 1+εh)*A) + kl_coef * ref_kl_k3``.

    ``advantages`` is ``[B, T]`` (GAE). Reduced by the token mean over the kept tokens this equals
    MiniMind's ``masked_ppo_loss + kl_coef * kl_ref_penalty`` (both are masked means over the same
    tokens). It is :func:`grpo_per_token_loss` with β = ``kl_coef``.
    Source: MiniMind ``trainer/train_ppo.py`` (``policy_loss``); SPEC.md section 3.
    """
    return grpo_per_token_loss(policy_logprobs, old_logprobs, advantages, clip_epsilon_low, clip_epsilon_high,
                               kl_coef, ref_logprobs)


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


def probability_gap(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                    mask: torch.Tensor) -> dict[str, float]:
    """Rollout vs trainer in probability space, as verl logs it (``training/rollout_probs_diff_*``):
    over kept tokens, ``|exp(trainer) - exp(sampler)|`` max / mean / std (Bessel) and the Pearson
    correlation of the two probabilities. Unitless (probabilities in [0, 1]); NaN when no token is kept.

    Source: verl 0.9.1 ``verl/utils/debug/metrics.py`` ``calculate_debug_metrics``; Pearson as in
    https://arxiv.org/abs/2506.13585.
    """
    keep = mask.bool()
    if not bool(keep.any()):
        return {"max": float("nan"), "mean": float("nan"), "std": float("nan"), "pearson": float("nan")}
    p_trainer = torch.exp(trainer_logprobs.double())[keep]  # (N,)
    p_sampler = torch.exp(sampler_logprobs.double())[keep]  # (N,)
    gap = sampler_prob_diff(trainer_logprobs.double(), sampler_logprobs.double())[keep]  # (N,)
    pearson = torch.corrcoef(torch.stack([p_trainer, p_sampler]))[0, 1] if gap.numel() > 1 else gap.new_tensor(float("nan"))
    return {"max": float(gap.max()), "mean": float(gap.mean()), "std": float(gap.std()) if gap.numel() > 1 else float("nan"),
            "pearson": float(pearson)}
