"""The per-token loss recomputed from the recorded inputs, and the ``recompute.per_token_loss`` check.

Rules (:mod:`tracer.formulas`, SPEC.md section 3): GRPO's clipped surrogate (TRL's ``grpo``,
``bnpo``, ``dr_grpo``, ``dapo``, ``luspo`` losses, with two-sided clipping ``delta``, the bias-corrected
KL and vLLM importance-sampling weights when the metadata says so; per token, or per sequence (GSPO,
``importance_sampling_level = "sequence"``); dual clip when ``clip_ratio_c`` is recorded), CISPO's
clipped-weight REINFORCE and
PPO's clipped surrogate on per-token GAE advantages, each plus ``coef * KL(policy || ref)`` (``beta``,
PPO ``kl_coef``; estimator k3 by default) unless the KL penalty is in the rewards
(:mod:`tracer.checks.kl_placement`).

When the recorded per-token loss disagrees, the check names the likely cause by recomputing the
variants: no KL term, the KL term's sign flipped, the KL counted in both rewards and loss, another
KL estimator (k1, k2, or k3 with swapped arguments), the dual clip missing or applied when not
recorded, the token ratio where the sequence ratio was declared (or the reverse), or other clip
epsilons than the recorded ones. An objective or setting not modelled here (TRL's ``sapo`` / ``vespo``
losses, ``off_policy_mask_threshold``, ``top_entropy_quantile``) is a
:func:`tracer.checks.coverage.not_modelled` skip: the report opens with ``not checked: <it>``.
The scalar loss built from it is :mod:`tracer.checks.reduction`.
"""

from __future__ import annotations

import math
import re

import torch

from tracer import formulas
from tracer.checks.comparison import compare
from tracer.checks.context import StepContext
from tracer.checks.coverage import not_modelled
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, Skip, register
from tracer.checks.kl_placement import kl_in_reward
from tracer.formulas import importance

GRPO_STYLE_TRL_LOSSES = {"grpo", "bnpo", "dr_grpo", "dapo", "luspo"}  # TRL loss_types with the GRPO per-token rule
#: TRL 1.16 loss_types whose per-token loss tracer does not recompute, and why (grpo_trainer.py _compute_loss)
UNMODELLED_TRL_LOSSES = {
    "sapo": "its soft gate sigmoid(τ(r - 1)) · 4/τ replaces the clip (sapo_temperature_pos / _neg)",
    "vespo": "its per-sequence gamma weights (get_gamma_weights, vespo_k_* / vespo_lambda_*) are not modelled",
}
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # TRL 1.16 importance_sampling_level values


def trl_loss_type(ctx: StepContext) -> str | None:
    """TRL's ``loss_type`` as the TRL integration records it (``loss_type``, or ``trl_loss_type``)."""
    return ctx.hyper("loss_type", None) or ctx.hyper("trl_loss_type", None)


