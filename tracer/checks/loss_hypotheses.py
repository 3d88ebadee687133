"""Explanations of a recorded scalar loss, each evaluated on the recorded tensors and ranked by its
residual ``|recorded loss - value|`` (used by ``recompute.loss``, :mod:`tracer.checks.reduction`).

A hypothesis is one way the trainer may have built its scalar loss:

* a reduction of the per-token loss a trainer may mean (SPEC.md section 3): ``sequence_mean`` (also
  over the rows that keep a token, MiniMind's ``valid_rows``), ``token_mean``, ``constant`` divisor;
* the unmasked mean over all ``B * T`` positions, padding included (a loss over padding:
  :func:`tracer.formulas.losses.unmasked_mean_loss`);
* when the per-token loss is recomputed from the recorded inputs (the trainer recorded no
  ``per_token_loss``; MiniMind's ``train_ppo.py`` has no such variable): the KL penalty's sign flipped,
  the KL penalty left out, the dual clip left out (``clip_ratio_c`` recorded), the ratio at the other
  level (token vs GSPO's sequence ratio), and another clip range than the recorded one (solved for:
  the loss is monotone in each epsilon).

Why residuals and not a pass/fail tolerance: a small term (``kl_coef`` 0.02 times the k3 of a policy
that has barely moved) changes the loss by less than a loose relative tolerance, yet by far more than
float noise; and a loss that cancels to ~0 (group-centred advantages) makes a relative tolerance
meaningless. The noise of a recomputed loss is a few ulps of the magnitude of its terms
(:func:`float_noise`); a wrong hypothesis is named only when it reproduces the loss to that noise and
every healthy one is off by clearly more (:data:`CLEAR`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tracer import formulas
from tracer.checks.context import StepContext
from tracer.checks.finding import Skip
from tracer.checks.per_token_loss import (
    dual_clip_c,
    importance_sampling_level,
    kl_term_name,
    loss_kl_coef,
    recomputed_per_token_loss,
    trl_loss_type,
)


NOISE_ULPS = 32.0  # float rounding of a recomputed loss, in ulps of the mean |per-token loss| (measured: <= 1)
CLEAR = 10.0  # a healthy hypothesis off by more than CLEAR * noise is clearly not float noise
REDUCTION_WORDS = {"sequence_mean": "sequence-mean", "token_mean": "token-mean", "constant": "constant divisor"}


@dataclass
class Hypothesis:
    """One explanation of the recorded loss.

    Attributes:
        key: ``sequence_mean`` / ``token_mean`` / ``constant`` (reductions), ``unmasked_mean``,
            ``kl_sign_flipped``, ``kl_missing`` or ``clip_range``.
        cause: the finding's first words when this hypothesis is the one named ("loss over padding").
        text: what the loss is under it, for the message.
        value: the scalar loss it predicts (float64 arithmetic on the recorded tensors).
        legitimate: a reduction a trainer may mean (the declared one, or any when none is declared).
        details: numbers for the finding's details (epsilons, divisor, positions).
        priority: which of several hypotheses that reproduce the loss equally closely is named: the
            unmasked mean (0: with the per-token loss 0 at padding it is also a constant divisor B * T,
            and the text says so), another reduction (1), the KL sign (2), the KL term (3), a clip range (4).
    """

    key: str
    cause: str
    text: str
    value: float
    legitimate: bool = False
    details: dict = field(default_factory=dict)
    priority: int = 0  # among hypotheses that all reproduce the loss to float noise, the lowest is named

    def residual(self, loss: float) -> float:
        gap = abs(loss - self.value)
        return gap if math.isfinite(gap) else math.inf


def float_noise(ctx: StepContext, per_token_loss: torch.Tensor, keep: torch.Tensor, loss: float) -> float:
    """The float noise of a loss recomputed in another order than the trainer's: ``NOISE_ULPS`` ulps
    of the trace's dtype times the mean |per-token loss| over the finite positions (kept, and all:
    the unmasked mean sums padding too) and |loss|, whichever is largest."""
    eps = torch.finfo(getattr(torch, ctx.dtype)).eps
    ptl = per_token_loss.double().abs()
    finite = torch.isfinite(ptl)
    scales = [abs(loss) if math.isfinite(loss) else 0.0]
    for where in (finite & keep, finite):
        if bool(where.any()):
            scales.append(float(ptl[where].mean()))
    return NOISE_ULPS * eps * max(scales) + 1e-30


def reducer(ctx: StepContext, keep: torch.Tensor, name: str, divisor: float,
            scale: float | None = None) -> Callable[[torch.Tensor], float]:
    """``ptl [B, T] -> scalar loss`` under reduction ``name`` times ``scale`` (default: metadata
    ``loss_scale``, else 1)."""
    scale = float(ctx.hyper("loss_scale", 1.0)) if scale is None else scale
    rules = {"sequence_mean": lambda p: formulas.sequence_mean_loss(p, keep),
             "kept_rows": lambda p: formulas.kept_rows_sequence_mean_loss(p, keep),
             "token_mean": lambda p: formulas.token_mean_loss(p, keep),
             "constant": lambda p: formulas.constant_divisor_loss(p, keep, divisor),
             "unmasked_mean": formulas.unmasked_mean_loss,
             "padded_divisor": lambda p: formulas.constant_divisor_loss(p, keep, float(keep.numel()))}
    return lambda ptl: scale * float(rules[name](ptl.double()))


def reduction_hypotheses(ctx: StepContext, values: dict, per_token_loss: torch.Tensor, keep: torch.Tensor,
                         divisor: float, declared: str | None, source: str, scale: float | None = None,
                         constant_is_padded: str | None = None) -> list[Hypothesis]:
    """The legitimate reductions (``values``: :func:`tracer.checks.reduction.candidate_losses`), the
    sequence mean over kept rows when a row keeps nothing, the unmasked mean over ``B * T``, and the
    masked sum over ``B * T`` (padding counted in the divisor: ``(ptl * mask).mean()``).

    ``constant_is_padded``: why the constant divisor ``B * T`` is no constant (the padded width changes
    between step files and no ``max_completion_length`` / ``loss_divisor`` is recorded); the constant
    reduction is then not legitimate: it is the padded divisor."""
    B, T = keep.shape
    out = [Hypothesis(name, "loss reduction", f"the {REDUCTION_WORDS[name]} of the {source}"
                      + (f" ({divisor:g})" if name == "constant" else ""), v,
                      declared in (None, name) and not (name == "constant" and constant_is_padded),
                      {"reduction": name}, priority=1) for name, v in values.items()]
    if not bool(keep.any(dim=1).all()):  # MiniMind's agent loop leaves empty rows out of the mean (valid_rows)
        out.append(Hypothesis("sequence_mean", "loss reduction", f"the sequence-mean over the rows that keep a "
                              f"token of the {source}", reducer(ctx, keep, "kept_rows", divisor, scale)(per_token_loss),
                              declared in (None, "sequence_mean"), {"reduction": "sequence_mean"}, priority=1))
    padding = int((~keep).sum())
    zero_padding = bool((per_token_loss[~keep] == 0).all()) if padding else True
    also = f", where the per-token loss is 0: also the masked sum / {B * T}" if zero_padding and padding else ""
    text = (f"the unmasked mean of the {source} over all {B} × {T} positions, padding included ({padding} of "
            f"{B * T} positions are masked{also})")
    out.append(Hypothesis("unmasked_mean", "loss over padding", text,
                          reducer(ctx, keep, "unmasked_mean", divisor, scale)(per_token_loss), False,
                          {"positions": B * T, "masked_positions": padding}))
    if padding and (not zero_padding or divisor != B * T or constant_is_padded):
        # the kept tokens summed, divided by every position: `(ptl * mask).mean()`, padding in the divisor
        why = f"; {constant_is_padded}" if constant_is_padded else ""
        out.append(Hypothesis("padded_divisor", "loss over padding", f"the masked sum of the {source} divided by "
                              f"all {B} × {T} = {B * T} positions, padding counted in the divisor ({padding} of "
                              f"{B * T} positions are masked{why})",
                              reducer(ctx, keep, "padded_divisor", divisor, scale)(per_token_loss), False,
                              {"positions": B * T, "masked_positions": padding}))
    return out


def variant_hypotheses(ctx: StepContext, keep: torch.Tensor, reductions: list[str], divisor: float,
                       loss: float, noise: float, clip_reduction: str, scale: float | None = None) -> list[Hypothesis]:
    """The per-token loss recomputed with one thing changed, under each of ``reductions``: the KL
    term's sign flipped, the KL term left out; and the clip range solved for (one side, then both)
    under ``clip_reduction`` alone (the declared one, else the closest: each solve costs ~40
    recomputations)."""
    out = []
    coef = loss_kl_coef(ctx)
    for name in reductions:
        reduce = reducer(ctx, keep, name, divisor, scale)
        words = REDUCTION_WORDS[name]
        if coef:
            term = kl_term_name(ctx)
            for sign, key, cause, how in ((-1.0, "kl_sign_flipped", "KL penalty sign flipped",
                                           f"with {term} subtracted instead of added"),
                                          (0.0, "kl_missing", "KL penalty missing", f"without its {term} term")):
                try:
                    value = reduce(recomputed_per_token_loss(ctx, kl_sign=sign))
                except Skip:
                    break
                out.append(Hypothesis(key, cause, f"the {words} of the per-token loss {how} "
                                      f"(coefficient {coef:g})", value, details={"reduction": name},
                                      priority=2 if sign else 3))
        out.extend(_objective_hypotheses(ctx, reduce, words, name))
    reduce = reducer(ctx, keep, clip_reduction, divisor, scale)
    out.extend(_clip_hypotheses(ctx, reduce, REDUCTION_WORDS[clip_reduction], clip_reduction, loss, noise))
    return out


def _objective_hypotheses(ctx: StepContext, reduce, words: str, reduction: str) -> list[Hypothesis]:
    """The per-token loss of another objective than the recorded settings say, under one reduction: the
    dual clip left out (``clip_ratio_c`` recorded), and the ratio at the other level (token ratio where
    ``importance_sampling_level = 'sequence'`` (GSPO) is recorded, GSPO's sequence ratio where it is not)."""
    out = []
    try:
        c = dual_clip_c(ctx)
        if c is not None:
            out.append(Hypothesis("dual_clip_missing", "dual clip missing", f"the {words} of the per-token loss "
                                  f"without its dual clip (clip_ratio_c = {c:g} is recorded: where A < 0 the loss "
                                  f"is not capped at -{c:g}·A)", reduce(recomputed_per_token_loss(ctx, dual_clip=0.0)),
                                  details={"reduction": reduction, "clip_ratio_c": c}, priority=2))
        sequence = importance_sampling_level(ctx) == "sequence"
        text = ("with the per-token ratio exp(policy − old), while importance_sampling_level = 'sequence' (GSPO) "
                "is recorded: the loop does not clip one ratio per sequence" if sequence else
                "with GSPO's sequence ratio exp(masked mean of policy − old), while importance_sampling_level is "
                "'token' (or not recorded)")
        value = reduce(recomputed_per_token_loss(ctx, sequence_level=not sequence))
        out.append(Hypothesis("ratio_level", "ratio level", f"the {words} of the per-token loss {text}", value,
                              details={"reduction": reduction, "recorded_level": "sequence" if sequence else "token"},
                              priority=2))
    except Skip:
        pass
    return out


def _clip_hypotheses(ctx: StepContext, reduce, words: str, reduction: str, loss: float,
                     noise: float) -> list[Hypothesis]:
    """Clip ranges that reproduce ``loss``: the loss is non-increasing in each epsilon (the surrogate
    ``min(r*A, clip(r)*A)`` grows with both), so each side is solved by bisection. A continuous
    parameter fits any loss in its range, so a solution counts only when it is a discrete fact: the
    clip binds on no token of that side, or the epsilon has at most 2 significant digits (a typed value)."""
    if ctx.algorithm not in ("ppo", "grpo", "") or trl_loss_type(ctx) == "cispo" or ctx.hyper("delta", None):
        return []
    if ctx.hyper("importance_sampling_level", "token") != "token":
        return []  # the bounds below read token ratios; GSPO clips one ratio per sequence
    try:
        eps_high = float(ctx.hyper("clip_epsilon_high"))
        eps_low = float(ctx.hyper("clip_epsilon_low", eps_high))
        r = formulas.ratio(ctx.tensor("policy_logprobs"), ctx.old_logprobs()).double()
        adv = ctx.tensor("advantages").double()
    except Skip:
        return []
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    keep = ctx.mask()
    pos, neg = keep & (adv > 0) & torch.isfinite(r), keep & (adv < 0) & torch.isfinite(r)
    top = float(r[pos].max()) - 1 if bool(pos.any()) else 0.0  # eps_high beyond which nothing binds
    bottom = 1 - float(r[neg].min()) if bool(neg.any()) else 0.0  # eps_low beyond which nothing binds
    sides = {"high": (lambda e: (eps_low, e), max(top, 0.0), eps_high),
             "low": (lambda e: (e, eps_high), min(max(bottom, 0.0), 1.0), eps_low),
             "both": (lambda e: (e, e), min(max(top, bottom, 0.0), 1.0), None)}
    out = []
    for side, (clip, upper, declared) in sides.items():
        def f(e, clip=clip):
            return reduce(recomputed_per_token_loss(ctx, clip=clip(e)))
        try:
            solved = _solve_monotone(f, loss, upper, noise)
        except Skip:
            return out
        if solved is None:
            continue
        eps, unbound = solved
        if side == "both" and unbound:
            continue  # 'nothing binds on either side' is the two one-sided facts at once: named by them
        low, high = clip(eps)
        if unbound:
            tokens = pos & (r > 1 + eps_high) if side == "high" else neg & (r < 1 - eps_low)
            extreme = (f"the largest ratio on a token with A > 0 is {1 + eps:.4g}" if side == "high" else
                       f"the smallest ratio on a token with A < 0 is {1 - eps:.4g}")
            text = (f"the {words} of the objective whose {'upper' if side == 'high' else 'lower'} clip binds on no "
                    f"token: clip_epsilon_{side} ≥ {eps:.4g} ({extreme}), not the declared {declared:g}, which "
                    f"clips {int(tokens.sum())} of {int(keep.sum())} kept tokens")
        else:
            what = (f"clip_epsilon_{side} {eps:g}, declared {declared:g}" if declared is not None else
                    f"clip_epsilon {eps:g} on both sides, declared {eps_low:g} / {eps_high:g}")
            text = f"the {words} of the clipped objective with clip range [{1 - low:.4g}, {1 + high:.4g}] ({what})"
        out.append(Hypothesis("clip_range", "clip range", text, f(eps), priority=4, details={
            "reduction": reduction, "implied_clip_epsilon_low": low if side != "high" else eps_low,
            "implied_clip_epsilon_high": high if side != "low" else eps_high, "clip_unbound": unbound}))
    return out


def _solve_monotone(f, target: float, upper: float, noise: float) -> tuple[float, bool] | None:
    """``eps`` in ``[0, upper]`` with ``f(eps) == target`` to ``noise``, ``f`` non-increasing; None when
    ``target`` is out of range or the solution is no discrete fact. Returns ``(eps, unbound)``:
    ``unbound`` when ``f`` is flat from ``eps`` on (the clip binds nowhere; eps is the smallest such)."""
    f_lo, f_hi = f(0.0), f(upper)
    if not (f_hi - noise <= target <= f_lo + noise) or upper <= 0:
        return None
    if abs(f_hi - target) <= noise:  # flat from `upper` on: the clip binds on no token of this side
        return upper, True
    lo, hi = 0.0, upper
    for _ in range(40):  # upper <= ~1 in practice: 40 halvings reach 1e-12, below any typed value's spacing
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
    eps = (lo + hi) / 2
    typed = float(f"{eps:.2g}")
    if abs(f(typed) - target) <= noise:
        return typed, False
    return None
