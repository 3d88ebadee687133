"""Advantages and rewards (SPEC.md section 6).

Grouped algorithms (GRPO, CISPO, RLOO): advantages sum to ~0 within each group, zero-variance
groups (no learning signal) are counted, and |A| stays within the bound a group z-score allows
(|A| <= sqrt(G - 1) for a group of G). PPO: the sequence reward lands on the last kept token of
``token_rewards``, and no reward or advantage sits on a masked position.

Groups are read from ``group_ids`` when recorded (rows may be shuffled), else G consecutive rows
(``num_generations``). Only complete groups of G rows in the step file are checked
(:func:`tracer.checks.advantage_rules.full_groups`).
"""

from __future__ import annotations

import math

import torch

from tracer import formulas
from tracer.checks.advantage_rules import empty_rows, full_groups, named_rule, whitened_fit
from tracer.checks.context import StepContext, check_memo
from tracer.checks.text import count
from tracer.checks.finding import ERROR, INFO, WARNING, Skip, not_applicable, register

GROUPED = {"grpo", "cispo", "rloo", ""}
Z_SCORE_RULES = {"group_zscore", "group_zscore_unbiased", "verl_grpo"}  # |A| <= sqrt(G - 1) holds for these
# the rules known not to subtract the group's mean reward: their advantages need not sum to 0 per group
# (an unknown rule name is not taken for one of these: group_sum still runs)
NOT_GROUP_CENTRED_RULES = {"gae", "gae_whitened"}


def not_group_centred(rule: str) -> bool:
    """True for an advantage rule known not to centre on the group mean: GAE, or one of verl's other
    estimators (``verl_<estimator>``, except ``verl_grpo``)."""
    canonical = formulas.ADVANTAGE_RULE_ALIASES.get(rule, rule)
    return canonical in NOT_GROUP_CENTRED_RULES or (canonical.startswith(formulas.VERL_RULE_PREFIX) and canonical != "verl_grpo")


def _sequence_advantages(ctx: StepContext) -> torch.Tensor:
    (advantages,) = ctx.require("advantages")
    if advantages.dim() != 1:
        raise Skip("advantages are per token here; the group rules apply to per-sequence advantages [B]")
    return advantages


@register("advantages.group_size", "group sizes in group_ids agree with num_generations", GROUPED)
def check_group_size(ctx: StepContext):
    G = ctx.hyper("num_generations", None)
    if G is None or "group_ids" not in ctx.data:
        raise Skip("needs field group_ids and metadata key 'num_generations'")
    ids = ctx.data["group_ids"].tolist()
    sizes = {gid: ids.count(gid) for gid in dict.fromkeys(ids)}
    wrong = {gid: n for gid, n in sizes.items() if n != int(G)}
    if not wrong:
        return []
    gid, n = next(iter(wrong.items()))
    message = (
        f"num_generations = {G}, but group_ids give groups of sizes {sorted(set(sizes.values()))} "
        f"({len(wrong)} of {len(sizes)} groups differ; group {gid} has {n} rows). The group checks below use "
        "the groups of group_ids. Why it matters: if the trainer normalised advantages over G consecutive "
        "rows while prompts have a different number of completions, advantages mix completions of different "
        "prompts. Likely fix: make num_generations match the completions sampled per prompt (or record the "
        "group_ids the trainer really used); a micro-batch holding part of a group is fine (info only)."
    )
    partial = all(n < int(G) for n in wrong.values())  # micro-batches split groups: expected, not a bug
    rows = [r for r, g in enumerate(ids) if g == gid]
    return [ctx.finding("advantages.group_size", INFO if partial else WARNING, message, rows[0], field="group_ids",
                        group_sizes=sorted(set(sizes.values())), num_generations=int(G))]