def recomputed_per_token_loss(ctx: StepContext, kl_sign: float = 1.0,
                              clip: tuple[float, float] | None = None, estimator: str | None = None,
                              kl_coef: float | None = None, dual_clip: float | None = None,
                              sequence_level: bool | None = None, is_weights: bool = True) -> torch.Tensor:
    """The per-token loss ``[B, T]`` from the recorded inputs (GRPO, CISPO or PPO rule); Skip otherwise.

    PPO: ``-min(r*A, clip(r)*A) + kl_coef * ref_kl_k3`` with per-token GAE advantages
    (:func:`tracer.formulas.ppo_per_token_loss`). ``kl_sign = -1`` flips the KL term (used to name a
    flipped sign when the recorded loss disagrees); ``clip`` = ``(eps_low, eps_high)`` replaces the
    recorded clip epsilons (GRPO and PPO; used to name the epsilons a loss clips with); ``estimator``
    the KL term's estimator (used to name the one a loss uses); ``kl_coef`` the KL term's coefficient
    (used to name a KL penalty the rewards already carry); ``dual_clip`` the dual-clip bound (0: none;
    None: metadata ``clip_ratio_c``) and ``sequence_level`` the ratio's level (None: metadata
    ``importance_sampling_level``), used to name a dual clip or a ratio level the loop did not apply;
    ``is_weights = False`` leaves out the declared importance-sampling correction (used to name weights
    the loop did not apply).
    An objective not modelled is a :func:`tracer.checks.coverage.not_modelled` skip."""
    trl_loss = trl_loss_type(ctx)
    level = importance_sampling_level(ctx)
    for key, off, what in (("off_policy_mask_threshold", None, "TRL's off-policy sequence mask (OPSM)"),
                           ("top_entropy_quantile", 1.0, "TRL's high-entropy token mask")):
        if ctx.hyper(key, off) not in (off,):
            raise not_modelled(f"{key} = {ctx.hyper(key)!r}", f"{what} zeroes tokens of the per-token loss by a rule "
                               "tracer does not recompute; record per_token_loss as the loop computes it to have the "
                               "reduction checked")
    if trl_loss in UNMODELLED_TRL_LOSSES:
        raise not_modelled(f"TRL loss_type {trl_loss!r}", f"{UNMODELLED_TRL_LOSSES[trl_loss]}; the per-token loss is "
                           "not recomputed (record per_token_loss to have its reduction checked)")
    cispo = ctx.algorithm == "cispo" or trl_loss == "cispo"
    ppo = ctx.algorithm == "ppo"
    if not (cispo or ppo) and (ctx.algorithm not in ("grpo", "") or (trl_loss and trl_loss not in GRPO_STYLE_TRL_LOSSES)):
        raise not_modelled(f"the {ctx.algorithm!r} objective (loss_type {trl_loss!r})",
                           "no per-token loss rule in tracer.formulas; record per_token_loss")
    if level == "sequence" and (cispo or ppo):
        raise not_modelled(f"importance_sampling_level 'sequence' with {'CISPO' if cispo else 'PPO'}",
                           "the sequence ratio is modelled for the clipped GRPO surrogate (GSPO) only")
    policy, advantages = ctx.require("policy_logprobs", "advantages")
    old = ctx.old_logprobs()
    beta = loss_kl_coef(ctx) if kl_coef is None else kl_coef
    estimator = estimator or (loss_kl_estimator(ctx) if beta else "k3")
    ref = ctx.tensor("ref_logprobs") if beta and ctx.has("ref_logprobs") else None
    if beta and ref is None:
        raise Skip(f"{'kl_coef' if ppo else 'beta'} > 0 but no ref_logprobs recorded")
    weighted = bool(ctx.hyper("use_bias_correction_kl", False))  # TRL: k3 times the ratio
    sampler_weights = None
    if is_weights and corrects_pg_term(ctx):  # TRL and the explicit API: the pg term times the capped IS weights
        sampler_weights = applied_is_weights(ctx, old)
    if cispo:
        return formulas.cispo_per_token_loss(policy, old, advantages, ctx.cispo_ratio_max(), kl_sign * beta, ref,
                                             weighted, sampler_weights, estimator)
    if clip is not None:
        eps_low, eps_high = clip
    else:
        eps_high = float(ctx.hyper("clip_epsilon_high"))
        eps_low = float(ctx.hyper("clip_epsilon_low", eps_high))
    c = dual_clip_c(ctx) if dual_clip is None else (dual_clip or None)
    if ppo:
        if advantages.dim() != 2:
            raise Skip("PPO advantages are per sequence here; the PPO loss rule needs per-token GAE advantages")
        return formulas.ppo_per_token_loss(policy, old, advantages, eps_low, eps_high, kl_sign * beta, ref, estimator, c)
    delta = ctx.hyper("delta", None)  # TRL's two-sided clipping (its grpo-style losses only; not CISPO's)
    level = level if sequence_level is None else ("sequence" if sequence_level else "token")
    return formulas.grpo_per_token_loss(policy, old, advantages, eps_low, eps_high, kl_sign * beta, ref, weighted,
                                        sampler_weights, None if delta is None else float(delta), estimator, c,
                                        ctx.mask() if level == "sequence" else None)


