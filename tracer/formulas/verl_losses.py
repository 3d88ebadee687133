"""verl's policy-loss aggregation (``loss_agg_mode``), its registered policy losses per token that tracer
models (``vanilla`` with dual clip, ``gspo``, ``cispo``, ``gpg``), its KL estimators (``kl_penalty``) and
the entropy term, as verl 0.9.1 computes them, so that a check can say which aggregation produced a
recorded ``pg_loss`` and whether the per-token loss follows the registered loss.

verl aggregates a micro-batch's per-token loss over the *global* mini-batch (``dp_size`` ranks,
``batch_num_tokens`` kept tokens, ``global_batch_size`` sequences), so that summing the micro-batches'
losses gives the mini-batch's loss whatever the split. Every mask is True = keep. Torch, no I/O.

Source: verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` (``agg_loss``, ``compute_policy_loss_vanilla``,
``compute_policy_loss_gspo``, ``compute_policy_loss_cispo``, ``compute_policy_loss_gpg``, ``kl_penalty``),
``verl/workers/utils/losses.py`` (``ppo_loss``: entropy and KL terms) and ``verl/utils/torch_functional.py``
(``masked_sum`` zeroes NaN outside the mask).
"""

from __future__ import annotations

import torch

from tracer.formulas.reductions import masked_sum

#: verl 0.9.1's ``loss_agg_mode`` values (``ActorConfig.__post_init__``), and what each divides by.
VERL_LOSS_AGG_MODES = {
    "token-mean": "sum over kept tokens / kept tokens of the global mini-batch (batch_num_tokens) * dp_size",
    "seq-mean-token-sum": "per-sequence token sum, summed over sequences / global_batch_size * dp_size",
    "seq-mean-token-mean": "per-sequence token mean, summed over sequences / global_batch_size * dp_size",
    "seq-mean-token-sum-norm": "seq-mean-token-sum / loss_scale_factor (default: the padded width T)",
    "token-sum": "sum over kept tokens * dp_size",
}