@register("advantages.group_sum", "advantages sum to ~0 within each group", GROUPED)
def check_group_sum(ctx: StepContext):
    rule = ctx.hyper("advantage_rule", None)
    if rule is not None and not_group_centred(str(rule)):
        raise not_applicable(f"advantage_rule = {rule!r} is not centred on the group mean: its advantages need not "
                             "sum to 0")
    advantages = _sequence_advantages(ctx)
    groups, G = full_groups(ctx, advantages.shape[0])
    # a row whose mask keeps no token and whose advantage is exactly 0 had its advantage dropped (verl
    # records 0 for the rows its rollout rejection empties); a masked row that kept its advantage
    # (TRL's mask_truncated_completions) still counts
    dropped = {r for r in empty_rows(ctx) if float(advantages[r]) == 0.0}
    bad = []
    for rows in groups:
        if dropped & set(rows):
            continue
        a = advantages[rows]
        total = float(a.sum())
        tol = G * (10 * ctx.tol.atol + ctx.tol.rtol * float(a.abs().max()))
        if abs(total) > tol:
            bad.append((abs(total), total, rows))
    if not bad:
        return []
    _, total, rows = max(bad)
    message = (
        f"advantages of the group of rows {rows} sum to {total:.4g} (mean {total / G:.4g}); {len(bad)} of "
        f"{len(groups)} groups do not sum to 0. Group-relative advantages subtract the group's mean reward, so "
        "they sum to 0 within each group of G. Why it matters: a non-zero group mean pushes every completion "
        "of that prompt the same way, a bias unrelated to which answer was better. Likely fix: centre with "
        "the mean of the same G rows (rewards.view(-1, G) with G consecutive completions per prompt), and "
        "keep group order when rows are shuffled."
    )
    return [ctx.finding("advantages.group_sum", ERROR, message, rows[0], field="advantages",
                        groups=len(bad), group_sum=total)]


def _advantages_have_another_term(ctx: StepContext) -> bool:
    """True when the advantage rule adds a term besides the reward, so that equal rewards need not give
    zero advantages: RLOO's KL-penalised rewards (advantage_rule rloo_kl, or RLOO with beta > 0), or one
    of verl's other estimators (verl_<estimator>)."""
    rule = str(ctx.hyper("advantage_rule", "") or "")
    if rule == "rloo_kl" or (rule.startswith(formulas.VERL_RULE_PREFIX) and rule != "verl_grpo"):
        return True
    return ctx.algorithm == "rloo" and float(ctx.hyper("beta", 0.0) or 0.0) != 0.0


def _file_group_counts(ctx: StepContext, key) -> tuple[int, int] | None:
    """(groups, zero-variance groups) of the step file ``key``: from its header summary when it holds
    them (:mod:`tracer.format.summary`), else from its rewards; None when its groups cannot be formed."""
    try:
        summary = ctx.trace.metadata(key).get("summary")
        if isinstance(summary, dict) and isinstance(summary.get("groups"), int) \
                and isinstance(summary.get("zero_variance_groups"), int):
            return summary["groups"], summary["zero_variance_groups"]
        other = StepContext(ctx.trace, key, ctx.options)
        (rewards,) = other.require("rewards")
        groups, _ = full_groups(other, rewards.shape[0])
    except Exception:  # noqa: BLE001  (Skip, or an unreadable file: other checks report it)
        return None
    return len(groups), sum(float(rewards[rows].max() - rewards[rows].min()) == 0.0 for rows in groups)


def _rollout_group_counts(ctx: StepContext) -> tuple[int, int, int]:
    """(files, groups, zero-variance groups) over the step files of this step file's pass over its
    rollout: the same step, inner step and rank, every micro-batch (this file included). Worked out
    once per pass (:func:`check_memo`)."""
    memo = check_memo(ctx.trace, "rollout_groups")
    k = (ctx.key.step, ctx.key.inner_step, ctx.key.rank)
    if k not in memo:
        files = groups = zero = 0
        for key in ctx.pass_keys():
            counts = _file_group_counts(ctx, key)
            if counts is not None:
                files, groups, zero = files + 1, groups + counts[0], zero + counts[1]
        memo[k] = (files, groups, zero)
    return memo[k]


