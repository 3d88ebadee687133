"""Trace Hugging Face TRL's ``RLOOTrainer`` (written against TRL 1.16, ``rloo_trainer.py``).

Usage::

    trainer = RLOOTrainer(model=..., reward_funcs=[...], args=RLOOConfig(...), train_dataset=...)
    tracer.attach(trainer, "runs/my-trace")
    trainer.train()

TRL 1.16's ``RLOOTrainer`` has the four methods the GRPO hook wraps (``_calculate_rewards``,
``_generate_and_score_completions``, ``_get_per_token_logps_and_entropies``, ``compute_loss``) and
the same rollout buffering (``_prepare_inputs``: ``shuffle_sequence_dict`` then
``split_tensor_dict`` into ``steps_per_generation`` slices), so :class:`RLOOTraceHook` is the GRPO
hook with the row-id join unchanged. What differs, and how the trace records it:

- The rollout dict holds no per-token old or reference logprobs: only ``old_logps`` ``[B]``, the
  masked *sum* of the rollout-time policy logprobs. Both per-token tensors are computed inside
  ``_generate_and_score_completions`` by ``_get_per_token_logps_and_entropies``, first for the
  policy (no_grad), then, when ``beta != 0``, for the reference (``ref_model``, or the policy with
  its PEFT adapter disabled). The hook keeps those two calls of each rollout, in that order, and
  joins them to the loss rows like the rewards: ``old_logprobs`` and ``ref_logprobs`` ``[B, T]``.
- Advantages: ``A_i = r'_i - mean_{j != i} r'_j`` within each group of G, where
  ``r' = clip(rewards, reward_clip_range) - beta * sum_t (old - ref) * mask`` (k1, the KL of the
  rollout policy against the reference, as a reward penalty), optionally re-normalised over the
  generation batch (``normalize_advantages``). ``rewards`` is the weighted sum of the reward
  functions as TRL logs it (before clip and penalty); ``reward_kl_k1`` ``[B]`` is the summed k1;
  metadata ``advantage_rule`` (``rloo_kl`` / ``rloo``) names the rule for ``tracer check``.
- Ratio: TRL clips one ratio per sequence, ``exp(sum_t policy*mask - old_logps)``, recorded as
  ``sequence_ratio`` ``[B]`` (metadata ``importance_ratio = "sequence_sum"``); the canonical
  per-token ``ratio`` is ``exp(policy - old)``. The loss is the mean over sequences of the clipped
  per-sequence loss; ``loss`` holds the value ``compute_loss`` returned (TRL 1.16 does not divide it
  by the accumulation steps inside), which ``recompute.loss`` compares with that mean.

``old_logprobs`` is real here (never ``policy_detached``): TRL always recomputes it at rollout time.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from tracer import formulas
from tracer.errors import TraceError
from tracer.integrations.trl_grpo import GRPOTraceHook, _Rollout
from tracer.integrations.trl_metadata import rloo_hyperparameters_of

__all__ = ["RLOOTraceHook"]

OLD_FROM_ROLLOUT = "trl_rollout_forward"


class RLOOTraceHook(GRPOTraceHook):
    """Records every micro-batch of a TRL ``RLOOTrainer`` into a trace; see the module docstring
    (attributes ``writer``, ``capture_failures``: :class:`~tracer.integrations.trl_base.TrainerTraceHook`)."""

    trainer_name = "RLOOTrainer"

    def __init__(self, trainer: Any, out_dir: str | os.PathLike, strict: bool = False,
                 keep_source_dtype: bool = False, config: Mapping[str, Any] | None = None,
                 **writer_options: Any) -> None:
        super().__init__(trainer, out_dir, strict=strict, keep_source_dtype=keep_source_dtype, config=config,
                         **writer_options)
        self._rollout_calls: list[torch.Tensor] = []  # per-token logps computed during the current rollout
        self._rollout_logprobs: tuple[int, torch.Tensor, torch.Tensor | None] | None = None  # (index, old, ref)

    @staticmethod
    def _hyperparameters(trainer: Any) -> dict[str, Any]:
        return rloo_hyperparameters_of(trainer)

    # -- capture ------------------------------------------------------------------------------

    def _on_logps(self, result: Any) -> None:
        if self._in_loss:
            return super()._on_logps(result)
        logps = result[0] if isinstance(result, tuple) else result
        self._rollout_calls.append(logps.detach().cpu())  # (B, T): old first, then ref

    def _on_rollout(self, output: dict[str, Any]) -> None:
        calls, self._rollout_calls = self._rollout_calls, []
        self._rollout_logprobs = None
        super()._on_rollout(output)
        if not self._training():
            return
        uses_ref = float(self.trainer.beta) != 0.0
        if len(calls) < (2 if uses_ref else 1):
            raise TraceError(
                f"RLOOTrainer computed {len(calls)} per-token logprob tensors during the rollout; tracer expects "
                f"the policy's{' and the reference' if uses_ref else ''} (TRL 1.16 rloo_trainer.py order)")
        self._rollout_logprobs = (self._rollout.index, calls[0], calls[1] if uses_ref else None)

    def _loss_tensors(self, inputs: Mapping[str, Any], order: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = super()._loss_tensors(inputs, order)
        old_logps = inputs.get("old_logps")
        if old_logps is not None:
            tensors["old_sequence_logprobs"] = old_logps.detach()[order.to(old_logps.device)].cpu()  # (B,)
        return tensors  # loss: GRPOTraceHook._loss_fields (not when an aux loss is added)

    def _rollout_tensors(self, rollout: _Rollout, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = super()._rollout_tensors(rollout, rows)
        kept = self._rollout_logprobs
        if kept is None or kept[0] != rollout.index:
            raise TraceError(f"the per-token old/ref logprobs of rollout {rollout.index} were not captured")
        _, old, ref = kept
        tensors["old_logprobs"] = old[rows]  # (B, T)
        if ref is not None:
            tensors["ref_logprobs"] = ref[rows]  # (B, T)
        return tensors

    def _derived_tensors(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The GRPO hook's per-token terms plus RLOO's ``sequence_ratio`` and ``reward_kl_k1`` ``[B]``."""
        derived = super()._derived_tensors(tensors)
        mask = tensors["completion_mask"].bool()  # (B, T)
        policy32 = tensors["policy_logprobs"].float()  # (B, T)
        if "old_sequence_logprobs" in tensors:
            policy_sum = formulas.sequence_logprobs(policy32, mask)  # (B,)
            derived["sequence_ratio"] = formulas.ratio(policy_sum, tensors["old_sequence_logprobs"].float())
        if "ref_logprobs" in tensors:
            k1 = formulas.kl_k1(tensors["old_logprobs"].float(), tensors["ref_logprobs"].float())  # (B, T)
            derived["reward_kl_k1"] = formulas.masked_sum(k1, mask, dim=1)  # (B,)
        return derived

    def _step_metadata(self, inputs: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                       rollout: _Rollout) -> dict[str, Any]:
        meta = super()._step_metadata(inputs, tensors, rollout)
        meta["old_logprobs_source"] = OLD_FROM_ROLLOUT
        if "ref_logprobs" in tensors:
            ref_model = getattr(self.trainer, "ref_model", None)
            meta["ref_logprobs_source"] = "trl_ref_model_forward" if ref_model is not None \
                else "trl_adapter_disabled_forward"
        return meta
