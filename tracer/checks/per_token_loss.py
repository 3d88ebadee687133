"""The ``recompute.per_token_loss`` check: the recorded per-token loss against the one the declared
objective gives (:mod:`tracer.checks.objective`: GRPO / GSPO / CISPO / PPO, dual clip, importance-sampling
weights, the KL term); on a verl worker file, verl's registered policy loss
(:func:`tracer.checks.effective_config.verl_pg_losses_findings`).

When the recorded per-token loss disagrees, the check names the likely cause by recomputing the
variants, in this order: an optional term of the objective left out or added
(:mod:`tracer.checks.objective_terms`: the declared IS weights not applied, the dual clip missing, the
token ratio where the sequence ratio was declared or the reverse); the KL term
(:mod:`tracer.checks.kl_term`: missing, sign flipped, another coefficient, counted in both rewards and
loss, another estimator); other clip epsilons than the recorded ones (:mod:`tracer.checks.clip_range`).
The scalar loss built from it is :mod:`tracer.checks.reduction`.
"""

from __future__ import annotations

from tracer.checks.clip_range import clip_explanation
from tracer.checks.comparison import compare
from tracer.checks.context import StepContext
from tracer.checks.finding import ERROR, RL_ALGORITHMS, Skip, register
from tracer.checks.kl_placement import kl_placement
from tracer.checks.kl_term import (
    FLIPPED_KL,
    estimator_explanation,
    flipped_kl_matches,
    implied_kl_coef,
    kl_counted_twice,
    matches_without_kl,
)

# the objective's readers and rule, imported from here by reduction, loss_hypotheses and recompute
from tracer.checks.objective import (
    dual_clip_c,
    importance_sampling_level,
    kl_term_name,
    loss_kl_coef,
    recomputed_per_token_loss,
    trl_loss_type,
)
from tracer.checks.objective_terms import objective_term_at_fault

__all__ = ["check_per_token_loss", "dual_clip_c", "importance_sampling_level", "kl_term_name", "loss_kl_coef",
           "recomputed_per_token_loss", "trl_loss_type"]


@register("recompute.per_token_loss", "recorded per_token_loss == the GRPO/CISPO/PPO per-token loss from the "
          "recorded inputs (GSPO's sequence ratio, dual clip; verl: verl_pg_losses == the registered policy loss)",
          RL_ALGORITHMS)
def check_per_token_loss(ctx: StepContext):
    if "per_token_loss" not in ctx.data and "verl_pg_losses" in ctx.data:  # a verl worker file: its policy loss
        # imported here: effective_config's checks register after this module's (the order checks run in)
        from tracer.checks.effective_config import verl_pg_losses_findings

        return verl_pg_losses_findings(ctx)
    (recorded,) = ctx.require("per_token_loss")
    findings = compare(ctx, "recompute.per_token_loss", "per_token_loss", recorded, recomputed_per_token_loss(ctx),
                       ctx.mask(), f"the {ctx.algorithm or 'grpo'} per-token loss (tracer.formulas)")
    if not findings:
        return findings
    objective = objective_term_at_fault(ctx, recorded)
    if objective is not None:
        findings[0].message = objective[0] + findings[0].message
        findings[0].details.update(objective[1])
    elif matches_without_kl(ctx, recorded):  # before the flipped sign: a tiny KL term fits either way
        if kl_placement(ctx) is None:  # a penalty in the rewards, undeclared, explains it as well as a bug
            raise Skip(f"the recorded per_token_loss has no KL term ({kl_term_name(ctx)}) and no step file's "
                       "token_rewards can show whether the penalty is in the rewards instead (old == ref on every "
                       "kept token, as at a run's first rollout): record kl_in_reward = true or false to judge it")
        findings[0].message = (
            f"The recorded per_token_loss matches the loss without its KL term ({kl_term_name(ctx)}): the "
            "loop adds no reference-KL penalty to the loss. If it puts the penalty in the rewards (InstructGPT, "
            "OpenRLHF), record kl_in_reward = true (this run's token_rewards do not show it: not recorded, or "
            "old == ref); otherwise the penalty its kl_coef / beta declares is missing. " + findings[0].message)
        findings[0].details["matches_without_kl"] = True
    elif flipped_kl_matches(ctx, lambda ptl: ptl, recorded):
        findings[0].message = FLIPPED_KL.format(term=kl_term_name(ctx)) + findings[0].message
        findings[0].details["kl_sign_flipped"] = True
    elif (implied := implied_kl_coef(ctx, recorded)) is not None:
        coef, n_tokens, low, high = implied
        declared = loss_kl_coef(ctx)
        name = "kl_coef" if ctx.algorithm == "ppo" else "beta"
        findings[0].message = (
            f"KL coefficient: the recorded per_token_loss follows the loss with its {kl_term_name(ctx).split(' * ')[-1]} "
            f"term weighted by {coef:g}, not the recorded {name} {declared:g}: (recorded − the loss without its KL "
            f"term) / the KL term is {low:.4g}..{high:.4g} on all {n_tokens} kept tokens whose KL term is not 0, "
            f"and the loss recomputed with {coef:g} matches. " + findings[0].message)
        findings[0].details.update(cause="kl_coef", implied_kl_coef=coef, declared_kl_coef=declared)
    elif kl_counted_twice(ctx, recorded):
        findings[0].message = (
            "The recorded per_token_loss matches the loss with a KL term added, while the KL penalty is in the "
            "rewards (metadata kl_in_reward, or the recorded token_rewards show it): the penalty is counted "
            "twice, in the rewards and in the loss. Likely fix: keep one of them (verl: use_kl_in_reward or "
            "use_kl_loss), or record the loss's own coefficient if both are meant. " + findings[0].message)
        findings[0].details["kl_counted_twice"] = True
    else:
        findings[0] = estimator_explanation(ctx, findings[0], recorded)
        if findings[0].severity == ERROR:
            findings[0] = clip_explanation(ctx, findings[0], recorded)
    return findings
