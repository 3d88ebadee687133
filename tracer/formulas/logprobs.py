"""Logprobs and what is built from them (SPEC.md section 3): completion-token logprobs with the
alignment rule, per-sequence sums, the importance ratio, the k1/k2/k3 KL estimators, and the
sampler (inference engine) vs trainer maths: log ratios, TRL's importance-sampling weights, verl's
probability gap. Torch, no I/O; logprobs are natural-log (nats), every mask is True = keep.

Sources: the seed lesson (MiniMind ``train_ppo.py``, ``train_grpo.py``, ``train_dpo.py``); k2/k3
from J. Schulman, "Approximating KL Divergence" (2020); TRL 1.16 ``grpo_trainer.py``; verl 0.9.1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tracer.formulas.reductions import masked_sum
from tracer.formulas.importance import IS_MODES, is_weights, sequence_log_ratio  # noqa: F401  (re-exported)


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


# The reference-KL estimators a loss or a reward may use, by their names in Schulman (2020) and OpenRLHF's
# ``kl_estimator``; verl's ``kl_loss_type`` / ``kl_penalty`` names of the same three (``kl``, ``mse``, ``low_var_kl``).
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_ESTIMATOR_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
# k3 with its arguments swapped: KL(ref || policy) estimated as exp(policy - ref) - (policy - ref) - 1. Not an
# estimator to declare (it estimates the other KL); :func:`ref_kl` computes it so that a check can name the bug.
K3_SWAPPED = "k3_swapped"


def kl_estimator_name(name: str) -> str:
    """``k1`` / ``k2`` / ``k3`` for one of :data:`KL_ESTIMATORS` or a verl alias of one
    (:data:`KL_ESTIMATOR_ALIASES`). Raises ValueError naming the known names for any other."""
    key = KL_ESTIMATOR_ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if key not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; known: {', '.join(KL_ESTIMATORS)} "
                         f"(verl's names: {', '.join(KL_ESTIMATOR_ALIASES)})")
    return key


def ref_kl(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref), ``[B, T]`` nats, by ``estimator``: ``k1`` =
    ``policy - ref`` (:func:`kl_k1`), ``k2`` = ``0.5 * (policy - ref)^2``, ``k3`` = :func:`ref_kl_k3`
    (verl's ``kl`` / ``mse`` / ``low_var_kl`` accepted for the same three). verl clamps its
    ``low_var_kl`` to [-10, 10]; k3 is not clamped here (a k3 past 10 nats is a finding of its own).
    :data:`K3_SWAPPED` gives k3 of KL(ref || policy) (the swapped-arguments bug, for the checks).
    Raises ValueError for an unknown estimator. Source: Schulman (2020); OpenRLHF
    ``compute_approx_kl``; verl ``core_algos.kl_penalty``."""
    if estimator == K3_SWAPPED:
        return ref_kl_k3(ref_logprobs, policy_logprobs)
    kind = kl_estimator_name(estimator)
    if kind == "k1":
        return kl_k1(policy_logprobs, ref_logprobs)
    if kind == "k2":
        return approx_kl_k2(policy_logprobs, ref_logprobs)
    return ref_kl_k3(policy_logprobs, ref_logprobs)


# -- known wrong variants of the derived tensors (for the recompute checks to name the bug) ---------------
def ratio_variants(policy_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Known wrong importance ratios, each ``[B, T]`` like :func:`ratio`:

    - ``inverted``: ``exp(old - policy)`` = 1 / ratio (the subtraction's operands swapped);
    - ``log_ratio``: ``policy - old`` (exp never applied: the log ratio stored as the ratio);
    - ``exp_twice``: ``exp(exp(policy - old))`` (exp applied to a ratio already exponentiated);
    - ``logprob_quotient``: ``policy / old`` (logprobs divided as if they were probabilities).

    The correct ratio, ``exp(policy - old)`` = p_policy / p_old, is seed section 2.3; the variants are
    the ways that rule is broken with the same two tensors."""
    log_ratio = policy_logprobs - old_logprobs
    return {"inverted": torch.exp(-log_ratio), "log_ratio": log_ratio, "exp_twice": torch.exp(torch.exp(log_ratio)),
            "logprob_quotient": policy_logprobs / old_logprobs}


def ref_kl_k3_variants(policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Known wrong values stored as ``ref_kl_k3``, each ``[B, T]`` nats like :func:`ref_kl_k3`:

    - ``swapped``: k3 with its arguments swapped, ``exp(policy - ref) - (policy - ref) - 1`` (estimates
      KL(ref || policy), not KL(policy || ref));
    - ``k1``: ``policy - ref`` (:func:`kl_k1`) stored under the k3 name;
    - ``k2``: ``0.5 * (policy - ref)^2`` stored under the k3 name.

    Source: Schulman, "Approximating KL Divergence" (2020): k1, k2, k3 for samples from the policy."""
    return {"swapped": ref_kl_k3(ref_logprobs, policy_logprobs), "k1": kl_k1(policy_logprobs, ref_logprobs),
            "k2": approx_kl_k2(policy_logprobs, ref_logprobs)}


def approx_kl_k2_variants(policy_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Known wrong values stored as ``approx_kl_k2``, each ``[B, T]`` nats like :func:`approx_kl_k2`:

    - ``no_half``: ``(policy - old)^2``, twice k2 (the 0.5 missing);
    - ``k1``: ``policy - old``;
    - ``k3``: ``(ratio - 1) - log ratio`` = ``exp(policy - old) - (policy - old) - 1`` (CleanRL's
      ``approx_kl``, another estimator stored under the k2 name).

    Source: Schulman (2020); MiniMind ``train_ppo.py`` (k2); CleanRL ``ppo.py`` (``approx_kl``)."""
    return {"no_half": 2.0 * approx_kl_k2(policy_logprobs, old_logprobs), "k1": kl_k1(policy_logprobs, old_logprobs),
            "k3": ref_kl_k3(old_logprobs, policy_logprobs)}


def sequence_logprobs(token_logprobs_: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked sum of token logprobs per sequence, ``[B, T]`` -> ``[B]`` nats (DPO)."""
    return masked_sum(token_logprobs_, mask, dim=1)


# -- sampler (inference engine) vs trainer ---------------------------------------------------------
# The importance-sampling corrections live in tracer.formulas.importance (re-exported here).


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
