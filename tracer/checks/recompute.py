"""Recompute (SPEC.md section 6): derived tensors recomputed with :mod:`tracer.formulas` from the
recorded inputs and compared with what the trainer recorded: ratio, ref_kl_k3, approx_kl_k2,
advantages (group rules, RLOO, GAE), clip fractions and DPO terms. The loss is in ``reduction.py``.

Advantage rules (metadata ``advantage_rule`` names one; ``advantage_std`` = population | unbiased
and ``scale_rewards`` name one too, see ``_declared_rule``):
``seed`` (population std, the seed/MiniMind rule), ``trl_group`` / ``trl_batch`` / ``trl_none``
(TRL: Bessel's std per group / over the batch / centring only), ``rloo`` (leave-one-out),
``rloo_kl`` (leave-one-out on rewards - β·Σ(old - ref), TRL's RLOO with β > 0), and ``gae`` (PPO).
With no rule declared, any known rule that matches passes (info when it is not the seed's).
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.advantages import full_groups
from tracer.checks.context import StepContext, where_text
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, Skip, register

CLIP_FRACTION_ATOL = 1e-3


def compare(ctx: StepContext, check: str, name: str, recorded: torch.Tensor, expected: torch.Tensor,
            keep: torch.Tensor, formula: str, ids_field: str = "completion_ids"):
    """One error finding when ``recorded`` and ``expected`` differ beyond the dtype tolerance at a
    kept, finite position (non-finite values are nonfinite.values' business); else []."""
    recorded, expected = recorded.double(), expected.double()
    diff = (recorded - expected).abs()
    tol = ctx.tol.atol + ctx.tol.rtol * expected.abs()
    bad = (diff > tol) & keep & torch.isfinite(recorded) & torch.isfinite(expected)
    if not bool(bad.any()):
        return []
    flat = int(diff.masked_fill(~bad, -1.0).argmax())
    idx = torch.unravel_index(torch.tensor(flat), diff.shape)
    b = int(idx[0]) if diff.dim() >= 1 else None
    t = int(idx[1]) if diff.dim() >= 2 else None
    r, e = float(recorded[idx]), float(expected[idx])
    message = (
        f"recorded {name} differs from {formula} recomputed from the recorded inputs at {int(bad.sum())} of "
        f"{int(keep.sum())} kept positions; worst at {where_text(b, t) or 'the scalar'}: recorded {r:.6g}, "
        f"recomputed {e:.6g} (|Δ| {abs(r - e):.3g} > {ctx.tol.atol:g} + {ctx.tol.rtol:g}·|recomputed| for "
        f"{ctx.dtype}). Why it matters: the trainer computes {name} differently from the textbook formula, or "
        f"records a tensor other than the one it trains with. Likely fix: compute it with {formula}."
    )
    return [ctx.finding(check, ERROR, message, b, t, field=name, ids_field=ids_field, recorded=r, recomputed=e,
                        positions=int(bad.sum()))]


def _keep_like(ctx: StepContext, tensor: torch.Tensor) -> torch.Tensor:
    keep = ctx.mask()
    return keep if tensor.dim() == 2 else keep.any(dim=1)


@register("recompute.ratio", "recorded ratio == exp(policy - old)", RL_ALGORITHMS)
def check_ratio(ctx: StepContext):
    if ctx.hyper("importance_sampling_level", "token") != "token":
        raise Skip("importance_sampling_level is not 'token': the recorded ratio is per sequence")
    ratio, policy = ctx.require_recorded("ratio", "policy_logprobs")
    return compare(ctx, "recompute.ratio", "ratio", ratio, formulas.ratio(policy, ctx.old_logprobs()),
                   ctx.mask(), "tracer.formulas.ratio")


@register("recompute.ref_kl_k3", "recorded ref_kl_k3 == exp(ref - policy) - (ref - policy) - 1", RL_ALGORITHMS)
def check_ref_kl_k3(ctx: StepContext):
    k3, policy, ref = ctx.require_recorded("ref_kl_k3", "policy_logprobs", "ref_logprobs")
    return compare(ctx, "recompute.ref_kl_k3", "ref_kl_k3", k3, formulas.ref_kl_k3(policy, ref), ctx.mask(),
                   "tracer.formulas.ref_kl_k3")


@register("recompute.approx_kl_k2", "recorded approx_kl_k2 == 0.5 * (policy - old)^2", RL_ALGORITHMS)
def check_approx_kl_k2(ctx: StepContext):
    k2, policy = ctx.require_recorded("approx_kl_k2", "policy_logprobs")
    return compare(ctx, "recompute.approx_kl_k2", "approx_kl_k2", k2,
                   formulas.approx_kl_k2(policy, ctx.old_logprobs()), ctx.mask(), "tracer.formulas.approx_kl_k2")


def _declared_rule(ctx: StepContext) -> str | None:
    """Metadata ``advantage_rule``; else ``advantage_std`` (``population`` -> seed, ``unbiased`` ->
    TRL with ``scale_rewards``, default group); else ``scale_rewards`` alone implies TRL."""
    rule = ctx.hyper("advantage_rule", None)
    if rule is not None or ctx.algorithm == "rloo":
        return rule
    std, scale = ctx.hyper("advantage_std", None), ctx.hyper("scale_rewards", None)
    if std == "population":
        return "seed"
    if std == "unbiased" or scale is not None:
        return f"trl_{scale or 'group'}"
    return None


def _group_rules(ctx: StepContext, rows: list[int]):
    if ctx.algorithm == "rloo":
        clip = ctx.hyper("reward_clip_range", None)  # TRL RLOO clamps rewards before the baseline
        lo, hi = (float(clip[0]), float(clip[1])) if clip else (None, None)
        rules = {"rloo": lambda r, G: formulas.rloo_advantages(r.clamp(lo, hi) if clip else r, G)}
        beta = float(ctx.hyper("beta", 0.0) or 0.0)
        if beta and ctx.has("ref_logprobs", "completion_mask"):
            try:
                old = ctx.old_logprobs()
            except Skip:
                return rules
            # TRL RLOO: rewards - beta * sum over kept tokens of k1(old, ref), before leave-one-out
            k1_sum = formulas.masked_sum(formulas.kl_k1(old, ctx.tensor("ref_logprobs")), ctx.mask(), dim=1)[rows]  # (N,)
            rules["rloo_kl"] = lambda r, G: formulas.rloo_advantages((r.clamp(lo, hi) if clip else r) - beta * k1_sum, G)
        return rules
    return {"seed": formulas.group_advantages,
            **{f"trl_{s}": (lambda r, G, s=s: formulas.trl_group_advantages(r, G, s)) for s in ("group", "batch", "none")}}


def _check_gae(ctx: StepContext):
    advantages, token_rewards, values = ctx.require("advantages", "token_rewards", "values")
    gamma, lam = float(ctx.hyper("gamma")), float(ctx.hyper("lam"))
    keep = ctx.mask()
    expected_adv, expected_ret = formulas.gae(token_rewards, values, keep, gamma, lam)
    findings = compare(ctx, "recompute.advantages", "advantages", advantages, expected_adv, keep,
                       f"tracer.formulas.gae (gamma {gamma:g}, lam {lam:g})")
    if "returns" in ctx.data:
        findings += compare(ctx, "recompute.advantages", "returns", ctx.tensor("returns"), expected_ret, keep,
                            "advantages + values (tracer.formulas.gae)")
    return findings


@register("recompute.advantages", "recorded advantages == the group rule (seed / TRL / RLOO) or GAE (PPO) "
          "recomputed from rewards", RL_ALGORITHMS)
def check_advantages(ctx: StepContext):
    if ctx.algorithm == "ppo":
        return _check_gae(ctx)
    advantages, rewards = ctx.require("advantages", "rewards")
    if advantages.dim() != 1:
        raise Skip("per-token advantages without algorithm 'ppo': no group rule to recompute")
    if ctx.hyper("normalize_advantages", False) or ctx.hyper("multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        raise Skip("advantages are re-normalised over the batch (normalize_advantages / normalize_then_sum)")
    if not bool(torch.isfinite(rewards).all()):
        raise Skip("rewards hold NaN/Inf (unscorable completions); see nonfinite.values")
    groups, G = full_groups(ctx, rewards.shape[0])
    rows = [r for g in groups for r in g]
    recorded = advantages[rows]
    rules = _group_rules(ctx, rows)
    declared = _declared_rule(ctx)
    if declared is not None and declared not in rules:
        raise Skip(f"advantage rule {declared!r} is not one the checks know ({', '.join(rules)})")
    diffs = {}
    for name, rule in rules.items():
        expected = rule(rewards[rows], G).double()
        tol = 10 * ctx.tol.atol + 10 * ctx.tol.rtol * expected.abs()
        diffs[name] = (expected, (recorded.double() - expected).abs(), tol)
    matches = [n for n, (_, d, tol) in diffs.items() if bool((d <= tol).all())]
    default = declared or next(iter(rules))
    if default in matches:
        return []
    if matches and declared is None:
        return [ctx.finding("recompute.advantages", INFO, f"advantages follow the {matches[0]!r} rule "
                            f"(not the seed's population-std rule): {', '.join(matches)} match the recorded values.",
                            field="advantages", rule=matches[0])]
    expected, d, _ = diffs[default]
    i = int(d.argmax())
    told = f"metadata declares {declared!r}" if declared else f"the default rule is {default!r}"
    other = f"; the recorded values match {matches} instead" if matches else "; no known rule matches"
    message = (
        f"recorded advantages differ from the {default!r} rule recomputed from rewards ({told}){other}. "
        f"Worst at seq {rows[i]}: recorded {float(recorded[i]):.6g}, recomputed {float(expected[i]):.6g}; "
        f"max |Δ| by rule: " + ", ".join(f"{n} {float(v[1].max()):.3g}" for n, v in diffs.items()) + ". Why it "
        "matters: the trainer does not compute the advantages its configuration says (std with or without "
        "Bessel's correction, group vs batch scaling, a missing eps), so the update differs from the one "
        "intended. Likely fix: compute them with tracer.formulas (group_advantages, trl_group_advantages, "
        "rloo_advantages) or record metadata advantage_rule / scale_rewards that matches the trainer."
    )
    return [ctx.finding("recompute.advantages", ERROR, message, rows[i], field="advantages", rule=default,
                        matching_rules=matches)]


@register("recompute.clip_fractions", "clip fractions (low / high / region, sign-aware) recomputed and "
          "compared with metadata clip_fraction_* when recorded", {"ppo", "grpo", ""})
def check_clip_fractions(ctx: StepContext):
    if ctx.hyper("importance_sampling_level", "token") != "token":
        raise Skip("importance_sampling_level is not 'token': the trainer clips one ratio per sequence")
    (policy,) = ctx.require("policy_logprobs")
    (advantages,) = ctx.require("advantages")
    eps_high = float(ctx.hyper("clip_epsilon_high"))
    eps_low = float(ctx.hyper("clip_epsilon_low", eps_high))
    keep = ctx.mask()
    fractions = {k: float(v) for k, v in formulas.clip_fractions(
        formulas.ratio(policy, ctx.old_logprobs()), advantages, keep, eps_low, eps_high).items()}
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
    if "loss" in ctx.data and ctx.data["loss"].numel() == 1:  # the step's loss: mean over pairs
        findings += compare(ctx, "recompute.dpo", "loss", ctx.tensor("loss").reshape(1), terms["dpo_loss"].mean().reshape(1),
                            torch.ones(1, dtype=torch.bool), "the mean over pairs of tracer.formulas.dpo_terms' dpo_loss")
    return findings
