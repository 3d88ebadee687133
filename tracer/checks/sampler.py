"""Sampler vs trainer (SPEC.md section 6): when the inference engine reported its own logprobs,
compare them with the trainer's for the same tokens.

``sampler.mismatch`` reports, over kept tokens, both conventions of the mismatch:

- log space (TRL's ``sampling/sampling_logp_difference``): mean, mean |·|, max |·| and quantiles
  of ``old - sampler`` in nats, and the share of tokens whose ratio ``exp(old - sampler)`` lies
  outside [1/C, C] (C = ``CheckOptions.sampler_ratio_bound``, default 2);
- probability space (verl's ``rollout_probs_diff``): mean and max of ``|p_old - p_sampler|``;

plus the worst tokens and, when the trace records them (TRL with vLLM), what TRL's importance-sampling
correction did: the weights, how many tokens or sequences its cap truncated or masked, and for
sequence modes whether the sequence ratio was aggregated by sum or by mean (trl#5814).

Cause. :func:`tracer.checks.sampler_patterns.diagnose` tests each plausible cause against the data
(temperature on one side, truncation when top-p/top-k/min-p is in effect or unrecorded, a sampler
penalty on repeated tokens, a stale policy, a constant offset) with the sampler's settings in effect
(``sampler_*`` metadata, read from the engine's ``SamplingParams``; else the trainer's
``temperature``/``top_p``/``top_k``) and names the one that explains it, or says that none does.

Severity. Error: a cause found, an engine that reports raw logprobs while it samples with
temperature or truncation, or a mismatch beyond the error bounds. Warning: beyond the warning
bounds, or an importance-sampling correction that is length-biased or differs from the recorded
settings. Info: within the noise of the engine's dtype (``sampler_dtype``: ~5e-3 nats for a bf16
vLLM engine, ~0 for fp32; :func:`tracer.checks.sampler_patterns.noise_floor`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tracer import formulas
from tracer.checks import importance, staleness  # noqa: F401  (register sampler.is_weights, sampler.policy_lag)
from tracer.checks import sampler_patterns as patterns
from tracer.checks.context import NO_ENGINE, StepContext, check_memo, engine_sampled, worst_positions
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, WARNING, not_applicable, register
from tracer.checks.identity import is_fresh
from tracer.errors import TraceError

QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)
WARN_SHARE, ERROR_SHARE = 0.01, 0.10  # share of tokens outside [1/C, C]
WARN_MEAN, ERROR_MEAN = 0.05, 0.5  # |mean(old - sampler)| in nats
WARN_PROB = 0.05  # mean |p_old - p_sampler|
LENGTH_BIAS_SHARE = 0.1  # sequences the sum-aggregated correction cut but a mean would keep
WEIGHT_RTOL = 1e-3  # recorded IS weights vs TRL's rule recomputed in float64
MAX_QUANTILE_ELEMENTS = 1 << 20


def _statistics(delta: torch.Tensor, prob_diff: torch.Tensor, bound: float) -> dict[str, Any]:
    """Summary of the kept tokens' ``delta = old - sampler`` ``[N]`` and ``|p_old - p_sampler|`` ``[N]``."""
    step = delta.numel() // MAX_QUANTILE_ELEMENTS + 1
    sample = delta[::step]
    q = torch.quantile(sample, torch.tensor(QUANTILES, dtype=sample.dtype))
    outside = delta.abs() > math.log(bound)
    return {"mean": float(delta.mean()), "mean_abs": float(delta.abs().mean()), "max_abs": float(delta.abs().max()),
            "quantiles": {f"q{int(p * 100):02d}": float(v) for p, v in zip(QUANTILES, q)},
            "outside": int(outside.sum()), "share_outside": float(outside.double().mean()),
            "prob_diff_mean": float(prob_diff.mean()), "prob_diff_max": float(prob_diff.max())}


