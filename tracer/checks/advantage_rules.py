"""Which advantage rule the recorded advantages follow, recomputed from the recorded rewards.

Shared by the ``advantages`` family (groups, the z-score bound, masked positions) and the
``recompute.advantages`` check: how groups of G rows are formed (``group_ids``, else G consecutive
rows), which rows had their advantage dropped, the affine fit that recognises whitened GAE, and the
rule recomputation itself.

Advantage rules: :data:`tracer.formulas.ADVANTAGE_RULES` (``gae``, ``gae_whitened``, ``group_zscore``,
``group_zscore_unbiased``, ``batch_zscore_unbiased``, ``group_mean``, ``rloo``, ``rloo_kl``,
``verl_grpo``). Metadata ``advantage_rule`` declares one (``advantage_std`` = population | unbiased
and ``scale_rewards`` imply one too, see :func:`declared_rule`). A declared rule the values do not
follow is an error; with no rule declared, any known rule that matches passes (an info names it when
it is not the default).
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.comparison import compare
from tracer.checks.context import StepContext
from tracer.checks.finding import ERROR, INFO, Skip

# TRL's scale_rewards -> the rule it implies with Bessel's std (advantage_std = unbiased)
SCALE_TO_RULE = {"group": "group_zscore_unbiased", "batch": "batch_zscore_unbiased", "none": "group_mean"}


def full_groups(ctx: StepContext, rows: int) -> tuple[list[list[int]], int]:
    """Row indices of every complete group in the step and G; Skip when groups cannot be formed.

    Groups come from ``group_ids`` when recorded (rows may be shuffled), else G consecutive rows
    (metadata ``num_generations``). Only complete groups of G rows in the step file are returned."""
    G = ctx.hyper("num_generations", None)
    if rows == 0:
        raise Skip("the step file holds no sequences (B = 0)")
    if G is not None and (not isinstance(G, (int, float)) or isinstance(G, bool) or int(G) < 1):
        raise Skip(f"metadata num_generations = {G!r} is not a group size >= 1")
    if "group_ids" in ctx.data:
        by_id: dict[int, list[int]] = {}
        for row, gid in enumerate(ctx.data["group_ids"].tolist()):
            by_id.setdefault(gid, []).append(row)
        sizes = [len(r) for r in by_id.values()]
        # group_ids are the recorded truth: when they form groups larger than num_generations, use their
        # size (advantages.group_size reports the disagreement); groups smaller than G are partial groups of
        # a micro-batch and are left out
        if G is None or (int(G) not in sizes and max(sizes) > int(G)):
            G = max(set(sizes), key=sizes.count)
        groups = [r for r in by_id.values() if len(r) == int(G)]
    else:
        if G is None:
            raise Skip("needs field group_ids or metadata key 'num_generations' to form groups")
        if rows % int(G):
            raise Skip(f"B = {rows} rows is not a multiple of num_generations = {G} and no group_ids are recorded")
        groups = [list(range(s, s + int(G))) for s in range(0, rows, int(G))]
    if int(G) < 2 or not groups:
        raise Skip(f"no complete group of G = {G} >= 2 rows in this step file")
    return groups, int(G)


def empty_rows(ctx: StepContext) -> set[int]:
    """The rows whose completion_mask keeps no token (none when no mask is recorded)."""
    if not ctx.has("completion_mask") or ctx.data["completion_mask"].dim() != 2:
        return set()
    return set((~ctx.mask().any(dim=1)).nonzero().flatten().tolist())


def whitened_fit(recorded: torch.Tensor, raw: torch.Tensor, keep: torch.Tensor, ctx: StepContext):
    """Does ``recorded`` equal ``a * raw + b`` (a > 0) on the kept tokens, as whitening GAE with the
    statistics of the whole rollout gives (a step file may hold one minibatch of it)? ``recorded``,
    ``raw``, ``keep``: ``[B, T]``. Returns ``(matches, a, b, max residual)`` (least-squares fit;
    NaNs when no token is kept)."""
    y, x = recorded.double()[keep], raw.double()[keep]  # (N,)
    if y.numel() == 0:
        return False, float("nan"), float("nan"), float("nan")
    xc = x - x.mean()
    spread = float((xc ** 2).sum())
    a = float((xc * (y - y.mean())).sum()) / spread if spread > 0 else 1.0
    b = float(y.mean()) - a * float(x.mean())
    residual = (y - (a * x + b)).abs()
    tol = 10 * ctx.tol.atol + 10 * ctx.tol.rtol * y.abs()
    return bool(a > 0 and (residual <= tol).all()), a, b, float(residual.max())


def declared_rule(ctx: StepContext) -> str | None:
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


def _gae_findings(ctx: StepContext):
    """PPO: the recorded per-token advantages (and ``returns``) against raw GAE(γ, λ) recomputed from
    ``token_rewards`` and ``values``, or against its whitened form (an affine image, :func:`whitened_fit`)."""
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
    declared = declared_rule(ctx)
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


def advantage_rule_findings(ctx: StepContext):
    """The ``recompute.advantages`` check: the recorded advantages against the declared rule, or any
    known rule when none is declared, recomputed from the recorded rewards (GAE for PPO). Findings:
    an error when the declared (or default) rule does not match, an info naming the matching rule
    when an undeclared non-default one does; Skip when no rule can be recomputed."""
    if ctx.algorithm == "ppo":
        return _gae_findings(ctx)
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
    declared = declared_rule(ctx)
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
    if default in matches or _std_normalisation_reported(ctx, matches, declared):
        return []
    if matches and declared is None:
        return [ctx.finding("recompute.advantages", INFO, f"advantages follow the {matches[0]!r} rule "
                            f"({formulas.ADVANTAGE_RULES[matches[0]]}), not the rule assumed when none is declared, "
                            f"{default!r} ({formulas.ADVANTAGE_RULES[default]}); "
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


def _std_normalisation_reported(ctx: StepContext, matches: list[str], declared: str | None) -> bool:
    """True for a verl GRPO step (metadata ``adv_estimator`` ``grpo`` / ``grpo_vectorized``) whose values follow
    the other of ``verl_grpo`` / ``group_mean`` than the one declared: the std normalisation in effect
    differs, and ``recompute.advantage_std`` (:mod:`tracer.checks.effective_config`) names it with the
    config's value, so this check does not report the same cause twice."""
    pair = {"verl_grpo", "group_mean"}
    if ctx.hyper("adv_estimator", None) not in ("grpo", "grpo_vectorized") or declared not in pair:
        return False
    return (pair - {declared}).pop() in matches


def named_rule(ctx: StepContext) -> str | None:
    """The known rule :func:`advantage_rule_findings` names in its info for a step that declares none
    and whose advantages follow a rule other than the default (``group_mean``,
    ``batch_zscore_unbiased``...); None when it reports no such info (a rule declared, the default
    followed, no rule matching, or the check skipped)."""
    try:
        findings = advantage_rule_findings(ctx)
    except Skip:
        return None
    return next((f.details["rule"] for f in findings if f.severity == INFO), None)
