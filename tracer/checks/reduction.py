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
Metadata ``loss_scale`` (e.g. 1 / gradient_accumulation_steps) multiplies every candidate; without it,
a recorded ``gradient_accumulation_steps`` > 1 adds the candidates times ``1 / steps`` (a loop that
records the ``loss / accumulation_steps`` it backpropagates). Without a recorded divisor, the constant
reduction's ``B * T`` is the padded width: when that width changes between step files it is no
constant, and a loss that matches it is named a loss over padding (padding counted in the divisor).

An entropy bonus (metadata ``entropy_coef``, TRL's name, or ``entropy_coeff``, verl's, not 0) is part of
the recorded loss: ``loss = reduce(per-token loss) - coef * reduce(entropy)`` (TRL 1.16, verl 0.9.1
``ppo_loss``), the entropy reduced with metadata ``entropy_reduction``, else verl's ``loss_agg_mode``,
else the token mean, times the loss's scale. The bonus is added back before the reductions are
compared; a recorded loss that matches the policy loss *plus* the bonus is named ``entropy bonus sign
flipped``, one that matches the policy loss alone ``entropy bonus missing``. Without a recorded
``entropy`` the loss is not checked (:func:`tracer.checks.coverage.not_modelled`: the report says so).

When the declared reduction does not reproduce the loss to float noise, the explanations of
:mod:`tracer.checks.loss_hypotheses` (the unmasked mean over padding, the KL sign flipped or the KL
term missing, another clip range) are ranked by residual, and the error names the one that
reproduces the loss, cause first, with its residual, the declared value and the gap. A wrong
explanation is named even inside the dtype's ``loss_rtol`` when the declared one is off by clearly
more than float noise; where explanations give the same value, nothing is said.
"""

from __future__ import annotations

import math

import torch

from tracer import formulas
from tracer.checks.comparison import compare
from tracer.checks.context import StepContext, check_memo, loss_scales
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, Skip, register
from tracer.errors import TraceError
from tracer.checks.loss_hypotheses import (
    CLEAR,
    float_noise,
    reduction_hypotheses,
    variant_hypotheses,
)
from tracer.checks.coverage import not_modelled
from tracer.checks.per_token_loss import recomputed_per_token_loss, trl_loss_type
from tracer.formulas.losses import entropy_bonus
from tracer.formulas.verl_losses import VERL_LOSS_AGG_MODES, verl_agg_loss

TRL_LOSS_REDUCTION = {"grpo": "sequence_mean", "sapo": "sequence_mean", "bnpo": "token_mean",
                      "dapo": "token_mean", "cispo": "token_mean", "vespo": "token_mean", "dr_grpo": "constant",
                      "luspo": "constant"}
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
    if ctx.metadata.get("loss_not_recorded"):  # the capture knew the loss holds a term it could not record
        raise not_modelled("the scalar loss", f"{ctx.metadata['loss_not_recorded']}, so the capture did not record "
                           "it; record loss (and entropy with entropy_coef for an entropy bonus) to check its reduction")
    raise Skip("needs the recorded scalar loss: tensor field 'loss' ([] or [1]) or metadata key 'loss'")


def entropy_coef(ctx: StepContext) -> float:
    """The entropy bonus's coefficient: metadata ``entropy_coef`` (TRL) or ``entropy_coeff`` (verl); 0 when
    neither is recorded. Skip for a value that is not a number."""
    value = ctx.hyper("entropy_coef", None)
    value = ctx.hyper("entropy_coeff", None) if value is None else value
    if value is None or isinstance(value, bool):
        return 0.0
    try:
        return float(value)
    except (TypeError, ValueError):
        raise Skip(f"metadata entropy_coef = {value!r} is not a number") from None


def entropy_term(ctx: StepContext, keep: torch.Tensor) -> tuple[float, float, str] | None:
    """``(coef, reduced entropy, how it is reduced)`` of the loss's entropy bonus, None without one; a
    :func:`not_modelled` skip when the coefficient is recorded and the entropy is not."""
    coef = entropy_coef(ctx)
    if not coef:
        return None
    if not ctx.has("entropy"):
        raise not_modelled(f"entropy bonus (entropy_coef {coef:g})", "the loss subtracts entropy_coef × the mean "
                           "token entropy, and entropy is not recorded; record entropy [B, T] (nats)")
    entropy = ctx.tensor("entropy").double()
    how = ctx.hyper("entropy_reduction", None) or ctx.hyper("loss_agg_mode", None) or "token_mean"
    if how in VERL_LOSS_AGG_MODES:
        counts = {k: ctx.hyper(k, None) for k in ("batch_num_tokens", "global_batch_size", "loss_scale_factor")}
        value = float(verl_agg_loss(entropy, keep, how, int(ctx.hyper("dp_size", 1) or 1), **counts))
        return coef, value, f"verl agg_loss {how!r}"
    try:
        return coef, float(entropy_bonus(entropy, keep, 1.0, how)), how.replace("_", "-")
    except ValueError as err:
        raise not_modelled(f"entropy_reduction {how!r}", str(err)) from None


def _declared(ctx: StepContext) -> str | None:
    declared = ctx.hyper("loss_reduction", None)
    if declared is None:
        declared = TRL_LOSS_REDUCTION.get(trl_loss_type(ctx) or "")
    return declared


def candidate_losses(ctx: StepContext, per_token_loss: torch.Tensor, keep: torch.Tensor,
                     scale: float | None = None) -> tuple[dict, float]:
    """The scalar loss under each reduction (times ``scale``, default metadata ``loss_scale``, else 1)
    and the constant divisor used."""
    B, T = per_token_loss.shape
    divisor = ctx.hyper("loss_divisor", None) or ctx.hyper("loss_constant_divisor", None)
    if divisor is None:
        max_len = ctx.hyper("max_completion_length", None)
        divisor = B * (int(max_len) if max_len is not None else T)
    scale = float(ctx.hyper("loss_scale", 1.0)) if scale is None else scale
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
          "/ constant divisor) of the per-token loss; else names the explanation that reproduces it (another "
          "reduction, the unmasked mean over padding, the KL sign, the clip range)", RL_ALGORITHMS)
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
    recomputed = "per_token_loss" not in ctx.data
    if recomputed:
        per_token_loss, source = recomputed_per_token_loss(ctx), "per-token loss recomputed from the recorded inputs"
    else:
        per_token_loss = ctx.tensor("per_token_loss")
    declared = _declared(ctx)
    padded = _constant_is_padded(ctx, keep)
    noise = float_noise(ctx, per_token_loss, keep, loss)
    bonus = entropy_term(ctx, keep)
    if bonus is not None:  # the noise of a loss that holds the bonus besides the policy loss
        noise = float_noise(ctx, per_token_loss, keep, abs(loss) + abs(bonus[0] * bonus[1]))
    recorded = loss
    scale, values, divisor, hypotheses = None, {}, 0.0, []
    for scale in loss_scales(ctx):  # the recorded loss_scale; else 1, then 1 / gradient_accumulation_steps
        values, divisor = candidate_losses(ctx, per_token_loss, keep, scale)
        if bonus is not None:
            wrong = _entropy_fault(ctx, recorded, values, declared, bonus, scale, noise)
            if wrong is not None:
                return [wrong]
            loss = recorded + scale * bonus[0] * bonus[1]  # the policy loss: the bonus added back
        hypotheses = reduction_hypotheses(ctx, values, per_token_loss, keep, divisor, declared, source, scale, padded)
        if min((h.residual(loss) for h in hypotheses if h.legitimate), default=math.inf) <= noise:
            break
    if bonus is not None:
        source += f" (the entropy bonus {scale * bonus[0] * bonus[1]:.6g} added back to the recorded loss {recorded:.6g})"
    if scale != 1.0 and ctx.hyper("loss_scale", None) is None:  # the loop divides by its accumulation steps
        source += f" times 1 / gradient_accumulation_steps ({scale:g})"
    loose = [h.key for h in hypotheses
             if h.key in values and abs(loss - h.value) <= ctx.tol.atol + ctx.tol.loss_rtol * abs(h.value)]
    matches = list(dict.fromkeys(loose))  # the reductions within the dtype's loss tolerance (as before ranking)
    healthy = [h for h in hypotheses if h.legitimate]
    best_healthy = min((h.residual(loss) for h in healthy), default=math.inf)  # none: an unknown declared name
    if best_healthy <= noise:
        return _undeclared_info(ctx, loss, matches or [min(healthy, key=lambda h: h.residual(loss)).key], values,
                                divisor, source) if declared is None else []
    wrong = [h for h in hypotheses if not h.legitimate]
    if recomputed:
        closest = declared if declared in values else min(values, key=lambda n: abs(loss - values[n]))
        wrong += variant_hypotheses(ctx, keep, [declared] if declared in values else list(values), divisor, loss,
                                    noise, closest, scale)
    # those that reproduce the loss to a tenth of the noise first; among them the priority decides (an exact tie)
    fits = sorted((h for h in wrong if h.residual(loss) <= noise),
                  key=lambda h: (h.residual(loss) > noise / CLEAR, h.priority, h.residual(loss)))
    # named when the healthy reduction is off by more than the noise (else it returned above) and by CLEAR
    # times more than the hypothesis: a loss that nearly cancels (|loss| << |per-token loss|) can be off by
    # 13% while its absolute gap stays under CLEAR * noise (the README skeleton's loss over padding)
    named = fits[0] if fits and best_healthy > CLEAR * max(fits[0].residual(loss), noise / CLEAR) else None
    if named is None and (declared in matches or (declared is None and matches)):
        return _undeclared_info(ctx, loss, matches, values, divisor, source) if declared is None else []
    if named is None and not matches and trl_loss_type(ctx) in GENERATION_BATCH_TOKEN_MEAN \
            and not ctx.hyper("num_items_in_batch", None):
        raise Skip("TRL's dapo/cispo/vespo loss divides by the token count of the whole generation batch; "
                   "record metadata num_items_in_batch to compare")
    said_loss = None if bonus is None else (f"the policy loss {loss:.6g} (recorded loss {recorded:.6g} + the entropy "
                                            f"bonus {loss - recorded:.6g})")
    return [_error(ctx, loss, named, fits, healthy, matches, declared, values, divisor, source, noise, said_loss)]


def _entropy_fault(ctx: StepContext, recorded: float, values: dict, declared: str | None,
                   bonus: tuple[float, float, str], scale: float, noise: float):
    """The error naming the entropy bonus as the term at fault: the recorded loss is a legitimate reduction
    of the per-token loss *plus* ``coef * H`` (sign flipped) or the reduction alone (bonus missing), while
    ``loss - coef * H`` is not; None otherwise."""
    coef, entropy, how = bonus
    term = scale * coef * entropy
    legit = {k: v for k, v in values.items() if declared in (None, k)}
    if not legit or abs(term) <= CLEAR * noise:
        return None  # a bonus within float noise: its sign cannot be told
    right = min(abs(recorded - (v - term)) for v in legit.values())
    if right <= noise:
        return None
    for key, cause, value in (("entropy_sign_flipped", "entropy bonus sign flipped", lambda v: v + term),
                              ("entropy_missing", "entropy bonus missing", lambda v: v)):
        name, gap = min(((k, abs(recorded - value(v))) for k, v in legit.items()), key=lambda x: x[1])
        if gap <= noise and right > CLEAR * max(gap, noise / CLEAR):
            policy = legit[name]
            said = ("+ entropy_coef × H: the loss pays the policy for lowering its entropy" if key == "entropy_sign_flipped"
                    else "with no entropy term: the declared bonus is not in the loss")
            message = (f"{cause}: recorded loss {recorded:.6g} equals the {name.replace('_', '-')} policy loss "
                       f"{policy:.6g} {said} (entropy_coef {coef:g}, H = {entropy:.6g} nats, the {how} of the recorded "
                       f"entropy{f', times the loss scale {scale:g}' if scale != 1.0 else ''}; to {gap:.1g}). The "
                       f"bonus is subtracted: policy loss − entropy_coef × H = {policy - term:.6g}, off by {right:.2g} "
                       f"(float noise here {noise:.1g}). Source: TRL 1.16 GRPOTrainer._compute_loss, verl 0.9.1 ppo_loss.")
            return ctx.finding("recompute.loss", ERROR, message, field="loss", cause=key, recorded=recorded,
                               policy_loss=policy, entropy_coef=coef, entropy=entropy, reduction=name)
    return None


def _constant_is_padded(ctx: StepContext, keep: torch.Tensor) -> str | None:
    """Why the constant divisor ``B * T`` is no constant, or None. Without a recorded divisor
    (``loss_divisor``, ``loss_constant_divisor``, ``max_completion_length``) the constant reduction
    divides by ``B * T``, the padded width of this step file; Dr. GRPO's divisor is a constant
    (``B * max_completion_length``). When the padded width changes between the trace's step files,
    a loss that matches ``masked sum / (B * T)`` divides by the padding it holds: not a constant."""
    if any(ctx.hyper(k, None) is not None for k in ("loss_divisor", "loss_constant_divisor", "max_completion_length")):
        return None
    memo = check_memo(ctx.trace, "completion_widths")
    if "widths" not in memo:
        widths = set()
        for key in ctx.trace.steps()[:200]:  # headers only
            try:
                shape = ctx.trace.fields(key).get("completion_mask", (None,))[0]
            except TraceError:
                continue
            if shape and len(shape) == 2:
                widths.add(int(shape[1]))
        memo["widths"] = sorted(widths)
    widths = memo["widths"]
    if len(widths) < 2:
        return None
    shown = ", ".join(str(w) for w in widths[:6]) + (", …" if len(widths) > 6 else "")
    return (f"the padded width T changes between step files ({shown}) and no max_completion_length or "
            "loss_divisor is recorded, so B × T is no constant divisor")


def _undeclared_info(ctx: StepContext, loss: float, matches: list[str], values: dict, divisor: float, source: str):
    return [ctx.finding("recompute.loss", INFO, f"recorded loss {loss:.6g} matches the {' = '.join(matches)} "
                        f"reduction of the {source} ({_listing(values, divisor)}).", field="loss", matches=matches,
                        **values)]


def _listing(values: dict, divisor: float) -> str:
    return (f"sequence-mean {values['sequence_mean']:.6g}, token-mean {values['token_mean']:.6g}, constant "
            f"divisor {divisor:g} {values['constant']:.6g}")


def _error(ctx: StepContext, loss: float, named, fits: list, healthy: list, matches: list[str], declared: str | None,
           values: dict, divisor: float, source: str, noise: float, said_loss: str | None = None):
    """The one finding: the cause that reproduces the loss first, then the evidence (its residual, the
    healthy hypothesis' value and gap, the float noise), then the reductions for reference. ``said_loss``:
    how the loss compared is named (default ``recorded loss <value>``; with an entropy bonus, the policy
    loss the recorded one gives once the bonus is added back)."""
    what = said_loss or f"recorded loss {loss:.6g}"
    said = f"metadata says {declared!r}" if declared else "no reduction is declared (metadata loss_reduction)"
    closest = min(healthy, key=lambda h: h.residual(loss)) if healthy else None
    gap = "" if closest is None else (
        f"{closest.text.replace('the ', 'the declared ', 1) if declared else closest.text} gives {closest.value:.6g}, "
        f"off by {closest.residual(loss):.2g}")
    evidence = f"; {gap}" if gap else ""
    listing = f"Reductions of the {source}: {_listing(values, divisor)}."
    if named is not None and named.key in values:  # another legitimate reduction
        message = (f"loss reduction: {what}: it matches {named.key}, but {said} "
                   f"(to {named.residual(loss):.1g}{evidence}). {listing}")
    elif named is not None:
        said_in_text = ("clip_range", named.key, "constant" if named.key == "unmasked_mean" else named.key)
        also = [h for h in fits[1:] if h.key not in said_in_text and h.residual(loss) <= noise / CLEAR]
        message = (f"{named.cause}: {what} equals {named.text} to {named.residual(loss):.1g}"
                   f"{evidence} (float noise here {noise:.1g}). "
                   + (f"Equally close: {also[0].text}. " if also else "") + listing)
    elif matches:
        message = f"loss reduction: {what}: it matches {' = '.join(matches)}, but {said}. {listing}"
    else:
        tried = ", nor with the KL sign, the KL term or the clip range varied" if "recomputed" in source else ""
        message = (f"unexplained loss: {what}: it matches none of the three reductions, nor the "
                   f"unmasked mean over all positions{tried}; {said}{evidence}. {listing}")
    details = {"recorded": loss, "declared": declared, "matches": matches, "divisor": divisor, "noise": noise,
               "cause": named.key if named is not None else None,
               "kl_sign_flipped": named is not None and named.key == "kl_sign_flipped", **values}
    if named is not None:
        details.update(named.details, explained_residual=named.residual(loss))
    return ctx.finding("recompute.loss", ERROR, message, field="loss", **details)


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
