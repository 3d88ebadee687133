"""Recompute (SPEC.md section 6): derived tensors recomputed with :mod:`tracer.formulas` from the
recorded inputs and compared with what the trainer recorded: ratio, ref_kl_k3, approx_kl_k2,
advantages (group rules, RLOO, GAE), PPO's token rewards when the KL penalty is in the reward, clip
fractions and DPO terms. The loss is in ``reduction.py``.

Advantage rules: :data:`tracer.formulas.ADVANTAGE_RULES` (``gae``, ``gae_whitened``, ``group_zscore``,
``group_zscore_unbiased``, ``batch_zscore_unbiased``, ``group_mean``, ``rloo``, ``rloo_kl``). Metadata
``advantage_rule`` declares one (``advantage_std`` = population | unbiased and ``scale_rewards`` imply
one too, see ``_declared_rule``). A declared rule the values do not follow is an error; with no rule
declared, any known rule that matches passes (an info names it when it is not the default).
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.advantages import empty_rows, full_groups, whitened_fit
from tracer.checks.context import StepContext, check_memo, where_text
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


SCALE_TO_RULE = {"group": "group_zscore_unbiased", "batch": "batch_zscore_unbiased", "none": "group_mean"}


def _declared_rule(ctx: StepContext) -> str | None:
    """The canonical rule the trace declares (:data:`tracer.formulas.ADVANTAGE_RULES`): metadata
    ``advantage_rule`` (aliases resolved); else ``advantage_std`` (``population`` -> ``group_zscore``,
    ``unbiased`` -> the TRL rule of ``scale_rewards``, default group); else ``scale_rewards`` alone
    implies TRL's Bessel std. None when nothing is declared. Raises Skip for an unknown name."""
    rule = ctx.hyper("advantage_rule", None)
    if rule is not None:
        try:
            return formulas.advantage_rule_name(str(rule))
        except ValueError as err:
            if str(rule).startswith(formulas.VERL_RULE_PREFIX):  # verl's other estimators (verl_record)
                estimator = str(rule)[len(formulas.VERL_RULE_PREFIX):]
                raise Skip(f"advantage_rule {rule!r}: verl's {estimator!r} estimator, which tracer.formulas has "
                           "no rule for (not recomputed)") from None
            raise Skip(str(err)) from None
    if ctx.algorithm in ("rloo", "ppo"):
        return None
    std, scale = ctx.hyper("advantage_std", None), ctx.hyper("scale_rewards", None)
    if std == "population":
        return "group_zscore"
    if std == "unbiased" or scale is not None:
        return SCALE_TO_RULE.get(str(scale or "group"))
    return None