def corrects_pg_term(ctx: StepContext) -> bool:
    """True when the step declares an importance-sampling correction that multiplies the clipped
    policy-gradient term (TRL's placement, ``grpo_trainer.py``): metadata ``is_correction`` (the explicit
    API's name), else TRL's ``vllm_importance_sampling_correction`` (the order
    :func:`tracer.formulas.importance.declared_correction` reads them in). verl's ``rollout_is`` acts
    on its registered policy losses (``recompute.verl_policy_loss``), not here."""
    declared = ctx.hyper("is_correction", None)
    declared = ctx.hyper("vllm_importance_sampling_correction", False) if declared is None else declared
    return bool(declared)


def applied_is_weights(ctx: StepContext, old: torch.Tensor) -> torch.Tensor:
    """The importance-sampling weights the loss multiplies its policy-gradient term by (TRL's
    ``vllm_importance_sampling_correction``): the recorded ``is_weights`` ``[B, T]`` / ``sequence_is_weights``
    ``[B]``; else derived from ``old`` and the recorded ``sampler_logprobs`` under the declared mode and caps
    (:func:`tracer.formulas.importance.declared_correction`). A :func:`not_modelled` skip when neither can be had."""
    if ctx.has("is_weights") or ctx.has("sequence_is_weights"):
        return ctx.tensor("is_weights" if ctx.has("is_weights") else "sequence_is_weights")
    what = "vLLM importance-sampling correction (vllm_importance_sampling_correction)"
    try:
        correction = importance.declared_correction(lambda key: ctx.hyper(key, None))
    except ValueError as err:
        raise not_modelled(what, f"{err}; the IS weights the loss applies are not recorded either, so the loss is "
                           "not recomputed") from None
    if correction is None or not ctx.has("sampler_logprobs"):
        raise not_modelled(what, "the IS weights the loss applies are not recorded, nor sampler_logprobs to derive "
                           "them from; record is_weights [B, T] (or sequence_is_weights [B]), or sampler_logprobs "
                           "with the mode and caps")
    return correction.weights(old, ctx.tensor("sampler_logprobs"), ctx.mask().to(old.dtype))


def importance_sampling_level(ctx: StepContext) -> str:
    """Metadata ``importance_sampling_level`` (TRL's GRPOConfig; ``token`` when not recorded): ``token``
    or ``sequence`` (GSPO); a :func:`not_modelled` skip for another value."""
    level = str(ctx.hyper("importance_sampling_level", "token") or "token")
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise not_modelled(f"importance_sampling_level {level!r}", "tracer models 'token' and 'sequence' (GSPO); the "
                           "ratio, clip fractions and per-token loss are not recomputed")
    return level


def dual_clip_c(ctx: StepContext) -> float | None:
    """Dual-clip PPO's bound: metadata ``clip_ratio_c`` (verl's name; > 1), None when not recorded.
    Raises Skip for a recorded value that is no bound above 1 (verl asserts ``clip_ratio_c > 1``)."""
    value = ctx.hyper("clip_ratio_c", None)
    if value is None or isinstance(value, bool):
        return None
    try:
        c = float(value)
    except (TypeError, ValueError):
        raise Skip(f"metadata clip_ratio_c = {value!r} is not a number") from None
    if not c > 1.0:
        raise Skip(f"metadata clip_ratio_c = {c:g}: dual-clip PPO needs a bound > 1")
    return c


def loss_kl_coef(ctx: StepContext) -> float:
    """The coefficient of the loss's reference-KL term: ``kl_coef`` (PPO) or ``beta``; 0 when the
    penalty is in the rewards (:func:`kl_in_reward`)."""
    if kl_in_reward(ctx):
        return 0.0
    return float(ctx.hyper("kl_coef" if ctx.algorithm == "ppo" else "beta", 0.0) or 0.0)


