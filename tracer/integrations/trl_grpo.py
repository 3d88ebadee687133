"""Trace Hugging Face TRL's ``GRPOTrainer`` (written against TRL 1.16).

Usage::

    trainer = GRPOTrainer(model=..., reward_funcs=[...], args=GRPOConfig(...), train_dataset=...)
    tracer.attach(trainer, "runs/my-trace")
    trainer.train()

TRL's callbacks never see tensors, so the hook wraps four methods on the trainer *instance*
(SPEC.md section 8; the class is left untouched):

- ``_calculate_rewards`` returns ``rewards_per_func`` ``[B_global, F]``: kept for the rollout.
- ``_generate_and_score_completions`` returns the rollout dict (prompt/completion ids and masks,
  advantages, ``old_per_token_logps`` / ``ref_per_token_logps`` / ``sampling_per_token_logps`` when
  they exist). The hook adds one int64 tensor, ``tracer_row_ids`` ``[B]``, to that dict: TRL
  shuffles the rows (``shuffle_sequence_dict``) and splits them into ``steps_per_generation``
  slices, and every tensor of the dict travels with its row, so the ids join the loss-time rows
  back to the rollout's rewards and groups.
- ``_get_per_token_logps_and_entropies``, only while inside ``compute_loss``: the training-time
  policy logprobs (the ones that carry the gradient; stored detached) and entropies. It returns 3
  values from TRL 1.7 on (logps, entropies, aux_loss), 2 before; both are handled.
- ``compute_loss`` marks the micro-batch boundary: after it returns, one step file is written.

With ``tools=`` (or ``environment_factory=``) a completion row is a packed episode: assistant turns
with the tool results TRL appended between them. ``completion_mask`` is then TRL's loss mask,
``completion_mask * tool_mask`` (``tool_mask`` is recorded beside it), and ``turn_ids``,
``token_roles`` and ``mask_reasons`` are read from the ids and the chat template, never from
``tool_mask`` (:mod:`tracer.integrations.trl_tools`), so a tool token left in the loss shows.

Rows of a step file are put back in generation order (sorted by row id), so the G completions of a
prompt are consecutive and ``group_ids`` comes in runs of G whenever a micro-batch holds whole
groups (always when ``steps_per_generation == 1``, TRL's default with no gradient accumulation).

Facts from TRL 1.16's ``grpo_trainer.py`` that shape the trace:

- Logprobs come from a fused LM head (``trl.trainer.utils.add_fused_lm_head``) built with the
  trainer's ``temperature``: logits / temperature, then log_softmax, for the policy, the old and the
  reference model alike. Positions whose attention mask is 0 (after EOS) get logprob 0 exactly, so
  ``ratio`` is 1 and the KL terms are 0 there; they are outside ``completion_mask`` anyway.
- ``old_per_token_logps`` exists only when ``gradient_accumulation_steps % (steps_per_generation *
  num_iterations) != 0`` or with vLLM importance sampling; otherwise TRL uses
  ``per_token_logps.detach()`` and the ratio is 1 by construction. The trace then omits
  ``old_logprobs`` and says so in ``old_logprobs_source`` (``policy_detached``).
- Group advantages use ``nanstd`` with Bessel's correction (sample std), unlike the seed's
  population std: recorded as ``advantage_std = "unbiased"``.
- ``loss_type`` maps to ``loss_reduction`` (:data:`~tracer.integrations.trl_metadata.LOSS_REDUCTION_BY_LOSS_TYPE`).

Ratio and KL terms are computed inside TRL's ``_compute_loss`` and not kept; the hook recomputes
``ratio``, ``approx_kl_k2`` and ``ref_kl_k3`` with :mod:`tracer.formulas` in float32, and
``per_token_loss`` where the loss type follows the plain GRPO/CISPO rule. ``loss`` is the scalar
``compute_loss`` returned (after TRL's division by the gradient-accumulation steps, recorded as
``loss_scale``), so ``tracer check``'s ``recompute.loss`` compares TRL's real loss with the reduction
of the per-token loss.

Tracing never stops training (:mod:`tracer.integrations.trl_base`). ``trl_rloo.py`` builds the
RLOO hook on this one: TRL's ``RLOOTrainer`` has the same four methods.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from tracer import formulas
from tracer.errors import TraceError
from tracer.integrations import trl_tools, trl_vllm
from tracer.integrations.trl_base import TrainerTraceHook, require_methods
from tracer.integrations.trl_metadata import (algorithm_of, hyperparameters_of, run_config_of, settings_in_effect,
                                               tokenizer_of)

__all__ = ["GRPOTraceHook", "ROW_ID_KEY"]

ROW_ID_KEY = "tracer_row_ids"
_ROW_STRIDE = 1 << 32  # row id = rollout index * _ROW_STRIDE + row within the local generation batch

OLD_FROM_TRL, OLD_IS_POLICY = "trl_old_per_token_logps", "policy_detached"
_LOSS_DIVIDED_BY_ACCUMULATION = {"grpo", "sapo", "bnpo", "dr_grpo", "luspo"}  # TRL 1.16 _compute_loss
_WRAPPED = ("_calculate_rewards", "_generate_and_score_completions",
            "_get_per_token_logps_and_entropies", "compute_loss")


@dataclass
class _Rollout:
    """What the hook keeps from one call of ``_generate_and_score_completions`` (CPU tensors)."""

    index: int
    rewards: torch.Tensor  # (B,) TRL's weighted sum of reward functions, NaN when unscorable
    reward_components: torch.Tensor  # (B, F)
    group_ids: torch.Tensor  # (B,) int64
    global_rows: torch.Tensor  # (B,) int64, row in the all-process generation batch
    optimizer_step: int = 0  # optimizer steps completed when it was generated (``state.global_step``)
    turn_ids: torch.Tensor | None = None  # (B, T) int64, tool-calling runs only (trl_tools.episode_roles)
    token_roles: torch.Tensor | None = None  # (B, T) int64
    truncated_masked: torch.Tensor | None = None  # (B,) bool, rows TRL masked as truncated


class GRPOTraceHook(TrainerTraceHook):
    """Records every micro-batch of a TRL ``GRPOTrainer`` into a trace; see the module docstring
    (attributes ``writer``, ``capture_failures``: :class:`~tracer.integrations.trl_base.TrainerTraceHook`)."""

    trainer_name = "GRPOTrainer"

    def __init__(self, trainer: Any, out_dir: str | os.PathLike, strict: bool = False,
                 keep_source_dtype: bool = False, config: Mapping[str, Any] | None = None,
                 **writer_options: Any) -> None:
        require_methods(trainer, _WRAPPED, self.trainer_name)
        super().__init__(trainer, out_dir, algorithm_of(trainer), self._hyperparameters(trainer),
                         run_config_of(trainer, config), tokenizer=tokenizer_of(trainer), strict=strict,
                         keep_source_dtype=keep_source_dtype, **writer_options)
        self._rollout: _Rollout | None = None
        self._rollouts_seen = 0
        self._rewards_per_func: torch.Tensor | None = None
        self._in_loss = False
        self._policy: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._loss: torch.Tensor | None = None
        self._chat_markers: trl_tools.ChatMarkers | None = None  # tool-calling runs: read at the first rollout
        self._wrap("_calculate_rewards", after=self._on_rewards)
        self._wrap("_generate_and_score_completions", after=self._on_rollout)
        self._wrap("_get_per_token_logps_and_entropies", after=self._on_logps)
        self._wrap_compute_loss()
        self._close_at_train_end()

    @staticmethod
    def _hyperparameters(trainer: Any) -> dict[str, Any]:
        return {**hyperparameters_of(trainer), **trl_vllm.sampler_hyperparameters(trainer)}

    # -- installing ---------------------------------------------------------------------------

    def _wrap_compute_loss(self) -> None:
        original = self.trainer.compute_loss

        @functools.wraps(original)
        def compute_loss(model, inputs, *args, **kwargs):
            self._in_loss, self._policy = True, None
            try:
                loss = original(model, inputs, *args, **kwargs)
            finally:
                self._in_loss = False
            if self._training():
                self._loss = loss.detach() if isinstance(loss, torch.Tensor) else None
                self._guard(self._record_micro_batch, inputs)
                self._loss_calls += 1
            self._policy = self._loss = None
            return loss

        self._install("compute_loss", compute_loss)

    # -- capture ------------------------------------------------------------------------------

    def _on_rewards(self, rewards_per_func: torch.Tensor) -> None:
        self._rewards_per_func = rewards_per_func.detach().to("cpu", torch.float32)  # (B_global, F)

    def _on_logps(self, result: Any) -> None:
        if not self._in_loss or self._policy is not None:
            return  # old / ref logprobs during the rollout, or a second call inside one loss
        logps = result[0] if isinstance(result, tuple) else result
        entropies = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        self._policy = (logps.detach(), None if entropies is None else entropies.detach())

    def _on_rollout(self, output: dict[str, Any]) -> None:
        if not self._training():
            return
        trainer = self.trainer
        B = output["completion_ids"].shape[0]
        rewards_per_func, self._rewards_per_func = self._rewards_per_func, None
        if rewards_per_func is None:
            raise TraceError("tracer saw no call of _calculate_rewards during this rollout; rewards are unknown")
        start = trainer.accelerator.process_index * B
        components = rewards_per_func[start : start + B]  # (B, F)
        weights = trainer.reward_weights.detach().to("cpu", torch.float32)  # (F,)
        rewards = (components * weights.unsqueeze(0)).nansum(dim=1)  # (B,) as TRL logs it
        rewards[torch.isnan(components).all(dim=1)] = float("nan")
        global_rows = torch.arange(start, start + B, dtype=torch.int64)  # (B,)
        index = self._rollouts_seen
        self._rollouts_seen += 1
        self._rollout = _Rollout(index, rewards, components, global_rows // trainer.num_generations, global_rows,
                                 self._optimizer_step())
        if getattr(trainer, "tools", None):
            self._read_turns(self._rollout, output["completion_ids"].detach().cpu())
        device = output["completion_ids"].device
        output[ROW_ID_KEY] = torch.arange(B, dtype=torch.int64, device=device) + index * _ROW_STRIDE

    def _read_turns(self, rollout: _Rollout, completion_ids: torch.Tensor) -> None:
        """Turns and roles of a tool-calling rollout, from the ids and the chat template
        (:mod:`tracer.integrations.trl_tools`), never from TRL's ``tool_mask``."""
        if self._chat_markers is None:
            self._chat_markers = trl_tools.chat_markers(self.trainer)
        turn_ids, token_roles, truncated = trl_tools.episode_roles(completion_ids, self._chat_markers)
        rollout.turn_ids, rollout.token_roles = turn_ids, token_roles
        rollout.truncated_masked = truncated & bool(getattr(self.trainer, "mask_truncated_completions", False))

    def _record_micro_batch(self, inputs: Mapping[str, Any]) -> None:
        rollout, row_ids = self._rollout, inputs.get(ROW_ID_KEY)
        if row_ids is None or rollout is None:
            raise TraceError(f"the loss inputs carry no {ROW_ID_KEY!r}: the rollout of these rows was not captured")
        if self._policy is None:
            raise TraceError("no policy logprobs were captured: compute_loss did not call "
                             "_get_per_token_logps_and_entropies (a TRL version tracer does not know?)")
        row_ids = row_ids.detach().cpu()
        if bool((row_ids // _ROW_STRIDE != rollout.index).any()):
            raise TraceError(f"loss rows come from another rollout than the last one captured ({rollout.index})")
        local_rows = row_ids % _ROW_STRIDE  # (B,)
        order = torch.argsort(local_rows)  # back to generation order: groups consecutive
        rows = local_rows[order]
        tensors = self._loss_tensors(inputs, order)
        tensors.update(self._rollout_tensors(rollout, rows))
        tensors.update(self._derived_tensors(tensors))
        metadata = self._step_metadata(inputs, tensors, rollout)
        if rollout.turn_ids is not None:
            tensors.update(self._turn_tensors(rollout, rows, tensors["completion_mask"]))
            metadata.update(trl_tools.turn_metadata())
        loss_tensors, loss_metadata = self._loss_fields(tensors)
        tensors.update(loss_tensors)
        metadata.update(loss_metadata)
        self.writer.record(self._optimizer_step(), tensors, inner_step=self._inner_step(),
                           micro_batch=self._micro_batch(), metadata=metadata)

    def _loss_tensors(self, inputs: Mapping[str, Any], order: torch.Tensor) -> dict[str, torch.Tensor]:
        """The loss-time tensors of the micro-batch, rows put in generation ``order``."""
        def take(value: torch.Tensor) -> torch.Tensor:
            return value.detach()[order.to(value.device)].cpu()

        policy, entropy = self._policy
        completion_mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            completion_mask = completion_mask * inputs["tool_mask"]
        tensors = {
            "prompt_ids": take(inputs["prompt_ids"]),
            "prompt_mask": take(inputs["prompt_mask"]),
            "completion_ids": take(inputs["completion_ids"]),
            "completion_mask": take(completion_mask),
            "policy_logprobs": take(policy),
        }
        optional = {"entropy": entropy, "old_logprobs": inputs.get("old_per_token_logps"),
                    "ref_logprobs": inputs.get("ref_per_token_logps"),
                    "sampler_logprobs": inputs.get("sampling_per_token_logps"), "tool_mask": inputs.get("tool_mask")}
        tensors.update({name: take(value) for name, value in optional.items() if value is not None})
        tensors.update(trl_vllm.is_weight_tensors(self.trainer, inputs, take))  # vLLM importance sampling
        advantages = take(inputs["advantages"])
        tensors["advantages" if advantages.dim() == 1 else "token_advantages"] = advantages
        return tensors

    def _rollout_tensors(self, rollout: _Rollout, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the rollout kept for the micro-batch's ``rows`` (local generation-batch indices)."""
        return {
            "rewards": rollout.rewards[rows],
            "reward_components": rollout.reward_components[rows],
            "group_ids": rollout.group_ids[rows],
            "generation_row_ids": rollout.global_rows[rows],
        }

    @staticmethod
    def _turn_tensors(rollout: _Rollout, rows: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
        """``turn_ids``, ``token_roles`` and ``mask_reasons`` of the micro-batch's ``rows``; ``keep``
        ``[B, T]``: the mask the loss used."""
        token_roles = rollout.token_roles[rows]  # (B, T)
        return {"turn_ids": rollout.turn_ids[rows], "token_roles": token_roles,
                "mask_reasons": trl_tools.mask_reasons(token_roles, keep, rollout.truncated_masked[rows])}

    def _derived_tensors(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """ratio, approx_kl_k2 and ref_kl_k3, recomputed in float32 with :mod:`tracer.formulas`."""
        policy32 = tensors["policy_logprobs"].float()  # (B, T)
        old32 = tensors["old_logprobs"].float() if "old_logprobs" in tensors else policy32  # TRL: policy.detach()
        derived = {"ratio": formulas.ratio(policy32, old32), "approx_kl_k2": formulas.approx_kl_k2(policy32, old32)}
        if "ref_logprobs" in tensors:
            derived["ref_kl_k3"] = formulas.ref_kl_k3(policy32, tensors["ref_logprobs"].float())
        return derived

    def _loss_fields(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``loss`` (the scalar ``compute_loss`` returned, which TRL backpropagates) with its scale in
        metadata ``loss_scale``, and ``per_token_loss`` recomputed with :mod:`tracer.formulas` from TRL's
        own tensors and config where TRL 1.16's ``_compute_loss`` uses the plain GRPO/CISPO rule.

        TRL divides the ``grpo``/``sapo``/``bnpo``/``dr_grpo``/``luspo`` loss by
        ``current_gradient_accumulation_steps`` (``loss_scale`` = its inverse); ``dapo``/``cispo``/
        ``vespo`` divide by the generation batch's token count (metadata ``num_items_in_batch``). An
        static entropy bonus (``entropy_coef``, not adaptive) is recorded with the loss: TRL subtracts
        ``entropy_coef`` × the masked mean entropy divided by the accumulation steps (metadata
        ``entropy_loss_scale``), which the loss check adds back with the loss's own scale, so the loss is
        recorded where the two scales agree (the accumulation-divided loss types, or no accumulation). An
        adaptive bonus (its coefficient gated per step), a bonus under another scale, or a router aux loss
        changes the returned value in a way not recorded: then ``loss`` is not recorded and metadata
        ``loss_not_recorded`` says why."""
        trainer = self.trainer
        out: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        loss_type = getattr(trainer, "loss_type", None)
        accumulation = float(getattr(trainer, "current_gradient_accumulation_steps", 1) or 1)
        bonus = bool(getattr(trainer, "_entropy_bonus_enabled", False))
        extra = [name for name, on in (
            ("adaptive entropy bonus", bonus and getattr(trainer, "use_adaptive_entropy", False)),
            # the bonus is divided by the accumulation steps whatever the loss type, the dapo / cispo / vespo policy
            # loss by the generation batch's tokens: one loss_scale holds both only without accumulation
            ("entropy bonus (scaled by 1 / gradient accumulation steps, the policy loss by num_items_in_batch)",
             bonus and loss_type not in _LOSS_DIVIDED_BY_ACCUMULATION and accumulation != 1.0),
            ("router aux loss", getattr(trainer, "aux_loss_enabled", False))) if on]
        if bonus:
            meta["entropy_loss_scale"] = 1.0 / accumulation  # TRL 1.16: the bonus's mean entropy / accumulation steps
        if extra:
            meta["loss_not_recorded"] = f"TRL adds the {' and '.join(extra)} to the loss it returns"
        elif self._loss is not None and self._loss.numel() == 1:
            out["loss"] = self._loss.detach().float().cpu().reshape(())
            if loss_type in _LOSS_DIVIDED_BY_ACCUMULATION:
                meta["loss_scale"] = 1.0 / float(getattr(trainer, "current_gradient_accumulation_steps", 1) or 1)
        per_token_loss = self._per_token_loss(tensors, loss_type)
        if per_token_loss is not None:
            out["per_token_loss"] = per_token_loss
            meta["per_token_loss_source"] = "tracer.formulas from TRL's tensors and config"
        return out, meta

    def _per_token_loss(self, tensors: Mapping[str, torch.Tensor], loss_type: str | None) -> torch.Tensor | None:
        trainer, args = self.trainer, self.trainer.args
        plain = (loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
                 and getattr(trainer, "importance_sampling_level", "token") == "token"
                 and getattr(args, "delta", None) is None
                 and getattr(trainer, "off_policy_mask_threshold", None) is None
                 and float(getattr(trainer, "top_entropy_quantile", 1.0)) >= 1.0)
        sampler_weights = None
        if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False):
            sampler_weights = tensors.get("is_weights", tensors.get("sequence_is_weights"))  # TRL's capped weights
            plain = plain and sampler_weights is not None
        beta = float(trainer.beta)
        if not plain or (beta and "ref_logprobs" not in tensors):
            return None
        policy = tensors["policy_logprobs"].float()  # (B, T)
        old = tensors["old_logprobs"].float() if "old_logprobs" in tensors else policy
        ref = tensors["ref_logprobs"].float() if beta else None
        advantages = tensors["advantages"].float()  # (B,)
        weighted = bool(getattr(args, "use_bias_correction_kl", False))  # TRL: per_token_kl * coef_1
        if loss_type == "cispo":  # TRL: clamp(coef_1, max=epsilon_high), the bound itself
            return formulas.cispo_per_token_loss(policy, old, advantages, float(trainer.epsilon_high), beta, ref,
                                                 weighted, sampler_weights)
        return formulas.grpo_per_token_loss(policy, old, advantages, float(trainer.epsilon_low),
                                            float(trainer.epsilon_high), beta, ref, weighted, sampler_weights)

    # -- step bookkeeping ---------------------------------------------------------------------

    def _micro_index(self) -> int:
        step = getattr(self.trainer, "_step", None)  # TRL's count of training_step calls
        return int(step) if isinstance(step, int) else self._loss_calls

    def _inner_step(self) -> int:
        args = self.trainer.args
        spg = int(args.steps_per_generation or 1)
        return (self._micro_index() % (spg * int(self.trainer.num_iterations))) // spg

    def _micro_batch(self) -> int:
        return self._micro_index() % self._accumulation_steps()

    def _step_metadata(self, inputs: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                       rollout: _Rollout) -> dict[str, Any]:
        B = tensors["completion_ids"].shape[0]
        loss_type = getattr(self.trainer, "loss_type", None)
        meta: dict[str, Any] = {
            "old_logprobs_source": OLD_FROM_TRL if "old_logprobs" in tensors else OLD_IS_POLICY,
            "rollout_index": rollout.index,
            "generation_slice": self._micro_index() % int(self.trainer.args.steps_per_generation or 1),
            # no optimizer step since the rollout was generated: every pass over it before the first step
            # (TRL's "aligned" case, gradient_accumulation_steps >= steps_per_generation * num_iterations,
            # where later passes are on fresh rollouts too: TRL then drops old_per_token_logps)
            "fresh_rollouts": self._optimizer_step() == rollout.optimizer_step,
        }
        meta.update(settings_in_effect(self.trainer))  # what this call runs with, beside the declared config
        learning_rate = _current_learning_rate(self.trainer)
        if learning_rate is not None:  # the optimizer step this micro-batch feeds will use it (0 during warmup)
            meta["learning_rate"] = learning_rate
        if loss_type == "dr_grpo":
            meta["loss_constant_divisor"] = B * int(self.trainer.max_completion_length)
        elif loss_type == "luspo":
            meta["loss_constant_divisor"] = B
        num_items = inputs.get("num_items_in_batch")
        if isinstance(num_items, torch.Tensor) and num_items.numel() == 1:
            meta["num_items_in_batch"] = int(num_items.item())
        return meta


def _current_learning_rate(trainer: Any) -> float | None:
    """The learning rate of the optimizer step in progress (``lr_scheduler.get_last_lr()[0]``), or None."""
    scheduler = getattr(trainer, "lr_scheduler", None)
    try:
        return float(scheduler.get_last_lr()[0]) if scheduler is not None else None
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
