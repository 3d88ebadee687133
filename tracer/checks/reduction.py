"""The ``recompute.loss`` check (SPEC.md section 6): the scalar loss under the three reductions of the
per-token loss (recorded, else recomputed by :mod:`tracer.checks.per_token_loss`), compared with the
loss the trainer recorded.

Where a recorded loss lives: the scalar tensor field ``loss`` (shape ``[]`` or ``[1]``, the value
the trainer backpropagated for this step file), or, failing that, the metadata key ``loss`` (a
float). The reductions (SPEC.md section 3):

* ``sequence_mean``: per-sequence masked mean, then the mean over sequences (seed, TRL ``grpo``);
* ``token_mean``: masked mean over all kept tokens (TRL ``bnpo``). For TRL's ``dapo`` / ``cispo`` /
  ``vespo`` losses the count is the generation batch's (metadata ``num_items_in_batch``, scaled by
  ``gradient_accumulation_steps / (world_size * steps_per_generation)`` as ``_compute_loss`` does);
* ``constant``: masked sum / a constant: metadata ``loss_divisor`` or ``loss_constant_divisor``, else
  B * ``max_completion_length`` (Dr. GRPO, TRL ``dr_grpo``), else B * T.

The declared reduction is metadata ``loss_reduction``, else the one TRL's ``loss_type`` implies.
Metadata ``loss_scale`` (e.g. 1 / gradient_accumulation_steps) multiplies every candidate.
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.comparison import compare
from tracer.checks.context import StepContext
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, Skip, register
from tracer.checks.per_token_loss import (FLIPPED_KL, flipped_kl_matches, kl_term_name, recomputed_per_token_loss,
                                          trl_loss_type)

TRL_LOSS_REDUCTION = {"grpo": "sequence_mean", "sapo": "sequence_mean", "bnpo": "token_mean",
                      "dapo": "token_mean", "cispo": "token_mean", "vespo": "token_mean", "dr_grpo": "constant"}
GENERATION_BATCH_TOKEN_MEAN = {"dapo", "cispo", "vespo"}  # TRL divides by num_items_in_batch


def recorded_loss(ctx: StepContext) -> float:
    """The trainer's scalar loss for this step file: tensor ``loss`` or metadata ``loss``; else Skip."""
    if "loss" in ctx.data:
        loss = ctx.data["loss"]
        if loss.numel() != 1:
            raise Skip(f"field loss has shape {list(loss.shape)}; expected a scalar [] or [1]")
        return float(loss.reshape(()))
    if isinstance(ctx.metadata.get("loss"), (int, float)):
        return float(ctx.metadata["loss"])
    raise Skip("needs the recorded scalar loss: tensor field 'loss' ([] or [1]) or metadata key 'loss'")


def _declared(ctx: StepContext) -> str | None:
    declared = ctx.hyper("loss_reduction", None)
    if declared is None:
        declared = TRL_LOSS_REDUCTION.get(trl_loss_type(ctx) or "")
    return declared


def candidate_losses(ctx: StepContext, per_token_loss: torch.Tensor, keep: torch.Tensor) -> tuple[dict, float]:
    """The scalar loss under each reduction (times ``loss_scale``) and the constant divisor used."""
    B, T = per_token_loss.shape
    divisor = ctx.hyper("loss_divisor", None) or ctx.hyper("loss_constant_divisor", None)
    if divisor is None:
        max_len = ctx.hyper("max_completion_length", None)
        divisor = B * (int(max_len) if max_len is not None else T)
    scale = float(ctx.hyper("loss_scale", 1.0))
    ptl = per_token_loss.double()
    token_mean = formulas.token_mean_loss(ptl, keep)
    num_items = ctx.hyper("num_items_in_batch", None)
    if trl_loss_type(ctx) in GENERATION_BATCH_TOKEN_MEAN and num_items:
        count = (float(num_items) / float(ctx.hyper("world_size", 1)) * float(ctx.hyper("gradient_accumulation_steps", 1))
                 / float(ctx.hyper("steps_per_generation", 1) or 1))
        token_mean = formulas.constant_divisor_loss(ptl, keep, max(count, 1.0))
    return {
        "sequence_mean": scale * float(formulas.sequence_mean_loss(ptl, keep)),
        "token_mean": scale * float(token_mean),
        "constant": scale * float(formulas.constant_divisor_loss(ptl, keep, float(divisor))),
    }, float(divisor)


@register("recompute.loss", "the recorded loss equals the declared reduction (sequence-mean / token-mean "
          "/ constant divisor) of the per-token loss", RL_ALGORITHMS)
