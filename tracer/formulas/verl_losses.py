"""verl's policy-loss aggregation (``loss_agg_mode``) and its vanilla clipped policy loss per token, as
verl 0.9.1 computes them, so that a check can say which aggregation produced a recorded ``pg_loss``.

verl aggregates a micro-batch's per-token loss over the *global* mini-batch (``dp_size`` ranks,
``batch_num_tokens`` kept tokens, ``global_batch_size`` sequences), so that summing the micro-batches'
losses gives the mini-batch's loss whatever the split. Every mask is True = keep. Torch, no I/O.

Source: verl 0.9.1 ``verl/trainer/ppo/core_algos.py`` (``agg_loss``, ``compute_policy_loss_vanilla``)
and ``verl/utils/torch_functional.py`` (``masked_sum`` zeroes NaN outside the mask).
"""

from __future__ import annotations

import torch

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