def loss_kl_estimator(ctx: StepContext, default: str = "k3") -> str:
    """Metadata ``kl_estimator`` (k1 / k2 / k3, or verl's ``kl`` / ``mse`` / ``low_var_kl``; else
    verl's ``kl_loss_type`` as its integration records it), ``default`` when neither is recorded. verl's
    straight-through names (``k3+``, ``low_var_kl+``, ...) have the value of the estimator they name (only
    the gradient is k2's: verl 0.9.1 ``core_algos.kl_penalty``), so they are read as it. A
    :func:`not_modelled` skip for an estimator tracer.formulas does not have (verl's ``abs``, ``full``)."""
    name = str(ctx.hyper("kl_estimator", None) or ctx.hyper("kl_loss_type", None) or default)
    try:
        return formulas.kl_estimator_name(name.removesuffix("+"))
    except ValueError as err:
        raise not_modelled(f"KL estimator {name!r}", f"{err}; the loss's KL term is not recomputed") from None


def kl_term_name(ctx: StepContext) -> str:
    kind = loss_kl_estimator(ctx)
    return f"{'kl_coef' if ctx.algorithm == 'ppo' else 'beta'} * {'ref_kl_k3' if kind == 'k3' else kind}"


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


def _implied_clip(ctx: StepContext, recorded: torch.Tensor) -> tuple[float, float, set[str]] | None:
    """The clip epsilons ``(low, high, unbound_sides)`` the recorded per-token loss follows when they are
    not the recorded ones (GRPO / PPO clipped surrogate), else None. Where the clip binds, the recorded
    value is ``-(1 + eps_high) * A + kl`` (A > 0) or ``-(1 - eps_low) * A + kl`` (A < 0), so each
    disagreeing token names an epsilon; the largest named one on each side is tried (tokens the loop
    leaves unclipped only bound it from below), and kept when the whole loss then agrees. A side where
    the recorded clip would bind but the recorded values are the unclipped ones (a typo such as
    ``1 + 2.0`` for ``1 + 0.2`` with no ratio beyond 3) is unbound: its epsilon is only known to be at
    least the largest (high) or smallest (low) ratio's distance from 1, which is returned."""
    if ctx.algorithm == "cispo" or trl_loss_type(ctx) == "cispo" or ctx.hyper("delta", None) is not None:
        return None
    try:
        eps_high = float(ctx.hyper("clip_epsilon_high"))
        eps_low = float(ctx.hyper("clip_epsilon_low", eps_high))
        unclipped = recomputed_per_token_loss(ctx, clip=(float("inf"), float("inf"))).double()
        advantages = ctx.tensor("advantages").double()
        r = formulas.ratio(ctx.tensor("policy_logprobs"), ctx.old_logprobs()).double()
    except Skip:
        return None
    if corrects_pg_term(ctx):
        return None
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    keep, value = ctx.mask(), recorded.double()
    kl = unclipped + r * adv  # the KL term (0 without one)
    off = ((value - unclipped).abs() > ctx.tol.atol + ctx.tol.rtol * unclipped.abs()) & keep & torch.isfinite(value)
    off_high, off_low = off & (adv > 0), off & (adv < 0)
    named_high = ((kl - value) / adv - 1)[off_high]
    named_low = (1 - (kl - value) / adv)[off_low]
    unbound = set()
    high = float(named_high.max()) if named_high.numel() else eps_high
    low = float(named_low.max()) if named_low.numel() else eps_low
    high, low = (float(f"{x:.4g}") for x in (high, low))
    free_high = keep & ~off & (adv > 0) & (r > 1 + eps_high)  # the recorded clip binds here, the loop's did not
    free_low = keep & ~off & (adv < 0) & (r < 1 - eps_low)
    if not named_high.numel() and bool(free_high.any()):
        high, unbound = float((r - 1)[free_high].max()), unbound | {"high"}
    if not named_low.numel() and bool(free_low.any()):
        low, unbound = min(float((1 - r)[free_low].max()), 1.0), unbound | {"low"}
    if (low, high) == (eps_low, eps_high) or not (0 <= low <= 1 and high >= 0):
        return None
    try:
        implied = recomputed_per_token_loss(ctx, clip=(math.inf if "low" in unbound else low,
                                                       math.inf if "high" in unbound else high)).double()
    except Skip:
        return None
    tol = ctx.tol.atol + ctx.tol.rtol * implied.abs()
    return (low, high, unbound) if bool((((value - implied).abs() <= tol) | ~keep).all()) else None