@register("advantages.zero_variance", "share of groups whose rewards are all equal (advantage 0, "
          "no learning signal)", GROUPED)
def check_zero_variance(ctx: StepContext):
    (rewards,) = ctx.require("rewards")
    groups, G = full_groups(ctx, rewards.shape[0])
    zero = [rows for rows in groups if float(rewards[rows].max() - rewards[rows].min()) == 0.0]
    if not zero:
        return []
    share = len(zero) / len(groups)
    values = sorted({float(rewards[rows[0]]) for rows in zero})
    if len(zero) < len(groups):
        return [ctx.finding("advantages.zero_variance", INFO,
                            f"{len(zero)} of {len(groups)} groups ({share:.0%}) have zero reward variance "
                            "(all G rewards equal): the reward gives their completions no advantage over each other.",
                            zero[0][0], field="rewards", zero_variance_share=share)]
    flat = rewards[[r for rows in groups for r in rows]]
    largest = 0.0
    if ctx.has("advantages"):
        advantages = ctx.tensor("advantages")[[r for rows in groups for r in rows]]
        largest = float(advantages.abs().max()) if advantages.numel() else 0.0
    if largest > ctx.tol.atol and _advantages_have_another_term(ctx):
        return [ctx.finding(
            "advantages.zero_variance", INFO,
            f"all {len(groups)} groups have zero reward variance (the reward each group shares: {values[:8]}), but the "
            f"recorded advantages are not 0 (largest |A| {largest:.4g}): they come from the advantage "
            f"rule's other terms (advantage_rule {ctx.hyper('advantage_rule', None)!r}; RLOO's "
            "rloo_kl subtracts beta * sum(old - ref) from each reward), not from the reward.",
            zero[0][0], field="rewards", zero_variance_share=share, groups=len(groups), largest_advantage=largest)]
    if largest > ctx.tol.atol:  # no term besides the reward: these advantages do not come from these rewards
        message = (
            f"all {len(groups)} groups have zero reward variance (the reward each group shares: {values[:8]}), yet the recorded "
            f"advantages are not 0 (largest |A| {largest:.4g}), and the advantage rule has no term besides the "
            "reward. Why it matters: the advantages were not computed from these rewards within their groups "
            "(a batch-level normalisation, or advantages of other rows: stale, shuffled or misaligned), so the "
            "update pushes completions the reward does not tell apart. Likely fix: compute the advantages from "
            "the same rows' rewards, grouped by prompt (tracer.formulas.group_advantages)."
        )
        return [ctx.finding("advantages.zero_variance", WARNING, message, zero[0][0], field="advantages",
                            zero_variance_share=share, groups=len(groups), largest_advantage=largest)]
    files, rollout_groups, rollout_zero = _rollout_group_counts(ctx)
    if files > 1 and rollout_zero < rollout_groups:  # the rollout's other micro-batches carry the signal
        return [ctx.finding(
            "advantages.zero_variance", INFO,
            f"{'the one group' if len(groups) == 1 else f'all {len(groups)} groups'} of this micro-batch "
            f"{'has' if len(groups) == 1 else 'have'} zero reward variance (the reward each group shares: {values[:8]}), "
            f"so its advantages are 0; over the {files} micro-batch files of step {ctx.key.step} (inner step "
            f"{ctx.key.inner_step}), {rollout_zero} of {rollout_groups} groups ({rollout_zero / rollout_groups:.0%}) "
            "have zero variance: the step's other groups carry its learning signal.",
            zero[0][0], field="rewards", zero_variance_share=share, groups=len(groups),
            step_zero_variance_share=rollout_zero / rollout_groups)]
    message = (
        f"all {len(groups)} groups have zero reward variance (the reward each group shares: {values[:8]}), so every advantage is "
        f"0 and the step carries no learning signal (only the KL term moves the policy). The batch std of the "
        f"rewards is {float(flat.std(unbiased=False)):.4g} ({float(flat.std(unbiased=True)):.4g} with Bessel's "
        "correction), which hides this in batch-level logs. Why it matters: the step costs a full rollout "
        "and update for nothing. Likely fix: make the reward discriminate between completions of one prompt "
        "(partial credit, prompts of the right difficulty), raise G, or skip zero-variance groups (DAPO's "
        "dynamic sampling)."
    )
    return [ctx.finding("advantages.zero_variance", WARNING, message, zero[0][0], field="rewards",
                        zero_variance_share=share, groups=len(groups))]


