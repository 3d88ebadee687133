"""The objective a step declares and the per-token loss it implies, recomputed from the recorded inputs.

Rules (:mod:`tracer.formulas`, SPEC.md section 3): GRPO's clipped surrogate (TRL's ``grpo``,
``bnpo``, ``dr_grpo``, ``dapo``, ``luspo`` losses, with two-sided clipping ``delta``, the bias-corrected
KL and vLLM importance-sampling weights when the metadata says so; per token, or per sequence (GSPO,
``importance_sampling_level = "sequence"``); dual clip when ``clip_ratio_c`` is recorded), CISPO's
clipped-weight REINFORCE and
PPO's clipped surrogate on per-token GAE advantages, each plus ``coef * KL(policy || ref)`` (``beta``,
PPO ``kl_coef``; estimator k3 by default) unless the KL penalty is in the rewards
(:mod:`tracer.checks.kl_placement`). The readers of the settings (TRL's ``loss_type``, the ratio's
level, the dual-clip bound, the importance-sampling correction, the KL term's coefficient and
estimator) are here too: the per-token loss check (:mod:`tracer.checks.per_token_loss`), the loss
reduction (:mod:`tracer.checks.reduction`) and the ratio check (:mod:`tracer.checks.recompute`) share them.

An objective or setting not modelled here (TRL's ``sapo`` / ``vespo`` losses,
``off_policy_mask_threshold``, ``top_entropy_quantile``) is a :func:`tracer.checks.coverage.not_modelled`
skip: the report opens with ``not checked: <it>``.
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.context import StepContext
from tracer.checks.coverage import not_modelled
from tracer.checks.finding import Skip
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