def _group_rules(ctx: StepContext, rows: list[int]):
    """Candidate rules ``{canonical name: fn(rewards [N], G) -> advantages [N]}``, the default first."""
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
    return {"group_zscore": formulas.group_advantages,
            "group_zscore_unbiased": lambda r, G: formulas.trl_group_advantages(r, G, "group"),
            "batch_zscore_unbiased": lambda r, G: formulas.trl_group_advantages(r, G, "batch"),
            "group_mean": formulas.group_mean_advantages,
            # rows arrive group by group (full_groups), so consecutive runs of G are the uids
            "verl_grpo": lambda r, G: formulas.verl_grpo_advantages(r, torch.arange(r.shape[0] // G).repeat_interleave(G))}


def _check_gae(ctx: StepContext):
    advantages, token_rewards, values = ctx.require("advantages", "token_rewards", "values")
    gamma, lam = float(ctx.hyper("gamma")), float(ctx.hyper("lam"))
    keep = ctx.mask()
    if not bool(keep.any()):
        raise Skip("no kept token in completion_mask (masks.empty_row says why)")
    raw, expected_ret = formulas.gae(token_rewards, values, keep, gamma, lam)
    formula = f"tracer.formulas.gae (gamma {gamma:g}, lam {lam:g})"
    findings = []
    if "returns" in ctx.data:  # returns = raw GAE + values, before any whitening (MiniMind, verl)
        findings += compare(ctx, "recompute.advantages", "returns", ctx.tensor("returns"), expected_ret, keep,
                            "advantages + values (tracer.formulas.gae)")
    declared = _declared_rule(ctx)
    if declared not in (None, "gae", "gae_whitened"):
        raise Skip(f"advantage rule {declared!r} is not a PPO rule (gae, gae_whitened)")
    raw_findings = compare(ctx, "recompute.advantages", "advantages", advantages, raw, keep, formula)
    if declared is None and not raw_findings:
        return findings
    whitened, a, b, residual = whitened_fit(advantages, raw, keep, ctx)
    if declared == "gae":
        if raw_findings and whitened:
            raw_findings[0].message = ("the values follow the 'gae_whitened' rule instead of the declared 'gae'. "
                                       + raw_findings[0].message)
        return findings + raw_findings
    detail = (f"recorded = {a:.6g} * raw GAE {b:+.6g} on every kept token (max residual {residual:.3g}): "
              f"whitened with mean {-b / a if a else float('nan'):.6g} and std {1 / a if a else float('nan'):.6g} "
              "of the rollout's kept raw advantages")
    if whitened and declared == "gae_whitened":
        return findings
    if whitened:
        return findings + [ctx.finding("recompute.advantages", INFO, f"advantages follow the 'gae_whitened' rule "
                                       f"({formulas.ADVANTAGE_RULES['gae_whitened']}): {detail}.",
                                       field="advantages", rule="gae_whitened", scale=a, shift=b)]
    if declared is None:
        return findings + raw_findings  # neither raw nor whitened GAE: the raw comparison says where
    return findings + [ctx.finding(
        "recompute.advantages", ERROR,
        f"metadata declares advantage_rule 'gae_whitened', but the recorded advantages are no affine "
        f"image a * raw + b (a > 0) of the GAE recomputed with {formula} (best fit a {a:.6g}, b {b:+.6g}, "
        f"max residual {residual:.3g} over {int(keep.sum())} kept tokens). Why it matters: the advantages are "
        "not the whitened GAE the configuration says (wrong γ/λ, reward on the wrong token, values from "
        "another critic pass). Likely fix: compute raw GAE with tracer.formulas.gae, then whiten over the "
        "kept tokens (tracer.formulas.whiten).", field="advantages", rule="gae_whitened", scale=a, shift=b)]


@register("recompute.advantages", "recorded advantages == the declared or a known advantage rule "
          "(group z-score / group mean / RLOO / GAE raw or whitened) recomputed from rewards", RL_ALGORITHMS)
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
        raise Skip(f"advantage rule {declared!r} does not apply to algorithm {ctx.algorithm!r} "
                   f"(rules here: {', '.join(rules)})")
    # the rule runs on every row's reward; a row whose mask keeps no token and whose advantage is exactly 0
    # had it dropped (verl's rollout rejection empties a row's mask and records 0, its reward still in its
    # group): nothing to compare there
    empty = empty_rows(ctx)
    live = torch.tensor([not (r in empty and float(advantages[r]) == 0.0) for r in rows], dtype=torch.bool)
    diffs = {}
    for name, rule in rules.items():
        expected = rule(rewards[rows], G).double()
        tol = 10 * ctx.tol.atol + 10 * ctx.tol.rtol * expected.abs()
        diffs[name] = (expected, torch.where(live, (recorded.double() - expected).abs(), 0.0), tol)
    matches = [n for n, (_, d, tol) in diffs.items() if bool((d <= tol).all())]
    default = declared or next(iter(rules))
    if default in matches:
        return []
    if matches and declared is None:
        return [ctx.finding("recompute.advantages", INFO, f"advantages follow the {matches[0]!r} rule "
                            f"({formulas.ADVANTAGE_RULES[matches[0]]}), not the seed's population-std z-score; "
                            f"matching rules: {', '.join(matches)}. Declare it with metadata advantage_rule = "
                            f"{matches[0]!r} so that a change of rule is caught.",
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
        "group_mean_advantages, rloo_advantages) or declare the metadata advantage_rule the trainer uses."
    )
    return [ctx.finding("recompute.advantages", ERROR, message, rows[i], field="advantages", rule=default,
                        matching_rules=matches)]


def named_rule(ctx: StepContext) -> str | None:
    """The known rule :func:`check_advantages` names in its info for a step that declares none and
    whose advantages follow a rule other than the default (``group_mean``, ``batch_zscore_unbiased``...);
    None when it reports no such info (a rule declared, the default followed, no rule matching, or
    the check skipped)."""
    try:
        findings = check_advantages(ctx)
    except Skip:
        return None
    return next((f.details["rule"] for f in findings if f.severity == INFO), None)


def _reward_kl(ctx: StepContext) -> tuple[float, str] | None:
    """``(kl_coef, estimator)`` of a KL penalty in the rewards (``kl_coef``, else ``beta``;
    ``kl_estimator``, default k1); None without a non-zero coefficient. Skip for an unknown estimator."""
    coef = ctx.kl_coef()
    if coef is None:
        return None
    try:
        return coef, formulas.kl_estimator_name(ctx.hyper("kl_estimator", None) or "k1")
    except ValueError as err:
        raise Skip(f"metadata kl_estimator: {err}") from None


def _token_rewards_carry_kl(ctx: StepContext) -> bool | None:
    """What this step's recorded ``token_rewards`` show (PPO): True when they are the sequence reward
    on the last kept token plus ``-kl_coef * KL(old || ref)`` on every kept token (or that penalty
    with its sign flipped: recompute.token_rewards names it), False when the penalty would show and
    does not, None when it cannot show (fields missing, no coefficient, or old == ref on every kept
    token, as at a run's first rollout)."""
    if ctx.algorithm not in ("ppo", "") or not ctx.has("token_rewards", "rewards", "ref_logprobs"):
        return None
    try:
        reward_kl = _reward_kl(ctx)
        old = ctx.old_logprobs()
    except Skip:
        return None
    if reward_kl is None:
        return None
    coef, declared = reward_kl
    keep = ctx.mask()
    recorded, ref, rewards = ctx.tensor("token_rewards"), ctx.tensor("ref_logprobs"), ctx.tensor("rewards")
    penalty = torch.where(keep, coef * formulas.ref_kl(old, ref, declared), torch.zeros_like(recorded))
    if not bool((penalty.abs() > ctx.tol.atol + ctx.tol.rtol * recorded.abs()).any()):
        return None
    # undeclared, any of the three estimators (OpenRLHF's kl_estimator, verl's kl_penalty) may be the loop's
    estimators = (declared,) if ctx.hyper("kl_estimator", None) else (declared, *[e for e in formulas.KL_ESTIMATORS
                                                                                    if e != declared])
    for estimator in estimators:
        for sign in (1.0, -1.0):  # a flipped sign too: recompute.token_rewards names it
            if not compare(ctx, "recompute.token_rewards", "token_rewards", recorded,
                           formulas.kl_reward_token_rewards(rewards, old, ref, keep, sign * coef, estimator), keep, ""):
                check_memo(ctx.trace, "reward_kl_estimator").setdefault("value", estimator)
                return True
    return False


MAX_KL_PLACEMENT_PROBES = 8  # other step files read to tell where the KL penalty is, once per trace


def _run_kl_in_reward(ctx: StepContext) -> bool:
    """Where the run puts the KL penalty, from its latest step files whose token rewards can show it
    (at most :data:`MAX_KL_PLACEMENT_PROBES`, newest first: old == ref only at the start); False when
    none can. Worked out once per run of the checks (:func:`check_memo`)."""
    memo = check_memo(ctx.trace, "kl_in_reward")
    if "value" not in memo:
        memo["value"] = False
        for key in list(reversed(ctx.trace.steps()))[:MAX_KL_PLACEMENT_PROBES]:
            if key == ctx.key:
                continue
            try:
                seen = _token_rewards_carry_kl(StepContext(ctx.trace, key, ctx.options))
            except Exception:  # noqa: BLE001  (an unreadable step file is other checks' finding)
                continue
            if seen is not None:
                memo["value"] = seen
                break
    return memo["value"]


def kl_in_reward(ctx: StepContext) -> bool:
    """The reference-KL penalty is in the rewards, not the loss (InstructGPT, OpenRLHF, TRL's
    PPOTrainer, verl's ``use_kl_in_reward``): metadata ``kl_in_reward`` when recorded, else what this
    step's recorded ``token_rewards`` show (:func:`_token_rewards_carry_kl`), else what the run's
    latest ones show (:func:`_run_kl_in_reward`). Worked out once per step file."""
    memo = ctx.__dict__.setdefault("_kl_in_reward", {})
    if "value" not in memo:
        declared = ctx.flag("kl_in_reward")
        if declared is None:
            seen = _token_rewards_carry_kl(ctx)
            declared = seen if seen is not None else (ctx.algorithm in ("ppo", "") and ctx.has("token_rewards")
                                                      and _run_kl_in_reward(ctx))
        memo["value"] = declared
    return memo["value"]


@register("recompute.token_rewards", "PPO with the KL in the reward (kl_in_reward): recorded token_rewards == "
          "-kl_coef * KL(old || ref) on each kept token + the sequence reward on the last one", {"ppo", ""})
def check_token_rewards(ctx: StepContext):
    if not kl_in_reward(ctx):
        raise Skip("the KL penalty is in the loss (metadata kl_in_reward not set, and token_rewards carry no KL "
                   "penalty): token_rewards hold the sequence reward alone (advantages.reward_placement checks it)")
    token_rewards, rewards, ref = ctx.require("token_rewards", "rewards", "ref_logprobs")
    old = ctx.old_logprobs()
    reward_kl = _reward_kl(ctx)
    if reward_kl is None:
        raise Skip("kl_in_reward is set but neither kl_coef nor beta is recorded (or it is 0)")
    coef, estimator = reward_kl
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
    sigmoid = ctx.hyper("dpo_loss_is_sigmoid", True) is not False  # TRL ipo/hinge/sft mixes: another loss
    whole = ctx.rows_cut(cp.shape[0]) is None  # first_k_sequences: the loss was over pairs the file lacks
    if sigmoid and whole and "loss" in ctx.data and ctx.data["loss"].numel() == 1:  # the step's loss: mean over pairs
        findings += compare(ctx, "recompute.dpo", "loss", ctx.tensor("loss").reshape(1), terms["dpo_loss"].mean().reshape(1),
                            torch.ones(1, dtype=torch.bool), "the mean over pairs of tracer.formulas.dpo_terms' dpo_loss")
    return findings