def _config_keys_holding(ctx: StepContext, value: float) -> list[str]:
    """Names in the manifest's ``config`` (a zero-edit capture keeps the script's argparse namespace
    there) that name a clip range (``eps`` or ``clip`` in the name) and whose number is ``value`` to
    4 significant digits (``steps = 2`` is no clip bound)."""
    config = ctx.trace.manifest.get("config")
    if not isinstance(config, dict):
        return []
    return [str(k) for k, v in config.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and any(w.startswith(("eps", "clip")) for w in re.split(r"[\W_]+", str(k).lower())) and math.isfinite(v)
            and float(f"{float(v):.4g}") == value]


def _clip_explanation(ctx: StepContext, finding, recorded: torch.Tensor):
    """Rewrite ``finding`` when the recorded loss follows other clip epsilons than the recorded ones:
    name them (and the config keys holding them); an info when a zero-edit capture read the epsilons
    by the name map and the script's config holds the implied ones under a name of their side (the
    map read the wrong variable: DAPO's ``epsilon_high`` beside ``epsilon``), else the error, explained."""
    implied = _implied_clip(ctx, recorded)
    if implied is None:
        return finding
    low, high, unbound = implied
    eps_high = float(ctx.hyper("clip_epsilon_high"))
    eps_low = float(ctx.hyper("clip_epsilon_low", eps_high))
    parts, named_all = [], True
    for side, now, was in (("low", low, eps_low), ("high", high, eps_high)):
        if side in unbound:
            parts.append(f"clip_epsilon_{side} ≥ {now:.4g} (the {'upper' if side == 'high' else 'lower'} clip binds "
                         f"on no token: the {'largest' if side == 'high' else 'smallest'} ratio with A "
                         f"{'>' if side == 'high' else '<'} 0 is {1 + now if side == 'high' else 1 - now:.4g}), not the "
                         f"recorded {was:g}")
            named_all = False
            continue
        if now == was:
            continue
        keys = _config_keys_holding(ctx, now)
        named_all &= any(side in k.lower() for k in keys)
        where = f" (config {', '.join(keys)})" if keys else ""
        parts.append(f"clip_epsilon_{side} = {now:g}{where}, not the recorded {was:g}")
    shown_low, shown_high = (f"{1 - low:.4g}" if "low" not in unbound else f"≤ {1 - low:.4g}",
                             f"{1 + high:.4g}" if "high" not in unbound else f"≥ {1 + high:.4g}")
    text = (f"clip range: the recorded per_token_loss follows the clipped surrogate with {' and '.join(parts)} "
            f"(ratio clipped to [{shown_low}, {shown_high}] instead of [{1 - eps_low:.4g}, {1 + eps_high:.4g}]) on "
            f"every kept token: the loop clips with other epsilons than the step metadata says. ")
    config = ctx.trace.manifest.get("config") if isinstance(ctx.trace.manifest.get("config"), dict) else {}
    if named_all and config.get("trainer") == "tracer.watch":
        return ctx.finding("recompute.per_token_loss", INFO, text + (
            "The zero-edit capture read the epsilons by its name map, and the script's config names the implied "
            "ones: record those (tracer run --meta clip_epsilon_high=..., or map the variable under [metadata] "
            "clip_epsilon_high / clip_epsilon_low in --map), and the loss checks use them."),
            finding.sequence, finding.token, field="per_token_loss", implied_clip_epsilon_low=low,
            implied_clip_epsilon_high=high)
    finding.message = text + finding.message
    finding.details.update(implied_clip_epsilon_low=low, implied_clip_epsilon_high=high,
                           clip_unbound=sorted(unbound))
    return finding