def _first_rollout(ctx: StepContext, name: str) -> tuple[int, float] | None:
    """(step, mean |trainer - sampler|) of the first recorded rollout of this rank (lowest step, inner
    step 0, micro-batch 0), or None when this file is it or it records no sampler logprobs. Read
    once per run of the checks (:func:`check_memo`)."""
    memo = check_memo(ctx.trace, "sampler_first_rollout")
    if ctx.key.rank not in memo:
        keys = sorted((k for k in ctx.trace.steps() if k.inner_step == 0 and k.rank == ctx.key.rank),
                      key=lambda k: (k.step, k.micro_batch))
        memo[ctx.key.rank] = None
        try:
            data = (ctx.trace.load_step(keys[0], [name, "sampler_logprobs", "completion_mask"], derive=False)
                    if keys else {})
        except TraceError:  # an unreadable first rollout is trace.unreadable's finding; no baseline then
            data = {}
        if {name, "sampler_logprobs", "completion_mask"} <= set(data):
            trainer, sampler = data[name].double(), data["sampler_logprobs"].double()
            keep = data["completion_mask"].bool() & torch.isfinite(trainer) & torch.isfinite(sampler)
            if int(keep.sum()):
                memo[ctx.key.rank] = (keys[0].step, float((trainer - sampler)[keep].abs().mean()))
    first = memo[ctx.key.rank]
    return None if first is None or first[0] >= ctx.key.step else first


def _seen(ctx: StepContext, keep: torch.Tensor) -> torch.Tensor | None:
    """``[N]`` bool over kept tokens: the token occurred earlier in its row (prompt or completion);
    None when the completion ids are not recorded."""
    if not ctx.has("completion_ids"):
        return None
    prompt_ids = ctx.data.get("prompt_ids")
    prompt_mask = ctx.data.get("prompt_mask")
    if prompt_ids is not None and prompt_ids.shape[0] != keep.shape[0]:
        prompt_ids = prompt_mask = None
    seen = patterns.seen_in_context(prompt_ids, prompt_mask, ctx.data["completion_ids"])  # (B, T)
    return seen[keep]


def _cause(ctx: StepContext, name: str, trainer: torch.Tensor, sampler: torch.Tensor, delta: torch.Tensor,
           keep: torch.Tensor, settings: patterns.Settings) -> str | None:
    """The one cause :func:`tracer.checks.sampler_patterns.diagnose` finds for this step, with the
    engine's raw-logprobs configuration folded into a temperature cause."""
    # ctx.dtype: how the logprobs were stored / computed. Not sampler_dtype: vLLM runs the model in bf16
    # but computes log_softmax in float32, so its logprobs near 0 are not rounded to bf16
    evidence = patterns.Evidence(trainer, sampler, delta, _seen(ctx, keep), _first_rollout(ctx, name), ctx.key.step,
                                 ctx.dtype, settings)
    return patterns.diagnose(evidence, settings.show("temperature"))


def _config_problems(settings: patterns.Settings) -> list[str]:
    """An engine that reports raw logprobs (before temperature, penalties and truncation) while
    sampling with them (``settings`` in effect): its logprobs are not those of the distribution it
    sampled from."""
    if settings.logprobs_mode not in ("raw_logprobs", "raw_logits"):
        return []
    used = settings.in_effect(("temperature", *patterns.TRUNCATION_KEYS, *patterns.PENALTY_KEYS))
    if not used:
        return []
    return [f"the engine reports {settings.logprobs_mode} while it samples with {', '.join(used)}: its "
            "logprobs are not those of the distribution it sampled from (use logprobs_mode='processed_logprobs')"]


def _sequence_correction(ctx: StepContext, delta_full: torch.Tensor, keep: torch.Tensor, mode: str,
                         low: float | None, high: float | None) -> tuple[dict[str, Any], list[str]]:
    """Sequence modes: which aggregation (sum or mean of the token log ratios) reproduces the
    recorded ``sequence_is_weights`` ``[B]``, and how many sequences each would cut."""
    (recorded,) = ctx.require("sequence_is_weights")
    recorded = recorded.double()
    info: dict[str, Any] = {"unit": "sequences", "count": int(recorded.numel())}
    cut, matches = {}, []
    for aggregation in ("sum", "mean"):
        log_ratio = formulas.sequence_log_ratio(delta_full, keep, aggregation)  # (B,)
        raw = torch.exp(log_ratio)
        cut[aggregation] = int(((raw > (high if high is not None else math.inf)) |
                                (raw < (low if low is not None else -math.inf))).sum())
        rule = formulas.is_weights(log_ratio, mode, low, high)
        if torch.allclose(recorded, rule, rtol=WEIGHT_RTOL, atol=1e-6):
            matches.append(aggregation)
    aggregation = matches[0] if matches else "neither"
    info.update(aggregation=aggregation, cut=cut.get(aggregation, cut["sum"]), cut_if_sum=cut["sum"],
                cut_if_mean=cut["mean"], weights_mean=float(recorded.mean()), weights_min=float(recorded.min()),
                weights_max=float(recorded.max()))
    problems = []
    if aggregation == "neither":
        problems.append(f"the recorded sequence_is_weights match neither exp(sum) nor exp(mean) of old - sampler "
                        f"under is_mode = {mode} with the recorded caps")
    elif aggregation == "sum" and cut["sum"] - cut["mean"] >= max(1, LENGTH_BIAS_SHARE * recorded.numel()):
        problems.append(f"the sequence ratio is aggregated by sum (the product of token ratios, trl#5814): the cap cut "
                        f"{cut['sum']} of {recorded.numel()} sequences, a mean over tokens would cut {cut['mean']}; "
                        "the correction grows with completion length")
    return info, problems


