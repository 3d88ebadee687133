"""Importance-sampling corrections for the sampler/trainer gap (TRL's ``vllm_importance_sampling_*``,
verl's ``rollout_is*``, asynchronous loops that correct a stale sampler), checked where they act.

``sampler.is_weights`` recomputes the weights from ``old_logprobs`` and ``sampler_logprobs`` under the
settings the run records (:func:`settings`: ``is_mode``, ``is_clip_min``, ``is_clip_max``,
``is_sequence_aggregation``; TRL's ``vllm_importance_sampling_*``; verl's ``rollout_is``,
``rollout_is_threshold``, ``rollout_is_batch_normalize``) with :mod:`tracer.formulas.importance`, and:

- compares them with the recorded ``is_weights [B, T]``, ``sequence_is_weights [B]`` or verl's
  ``rollout_is_weights [B, T]``; when they differ, names the one form the recorded weights do follow
  (the other sequence aggregation, a mask mode whose mask was not applied, truncate where mask was
  declared or the reverse, an uncapped or inverted ratio, per-sequence weights where per-token ones
  were declared) with the numbers;
- where the trainer keeps no weights, derives them (marked ``derived`` in the finding);
- counts the kept tokens (token modes) or sequences (sequence modes) that the cap truncated or the
  mask zeroed, and the raw ratio's range before any cap (per step);
- when the step records ``per_token_loss`` of a GRPO-style objective, tests where the weights act:
  the policy-gradient term after the clip (TRL's and verl's placement), or not at all.

Severity: error for weights that follow another rule than the declared one, or weights the loss does
not apply; info with the counts otherwise. A correction the run declares without a mode, or a mode
this module does not model, is reported as ``not checked`` (:func:`tracer.checks.coverage.not_modelled`).
"""

from __future__ import annotations

import math

from typing import Any

import torch

from tracer import formulas
from tracer.checks.context import StepContext
from tracer.checks.coverage import not_modelled
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, Skip, register
from tracer.checks.text import count
from tracer.formulas import importance

WEIGHT_FIELDS = ("is_weights", "sequence_is_weights", "rollout_is_weights")
RTOL, ATOL = 1e-3, 1e-6  # recorded (float32) weights vs the rule in float64
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-5
GRPO_STYLE = (None, "grpo", "bnpo", "dr_grpo", "dapo")


Settings = importance.Correction


def settings(ctx: StepContext) -> Settings | None:
    """The declared correction (:func:`tracer.formulas.importance.declared_correction` on the step's
    metadata and the run's hyperparameters), or None; the ``not modelled`` Skip for a correction
    declared without a mode or with one this module does not model."""
    try:
        return importance.declared_correction(lambda key: ctx.hyper(key, None),
                                              any(ctx.has(f) for f in WEIGHT_FIELDS))
    except (TypeError, ValueError) as err:
        raise not_modelled("importance-sampling correction", str(err)) from None


def _rule(old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, s: Settings, **override: Any) -> torch.Tensor:
    """The weights of ``s`` (with ``override`` of mode, clip_min, clip_max, aggregation): ``[B, T]`` for
    token modes and verl's form, ``[B]`` for sequence modes."""
    if s.verl is not None and not override:
        return importance.verl_is_weights(old, sampler, mask, *s.verl)
    args = {"mode": s.mode, "clip_min": s.clip_min, "clip_max": s.clip_max, "aggregation": s.aggregation, **override}
    return importance.correction_weights(old, sampler, mask, args["mode"], args["clip_min"], args["clip_max"],
                                         args["aggregation"])