FLIPPED_KL = ("The recorded values match the loss with the KL term's sign flipped ({term} subtracted from "
              "the loss instead of added): the penalty rewards moving away from the reference. ")


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
    objective = _objective_explanation(ctx, recorded)
    if objective is not None:
        findings[0].message = objective[0] + findings[0].message
        findings[0].details.update(objective[1])
    elif _matches_without_kl(ctx, recorded):  # before the flipped sign: a tiny KL term fits either way
        findings[0].message = (
            f"The recorded per_token_loss matches the loss without its KL term ({kl_term_name(ctx)}): the "
            "loop adds no reference-KL penalty to the loss. If it puts the penalty in the rewards (InstructGPT, "
            "OpenRLHF), record kl_in_reward = true (this run's token_rewards do not show it: not recorded, or "
            "old == ref); otherwise the penalty its kl_coef / beta declares is missing. " + findings[0].message)
        findings[0].details["matches_without_kl"] = True
    elif flipped_kl_matches(ctx, lambda ptl: ptl, recorded):
        findings[0].message = FLIPPED_KL.format(term=kl_term_name(ctx)) + findings[0].message
        findings[0].details["kl_sign_flipped"] = True
    elif (implied := _implied_kl_coef(ctx, recorded)) is not None:
        coef, n_tokens, low, high = implied
        declared = loss_kl_coef(ctx)
        name = "kl_coef" if ctx.algorithm == "ppo" else "beta"
        findings[0].message = (
            f"KL coefficient: the recorded per_token_loss follows the loss with its {kl_term_name(ctx).split(' * ')[-1]} "
            f"term weighted by {coef:g}, not the recorded {name} {declared:g}: (recorded − the loss without its KL "
            f"term) / the KL term is {low:.4g}..{high:.4g} on all {n_tokens} kept tokens whose KL term is not 0, "
            f"and the loss recomputed with {coef:g} matches. " + findings[0].message)
        findings[0].details.update(cause="kl_coef", implied_kl_coef=coef, declared_kl_coef=declared)
    elif _kl_counted_twice(ctx, recorded):
        findings[0].message = (
            "The recorded per_token_loss matches the loss with a KL term added, while the KL penalty is in the "
            "rewards (metadata kl_in_reward, or the recorded token_rewards show it): the penalty is counted "
            "twice, in the rewards and in the loss. Likely fix: keep one of them (verl: use_kl_in_reward or "
            "use_kl_loss), or record the loss's own coefficient if both are meant. " + findings[0].message)
        findings[0].details["kl_counted_twice"] = True
    else:
        findings[0] = _estimator_explanation(ctx, findings[0], recorded)
        if findings[0].severity == ERROR:
            findings[0] = _clip_explanation(ctx, findings[0], recorded)
    return findings


def _matches(ctx: StepContext, recorded: torch.Tensor, **variant) -> bool:
    """The recorded per-token loss equals the one recomputed with ``variant`` (keywords of
    :func:`recomputed_per_token_loss`) under the dtype tolerance; False when it cannot be recomputed."""
    try:
        other = recomputed_per_token_loss(ctx, **variant)
    except Skip:
        return False
    return not compare(ctx, "recompute.per_token_loss", "per_token_loss", recorded, other, ctx.mask(), "")