def check_loss(ctx: StepContext):
    loss = recorded_loss(ctx)
    cut = ctx.rows_cut(ctx.mask().shape[0])
    if cut is not None:
        raise Skip(f"the writer kept the first {ctx.mask().shape[0]} of the step's {cut} sequences (first_k_sequences): "
                   "the recorded loss was taken over all of them")
    if ctx.algorithm == "rloo" and ctx.hyper("importance_ratio", None) == "sequence_sum":
        return _check_sequence_level_loss(ctx, loss)
    keep = ctx.mask()
    source = "recorded per_token_loss"
    if "per_token_loss" in ctx.data:
        per_token_loss = ctx.tensor("per_token_loss")
    else:
        per_token_loss, source = recomputed_per_token_loss(ctx), "per-token loss recomputed from the recorded inputs"
    values, divisor = candidate_losses(ctx, per_token_loss, keep)
    matches = [n for n, v in values.items() if abs(loss - v) <= ctx.tol.atol + ctx.tol.loss_rtol * abs(v)]
    if "sequence_mean" not in matches and not bool(keep.any(dim=1).all()):
        # rows the mask empties left out of the mean over sequences (MiniMind's agent loop: valid_rows)
        kept_rows = float(ctx.hyper("loss_scale", 1.0)) * float(formulas.kept_rows_sequence_mean_loss(
            per_token_loss.double(), keep))
        if abs(loss - kept_rows) <= ctx.tol.atol + ctx.tol.loss_rtol * abs(kept_rows):
            matches.append("sequence_mean")
    declared = _declared(ctx)
    listing = (f"sequence-mean {values['sequence_mean']:.6g}, token-mean {values['token_mean']:.6g}, constant "
               f"divisor {divisor:g} {values['constant']:.6g}")
    if declared in matches:
        return []
    if matches and declared is None:
        return [ctx.finding("recompute.loss", INFO, f"recorded loss {loss:.6g} matches the {' = '.join(matches)} "
                            f"reduction of the {source} ({listing}).", field="loss", matches=matches, **values)]
    if not matches and trl_loss_type(ctx) in GENERATION_BATCH_TOKEN_MEAN and not ctx.hyper("num_items_in_batch", None):
        raise Skip("TRL's dapo/cispo/vespo loss divides by the token count of the whole generation batch; "
                   "record metadata num_items_in_batch to compare")
    reduce_declared = (lambda ptl: torch.tensor(candidate_losses(ctx, ptl, keep)[0][declared or "token_mean"]))
    flipped = ("per_token_loss" not in ctx.data and flipped_kl_matches(ctx, reduce_declared, torch.tensor(loss)))
    said = f"metadata says {declared!r}" if declared else "no reduction is declared (metadata loss_reduction)"
    found = f"it matches {' = '.join(matches)}" if matches else "it matches none of the three reductions"
    message = (
        (FLIPPED_KL.format(term=kl_term_name(ctx)) if flipped else "") +
        f"recorded loss {loss:.6g}: {found}, but {said}. Reductions of the {source}: {listing}. Why it "
        "matters: the reduction decides how much each token and each sequence weighs (token-mean favours "
        "long completions, sequence-mean short ones), so a run trained with another reduction than "
        "intended learns a different objective. Likely fix: reduce with the intended function "
        "(tracer.formulas.sequence_mean_loss / token_mean_loss / constant_divisor_loss) or record the "
        "loss_reduction the trainer really uses."
    )
    return [ctx.finding("recompute.loss", ERROR, message, field="loss", recorded=loss, declared=declared,
                        matches=matches, divisor=divisor, kl_sign_flipped=flipped, **values)]


def _check_sequence_level_loss(ctx: StepContext, loss: float):
    """TRL RLOO: one clipped ratio per sequence, ``-min(sr*A, clip(sr, 1-εl, 1+εh)*A)``, mean over the
    micro-batch (``rloo_trainer.py:_compute_loss``), times metadata ``loss_scale``."""
    sequence_ratio, advantages = ctx.require("sequence_ratio", "advantages")
    eps_high = float(ctx.hyper("clip_epsilon_high"))
    eps_low = float(ctx.hyper("clip_epsilon_low", eps_high))
    sr, adv = sequence_ratio.double(), advantages.double()  # (B,), (B,)
    per_sequence = -torch.min(sr * adv, torch.clamp(sr, 1 - eps_low, 1 + eps_high) * adv)  # (B,)
    expected = float(ctx.hyper("loss_scale", 1.0)) * per_sequence.mean()
    return compare(ctx, "recompute.loss", "loss", torch.tensor([loss]), expected.reshape(1),
                   torch.ones(1, dtype=torch.bool), "the mean over sequences of RLOO's clipped sequence-ratio loss "
                   f"(eps_low {eps_low:g}, eps_high {eps_high:g})")
