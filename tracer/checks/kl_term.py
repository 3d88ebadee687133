"""The KL term of a per-token loss at fault, named from the recorded per-token loss: missing, its sign
flipped, weighted by another coefficient than the declared ``beta`` / ``kl_coef``, counted twice (the
penalty also in the rewards), or another estimator (k1, k2, k3 with swapped arguments) than the assumed
one. Each is tried by recomputing the loss with that variant
(:func:`tracer.checks.objective.recomputed_per_token_loss`)."""

from __future__ import annotations

import math

import torch

from tracer import formulas
from tracer.checks.comparison import compare
from tracer.checks.context import StepContext
from tracer.checks.finding import INFO, Skip
from tracer.checks.kl_placement import kl_in_reward
from tracer.checks.objective import (
    loss_kl_coef,
    loss_kl_estimator,
    recomputed_per_token_loss,
)

FLIPPED_KL = ("The recorded values match the loss with the KL term's sign flipped ({term} subtracted from "
              "the loss instead of added): the penalty rewards moving away from the reference. ")
KL_FORMS = {"k1": "policy - ref", "k2": "0.5 * (policy - ref)^2", "k3": "exp(ref - policy) - (ref - policy) - 1"}


def flipped_kl_matches(ctx: StepContext, reduce, recorded: torch.Tensor) -> bool:
    """True when ``recorded`` equals ``reduce(per-token loss with the KL term's sign flipped)``."""
    beta = loss_kl_coef(ctx)
    if not beta:
        return False
    try:
        flipped = reduce(recomputed_per_token_loss(ctx, kl_sign=-1.0)).double()
    except Skip:
        return False
    recorded = recorded.double()
    tol = ctx.tol.atol + ctx.tol.loss_rtol * flipped.abs()
    keep = ctx.mask() if recorded.dim() == 2 else torch.ones_like(recorded, dtype=torch.bool)
    return bool((((recorded - flipped).abs() <= tol) | ~keep).all())


KL_TERM_FLOOR = 1e-4  # a token's KL term (coefficient 1) below this gives no reliable coefficient in float32
KL_COEF_SPREAD = 0.01  # the implied coefficients of all tokens within 1 % of their median: one coefficient


def implied_kl_coef(ctx: StepContext, recorded: torch.Tensor) -> tuple[float, int, float, float] | None:
    """The one KL coefficient, other than the recorded one, that explains the recorded per-token loss.

    The GRPO / CISPO / PPO per-token loss is linear in the coefficient: ``base + coef * term``, with
    ``base`` the loss without its KL term and ``term`` the KL term at coefficient 1 (both recomputed
    with :func:`recomputed_per_token_loss`). Each kept token whose term is at least ``KL_TERM_FLOOR``
    gives ``(recorded - base) / term``; when these agree (within ``KL_COEF_SPREAD`` of their median)
    on at least 3 tokens, the median (rounded to 2 significant digits when that still reproduces the
    loss) is the coefficient in effect, provided it differs from the recorded one and the loss
    recomputed with it matches the recorded one under the dtype tolerance. Returns ``(coef, tokens,
    lowest, highest implied value)``, or None. Not tried when the penalty is declared in the rewards."""
    if kl_in_reward(ctx) or not ctx.has("ref_logprobs"):
        return None
    try:
        base = recomputed_per_token_loss(ctx, kl_sign=0.0).double()
        term = recomputed_per_token_loss(ctx, kl_coef=1.0).double() - base
    except Skip:
        return None
    keep = ctx.mask() & torch.isfinite(recorded) & torch.isfinite(term) & (term.abs() >= KL_TERM_FLOOR)
    if int(keep.sum()) < 3:
        return None
    implied = ((recorded.double() - base) / term)[keep]
    median = float(implied.median())
    declared = loss_kl_coef(ctx)
    if not math.isfinite(median) or median == 0.0 or abs(median - declared) <= KL_COEF_SPREAD * abs(median):
        return None
    if float((implied - median).abs().max()) > KL_COEF_SPREAD * abs(median):
        return None
    for coef in dict.fromkeys((float(f"{median:.2g}"), median)):  # a typed value first
        try:
            candidate = recomputed_per_token_loss(ctx, kl_coef=coef)
        except Skip:
            return None
        if not compare(ctx, "recompute.per_token_loss", "per_token_loss", recorded, candidate, ctx.mask(), ""):
            return coef, int(keep.sum()), float(implied.min()), float(implied.max())
    return None