def _token_correction(ctx: StepContext, delta_full: torch.Tensor, keep: torch.Tensor, mode: str,
                      low: float | None, high: float | None) -> tuple[dict[str, Any], list[str]]:
    """Token modes: the recorded ``is_weights`` ``[B, T]`` against TRL's rule, and how many kept tokens
    the cap truncated (``*_truncate``) or masked (``*_mask``)."""
    (recorded,) = ctx.require("is_weights")
    log_ratio = torch.where(keep, delta_full, torch.zeros_like(delta_full))
    rule = formulas.is_weights(log_ratio, mode, low, high)[keep]
    kept = recorded.double()[keep]
    raw = torch.exp(delta_full[keep])
    cut = int(((raw > (high if high is not None else math.inf)) | (raw < (low if low is not None else -math.inf))).sum())
    info = {"unit": "tokens", "count": int(kept.numel()), "cut": cut, "weights_mean": float(kept.mean()),
            "weights_min": float(kept.min()), "weights_max": float(kept.max())}
    problems = []
    if not torch.allclose(kept, rule, rtol=WEIGHT_RTOL, atol=1e-6):
        problems.append(f"the recorded is_weights differ from TRL's rule (is_mode = {mode}, caps [{low}, {high}]) "
                        f"by up to {float((kept - rule).abs().max()):.3g}")
    return info, problems


def _correction(ctx: StepContext, delta_full: torch.Tensor, keep: torch.Tensor) -> tuple[dict[str, Any] | None, list[str]]:
    """What the trainer's importance-sampling correction did, when the trace records its weights."""
    mode = ctx.hyper("is_mode", None)
    if mode not in formulas.IS_MODES or not (ctx.has("is_weights") or ctx.has("sequence_is_weights")):
        return None, []
    low, high = ctx.hyper("is_clip_min", None), ctx.hyper("is_clip_max", None)
    low, high = (None if v is None else float(v) for v in (low, high))
    delta_full = torch.nan_to_num(delta_full.double(), nan=0.0)
    if mode.startswith("sequence") and ctx.has("sequence_is_weights"):
        info, problems = _sequence_correction(ctx, delta_full, keep, mode, low, high)
    elif mode.startswith("token") and ctx.has("is_weights"):
        info, problems = _token_correction(ctx, delta_full, keep, mode, low, high)
    else:
        return None, []
    info.update(mode=mode, clip_min=low, clip_max=high)
    return info, problems


def _correction_text(info: dict[str, Any]) -> str:
    verb = "truncated" if info["mode"].endswith("truncate") else "masked"
    agg = f", sequence ratio by {info['aggregation']}" if "aggregation" in info else ""
    return (f" Importance sampling ({info['mode']}, caps [{info['clip_min']}, {info['clip_max']}]{agg}): weights "
            f"mean {info['weights_mean']:.4f}, min {info['weights_min']:.4f}, max {info['weights_max']:.4f}; the cap "
            f"{verb} {info['cut']} of {info['count']} {info['unit']}.")


def _severity(stats: dict[str, Any], systematic: list[str], soft: list[str]) -> str:
    if systematic or stats["share_outside"] > ERROR_SHARE or abs(stats["mean"]) > ERROR_MEAN:
        return ERROR
    if soft or stats["share_outside"] > WARN_SHARE or abs(stats["mean"]) > WARN_MEAN \
            or stats["prob_diff_mean"] > WARN_PROB:
        return WARNING
    return INFO


@register("sampler.mismatch", "old - sampler logprobs over kept tokens (log and probability space): mean, "
          "quantiles, share of ratios outside [1/C, C], worst tokens, temperature/truncation/offset patterns, "
          "what the importance-sampling correction did", RL_ALGORITHMS)