def _masked_sum(values: torch.Tensor, keep: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    kept = torch.where(keep, values, torch.zeros_like(values))  # NaN at a dropped slot does not leak
    return kept.sum() if dim is None else kept.sum(dim=dim)


def verl_agg_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
                  batch_num_tokens: float | None = None, global_batch_size: float | None = None,
                  loss_scale_factor: float | None = None) -> torch.Tensor:
    """verl's ``agg_loss``: the micro-batch's share of the global mini-batch's loss, a scalar.

    Args:
        per_token_loss: ``[B, T]`` loss per token (verl's ``loss_mat``, e.g. ``pg_losses``).
        mask: ``[B, T]`` bool or 0/1, True = the token enters the loss (``response_mask``).
        loss_agg_mode: one of :data:`VERL_LOSS_AGG_MODES`.
        dp_size: data-parallel ranks; ``batch_num_tokens`` / ``global_batch_size``: kept tokens /
            sequences of the global mini-batch. None = this micro-batch's own count (verl's fallback
            when ``dp_size == 1``).
        loss_scale_factor: ``seq-mean-token-sum-norm``'s divisor; None = the padded width T.
    Raises:
        ValueError: an unknown ``loss_agg_mode``.
    Source: verl 0.9.1 ``core_algos.agg_loss`` (sequences the mask empties count in neither sum).
    """
    keep = mask.bool()
    if loss_agg_mode not in VERL_LOSS_AGG_MODES:
        raise ValueError(f"unknown verl loss_agg_mode {loss_agg_mode!r}; known: {', '.join(VERL_LOSS_AGG_MODES)}")
    if loss_agg_mode == "token-mean":
        count = keep.sum() if batch_num_tokens is None else batch_num_tokens
        return _masked_sum(per_token_loss, keep) / count * dp_size
    if loss_agg_mode == "token-sum":
        return _masked_sum(per_token_loss, keep) * dp_size
    tokens = keep.sum(dim=-1)  # (B,)
    rows = tokens > 0  # (B,) sequences the mask empties are left out
    per_row = _masked_sum(per_token_loss, keep, dim=-1)  # (B,) token sums
    if loss_agg_mode == "seq-mean-token-mean":
        per_row = per_row / (tokens + 1e-8)  # (B,) token means, verl's epsilon
    count = rows.sum() if global_batch_size is None else global_batch_size
    loss = _masked_sum(per_row, rows) / count * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (per_token_loss.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def verl_vanilla_per_token_loss(policy_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                                clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float = 3.0,
                                rollout_is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """verl's ``vanilla`` policy loss per token, ``[B, T]``: the clipped surrogate with dual clip.

    ``r = exp(clamp(policy - old, -20, 20))``; ``l = max(-A r, -A clip(r, 1-εl, 1+εh))``; where
    ``A < 0`` the loss is capped at ``-A c`` (dual-clip PPO, Ye et al. 2020, ``clip_ratio_c`` = c);
    times ``rollout_is_weights`` when given. ``advantages`` ``[B, T]`` or ``[B]`` (broadcast over T).
    Source: verl 0.9.1 ``core_algos.compute_policy_loss_vanilla``.
    """
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    r = torch.exp(torch.clamp(policy_logprobs - old_logprobs, min=-20.0, max=20.0))  # (B, T)
    clipped = torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    losses = torch.where(adv < 0, torch.minimum(-adv * clip_ratio_c, clipped), clipped)  # (B, T)
    if rollout_is_weights is not None:
        losses = losses * rollout_is_weights
    return losses


#: verl 0.9.1's registered policy losses (``core_algos.POLICY_LOSS_REGISTRY``, read off the installed
#: package), each with what tracer models of it: the formula's name, or why it is not modelled.
VERL_POLICY_LOSSES = {
    "vanilla": "verl_vanilla_per_token_loss (clipped surrogate with dual clip clip_ratio_c)",
    "gspo": "verl_gspo_per_token_loss (sequence ratio, log-ratio clamped at 10)",
    "cispo": "verl_cispo_per_token_loss (ratio clipped to [1-εl, 1+εh], detached, times A * logprob)",
    "gpg": "verl_gpg_per_token_loss (-A * logprob)",
    "dppo_tv": None, "dppo_kl": None, "sapo": None, "clip_cov": None, "kl_cov": None, "geo_mean": None,
    "dro": None, "bypass_mode": None,
}
VERL_MODELLED_POLICY_LOSSES = frozenset(k for k, v in VERL_POLICY_LOSSES.items() if v)
VERL_GSPO_LOG_RATIO_MAX = 10.0  # compute_policy_loss_gspo: torch.clamp(log_seq_importance_ratio, max=10.0)


def verl_gspo_per_token_loss(policy_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float,
                             rollout_is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """verl's ``gspo`` policy loss per token, ``[B, T]``: ``s = exp(min(mean_t∈kept(policy - old), 10))``
    per row (GSPO-token's value, broadcast over T), ``l = max(-A s, -A clip(s, 1-εl, 1+εh))``, times
    ``rollout_is_weights`` when given. ``advantages`` ``[B, T]`` or ``[B]``; ``mask`` ``[B, T]`` True = keep.
    Source: verl 0.9.1 ``core_algos.compute_policy_loss_gspo``."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    keep = mask.bool()
    log_ratio = masked_sum(policy_logprobs - old_logprobs, keep, dim=-1) / keep.sum(dim=-1).clamp(min=1)  # (B,)
    s = torch.exp(torch.clamp(log_ratio, max=VERL_GSPO_LOG_RATIO_MAX)).unsqueeze(-1).expand_as(policy_logprobs)
    losses = torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - clip_ratio_low, 1 + clip_ratio_high))  # (B, T)
    return losses if rollout_is_weights is None else losses * rollout_is_weights


def verl_cispo_per_token_loss(policy_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                              clip_ratio_low: float, clip_ratio_high: float,
                              rollout_is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """verl's ``cispo`` policy loss per token, ``[B, T]``: ``-clip(r, 1-εl, 1+εh).detach() * A * policy``
    with ``r = exp(clamp(policy - old, -20, 20))`` (both sides clipped, unlike TRL's CISPO, which only caps
    ``r`` at ε_high), times ``rollout_is_weights`` when given. Source: verl 0.9.1
    ``core_algos.compute_policy_loss_cispo``."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    r = torch.exp(torch.clamp(policy_logprobs - old_logprobs, min=-20.0, max=20.0))
    losses = -torch.clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high).detach() * adv * policy_logprobs
    return losses if rollout_is_weights is None else losses * rollout_is_weights


def verl_gpg_per_token_loss(policy_logprobs: torch.Tensor, advantages: torch.Tensor,
                            rollout_is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """verl's ``gpg`` policy loss per token, ``[B, T]``: ``-policy * A`` (no ratio, no clip), times
    ``rollout_is_weights`` when given. Source: verl 0.9.1 ``core_algos.compute_policy_loss_gpg``."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    losses = -policy_logprobs * adv
    return losses if rollout_is_weights is None else losses * rollout_is_weights


#: verl 0.9.1 ``kl_penalty`` names -> the estimator's value (a ``+`` suffix, e.g. ``k3+``, changes only the
#: gradient: the straight-through k2 gradient under the named estimator's value).
VERL_KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def verl_kl_penalty(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """verl's per-token KL estimate ``[B, T]`` (nats) by ``kl_penalty``: ``kl``/``k1`` = ``policy - ref``;
    ``abs`` = ``|policy - ref|``; ``mse``/``k2`` = ``0.5 (policy - ref)^2``; ``low_var_kl``/``k3`` =
    ``clamp(exp(d) - d - 1, -10, 10)`` with ``d = clamp(ref - policy, -20, 20)``. A trailing ``+``
    (straight-through: k2's gradient, the named estimator's value) gives the same value. Raises
    ValueError for another name (verl raises NotImplementedError; ``full`` needs logits).
    Source: verl 0.9.1 ``core_algos.kl_penalty`` / ``kl_penalty_forward``."""
    base = kl_penalty.removesuffix("+")
    diff = policy_logprobs - ref_logprobs
    if base in ("kl", "k1"):
        return diff
    if base == "abs":
        return diff.abs()
    if base in ("mse", "k2"):
        return 0.5 * diff.square()
    if base in ("low_var_kl", "k3"):
        d = torch.clamp(-diff, min=-20, max=20)
        return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)
    raise ValueError(f"unknown verl kl_penalty {kl_penalty!r}; known: {', '.join(VERL_KL_PENALTIES)} (and each with '+')")


def verl_policy_loss(pg_loss: torch.Tensor, entropy_loss: torch.Tensor | None = None, entropy_coeff: float = 0.0,
                     kl_loss: torch.Tensor | None = None, kl_loss_coef: float = 0.0) -> torch.Tensor:
    """verl's actor loss from its aggregated terms, a scalar: ``pg_loss - entropy_coeff * entropy_loss +
    kl_loss_coef * kl_loss`` (each term already aggregated with the run's ``loss_agg_mode``: :func:`verl_agg_loss`
    of the policy losses, the entropy and the ``kl_penalty`` values). Source: verl 0.9.1
    ``workers/utils/losses.py:ppo_loss``."""
    loss = pg_loss
    if entropy_loss is not None:
        loss = loss - entropy_coeff * entropy_loss
    if kl_loss is not None:
        loss = loss + kl_loss * kl_loss_coef
    return loss
