"""Recompute (SPEC.md section 6): derived tensors recomputed with :mod:`tracer.formulas` from the
recorded inputs and compared with what the trainer recorded: ratio, ref_kl_k3, approx_kl_k2,
advantages, PPO's token rewards when the KL penalty is in the reward, clip fractions and DPO terms.

Each check gives the error finding of :func:`tracer.checks.comparison.compare` where recorded and
recomputed values differ. The advantage rules are in :mod:`tracer.checks.advantage_rules`, where the
KL penalty sits in :mod:`tracer.checks.kl_placement`, the per-token loss in
:mod:`tracer.checks.per_token_loss` and the scalar loss in :mod:`tracer.checks.reduction`.
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.advantage_rules import advantage_rule_findings
from tracer.checks.comparison import Variant, compare, compare_with_variants
from tracer.checks.context import StepContext, check_memo, loss_scales
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, Skip, not_applicable, register
from tracer.checks.kl_placement import kl_in_reward, reward_kl
from tracer.checks.per_token_loss import importance_sampling_level
from tracer.formulas.logprobs import approx_kl_k2_variants, ratio_variants, ref_kl_k3_variants
from tracer.formulas.losses import sequence_ratio

CLIP_FRACTION_ATOL = 1e-3  # recorded vs recomputed clip fraction (a share of kept tokens)


@register("recompute.ratio", "recorded ratio == exp(policy - old) (GSPO: exp of the masked mean per sequence); names the variant (inverted, exp not applied "
          "or applied twice, logprobs divided) that reproduces a wrong one", RL_ALGORITHMS)
def check_ratio(ctx: StepContext):
    level = importance_sampling_level(ctx)
    ratio, policy = ctx.require_recorded("ratio", "policy_logprobs")
    old = ctx.old_logprobs()
    if level == "sequence" and (ratio.dim() == 1 or ratio.shape[-1] == 1 or compare(
            ctx, "recompute.ratio", "ratio", ratio, formulas.ratio(policy, old), ctx.mask(), "")):
        return _check_sequence_ratio(ctx, ratio, policy, old)
    wrong = ratio_variants(policy, old)
    return compare_with_variants(ctx, "recompute.ratio", "ratio", ratio, formulas.ratio(policy, old), ctx.mask(),
                                 "exp(policy − old)", [
                                     Variant("ratio inverted", "exp(old − policy)", wrong["inverted"]),
                                     Variant("exp not applied (the log ratio recorded as the ratio)", "policy − old",
                                             wrong["log_ratio"]),
                                     Variant("exp applied twice", "exp(exp(policy − old))", wrong["exp_twice"]),
                                     Variant("logprobs divided as if they were probabilities", "policy / old",
                                             wrong["logprob_quotient"])])


def _check_sequence_ratio(ctx: StepContext, ratio: torch.Tensor, policy: torch.Tensor, old: torch.Tensor):
    """GSPO (``importance_sampling_level = "sequence"``): a recorded ratio of one value per row (``[B]``,
    ``[B, 1]``, or ``[B, T]`` repeated over the row's tokens) against ``exp`` of the masked mean log-ratio."""
    keep = ctx.mask()
    expected = sequence_ratio(policy, old, keep)  # (B,)
    formula = "exp(masked mean of policy − old) per sequence (GSPO, tracer.formulas.losses.sequence_ratio)"
    if ratio.dim() == 2 and ratio.shape[-1] != 1:
        return compare(ctx, "recompute.ratio", "ratio", ratio, expected.unsqueeze(1).expand_as(ratio), keep, formula)
    rows = keep.any(dim=1)  # (B,) a row that keeps no token has no ratio to compare
    return compare(ctx, "recompute.ratio", "ratio", ratio.reshape(-1, 1), expected.unsqueeze(1), rows.unsqueeze(1),
                   formula)


@register("recompute.ref_kl_k3", "recorded ref_kl_k3 == exp(ref - policy) - (ref - policy) - 1; names the variant "
          "(arguments swapped, k1 or k2 stored as k3) that reproduces a wrong one", RL_ALGORITHMS)
def check_ref_kl_k3(ctx: StepContext):
    k3, policy, ref = ctx.require_recorded("ref_kl_k3", "policy_logprobs", "ref_logprobs")
    wrong = ref_kl_k3_variants(policy, ref)
    return compare_with_variants(ctx, "recompute.ref_kl_k3", "ref_kl_k3", k3, formulas.ref_kl_k3(policy, ref),
                                 ctx.mask(), "exp(ref − policy) − (ref − policy) − 1", [
                                     Variant("k3 arguments swapped (KL(ref ‖ policy), not KL(policy ‖ ref))",
                                             "exp(policy − ref) − (policy − ref) − 1", wrong["swapped"]),
                                     Variant("k1 stored under the k3 name", "policy − ref", wrong["k1"]),
                                     Variant("k2 stored under the k3 name", "0.5·(policy − ref)²", wrong["k2"])])


@register("recompute.approx_kl_k2", "recorded approx_kl_k2 == 0.5 * (policy - old)^2; names the variant (0.5 "
          "missing, k1 or k3 stored as k2) that reproduces a wrong one", RL_ALGORITHMS)
def check_approx_kl_k2(ctx: StepContext):
    k2, policy = ctx.require_recorded("approx_kl_k2", "policy_logprobs")
    old = ctx.old_logprobs()
    wrong = approx_kl_k2_variants(policy, old)
    return compare_with_variants(ctx, "recompute.approx_kl_k2", "approx_kl_k2", k2, formulas.approx_kl_k2(policy, old),
                                 ctx.mask(), "0.5·(policy − old)²", [
                                     Variant("k2 missing its 0.5", "(policy − old)²", wrong["no_half"]),
                                     Variant("k1 stored under the k2 name", "policy − old", wrong["k1"]),
                                     Variant("k3 stored under the k2 name", "exp(policy − old) − (policy − old) − 1",
                                             wrong["k3"])])


# the rule recomputation lives with the group and rule helpers the advantages family shares
check_advantages = register(
    "recompute.advantages", "recorded advantages == the declared or a known advantage rule (group z-score / group "
    "mean / RLOO / GAE raw or whitened) recomputed from rewards", RL_ALGORITHMS)(advantage_rule_findings)


@register("recompute.token_rewards", "PPO with the KL in the reward (kl_in_reward): recorded token_rewards == "
          "-kl_coef * KL(old || ref) on each kept token + the sequence reward on the last one", {"ppo", ""})
def check_token_rewards(ctx: StepContext):
    if not kl_in_reward(ctx):
        raise not_applicable("the KL penalty is in the loss (metadata kl_in_reward not set, and token_rewards carry "
                             "no KL penalty): token_rewards hold the sequence reward alone "
                             "(advantages.reward_placement checks it)")
    token_rewards, rewards, ref = ctx.require("token_rewards", "rewards", "ref_logprobs")
    old = ctx.old_logprobs()
    found = reward_kl(ctx)
    if found is None:
        raise Skip("kl_in_reward is set but neither kl_coef nor beta is recorded (or it is 0)")
    coef, estimator = found
    if not ctx.hyper("kl_estimator", None):  # the one the run's token rewards follow, when found
        estimator = check_memo(ctx.trace, "reward_kl_estimator").get("value", estimator)
    keep = ctx.mask()
    formula = (f"-kl_coef * {estimator}(old, ref) + the sequence reward on the last kept token "
               f"(tracer.formulas.kl_reward_token_rewards, kl_coef {coef:g})")
    findings = compare(ctx, "recompute.token_rewards", "token_rewards", token_rewards,
                       formulas.kl_reward_token_rewards(rewards, old, ref, keep, coef, estimator), keep, formula)
    if findings and not compare(ctx, "recompute.token_rewards", "token_rewards", token_rewards,
                                formulas.kl_reward_token_rewards(rewards, old, ref, keep, -coef, estimator),
                                keep, formula):
        findings[0].message = (f"The recorded token_rewards match the KL penalty with its sign flipped (+kl_coef * "
                               f"{estimator} instead of -kl_coef * {estimator}): the reward pays the policy for "
                               "moving away from the reference. " + findings[0].message)
        findings[0].details["kl_sign_flipped"] = True
    elif findings:
        findings[0].message = ("Per-token reward terms besides the KL penalty and the sequence reward (a length "
                               "penalty, format shaping) are not modelled: a loop that adds them fails this check "
                               "by design. " + findings[0].message)
    if not findings and ctx.flag("kl_in_reward") is None:  # found in the values (kl_in_reward)
        return [ctx.finding("recompute.token_rewards", INFO, f"token_rewards = {formula}: the KL penalty is in the "
                            "rewards, not the loss, so the loss checks expect no KL term. Record metadata "
                            f"kl_in_reward = true{'' if estimator == 'k1' else f' and kl_estimator = {estimator}'} "
                            "to say so.", field="token_rewards", kl_in_reward=True, kl_estimator=estimator)]
    return findings


@register("recompute.clip_fractions", "clip fractions (low / high / region, sign-aware; per sequence under "
          "GSPO) recomputed and compared with metadata clip_fraction_* when recorded", {"ppo", "grpo", ""})
def check_clip_fractions(ctx: StepContext):
    level = importance_sampling_level(ctx)
    (policy,) = ctx.require("policy_logprobs")
    (advantages,) = ctx.require("advantages")
    eps_high = float(ctx.hyper("clip_epsilon_high"))
    eps_low = float(ctx.hyper("clip_epsilon_low", eps_high))
    keep = ctx.mask()
    if level == "sequence":  # GSPO clips one ratio per sequence: shares of all the rows (TRL 1.16 global_masked_mean)
        if advantages.dim() != 1:
            raise Skip("importance_sampling_level 'sequence' with per-token advantages: GSPO's advantage is one "
                       "per sequence")
        r = sequence_ratio(policy, ctx.old_logprobs(), keep).unsqueeze(1)  # (B, 1)
        keep = torch.ones_like(r, dtype=torch.bool)
    else:
        r = formulas.ratio(policy, ctx.old_logprobs())
    fractions = {k: float(v) for k, v in formulas.clip_fractions(r, advantages, keep, eps_low, eps_high).items()}
    recorded = {k: float(ctx.metadata[f"clip_fraction_{k}"]) for k in fractions if f"clip_fraction_{k}" in ctx.metadata}
    bad = {k: (v, fractions[k]) for k, v in recorded.items() if abs(v - fractions[k]) > CLIP_FRACTION_ATOL}
    text = ", ".join(f"{k} {v:.4f}" for k, v in fractions.items())
    if bad:
        detail = "; ".join(f"{k}: recorded {r:.4f}, recomputed {e:.4f}" for k, (r, e) in bad.items())
        message = (f"clip fractions recorded in metadata differ from the recomputation ({detail}; recomputed {text} "
                   f"with eps_low {eps_low:g}, eps_high {eps_high:g}, counted only where the clip binds for the "
                   "advantage's sign). Why it matters: the logged clip fraction is how users see the trust "
                   "region working; a wrong one hides a clip that never (or always) binds. Likely fix: count "
                   "(ratio < 1 - eps_low) & (A < 0) and (ratio > 1 + eps_high) & (A > 0) over kept tokens "
                   "(tracer.formulas.clip_fractions).")
        return [ctx.finding("recompute.clip_fractions", ERROR, message, field="ratio", **fractions)]
    if recorded or fractions["region"] == 0.0:
        return []
    return [ctx.finding("recompute.clip_fractions", INFO, f"clip fractions (recomputed; none recorded to compare): "
                        f"{text} with eps_low {eps_low:g}, eps_high {eps_high:g}.", field="ratio", **fractions)]


@register("recompute.dpo", "recorded DPO logits, loss and implicit rewards == recomputation from the "
          "per-token logprobs and masks", {"dpo"})
def check_dpo(ctx: StepContext):
    cp, rp, cr, rr = ctx.require("chosen_policy_logprobs", "rejected_policy_logprobs", "chosen_ref_logprobs",
                                 "rejected_ref_logprobs")
    recorded = [n for n in ("dpo_logits", "dpo_loss", "chosen_rewards", "rejected_rewards") if n in ctx.data]
    if not recorded and "loss" not in ctx.data:
        raise Skip("needs at least one of dpo_logits, dpo_loss, chosen_rewards, rejected_rewards, loss to compare")
    beta = float(ctx.hyper("beta"))
    cm, rm = ctx.mask("chosen_mask"), ctx.mask("rejected_mask")
    terms = formulas.dpo_terms(formulas.sequence_logprobs(cp, cm), formulas.sequence_logprobs(rp, rm),
                               formulas.sequence_logprobs(cr, cm), formulas.sequence_logprobs(rr, rm), beta)
    keep = torch.ones(cp.shape[0], dtype=torch.bool)
    findings = []
    for name in recorded:
        findings += compare(ctx, "recompute.dpo", name, ctx.tensor(name), terms[name], keep,
                            f"tracer.formulas.dpo_terms (beta {beta:g})", ids_field="chosen_ids")
    sigmoid = ctx.hyper("dpo_loss_is_sigmoid", True) is not False  # TRL ipo/hinge/sft mixes: another loss
    whole = ctx.rows_cut(cp.shape[0]) is None  # first_k_sequences: the loss was over pairs the file lacks
    if sigmoid and whole and "loss" in ctx.data and ctx.data["loss"].numel() == 1:  # the step's loss: mean over pairs
        recorded, mean = ctx.tensor("loss").reshape(1), terms["dpo_loss"].mean().reshape(1)
        one = torch.ones(1, dtype=torch.bool)
        found = compare(ctx, "recompute.dpo", "loss", recorded, mean, one,
                        "the mean over pairs of tracer.formulas.dpo_terms' dpo_loss")
        for scale in loss_scales(ctx)[1:]:  # a loop that records loss / accumulation_steps (MiniMind's train_dpo.py)
            if found and not compare(ctx, "recompute.dpo", "loss", recorded, scale * mean, one, ""):
                found = []
        findings += found
    return findings