def _per_token(weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B]`` sequence weights broadcast to ``[B, T]``; ``[B, T]`` as they are."""
    return weights.unsqueeze(1).expand_as(like) if weights.dim() == 1 else weights


def _compare(recorded: torch.Tensor, rule: torch.Tensor, keep: torch.Tensor) -> tuple[bool, float, int, int | None]:
    """(match, max |Δ|, count differing, first differing position flattened) over kept tokens
    (``[B, T]``), or over the rows when both are ``[B]``."""
    if recorded.dim() == 1 and rule.dim() == 1:
        where = keep.any(dim=1)
        a, b = recorded.double(), rule.double()
    else:
        where = keep
        a, b = _per_token(recorded.double(), keep), _per_token(rule.double(), keep)
    close = torch.isclose(a, b, rtol=RTOL, atol=ATOL) | ~where
    bad = ~close
    n = int(bad.sum())
    delta = float((a - b).abs()[where].max()) if bool(where.any()) else 0.0
    return n == 0, delta, n, (int(bad.flatten().nonzero()[0]) if n else None)


def _alternatives(s: Settings, recorded: torch.Tensor, declared_token: bool) -> list[tuple[str, dict[str, Any]]]:
    """Named wrong forms of the declared correction, as overrides of :func:`_rule`."""
    out: list[tuple[str, dict[str, Any]]] = []
    if s.mode.startswith("sequence"):
        other = "mean" if s.aggregation == "sum" else "sum"
        form = "sum (the product of the token ratios)" if other == "sum" else "mean (the geometric mean)"
        out.append((f"exp of the {form} of old − sampler over each sequence's kept tokens, where "
                    f"is_sequence_aggregation = {s.aggregation} declares the {s.aggregation}", {"aggregation": other}))
    kind = "truncate" if s.mode.endswith("truncate") else "mask"
    level = s.mode.split("_")[0]
    if kind == "mask":
        out.append((f"the raw ratio exp(old − sampler) with no mask: {s.mode}'s zeroing outside [{s.clip_min}, "
                    f"{s.clip_max}]{' (IcePop)' if s.clip_min is not None and s.clip_max is not None else ''} was "
                    "not applied", {"mode": f"{level}_truncate", "clip_min": None, "clip_max": None}))
        out.append((f"clamped to [{s.clip_min}, {s.clip_max}] ({level}_truncate) where {s.mode} declares them zeroed "
                    "outside", {"mode": f"{level}_truncate"}))
    else:
        out.append((f"the raw ratio exp(old − sampler): the {s.mode} cap [{s.clip_min}, {s.clip_max}] was not applied",
                    {"clip_min": None, "clip_max": None}))
        out.append((f"zeroed outside [{s.clip_min}, {s.clip_max}] ({level}_mask) where {s.mode} declares them clamped",
                    {"mode": f"{level}_mask"}))
    if declared_token and recorded.dim() == 2:
        for agg in importance.SEQUENCE_AGGREGATIONS:
            out.append((f"one weight per sequence (exp of the {agg} of old − sampler, {s.mode.replace('token', 'sequence')}) "
                        f"broadcast over its tokens, where {s.mode} declares one per token",
                        {"mode": s.mode.replace("token", "sequence"), "aggregation": agg}))
    return out


def _inverted(old, sampler, mask, s: Settings) -> torch.Tensor:
    return _rule(sampler, old, mask, s, mode=s.mode)


def _diagnose(name: str, recorded: torch.Tensor, old, sampler, mask, s: Settings) -> str | None:
    """The wrong form the recorded weights follow, or None when none of the named ones does."""
    declared_token = s.mode.startswith("token")
    for text, override in _alternatives(s, recorded, declared_token):
        if _compare(recorded, _rule(old, sampler, mask, s, **override), mask)[0]:
            return text
    if _compare(recorded, _inverted(old, sampler, mask, s), mask)[0]:
        return f"the inverted ratio exp(sampler − old) under {s.mode}: the correction divides where it should multiply"
    return None


def _where_applied(ctx: StepContext, weights: torch.Tensor, keep: torch.Tensor) -> tuple[str, bool]:
    """(what per_token_loss says about where the weights act, whether that is an error). Tests a
    GRPO-style per-token loss with the weights on the clipped policy-gradient term against one without
    them; '' when the step does not record what that needs."""
    if not ctx.has("per_token_loss", "policy_logprobs", "advantages") or ctx.algorithm not in ("grpo", ""):
        return "", False
    if ctx.hyper("loss_type", None) not in GRPO_STYLE or ctx.hyper("importance_sampling_level", "token") != "token":
        return "", False
    if ctx.data["advantages"].dim() != 1 or ctx.hyper("clip_epsilon_high", None) is None:
        return "", False
    beta = float(ctx.hyper("beta", 0.0) or 0.0)
    if beta and not ctx.has("ref_logprobs"):
        return "", False
    policy, old, advantages = ctx.tensor("policy_logprobs").double(), ctx.old_logprobs().double(), ctx.tensor("advantages").double()
    ref = ctx.tensor("ref_logprobs").double() if beta else None
    eps_high = float(ctx.hyper("clip_epsilon_high"))
    eps_low = float(ctx.hyper("clip_epsilon_low", eps_high))
    recorded = ctx.tensor("per_token_loss").double()

    def matches(w):
        rule = formulas.grpo_per_token_loss(policy, old, advantages, eps_low, eps_high, beta, ref, sampler_weights=w)
        return bool((torch.isclose(recorded, rule, rtol=LOSS_RTOL, atol=LOSS_ATOL) | ~keep).all())

    w = weights.double()
    if matches(w):
        return "applied to the policy-gradient term after the clip (per_token_loss matches)", False
    w_tokens = _per_token(w, keep)
    if matches(None) and bool((~torch.isclose(w_tokens, torch.ones_like(w_tokens), rtol=RTOL, atol=ATOL) & keep).any()):
        differ = int((~torch.isclose(w_tokens, torch.ones_like(w_tokens), rtol=RTOL, atol=ATOL) & keep).sum())
        return (f"not applied: per_token_loss equals the clipped surrogate without them, although {differ} kept "
                f"tokens have a weight ≠ 1 (mean {float(w_tokens[keep].mean()):.4f})"), True
    return "", False


@register("sampler.is_weights", "importance-sampling weights recomputed from old and sampler logprobs under the "
          "recorded mode, caps and sequence aggregation (TRL and verl forms); tokens or sequences the correction "
          "truncated or masked counted; the weights applied to the policy-gradient term after the clip",
          RL_ALGORITHMS)
def check_is_weights(ctx: StepContext):
    s = settings(ctx)
    if s is None:
        return []
    name = next((f for f in WEIGHT_FIELDS if ctx.has(f)), None)
    old = ctx.old_logprobs().double()
    if not ctx.has("sampler_logprobs"):
        raise Skip(f"an importance-sampling correction ({s.text()}) needs field sampler_logprobs to recompute its "
                   "weights, which these do not record")
    sampler = ctx.tensor("sampler_logprobs").double()
    keep = ctx.mask() & torch.isfinite(old) & torch.isfinite(sampler)
    if not bool(keep.any()):
        return []
    sampler = torch.where(torch.isfinite(sampler), sampler, old)  # NaN from the engine: weight 1, as TRL does
    rule = _rule(old, sampler, keep, s)
    sequence = s.mode.startswith("sequence")
    raw = importance.raw_is_ratio(old, sampler, keep, s.mode, s.aggregation)
    cut = importance.outside_caps(raw, s.clip_min, s.clip_max)
    live_rows = keep.any(dim=1)
    n_units = int(live_rows.sum()) if sequence else int(keep.sum())
    n_cut = int((cut & live_rows).sum()) if sequence else int((cut & keep).sum())
    unit = "sequences" if sequence else "tokens"
    verb = "zeroed" if s.mode.endswith("mask") else "truncated"
    raw_kept = raw[live_rows] if sequence else raw[keep]
    details: dict[str, Any] = {"is_mode": s.mode, "is_clip_min": s.clip_min, "is_clip_max": s.clip_max,
                               "is_sequence_aggregation": s.aggregation, "unit": unit, "count": n_units,
                               f"{verb}_{unit}": n_cut, "cut": n_cut, "raw_min": float(raw_kept.min()),
                               "raw_max": float(raw_kept.max()), "is_weights_source": "recorded" if name else "derived"}
    if name is None:
        weights = rule
        source = "derived from old_logprobs and sampler_logprobs (the trainer records no weights)"
    else:
        weights = ctx.tensor(name).double()
        source = f"recorded as {name}"
        if weights.dim() == 1 and not sequence:
            return [ctx.finding("sampler.is_weights", ERROR, (
                f"{name}: one weight per sequence [B] recorded where {s.text()} declares one per token; the loss "
                "weighs every token of a row alike, so the token-level correction did not run."), field=name, **details)]
        if s.verl is not None and s.verl[2]:
            # verl's batch normalisation divides by the mean weight of the whole batch, and a worker file holds a
            # micro-batch of it: the recorded weights are the declared un-normalised ones times one scale per file
            base = importance.verl_is_weights(old, sampler, keep, s.verl[0], s.verl[1], False)
            on = keep & (_per_token(base, keep) > 0)
            if bool(on.any()):
                scale = float((_per_token(weights, keep)[on] / _per_token(base, keep)[on]).median())
                if math.isfinite(scale) and scale > 0:
                    rule = base * scale
                    details["batch_normalize_scale"] = scale
        ok, delta, n_bad, first = _compare(weights, rule, keep)  # [B, T] sequence weights: verl's broadcast layout
        if not ok:
            wrong = _diagnose(name, weights, old, sampler, keep, s) if s.verl is None else None
            if rule.dim() == 1 and weights.dim() == 1:
                b, t = first, None
                shown = f"seq {b}: recorded {float(weights[b]):.6g}, declared rule {float(rule[b]):.6g}, raw ratio {float(raw[b]):.6g}"
            else:
                b, t = divmod(first, keep.shape[1])
                r_bt = float(_per_token(rule, keep)[b, t])
                raw_bt = float(_per_token(raw, keep)[b, t])
                shown = (f"seq {b}, token {t}: recorded {float(_per_token(weights, keep)[b, t]):.6g}, declared rule "
                         f"{r_bt:.6g}, raw ratio {raw_bt:.6g}")
            what = (f"{name} are {wrong}" if wrong else
                    f"{name} follow none of the modelled forms of {s.text()}")
            message = (f"{what}: {n_bad} {'rows' if rule.dim() == 1 and weights.dim() == 1 else 'kept tokens'} differ "
                       f"from the declared rule ({s.text()}) by up to {delta:.4g}; {shown}. The raw ratio of the "
                       f"kept {unit} spans [{details['raw_min']:.4g}, {details['raw_max']:.4g}]; the declared rule "
                       f"{verb} {n_cut} of {n_units}.")
            return [ctx.finding("sampler.is_weights", ERROR, message, b, t, field=name, weights_max_abs_diff=delta,
                                differing=n_bad, wrong_form=wrong, **details)]
    applied, applied_error = _where_applied(ctx, weights, keep)
    w_kept = _per_token(weights, keep)[keep] if not sequence or weights.dim() == 2 else weights[live_rows]
    details.update(weights_mean=float(w_kept.mean()), weights_min=float(w_kept.min()), weights_max=float(w_kept.max()),
                   applied=applied or None)
    if applied_error:
        (b, t) = divmod(int((keep & ~torch.isclose(_per_token(weights, keep), torch.ones_like(_per_token(weights, keep)),
                                                   rtol=RTOL, atol=ATOL)).flatten().nonzero()[0]), keep.shape[1])
        return [ctx.finding("sampler.is_weights", ERROR, (
            f"{name or 'is_weights (derived)'} {applied} under {s.text()}: the update ignores the sampler/trainer "
            f"correction the run declares (weights {source})."), b, t, field="per_token_loss", **details)]
    message = (f"importance sampling ({s.text()}), weights {source}: match the declared rule; over {n_units} kept "
               f"{unit} mean {details['weights_mean']:.4f}, min {details['weights_min']:.4f}, max "
               f"{details['weights_max']:.4f}; raw ratio before any cap in [{details['raw_min']:.4g}, "
               f"{details['raw_max']:.4g}]; the correction {verb} {count(n_cut, unit[:-1])} of {n_units}.")
    if applied:
        message += f" Weights {applied}."
    rejected = rejected_tokens(ctx)
    if rejected is not None:
        details["rejected_tokens"] = rejected
        message += (f" verl's rejection sampling (rollout_rs = {ctx.hyper('rollout_rs')}) rejects "
                    f"{count(rejected, 'kept token')} of {int(keep.sum())}.")
    return [ctx.finding("sampler.is_weights", INFO, message, field=name or "sampler_logprobs", **details)]


def rejected_tokens(ctx: StepContext) -> int | None:
    """Kept tokens verl's rejection sampling (metadata ``rollout_rs`` with ``rollout_rs_threshold``)
    rejects on this step, recomputed from old and sampler logprobs; None when not declared or not computable."""
    option, threshold = ctx.hyper("rollout_rs", None), ctx.hyper("rollout_rs_threshold", None)
    if option is None or threshold is None or not ctx.has("sampler_logprobs", "completion_mask"):
        return None
    old, sampler = ctx.old_logprobs().double(), ctx.tensor("sampler_logprobs").double()
    mask = ctx.mask().double()
    kept = importance.verl_rejection_mask(old, sampler, mask, str(option), threshold)
    return int((mask - kept).sum())