@register("advantages.z_bound", "|A| <= sqrt(G - 1), the largest group z-score", {"grpo", "cispo", ""})
def check_z_bound(ctx: StepContext):
    scale = ctx.hyper("scale_rewards", "group")
    if scale != "group":
        raise not_applicable(f"scale_rewards = {scale!r}: advantages are not divided by the group std, no z-score "
                             "bound")
    if ctx.hyper("multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        raise not_applicable("multi_objective_aggregation = 'normalize_then_sum': advantages are a batch z-score")
    rule = ctx.hyper("advantage_rule", None)
    if rule is not None and formulas.ADVANTAGE_RULE_ALIASES.get(str(rule), str(rule)) not in Z_SCORE_RULES:
        raise not_applicable(f"advantage_rule = {rule!r} does not divide by a group std: no z-score bound")
    advantages = _sequence_advantages(ctx)
    try:
        groups, G = full_groups(ctx, advantages.shape[0])
        rows = [r for g in groups for r in g]
    except Skip:
        # micro-batches that split groups (TRL with gradient accumulation): the bound holds row by row
        G = ctx.hyper("num_generations", None)
        if not isinstance(G, int) or isinstance(G, bool) or G < 2 or advantages.shape[0] == 0:
            raise
        rows = list(range(advantages.shape[0]))
    bound = math.sqrt(G - 1)
    a = advantages[rows].abs()
    worst = int(a.argmax())
    value = float(a[worst])
    if value <= bound * (1 + ctx.tol.rtol) + ctx.tol.atol:
        return []
    named = named_rule(ctx)  # an undeclared rule recompute.advantages accepts, with an info
    if named is not None and named not in Z_SCORE_RULES:
        raise not_applicable(f"advantages follow the {named!r} rule recomputed from rewards (recompute.advantages "
                             "names it), which does not divide by a group std: no z-score bound")
    row = rows[worst]
    n_over = int((a > bound * (1 + ctx.tol.rtol) + ctx.tol.atol).sum())
    message = (
        f"|A| = {value:.4g} at seq {row} exceeds sqrt(G - 1) = {bound:.4g}, the largest magnitude a z-score "
        f"(r - mean_g) / std_g can take in a group of G = {G} (with Bessel's std it is (G-1)/sqrt(G)); "
        f"{count(n_over, 'row exceeds', 'rows exceed')} it. Why it matters: the advantages were not normalised within the group, so "
        "their scale (and the effective learning rate) depends on the batch. Likely fix: take mean and std "
        "over the same G rows (rewards.view(-1, G)), not over the batch or the wrong axis (view(G, -1))."
    )
    return [ctx.finding("advantages.z_bound", ERROR, message, row, field="advantages", bound=bound, value=value)]


def _whitening_shift(ctx: StepContext, advantages: torch.Tensor, keep: torch.Tensor, offset: float) -> bool:
    """True when ``offset`` is the shift ``b`` of whitening GAE: the kept advantages are ``a * gae + b``
    (a > 0) with raw GAE recomputed from the recorded token_rewards and values (0 on masked slots,
    so whitening without re-masking leaves ``b`` there, as verl's masked_whiten does). False when
    those fields or gamma / lam are not recorded."""
    if not ctx.has("token_rewards", "values") or ctx.hyper("gamma", None) is None or ctx.hyper("lam", None) is None:
        return False
    raw, _ = formulas.gae(ctx.tensor("token_rewards"), ctx.tensor("values"), keep, float(ctx.hyper("gamma")),
                          float(ctx.hyper("lam")))
    matches, _, shift, _ = whitened_fit(advantages, raw, keep, ctx)
    return matches and abs(offset - shift) <= 10 * ctx.tol.atol + 10 * ctx.tol.rtol * abs(shift)


@register("advantages.masked_positions", "per-token advantages are 0 on masked positions", {"ppo", ""})
def check_masked_positions(ctx: StepContext):
    (advantages,) = ctx.require("advantages")
    if advantages.dim() != 2:
        raise not_applicable("advantages are per sequence here; nothing per token to check")
    keep = ctx.mask()
    leak = (advantages != 0) & ~keep & torch.isfinite(advantages)
    if not bool(leak.any()):
        return []
    b, t = (int(i) for i in leak.nonzero()[0])
    offsets = advantages[leak]
    constant = bool(((offsets - offsets[0]).abs() <= ctx.tol.atol + ctx.tol.rtol * offsets[0].abs()).all())
    if constant and (offsets.numel() > 1 or _whitening_shift(ctx, advantages, keep, float(offsets[0]))):
        # one constant on every masked slot: GAE was 0 there and the batch was whitened afterwards
        # without re-masking (verl's masked_whiten gives -mean * rsqrt(var + eps)); consumers mask it
        return [ctx.finding("advantages.masked_positions", INFO,
                            f"all {int(leak.sum())} masked positions carry the same advantage "
                            f"{float(offsets[0]):.4g} (first: seq {b}, token {t}): whitened after masking, "
                            "as verl's masked_whiten leaves them; harmless where the loss masks them.",
                            b, t, field="advantages", positions=int(leak.sum()))]
    message = (
        f"advantages[{b}, {t}] = {float(advantages[b, t]):.4g} at a masked position; "
        f"{count(int(leak.sum()), 'masked position carries', 'masked positions carry')} a non-zero advantage. Why it matters: harmless only if every consumer masks it; "
        "it also shows GAE ran across padding, so the last kept token may bootstrap from a padded value. "
        "Likely fix: zero values and rewards at masked positions before GAE (tracer.formulas.gae does)."
    )
    return [ctx.finding("advantages.masked_positions", WARNING, message, b, t, field="advantages",
                        positions=int(leak.sum()))]


@register("advantages.reward_placement", "PPO: the sequence reward sits on the last kept token of "
          "token_rewards, never on a masked position", {"ppo", ""})
def check_reward_placement(ctx: StepContext):
    (token_rewards,) = ctx.require("token_rewards")
    keep = ctx.mask()
    last = formulas.last_kept_index(keep)  # (B,)
    why = ("Why it matters: a reward on a masked position never reaches the loss, so the policy learns "
           "nothing from it. Likely fix: place the score at the last kept token, index mask.sum(1) - 1 for "
           "right-padded rows (tracer.formulas.token_rewards_from_sequence).")
    masked = (token_rewards != 0) & ~keep
    if bool(masked.any()):
        b, t = (int(i) for i in masked.nonzero()[0])
        message = (f"token_rewards[{b}, {t}] = {float(token_rewards[b, t]):.4g} sits at a masked position; the last "
                   f"kept token of seq {b} is {int(last[b])}. "
                   f"{count(int(masked.any(dim=1).sum()), 'row puts', 'rows put')} reward on masked positions. {why}")
        return [ctx.finding("advantages.reward_placement", ERROR, message, b, t, field="token_rewards",
                            last_kept=int(last[b]))]
    rewards = ctx.data.get("rewards")
    if rewards is None:
        return []
    for b in range(token_rewards.shape[0]):
        nonzero = token_rewards[b].nonzero().flatten().tolist()
        if len(nonzero) == 1 and nonzero[0] != int(last[b]) and float(rewards[b]) != 0:
            t = nonzero[0]
            message = (f"the reward of seq {b} ({float(rewards[b]):.4g}) sits on token {t}, not on the last kept "
                       f"token {int(last[b])}. {why}")
            return [ctx.finding("advantages.reward_placement", ERROR, message, b, t, field="token_rewards",
                                last_kept=int(last[b]))]
    return []