def _objective_explanation(ctx: StepContext, recorded: torch.Tensor) -> tuple[str, dict] | None:
    """The objective's term at fault, when the recorded per-token loss is another objective than the
    recorded settings say: the declared importance-sampling weights not applied, the dual clip
    (``clip_ratio_c``) missing, or the ratio's level (token vs sequence, GSPO). Returns ``(the message's opening, details)`` or None."""
    if corrects_pg_term(ctx) and _matches(ctx, recorded, is_weights=False):
        weights = applied_is_weights(ctx, ctx.old_logprobs()).double()
        name = "is_weights" if ctx.has("is_weights") else "sequence_is_weights" if ctx.has("sequence_is_weights") \
            else "derived IS weights"
        keep = ctx.mask() if weights.dim() == 2 else ctx.mask().any(dim=1)
        off = keep & ~torch.isclose(weights, torch.ones_like(weights), rtol=1e-3, atol=1e-6)  # sampler.is_weights' rule
        text = (f"IS weights not applied: the recorded per_token_loss is the clipped surrogate without the "
                f"importance-sampling weights ({name}; {int(off.sum())} of {int(keep.sum())} kept "
                f"{'tokens' if weights.dim() == 2 else 'rows'} ≠ 1, mean {float(weights[keep].mean()):.4f}), while "
                "the step declares the correction (is_correction / vllm_importance_sampling_correction): the loss "
                "ignores the sampler/trainer correction. ")
        return text, {"cause": "is_weights_not_applied", "weights_not_one": int(off.sum())}
    if ctx.algorithm == "cispo" or trl_loss_type(ctx) == "cispo":
        return None
    c = dual_clip_c(ctx)
    if c is not None and _matches(ctx, recorded, dual_clip=0.0):
        r = formulas.ratio(ctx.tensor("policy_logprobs"), ctx.old_logprobs())
        adv = ctx.tensor("advantages")
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        binds = ctx.mask() & (adv < 0) & (r > c)  # (B, T) where the dual clip caps the loss
        largest = float(r[binds].max()) if bool(binds.any()) else float("nan")
        text = (f"dual clip missing: the recorded per_token_loss is the clipped surrogate without the dual clip, "
                f"while clip_ratio_c = {c:g} is recorded: on {int(binds.sum())} kept tokens with A < 0 and ratio > "
                f"{c:g} (largest ratio there {largest:.4g}) the loss should be capped at -{c:g}·A (dual-clip PPO, "
                "tracer.formulas.dual_clip). ")
        return text, {"cause": "dual_clip_missing", "clip_ratio_c": c, "tokens_beyond_c": int(binds.sum())}
    level = importance_sampling_level(ctx)
    if not _matches(ctx, recorded, sequence_level=level != "sequence"):
        return None
    if level == "sequence":
        text = ("ratio level: the recorded per_token_loss follows the per-token ratio exp(policy − old), while "
                "importance_sampling_level = 'sequence' (GSPO) is recorded: the loop does not clip one ratio per "
                "sequence, exp(masked mean of policy − old). ")
        return text, {"cause": "token_ratio_under_sequence_level"}
    text = ("ratio level: the recorded per_token_loss follows GSPO's sequence ratio exp(masked mean of policy − old), "
            "while importance_sampling_level is 'token' (or not recorded): record importance_sampling_level = "
            "'sequence' if GSPO is meant. ")
    return text, {"cause": "sequence_ratio_under_token_level"}


KL_TERM_FLOOR = 1e-4  # a token's KL term (coefficient 1) below this gives no reliable coefficient in float32
KL_COEF_SPREAD = 0.01  # the implied coefficients of all tokens within 1 % of their median: one coefficient


def _implied_kl_coef(ctx: StepContext, recorded: torch.Tensor) -> tuple[float, int, float, float] | None:
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


def _kl_counted_twice(ctx: StepContext, recorded: torch.Tensor) -> bool:
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


def _matches_without_kl(ctx: StepContext, recorded: torch.Tensor) -> bool:
    """The recorded per-token loss equals the recomputed one with no KL term (a KL coefficient declared)."""
    if not loss_kl_coef(ctx):
        return False
    try:
        bare = recomputed_per_token_loss(ctx, kl_sign=0.0)
    except Skip:
        return False
    return not compare(ctx, "recompute.per_token_loss", "per_token_loss", recorded, bare, ctx.mask(), "")


def _estimator_explanation(ctx: StepContext, finding, recorded: torch.Tensor):
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


KL_FORMS = {"k1": "policy - ref", "k2": "0.5 * (policy - ref)^2", "k3": "exp(ref - policy) - (ref - policy) - 1"}
