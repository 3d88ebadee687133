"""The configuration in effect, told from the tensors, against the one the run declares (verl).

A setting can be right in the config and wrong where it is used: ``fit`` reads it into an argument,
a function ignores the argument, a hard-coded value wins. :mod:`tracer.integrations.verl` records
both sides (``declared_<key>`` from the config objects, ``<key>`` from the call), and these checks
ask the recorded tensors which setting actually ran:

- ``recompute.loss_agg_mode``: the recorded ``verl_pg_loss`` against verl's ``agg_loss`` under every
  ``loss_agg_mode`` (:data:`tracer.formulas.verl_losses.VERL_LOSS_AGG_MODES`), applied to the per-token
  loss the policy loss aggregated (``verl_pg_losses``; else, for the ``vanilla`` loss, recomputed
  with :func:`~tracer.formulas.verl_losses.verl_vanilla_per_token_loss`), with the global mini-batch
  counts the call used (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``).
- ``recompute.per_token_loss`` on a verl worker file (:func:`verl_pg_losses_findings`): the per-token loss
  verl's policy loss aggregated (``verl_pg_losses``) against the registered loss recomputed from the
  recorded logprobs, advantages and clip ratios (``vanilla`` with its dual clip ``clip_ratio_c``, ``gspo``,
  ``cispo``, ``gpg``: :data:`tracer.formulas.verl_losses.VERL_POLICY_LOSSES`); a loss tracer does not model
  is named in the report's ``not checked:`` lines.
- ``recompute.advantage_std``: verl GRPO's recorded advantages against the rule with and without the
  std normalisation (``norm_adv_by_std_in_grpo``), recomputed from ``rewards`` per group.
- ``recompute.declared_settings``: any other recorded setting whose value at the call differs from
  the config's (verl: estimator, γ, λ, clip ratios, temperature, the KL penalty in the rewards; TRL
  (:func:`tracer.integrations.trl_metadata.settings_in_effect`): loss type, β, ε, the sampling
  settings ``generate`` used).

An error's first line names the setting in effect and the declared one, with the numbers; the
second says where the two parted, from what was recorded at each call.
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.advantage_rules import empty_rows, full_groups
from tracer.checks.context import StepContext
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, Skip, not_applicable, register
from tracer.checks.comparison import compare
from tracer.checks.coverage import not_modelled
from tracer.formulas.verl_losses import (
    VERL_LOSS_AGG_MODES,
    VERL_POLICY_LOSSES,
    verl_agg_loss,
    verl_cispo_per_token_loss,
    verl_gpg_per_token_loss,
    verl_gspo_per_token_loss,
    verl_vanilla_per_token_loss,
)

VERL_GRPO_ESTIMATORS = ("grpo", "grpo_vectorized")
# verl policy losses that aggregate with a fixed mode whatever loss_agg_mode says, by design (verl 0.9.1
# core_algos.compute_policy_loss_sapo: agg_loss(..., loss_agg_mode="seq-mean-token-mean"))
VERL_FIXED_AGG_MODES = {"sapo": "seq-mean-token-mean"}


def _tolerance(ctx: StepContext, value: float) -> float:
    return 10 * ctx.tol.atol + 10 * ctx.tol.rtol * abs(value)


# -- loss aggregation -------------------------------------------------------------------------------


def _per_token_pg_loss(ctx: StepContext) -> tuple[torch.Tensor, str]:
    """``[B, T]`` per-token policy loss and where it comes from; Skip when neither recorded nor recomputable."""
    if ctx.has("verl_pg_losses"):
        return ctx.tensor("verl_pg_losses").double(), "the recorded pg_losses (the loss_mat agg_loss received)"
    loss_mode = ctx.hyper("loss_mode", None)
    if loss_mode != "vanilla":
        raise Skip(f"needs field verl_pg_losses (policy loss {loss_mode!r} is recomputed only when it is 'vanilla')")
    policy, old, _ = ctx.require("policy_logprobs", "old_logprobs", "completion_mask")
    advantages = ctx.tensor("token_advantages") if ctx.has("token_advantages") else ctx.require("advantages")[0]
    low, high = ctx.hyper("clip_epsilon_low"), ctx.hyper("clip_epsilon_high")
    weights = ctx.tensor("rollout_is_weights").double() if ctx.has("rollout_is_weights") else None
    losses = verl_vanilla_per_token_loss(policy.double(), old.double(), advantages.double(), float(low), float(high),
                                         float(ctx.hyper("clip_ratio_c", 3.0)), weights)
    return losses, "the vanilla loss recomputed per token (tracer.formulas.verl_vanilla_per_token_loss)"


def verl_per_token_loss(ctx: StepContext, loss_mode: str, dual_clip: bool = True) -> torch.Tensor:
    """verl's registered policy loss ``loss_mode`` per token ``[B, T]`` (float64) from the recorded
    ``policy_logprobs``, ``old_logprobs``, advantages (``token_advantages`` or per-row ``advantages``),
    clip ratios, ``clip_ratio_c`` (the call's, else the config's, else verl's 3.0) and ``rollout_is_weights``;
    ``dual_clip=False``: the vanilla loss without its dual clip (to name a loss that lacks it). A
    :func:`not_modelled` skip for a loss tracer does not model."""
    if not VERL_POLICY_LOSSES.get(loss_mode):
        modelled = ", ".join(k for k, v in VERL_POLICY_LOSSES.items() if v)
        raise not_modelled(f"verl policy loss {loss_mode!r}", f"tracer recomputes {modelled}; the per-token loss "
                           "of this one is not checked (its aggregation is: recompute.loss_agg_mode)")
    policy, old, keep = ctx.require("policy_logprobs", "old_logprobs", "completion_mask")
    advantages = ctx.tensor("token_advantages") if ctx.has("token_advantages") else ctx.require("advantages")[0]
    policy, old, advantages = policy.double(), old.double(), advantages.double()
    weights = ctx.tensor("rollout_is_weights").double() if ctx.has("rollout_is_weights") else None
    if loss_mode == "gpg":
        return verl_gpg_per_token_loss(policy, advantages, weights)
    low, high = (float(_first_hyper(ctx, f"clip_epsilon_{side}", f"clip_ratio_{side}", "clip_ratio"))
                 for side in ("low", "high"))
    if loss_mode == "gspo":
        return verl_gspo_per_token_loss(policy, old, advantages, keep.bool(), low, high, weights)
    if loss_mode == "cispo":
        return verl_cispo_per_token_loss(policy, old, advantages, low, high, weights)
    c = float(ctx.hyper("clip_ratio_c", None) or ctx.hyper("declared_clip_ratio_c", None) or 3.0)
    return verl_vanilla_per_token_loss(policy, old, advantages, low, high, c if dual_clip else float("inf"), weights)


def _first_hyper(ctx: StepContext, *names: str):
    """The first of ``names`` the step records (:meth:`StepContext.hyper`); Skip naming them all when none is
    (verl's integration records CISPO's clip ratios as ``clip_ratio_low`` / ``_high``, not as epsilons)."""
    for name in names:
        value = ctx.hyper(name, None)
        if value is not None:
            return value
    raise Skip(f"needs one of the metadata keys {', '.join(names)}, which this step does not record")


def verl_pg_losses_findings(ctx: StepContext, check: str = "recompute.per_token_loss"):
    """``recompute.per_token_loss`` on a verl worker file (:mod:`tracer.checks.per_token_loss` calls it when the
    file holds ``verl_pg_losses`` and no ``per_token_loss``): the recorded per-token policy loss against the
    registered loss recomputed; the dual clip named first when the recorded losses lack it."""
    loss_mode = str(ctx.hyper("loss_mode", "vanilla"))
    recorded = ctx.tensor("verl_pg_losses")
    expected = verl_per_token_loss(ctx, loss_mode)
    formula = f"verl's {loss_mode!r} policy loss ({VERL_POLICY_LOSSES[loss_mode]})"
    findings = compare(ctx, check, "verl_pg_losses", recorded, expected, ctx.mask(), formula)
    if findings and loss_mode == "vanilla" and not compare(ctx, check, "verl_pg_losses", recorded,
                                                           verl_per_token_loss(ctx, loss_mode, False), ctx.mask(), ""):
        c = float(ctx.hyper("clip_ratio_c", None) or ctx.hyper("declared_clip_ratio_c", None) or 3.0)
        r = torch.exp(ctx.tensor("policy_logprobs").double() - ctx.tensor("old_logprobs").double())
        adv = ctx.tensor("token_advantages") if ctx.has("token_advantages") else ctx.tensor("advantages")
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        binds = ctx.mask() & (adv < 0) & (r > c)
        findings[0].message = (f"dual clip missing: the recorded pg_losses are the clipped surrogate without the dual "
                               f"clip, while clip_ratio_c = {c:g} is the config's: on {int(binds.sum())} kept tokens "
                               f"with A < 0 and ratio > {c:g} the loss is not capped at -{c:g}·A (verl "
                               "compute_policy_loss_vanilla). " + findings[0].message)
        findings[0].details.update(cause="dual_clip_missing", clip_ratio_c=c)
    return findings


def agg_candidates(ctx: StepContext, per_token_loss: torch.Tensor) -> dict[str, float]:
    """The scalar loss under every verl ``loss_agg_mode``, with the global mini-batch counts the step recorded."""
    keep = ctx.mask()
    counts = {k: ctx.hyper(k, None) for k in ("batch_num_tokens", "global_batch_size", "loss_scale_factor")}
    dp_size = int(ctx.hyper("dp_size", 1) or 1)
    return {mode: float(verl_agg_loss(per_token_loss, keep, mode, dp_size, **counts)) for mode in VERL_LOSS_AGG_MODES}


def _where_agg_parted(ctx: StepContext, effective: str, declared: str) -> str:
    """Which recorded call first used ``effective`` instead of ``declared``."""
    argument = ctx.hyper("loss_agg_mode_argument", None)
    at_call = ctx.hyper("loss_agg_mode", None)
    loss_mode = ctx.hyper("loss_mode", "?")
    if argument is not None and argument != declared:
        return (f"ppo_loss called the policy loss {loss_mode!r} with loss_agg_mode {argument!r} while the ActorConfig "
                f"it received says {declared!r}: the config's value did not reach the call.")
    if at_call is not None and at_call != argument and at_call == effective:
        return (f"the policy loss {loss_mode!r} received loss_agg_mode {argument!r} and called agg_loss with "
                f"{at_call!r}: the loss does not aggregate with its argument.")
    if ctx.hyper("pg_losses_from", None) != "agg_loss":
        return (f"config and the loss_agg_mode argument of the policy loss {loss_mode!r} say {declared!r}, yet the "
                f"value is {effective!r}'s: the loss's aggregation is not {declared!r} (its agg_loss call was not "
                "recorded: an agg_loss other than verl's, or a loss that aggregates by itself).")
    return (f"config, the policy loss {loss_mode!r} and its agg_loss call all say {declared!r}, yet the value is "
            f"{effective!r}'s: agg_loss itself aggregates differently from verl's {declared!r}.")


@register("recompute.loss_agg_mode", "verl's recorded pg_loss is the declared loss_agg_mode of its per-token loss "
          "(names the mode in effect)", RL_ALGORITHMS)
def check_loss_agg_mode(ctx: StepContext):
    if "verl_pg_loss" not in ctx.data:
        return []  # not a verl worker file (only tracer.integrations.verl records pg_loss): not applicable
    (pg_loss,) = ctx.require("verl_pg_loss")
    recorded = float(pg_loss.reshape(()))
    declared = ctx.hyper("declared_loss_agg_mode", None) or ctx.hyper("loss_agg_mode")
    if declared not in VERL_LOSS_AGG_MODES:
        raise Skip(f"loss_agg_mode {declared!r} is not one of verl's ({', '.join(VERL_LOSS_AGG_MODES)})")
    losses, source = _per_token_pg_loss(ctx)
    candidates = agg_candidates(ctx, losses)
    gaps = {mode: abs(value - recorded) for mode, value in candidates.items()}
    matches = [m for m in candidates if gaps[m] <= _tolerance(ctx, recorded)]
    if declared in matches:
        return []
    by_mode = ", ".join(f"{m} {v:.6g}" for m, v in candidates.items())
    if not matches:
        if not ctx.has("verl_pg_losses"):  # a recomputation that matches nothing: the loss is not the one modelled
            raise Skip(f"the recomputed vanilla loss matches no loss_agg_mode (recorded {recorded:.6g}; {by_mode})")
        return [ctx.finding("recompute.loss_agg_mode", ERROR, (
            f"pg_loss {recorded:.6g} is no verl loss_agg_mode of the per-token loss agg_loss received (config "
            f"declares {declared}): {by_mode}.\nagg_loss was called with {ctx.hyper('loss_agg_mode', '?')!r}, "
            f"dp_size {ctx.hyper('dp_size', 1)}, batch_num_tokens {ctx.hyper('batch_num_tokens', None)}, "
            f"global_batch_size {ctx.hyper('global_batch_size', None)}: its aggregation is not verl's."),
            field="verl_pg_loss", declared=declared, candidates=candidates)]
    at_call = ctx.hyper("loss_agg_mode", None)
    effective = at_call if at_call in matches else matches[0]
    loss_mode = ctx.hyper("loss_mode", None)
    if VERL_FIXED_AGG_MODES.get(loss_mode) in matches:
        fixed = VERL_FIXED_AGG_MODES[loss_mode]
        return [ctx.finding("recompute.loss_agg_mode", INFO, (
            f"policy loss {loss_mode!r} aggregates with {fixed} whatever loss_agg_mode says (verl's own design, "
            f"core_algos.compute_policy_loss_{loss_mode}); config declares {declared}: recorded pg_loss {recorded:.6g} "
            f"equals agg_loss(..., '{fixed}') to {gaps[fixed]:.1g}; {declared} gives {candidates[declared]:.6g}."),
            field="verl_pg_loss", in_effect=fixed, declared=declared)]
    message = (f"loss aggregation in effect is {effective}, config declares {declared}: recorded pg_loss {recorded:.6g} "
               f"equals agg_loss(..., '{effective}') to {gaps[effective]:.1g}; {declared} gives "
               f"{candidates[declared]:.6g}.\n{_where_agg_parted(ctx, effective, declared)} Per-token loss: {source}; "
               f"every mode: {by_mode}.")
    return [ctx.finding("recompute.loss_agg_mode", ERROR, message, field="verl_pg_loss", in_effect=effective,
                        declared=declared, matching_modes=matches, candidates=candidates)]


# -- GRPO std normalisation -------------------------------------------------------------------------


def _grpo_rule(norm_by_std: bool) -> str:
    return "z-score (r - mean_g) / (std_g + 1e-6)" if norm_by_std else "mean-centring r - mean_g (no std)"


def advantage_std_in_effect(ctx: StepContext) -> dict:
    """verl GRPO's recorded advantages against the rule with and without the std normalisation, on the
    step's complete groups. Returns ``{True: (max |Δ|, recomputed [N]), False: ...}``, the rows compared
    and the recorded values; Skip when the step is not verl GRPO or lacks rewards, advantages or groups."""
    estimator = ctx.hyper("adv_estimator", None)
    if estimator not in VERL_GRPO_ESTIMATORS:
        raise not_applicable(f"applies to verl's GRPO estimators {VERL_GRPO_ESTIMATORS} (metadata adv_estimator = "
                             f"{estimator!r})")
    advantages, rewards = ctx.require("advantages", "rewards")
    if advantages.dim() != 1 or not bool(torch.isfinite(rewards).all()):
        raise Skip("needs per-sequence advantages [B] and finite rewards")
    groups, G = full_groups(ctx, rewards.shape[0])
    empty = empty_rows(ctx)
    rows = [r for g in groups for r in g]
    ids = torch.arange(len(groups)).repeat_interleave(G)  # (N,) rows come group by group
    live = torch.tensor([not (r in empty and float(advantages[r]) == 0.0) for r in rows])  # rollout_rs drops
    recorded = advantages[rows].double()
    out = {}
    for norm in (True, False):
        expected = formulas.verl_grpo_advantages(rewards[rows], ids, norm_by_std=norm).double()
        gap = torch.where(live, (recorded - expected).abs(), 0.0)
        tol = 10 * ctx.tol.atol + 10 * ctx.tol.rtol * expected.abs()
        out[norm] = (float(gap.max()), expected, bool((gap <= tol).all()))
    return {"rules": out, "rows": rows, "recorded": recorded}


def _where_std_parted(ctx: StepContext, effective: bool, declared: bool) -> str:
    at_call = ctx.hyper("norm_adv_by_std_in_grpo", None)
    estimator = ctx.hyper("adv_estimator", "?")
    if at_call is not None and bool(at_call) != declared:
        return (f"compute_advantage was called with norm_adv_by_std_in_grpo={bool(at_call)}: the config's value did "
                "not reach the call.")
    if estimator != "grpo":
        return (f"compute_advantage was called with norm_adv_by_std_in_grpo={declared}, but adv_estimator "
                f"{estimator!r} did not apply it (verl 0.9.1's compute_advantage passes the flag only to 'grpo'; a "
                "registry estimator gets config and keeps its own default).")
    return (f"compute_advantage was called with norm_adv_by_std_in_grpo={declared} and adv_estimator 'grpo', yet the "
            f"advantages are {'' if effective else 'not '}divided by the group std: the estimator ignores the flag.")


@register("recompute.advantage_std", "verl GRPO's advantages follow the declared norm_adv_by_std_in_grpo (names "
          "the one in effect)", RL_ALGORITHMS)
def check_advantage_std(ctx: StepContext):
    if ctx.hyper("adv_estimator", None) not in VERL_GRPO_ESTIMATORS:
        return []  # not verl's GRPO (another estimator, or not a verl trace): not applicable, not skipped
    found = advantage_std_in_effect(ctx)
    rules, rows, recorded = found["rules"], found["rows"], found["recorded"]
    declared = ctx.hyper("declared_norm_adv_by_std_in_grpo", None)
    declared = bool(ctx.hyper("norm_adv_by_std_in_grpo", True) if declared is None else declared)
    if rules[declared][2] or not rules[not declared][2]:
        return []  # the declared rule holds, or neither does (recompute.advantages reports that)
    effective = not declared
    gap_in_effect, _, _ = rules[effective]
    _, expected, _ = rules[declared]
    i = int((recorded - expected).abs().argmax())
    message = (f"advantage std normalisation in effect is {'on' if effective else 'off'}, config declares "
               f"norm_adv_by_std_in_grpo={declared}: recorded advantages equal verl's GRPO {_grpo_rule(effective)} "
               f"to {gap_in_effect:.1g} over {len(rows)} rows; norm_adv_by_std_in_grpo={declared} gives "
               f"{float(expected[i]):.6g} at seq {rows[i]} (recorded {float(recorded[i]):.6g}).\n"
               f"{_where_std_parted(ctx, effective, declared)}")
    return [ctx.finding("recompute.advantage_std", ERROR, message, rows[i], field="advantages",
                        in_effect=effective, declared=declared)]


# -- other settings: the value at the call against the config's -------------------------------------

# key recorded at the call -> (the declared key, what the value at the call is)
COMPARED_SETTINGS = {
    # verl (tracer.integrations.verl)
    "adv_estimator": ("declared_adv_estimator", "the advantage estimator compute_advantage ran"),
    "gamma": ("declared_gamma", "the γ compute_advantage was called with"),
    "lam": ("declared_lam", "the λ compute_advantage was called with"),
    "clip_ratio_low": ("declared_clip_ratio_low", "the clip_ratio_low of the config the policy loss received"),
    "clip_ratio_high": ("declared_clip_ratio_high", "the clip_ratio_high of the config the policy loss received"),
    "clip_ratio_c": ("declared_clip_ratio_c", "the dual-clip clip_ratio_c of the config the policy loss received"),
    "use_kl_in_reward": ("declared_use_kl_in_reward", "a KL penalty in the rewards (token_level_rewards differ "
                                                      "from token_level_scores)"),
    # TRL (tracer.integrations.trl_metadata.settings_in_effect) and verl's worker temperature
    "temperature": ("declared_temperature", "the temperature the trainer divides the logits by when it scores "
                                            "logprobs"),
    "generation_temperature": ("declared_temperature", "the temperature generate() sampled with (GenerationConfig; "
                                                       "TRL's generation_kwargs override the config's field)"),
    "generation_top_p": ("declared_top_p", "the top_p generate() sampled with (GenerationConfig)"),
    "generation_top_k": ("declared_top_k", "the top_k generate() sampled with (GenerationConfig)"),
    "generation_min_p": ("declared_min_p", "the min_p generate() sampled with (GenerationConfig)"),
    "generation_repetition_penalty": ("declared_repetition_penalty", "the repetition_penalty generate() sampled "
                                                                     "with (GenerationConfig)"),
    "loss_type": ("declared_loss_type", "the loss_type _compute_loss branched on"),
    "beta": ("declared_beta", "the β _compute_loss used"),
    "clip_epsilon_low": ("declared_clip_epsilon_low", "the lower clip ε _compute_loss used"),
    "clip_epsilon_high": ("declared_clip_epsilon_high", "the upper clip ε _compute_loss used"),
    "importance_sampling_level": ("declared_importance_sampling_level", "the ratio level _compute_loss used"),
    "scale_rewards": ("declared_scale_rewards", "the reward scaling the advantages used"),
    "num_generations": ("declared_num_generations", "the group size the advantages used"),
    "mask_truncated_completions": ("declared_mask_truncated_completions", "the truncation masking the rollout used"),
}


def _differs(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(float(a) - float(b)) > 1e-6 * max(1.0, abs(float(b)))
    return a != b


@register("recompute.declared_settings", "a setting at the call (verl: estimator, γ, λ, clip ratios, KL in the "
          "rewards; TRL: loss type, β, ε, sampling settings) equals the config's", RL_ALGORITHMS)
def check_declared_settings(ctx: StepContext):
    findings = []
    for key, (declared_key, what) in COMPARED_SETTINGS.items():
        at_call, declared = ctx.hyper(key, None), ctx.hyper(declared_key, None)
        if at_call is None or declared is None or not _differs(at_call, declared):
            continue
        if key == "use_kl_in_reward" and not at_call:
            continue  # declared but not showing: KL(old || ref) is 0 while the policy equals the reference
        evidence = (f" (max |token_level_rewards - token_level_scores| {ctx.hyper('kl_in_reward_max_abs', 0.0):.3g})"
                    if key == "use_kl_in_reward" else "")
        findings.append(ctx.finding("recompute.declared_settings", ERROR, (
            f"{key} in effect is {at_call!r}, config declares {declared_key.removeprefix('declared_')} = "
            f"{declared!r}{evidence}.\n{what[0].upper() + what[1:]} differs from the config the run was started "
            "with: the config's value did not reach the call."), setting=key, in_effect=at_call, declared=declared))
    # a trace without declared_<setting> metadata (only the verl and TRL integrations record the config's
    # values beside those at the call) has nothing to compare: not applicable, so no skipped line
    return findings


__all__ = ["COMPARED_SETTINGS", "VERL_FIXED_AGG_MODES", "VERL_GRPO_ESTIMATORS", "advantage_std_in_effect", "agg_candidates",
           "check_advantage_std", "check_declared_settings", "check_loss_agg_mode"]
