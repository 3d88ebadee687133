"""Trace Hugging Face TRL's ``DPOTrainer`` (written against TRL 1.16, ``dpo_trainer.py``).

Usage::

    trainer = DPOTrainer(model=..., args=DPOConfig(...), train_dataset=preference_dataset)
    tracer.attach(trainer, "runs/my-trace")
    trainer.train()

Facts from TRL 1.16 that shape the hook:

- ``DataCollatorForPreference`` stacks ``[chosen; rejected]`` in one batch: ``input_ids``,
  ``attention_mask`` and ``completion_mask`` ``[2B, S]``, right-padded, the first B rows chosen and
  the last B rejected (pair b is rows b and B + b). ``completion_mask`` is 1 on the completion
  tokens (EOS included) and 0 on the prompt and the padding. The sampler shuffles pairs; rows are
  never shuffled within a batch, so no row join is needed.
- TRL 1.16 has no concatenated-forward method to wrap: ``_compute_loss`` calls the policy as
  ``model(input_ids, attention_mask, labels=input_ids masked to -100 off the completion,
  fused_lm_head=True)``. The fused LM head (``trl.trainer.utils.add_fused_lm_head``) returns
  ``log_probs`` ``[2B, S - 1]``: column k scores ``input_ids[:, k + 1]``, and every position whose
  label is -100 holds exactly 0. TRL's sequence logprob is the plain row sum of that tensor.
- Reference logprobs come from one of three paths: a second forward of ``ref_model`` under
  ``no_grad`` in the same ``_compute_loss`` (the default when a model path or a separate reference
  is given); a second forward of the policy itself with its PEFT adapter disabled; or, with
  ``precompute_ref_log_probs=True``, per-pair *sums* computed once in ``__init__`` (before
  ``tracer.attach`` can run) and fed back as ``inputs["ref_chosen_logps"]`` /
  ``inputs["ref_rejected_logps"]``: then no per-token reference exists anywhere.

So the hook wraps ``compute_loss`` on the trainer instance (the micro-batch boundary, and the
inputs) and puts a forward hook (``register_forward_hook``) on the policy module and on
``ref_model``; inside ``compute_loss`` it keeps the ``log_probs`` of the first policy forward and of
the reference forward (or the second policy forward: the adapter-disabled path). This depends only
on the public ``compute_loss`` and the fused head's ``log_probs`` output, not on private helpers.

Layout of a DPO step file (one row per pair, T = S, the stacked batch's padded width):
``chosen_ids`` / ``rejected_ids`` are the ``input_ids`` rows (prompt + completion + padding), the
masks are TRL's ``completion_mask`` rows, and the logprobs are token-aligned:
``chosen_policy_logprobs[b, t] = log p(chosen_ids[b, t] | chosen_ids[b, :t])`` (0 at t = 0 and
wherever TRL scores nothing). ``dpo_logits``, ``chosen_rewards``, ``rejected_rewards`` (and
``dpo_loss`` when TRL's loss is plain sigmoid DPO) are recomputed from those with
:func:`tracer.formulas.dpo_terms` and TRL's ``beta``; ``loss`` is what ``compute_loss`` returned.
With precomputed references the per-token ``*_ref_logprobs`` are absent and the per-pair sums are
recorded as ``chosen_ref_sequence_logprobs`` / ``rejected_ref_sequence_logprobs`` ``[B]``.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping

import torch

from tracer import formulas
from tracer.errors import TraceError
from tracer.integrations.trl_base import TrainerTraceHook, require_methods
from tracer.integrations.trl_metadata import DPO_CONFIG_KEYS, dpo_hyperparameters_of, run_config_of, tokenizer_of
from tracer.format.schema import REF_PRECOMPUTED_SUMS, REF_SEQUENCE_SUMS

__all__ = ["DPOTraceHook"]

REF_FROM_MODEL, REF_FROM_ADAPTER_OFF, REF_PRECOMPUTED = (
    "trl_ref_model_forward", "trl_adapter_disabled_forward", REF_PRECOMPUTED_SUMS)
_POLICY, _REF = "policy", "ref"


class DPOTraceHook(TrainerTraceHook):
    """Records every micro-batch of a TRL ``DPOTrainer`` into a trace; see the module docstring
    (attributes ``writer``, ``capture_failures``: :class:`~tracer.integrations.trl_base.TrainerTraceHook`)."""

    trainer_name = "DPOTrainer"

    def __init__(self, trainer: Any, out_dir: str | os.PathLike, strict: bool = False,
                 keep_source_dtype: bool = False, config: Mapping[str, Any] | None = None,
                 **writer_options: Any) -> None:
        require_methods(trainer, ("compute_loss",), self.trainer_name)
        if not isinstance(getattr(trainer, "model", None), torch.nn.Module) or getattr(trainer, "beta", None) is None:
            raise TraceError(f"cannot trace a {type(trainer).__name__}: tracer needs a DPOTrainer's model (an "
                             "nn.Module) and beta; pass a trl.DPOTrainer (TRL >= 1.0)")
        super().__init__(trainer, out_dir, "dpo", dpo_hyperparameters_of(trainer),
                         run_config_of(trainer, config, DPO_CONFIG_KEYS), tokenizer=tokenizer_of(trainer),
                         strict=strict, keep_source_dtype=keep_source_dtype, **writer_options)
        self._in_loss = False
        self._forwards: list[tuple[str, torch.Tensor | None]] = []  # (role, log_probs [2B, S - 1]) in call order
        self._forward_error: Exception | None = None
        self._handles = [trainer.model.register_forward_hook(self._forward_hook(_POLICY))]
        ref_model = getattr(trainer, "ref_model", None)
        if isinstance(ref_model, torch.nn.Module) and ref_model is not trainer.model:
            self._handles.append(ref_model.register_forward_hook(self._forward_hook(_REF)))
        self._wrap_compute_loss()
        self._close_at_train_end()

    def detach(self) -> None:
        """Restore the trainer's ``compute_loss`` and remove the forward hooks."""
        super().detach()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- installing ---------------------------------------------------------------------------

    def _forward_hook(self, role: str):
        def hook(module, args, output):
            if not self._in_loss:
                return
            try:  # runs inside the model's forward: an exception here would stop training
                log_probs = getattr(output, "log_probs", None)
                self._forwards.append((role, None if log_probs is None else log_probs.detach()))
            except Exception as err:  # noqa: BLE001
                self._forward_error = err

        return hook

    def _wrap_compute_loss(self) -> None:
        original = self.trainer.compute_loss

        @functools.wraps(original)
        def compute_loss(model, inputs, *args, **kwargs):
            self._in_loss, self._forwards, self._forward_error = True, [], None
            try:
                result = original(model, inputs, *args, **kwargs)
            finally:
                self._in_loss = False
            if self._training():
                loss = result[0] if isinstance(result, tuple) else result
                self._guard(self._record_micro_batch, (inputs, loss))
                self._loss_calls += 1
            self._forwards = []
            return result

        self._install("compute_loss", compute_loss)

    # -- capture ------------------------------------------------------------------------------

    def _split_forwards(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(policy, ref) ``log_probs`` of this ``compute_loss``; ref None when none was run."""
        if self._forward_error is not None:
            raise self._forward_error
        policy_calls = [lp for role, lp in self._forwards if role == _POLICY]
        ref_calls = [lp for role, lp in self._forwards if role == _REF]
        if not policy_calls or policy_calls[0] is None:
            raise TraceError("no policy log_probs were captured in compute_loss: the policy forward did not run "
                             "through TRL's fused LM head (model(..., fused_lm_head=True), TRL >= 1.x), or the "
                             "trainer replaced trainer.model after tracer.attach; attach right before train()")
        ref = ref_calls[0] if ref_calls else (policy_calls[1] if len(policy_calls) > 1 else None)
        return policy_calls[0], ref

    def _ref_source(self, inputs: Mapping[str, Any]) -> str:
        if getattr(self.trainer, "precompute_ref_logps", False) and "ref_chosen_logps" in inputs:
            return REF_PRECOMPUTED
        return REF_FROM_MODEL if getattr(self.trainer, "ref_model", None) is not None else REF_FROM_ADAPTER_OFF

    def _record_micro_batch(self, value: tuple[Mapping[str, Any], Any]) -> None:
        inputs, loss = value
        input_ids = inputs["input_ids"].detach().cpu()  # (2B, S)
        completion_mask = inputs["completion_mask"].detach().cpu().bool()  # (2B, S)
        two_b, S = input_ids.shape
        if two_b % 2:
            raise TraceError(f"DPO batch has {two_b} rows; expected [chosen; rejected] stacked (an even count)")
        B = two_b // 2
        policy, ref = self._split_forwards()
        source = self._ref_source(inputs)
        tensors: dict[str, torch.Tensor] = {
            "chosen_ids": input_ids[:B], "rejected_ids": input_ids[B:],
            "chosen_mask": completion_mask[:B], "rejected_mask": completion_mask[B:],
        }
        tensors.update(_sides("policy", _token_aligned(policy, S)))
        if source == REF_PRECOMPUTED:
            ref_c = inputs["ref_chosen_logps"].detach().float().cpu()  # (B,)
            ref_r = inputs["ref_rejected_logps"].detach().float().cpu()  # (B,)
            tensors.update({REF_SEQUENCE_SUMS["chosen_ref_logprobs"]: ref_c,
                            REF_SEQUENCE_SUMS["rejected_ref_logprobs"]: ref_r})
        elif ref is None:
            raise TraceError("no reference log_probs were captured in compute_loss (no ref_model forward, no "
                             "second policy forward, no precomputed ref_chosen_logps)")
        else:
            tensors.update(_sides("ref", _token_aligned(ref, S)))
            ref_c = formulas.sequence_logprobs(tensors["chosen_ref_logprobs"].float(), tensors["chosen_mask"])  # (B,)
            ref_r = formulas.sequence_logprobs(tensors["rejected_ref_logprobs"].float(), tensors["rejected_mask"])
        policy_c = formulas.sequence_logprobs(tensors["chosen_policy_logprobs"].float(), tensors["chosen_mask"])  # (B,)
        policy_r = formulas.sequence_logprobs(tensors["rejected_policy_logprobs"].float(), tensors["rejected_mask"])
        terms = formulas.dpo_terms(policy_c, policy_r, ref_c, ref_r, float(self.trainer.beta))
        plain = self._loss_is_sigmoid_dpo()
        tensors.update({name: value for name, value in terms.items() if name != "dpo_loss" or plain})
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            tensors["loss"] = loss.detach().reshape(()).cpu()
        metadata = {"ref_logprobs_source": source, "dpo_token_layout": "input_ids", "dpo_loss_is_sigmoid": plain}
        self.writer.record(self._optimizer_step(), tensors, inner_step=0,
                           micro_batch=self._loss_calls % self._accumulation_steps(), metadata=metadata)

    def _loss_is_sigmoid_dpo(self) -> bool:
        """True when TRL's loss is ``-logsigmoid(beta * logits)`` of plain masked sums, i.e. what
        :func:`tracer.formulas.dpo_terms` computes (``loss_type == ["sigmoid"]``, reverse KL, no
        ``ld_alpha`` length weighting, no WPO weighting, a loss weight of 1 (``loss_weights``, TRL 1.16
        ``dpo_trainer.py`` multiplies each loss type's loss by its weight) and no router auxiliary loss
        added (``aux_loss_enabled``, a mixture-of-experts model))."""
        trainer = self.trainer
        weights = [float(w) for w in (getattr(trainer, "loss_weights", None) or [1.0])]
        return (list(getattr(trainer, "loss_types", []) or []) == ["sigmoid"] and weights == [1.0]
                and getattr(trainer, "f_divergence_type", "reverse_kl") == "reverse_kl"
                and getattr(trainer, "ld_alpha", None) is None and not getattr(trainer, "use_weighting", False)
                and not getattr(trainer, "aux_loss_enabled", False))


def _token_aligned(log_probs: torch.Tensor, S: int) -> torch.Tensor:
    """TRL's shifted ``[2B, >= S - 1]`` log_probs (column k scores token k + 1) as ``[2B, S]``
    aligned with ``input_ids`` (column t scores token t; column 0 is 0)."""
    if S < 2 or log_probs.shape[1] < S - 1:
        raise TraceError(f"DPO log_probs of shape {list(log_probs.shape)} do not cover input_ids of width {S}")
    shifted = log_probs[:, -(S - 1):].cpu()  # (2B, S - 1); prompt-learning PEFT prepends columns
    return torch.cat([shifted.new_zeros(shifted.shape[0], 1), shifted], dim=1)  # (2B, S)


def _sides(model: str, token_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{chosen_<model>_logprobs, rejected_<model>_logprobs}`` from the stacked ``[2B, S]`` tensor."""
    B = token_logprobs.shape[0] // 2
    return {f"chosen_{model}_logprobs": token_logprobs[:B], f"rejected_{model}_logprobs": token_logprobs[B:]}