def kl_counted_twice(ctx: StepContext, recorded: torch.Tensor) -> bool:
    """The KL penalty is in the rewards, yet the recorded per-token loss adds a KL term of the same
    coefficient (``kl_coef``, else ``beta``) under one of the estimators."""
    if not kl_in_reward(ctx) or not ctx.has("ref_logprobs"):
        return False
    coef = ctx.kl_coef()
    if coef is None:
        return False
    for estimator in formulas.KL_ESTIMATORS:
        try:
            with_kl = recomputed_per_token_loss(ctx, estimator=estimator, kl_coef=float(coef))
        except Skip:
            return False
        if not compare(ctx, "recompute.per_token_loss", "per_token_loss", recorded, with_kl, ctx.mask(), ""):
            return True
    return False


def matches_without_kl(ctx: StepContext, recorded: torch.Tensor) -> bool:
    """The recorded per-token loss equals the recomputed one with no KL term (a KL coefficient declared)."""
    if not loss_kl_coef(ctx):
        return False
    try:
        bare = recomputed_per_token_loss(ctx, kl_sign=0.0)
    except Skip:
        return False
    return not compare(ctx, "recompute.per_token_loss", "per_token_loss", recorded, bare, ctx.mask(), "")


def estimator_explanation(ctx: StepContext, finding, recorded: torch.Tensor):
    """When the recorded loss follows another KL estimator than the one assumed: an info naming it when
    none is declared (k3 is only the default: k1 and k2 are estimators loops use, OpenRLHF's
    ``kl_estimator``, verl's ``kl`` / ``mse``), else the error with that named."""
    if not loss_kl_coef(ctx) or not ctx.has("ref_logprobs"):
        return finding
    declared = ctx.hyper("kl_estimator", None) or ctx.hyper("kl_loss_type", None)
    assumed = loss_kl_estimator(ctx)
    keep = ctx.mask()
    for other in formulas.KL_ESTIMATORS:
        if other == assumed:
            continue
        try:
            if compare(ctx, "recompute.per_token_loss", "per_token_loss", recorded,
                       recomputed_per_token_loss(ctx, estimator=other), keep, ""):
                continue
        except Skip:
            return finding
        text = (f"The recorded per_token_loss follows the loss with the {other} estimator in its KL term "
                f"({formulas.ref_kl.__module__}.ref_kl: {KL_FORMS[other]}), not {assumed}. ")
        swapped = not compare(ctx, "recompute.per_token_loss", "per_token_loss", recorded,
                              recomputed_per_token_loss(ctx, estimator=formulas.K3_SWAPPED), keep, "")
        if swapped:  # small KLs: k2 and the swapped k3 agree to second order, so the values cannot tell
            finding.message = (text + "It equally follows k3 with its arguments swapped (KL(ref || policy): "
                               "exp(policy - ref) - (policy - ref) - 1), a bug these values cannot tell from "
                               f"{other}: record kl_estimator = {other} if that is the loop's estimator. "
                               + finding.message)
            finding.details.update(kl_estimator_matched=other, kl_k3_swapped_matches=True)
            return finding
        if declared is None:
            return ctx.finding("recompute.per_token_loss", INFO, text + (
                f"No estimator is recorded, and k3 is only the default: record kl_estimator = {other} to say so."),
                finding.sequence, finding.token, field="per_token_loss", kl_estimator=other)
        finding.message = text + f"Metadata declares {declared!r}: the loop or the metadata is wrong. " + finding.message
        finding.details["kl_estimator_matched"] = other
        return finding
    return finding