def check_sampler_mismatch(ctx: StepContext):
    name = "old_logprobs" if ctx.has("old_logprobs") else "policy_logprobs"
    if name == "policy_logprobs" and not is_fresh(ctx):
        return []  # after an update the policy differs from the sampler for a good reason
    if name == "old_logprobs" and ctx.key.inner_step != 0:
        return []  # old and sampler logprobs of a rollout are the same at every inner step: report once
    if not ctx.has("sampler_logprobs") and not engine_sampled(ctx):
        raise not_applicable(NO_ENGINE)
    trainer, sampler = ctx.require(name, "sampler_logprobs")
    keep = ctx.mask() & torch.isfinite(trainer) & torch.isfinite(sampler)
    # rows a policy some updates old sampled differ from the trainer by the lag: sampler.policy_lag reports them
    keep, lagged_tokens = staleness.lagged_mask(ctx, keep)
    if int(keep.sum()) == 0:
        return []
    delta_full = formulas.sampler_log_ratio(trainer, sampler)  # (B, T)
    t64, s64 = trainer[keep].double(), sampler[keep].double()  # (N,)
    delta = formulas.sampler_log_ratio(t64, s64)
    C = ctx.options.sampler_ratio_bound
    stats = _statistics(delta, formulas.sampler_prob_diff(t64, s64), C)
    settings = patterns.settings_of(ctx.hyper)
    cause = _cause(ctx, name, t64, s64, delta, keep, settings)
    config = _config_problems(settings)
    if cause is not None and config and "temperature applied on one side" in cause:
        systematic = [f"{cause}: {config[0]}"]  # the configuration is the cause the data shows: one finding
    else:
        systematic = ([cause] if cause is not None else []) + config
    # with lagged rows left out the weights of the others cannot be compared row by row: sampler.is_weights does
    correction, soft = _correction(ctx, delta_full, keep) if not lagged_tokens else (None, [])
    severity = _severity(stats, systematic, soft)
    worst = worst_positions(delta_full.abs(), keep, ctx.options.worst_tokens)
    b, t = worst[0]
    qtext = ", ".join(f"{k} {v:+.4f}" for k, v in stats["quantiles"].items())
    lead = f"Cause: {'; '.join(systematic)}. " if systematic else ""
    message = lead + (
        f"{name} - sampler_logprobs over {delta.numel()} kept tokens: mean {stats['mean']:+.4f} nats, mean |·| "
        f"{stats['mean_abs']:.4f}, {qtext}; |p_old - p_sampler| mean {stats['prob_diff_mean']:.4f}, max "
        f"{stats['prob_diff_max']:.4f}; {stats['outside']} tokens ({stats['share_outside']:.2%}) have exp(old - "
        f"sampler) outside [1/{C:g}, {C:g}]; worst at seq {b}, token {t}: {float(delta_full[b, t]):+.4f} nats."
    )
    if lagged_tokens:
        message += (f" Left out: {lagged_tokens} kept tokens of rows sampled by an older policy (sampler.policy_lag "
                    "reports them).")
    if correction is not None:
        message += _correction_text(correction)
    if soft:
        message += " Importance-sampling problem: " + "; ".join(soft) + "."
    floor = patterns.noise_floor(settings.engine_dtype)
    engine = f"a {settings.engine_dtype} engine" if settings.engine_dtype else "an engine of unrecorded dtype"
    if not systematic and stats["mean_abs"] <= floor:
        message += f" Within the noise of {engine} (mean |·| {stats['mean_abs']:.4f} <= {floor:.3g} nats)."
    elif not systematic:
        message += (f" No known cause explains it: mean |·| {stats['mean_abs']:.4f} nats is beyond the noise of "
                    f"{engine} ({floor:.3g}) with no temperature, truncation, penalty, stale-policy or offset pattern "
                    f"({settings.text(('temperature', *patterns.TRUNCATION_KEYS, *patterns.PENALTY_KEYS))}).")
    if severity != INFO:
        message += (f" Rule: no systematic pattern, |mean| <= {WARN_MEAN} nats, mean |p_old - p_sampler| <= {WARN_PROB} "
                    f"and at most {WARN_SHARE:.0%} of tokens outside [1/C, C]. Why it matters: the rollout was "
                    "sampled from a different distribution than the trainer scores, so the update is off-policy and "
                    "an importance-sampling correction built on these logprobs is biased.")
    worst_list = [{"sequence": i, "token": j, "old_minus_sampler": float(delta_full[i, j])} for i, j in worst]
    return [ctx.finding("sampler.mismatch", severity, message, b, t, field="sampler_logprobs", trainer_field=name,
                        ratio_bound=C, worst_tokens=worst_list, patterns=systematic + soft, correction=correction,
                        noise_floor=floor, engine_dtype=settings.engine_dtype, **stats)]
