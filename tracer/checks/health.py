"""Health of a run that is not broken but drifting: warnings when a measured quantity crosses a
documented, overridable threshold (:class:`tracer.checks.context.CheckOptions`, ``tracer check
--threshold NAME=VALUE``). Each is a trace check that gives one finding naming the value, the
threshold and the steps it occurs on. Each quantity is judged per update (step, inner step): its mean
over the kept tokens (or groups) of all the update's micro-batches and ranks:

- ``health.ref_kl``: mean k3 KL to the reference over kept tokens (``tracer.formulas.ref_kl_k3``).
- ``health.clip_fraction``: share of kept tokens whose gradient the clip removes (ratio past the bound
  on the side its advantage pushes: TRL's ``clip_ratio/low_mean`` + ``high_mean``) after the first
  update on a rollout (on fresh rollouts the ratio is 1: ``identity.first_step`` judges those). Not the
  share outside the region whatever the sign: a tight clip (ε 0.05) leaves most tokens outside it in a
  healthy run (tests/checks/test_minimind_configs.py, 0.7-0.8) while it removes the gradient of 0.1-0.2.
- ``health.sampler_gap``: mean |old - sampler| over kept tokens (TRL's ``sampling_logp_difference``),
  rows sampled by an older policy left out (their gap is the policy lag: ``sampler.policy_lag``).
- ``health.entropy_collapse``: mean token entropy fallen below a floor, or by a large share of its
  first value.
- ``health.reward_flat``: the share of groups whose G rewards are all equal and whose advantages are
  0 (no other term, such as RLOO's KL-penalised rewards, gives them a signal).

A warning leaves ``tracer check``'s exit code at 0 unless ``--fail-on warning`` is given. A quantity
the trace does not record is not judged and not reported as skipped: these are advice on a run, and
the bug classes that need fields are reported by ``tracer.checks.coverage``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from tracer import formulas
from tracer.checks.advantage_rules import full_groups
from tracer.checks.context import HEALTH_THRESHOLDS, TIGHT_CLIP, CheckOptions, StepContext, StepHeader, check_memo
from tracer.checks.text import steps_text
from tracer.checks.finding import RL_ALGORITHMS, WARNING, Finding, Skip, register
from tracer.checks.identity import _clip_region, is_fresh
from tracer.checks.staleness import lagged_mask
from tracer.read import StepKey, Trace

GROUPED = frozenset({"grpo", "cispo", "rloo", ""})


Total = tuple[float, int]  # (sum, count): a step file's part of an update's mean


def _mean(values: torch.Tensor, keep: torch.Tensor) -> Total | None:
    """Sum and count of ``values`` over kept, finite positions; None when there is none (NaN is
    nonfinite's finding)."""
    keep = keep.bool() & torch.isfinite(values)
    return (float(values.double()[keep].sum()), int(keep.sum())) if bool(keep.any()) else None


def _clip_fraction(ctx: StepContext, keep: torch.Tensor) -> Total | None:
    """The share of kept tokens whose gradient the clip removes (``tracer.formulas.clip_fractions``' low +
    high, the ``clip_fraction`` of ``tracer info``: ratio past the bound on the side the advantage
    pushes), on a step file after the first update on its rollout; None on fresh rollouts or without
    ratio, advantages or the clip range, and under a clip epsilon below ``TIGHT_CLIP`` (0.1)."""
    if is_fresh(ctx) or "ratio" not in ctx.data or "advantages" not in ctx.data:
        return None
    if ctx.rows_cut(keep.shape[0]) is not None:
        return None  # first_k_sequences: a few rows of the update (3 rows, 11 tokens) are no measure of its share
    region = _clip_region(ctx)
    if region is None:
        return None
    low, high = region
    if ctx.algorithm != "cispo" and min(1.0 - low, high - 1.0) < TIGHT_CLIP:
        return None  # a trust region tighter than practice binds by design
    fractions = formulas.clip_fractions(ctx.tensor("ratio"), ctx.tensor("advantages"), keep, 1.0 - low, high - 1.0)
    kept = int(keep.sum())
    return (float(fractions["low"] + fractions["high"]) * kept, kept) if kept else None


def _reward_flat(ctx: StepContext) -> Total | None:
    if ctx.algorithm not in GROUPED or "rewards" not in ctx.data:
        return None
    view = ctx.episode_view()
    rewards = view.tensor("rewards")
    groups, G = full_groups(view, rewards.shape[0])
    if G < 2 or not groups:
        return None
    advantages = view.tensor("advantages") if "advantages" in view.data else None

    def no_signal(rows: list[int]) -> bool:  # equal rewards, and no other advantage term (RLOO's KL) moves them
        if float(rewards[rows].max() - rewards[rows].min()) != 0.0:
            return False
        return advantages is None or float(advantages[rows].abs().max()) <= ctx.tol.atol

    return float(sum(no_signal(rows) for rows in groups)), len(groups)


def step_health(trace: Trace, key: StepKey, options: CheckOptions) -> dict[str, Total | None]:
    """The health quantities of one step file as ``(sum, count)``, so that the micro-batches and ranks
    of one update add up to its mean: ``ref_kl`` (k3 over kept tokens, nats), ``clip_fraction``
    (clipped kept tokens), ``sampler_gap`` (|old - sampler| over kept tokens of rows not lagged, nats), ``entropy``
    (over kept tokens, nats), ``reward_flat`` (flat groups over groups); each None when the file
    lacks its inputs."""
    ctx = StepContext(trace, key, options)
    out: dict[str, Total | None] = {}
    if "completion_mask" in ctx.data:
        keep = ctx.mask()
        out["ref_kl"] = _mean(ctx.tensor("ref_kl_k3"), keep) if "ref_kl_k3" in ctx.data else None
        out["clip_fraction"] = _clip_fraction(ctx, keep)
        try:
            old = ctx.old_logprobs()
        except Skip:
            old = None
        if old is not None and "sampler_logprobs" in ctx.data:
            # rows sampled by an older policy: their gap is the lag (sampler.policy_lag), not engine drift
            out["sampler_gap"] = _mean((old - ctx.tensor("sampler_logprobs")).abs(), lagged_mask(ctx, keep)[0])
        out["entropy"] = _mean(ctx.tensor("entropy"), keep) if "entropy" in ctx.data else None
    try:
        out["reward_flat"] = _reward_flat(ctx)
    except Skip:
        out["reward_flat"] = None
    return out


def _health(trace: Trace, options: CheckOptions, keys: list[StepKey]) -> list[tuple[StepKey, dict[str, Total | None]]]:
    """:func:`step_health` of every step file, in step order, once per run of the checks."""
    memo = check_memo(trace, "health")
    for key in keys:
        if key not in memo:
            try:
                memo[key] = step_health(trace, key, options)
            except Exception:  # noqa: BLE001  (an unreadable file is trace.unreadable's finding)
                memo[key] = {}
    return [(k, memo[k]) for k in sorted(keys, key=lambda k: (k.step, k.inner_step, k.micro_batch, k.rank))]


def _values(trace, options, keys, quantity: str) -> list[tuple[StepKey, float]]:
    """``quantity`` per update (step, inner step): the mean over the kept tokens (groups) of all its
    micro-batches and ranks, keyed by its first step file. A micro-batch of two rows is too small to
    judge alone: one of a healthy run's may clip 2 of 3 tokens where its update clips a fifth."""
    totals: dict[tuple[int, int], list] = {}
    for key, health in _health(trace, options, keys):
        part = health.get(quantity)
        if part is None or not math.isfinite(part[0]):
            continue
        entry = totals.setdefault((key.step, key.inner_step), [key, 0.0, 0])
        entry[1] += part[0]
        entry[2] += part[1]
    return [(key, total / count) for key, total, count in totals.values() if count]


def _finding(check: str, name: str, above: list[tuple[StepKey, float]], total: int, quantity: str, threshold: str,
             worst: str, why: str, **details) -> Finding:
    """One warning for the updates in ``above`` (worst first): the quantity past its threshold, the
    steps, the worst value, and what it means."""
    worst_key, _ = above[0]
    steps = sorted({k.step for k, _ in above})
    message = (f"{quantity} {threshold} (--threshold {name}=...) at step{'s' if len(steps) > 1 else ''} "
               f"{steps_text(steps)} ({len(above)} of {total} updates): {worst} at step {worst_key.step}, "
               f"inner step {worst_key.inner_step}. {why}")
    return Finding(check, WARNING, message, step=worst_key.step, inner_step=worst_key.inner_step,
                   micro_batch=worst_key.micro_batch, rank=worst_key.rank, path=str(worst_key.path),
                   details=dict(steps=steps, threshold_name=name, cause=check, **details))


def _above(values, limit: float, larger: Callable[[float, float], bool] = lambda v, lim: v > lim,
           persistent: bool = True):
    """The (key, value) pairs past ``limit``, worst first, when the run stays past it: at two or more
    steps, or at its last step (a diverging run ends there). A spike at one earlier step that the run
    recovered from is no drift (a few tokens with a large k3 can lift one step's mean: the healthy
    sample_traces/agent-trl-tiny has 3.08 nats at step 1 from three tokens of ref - policy = 6 nats,
    and 0.01-0.02 after); ``kl.ref_gap`` judges such tokens. ``persistent=False``: any step file past it."""
    hits = [(k, v) for k, v in values if larger(v, limit)]
    steps = {k.step for k, _ in hits}
    last = max(k.step for k, _ in values) if values else None
    if persistent and len(steps) < 2 and last not in steps:
        return []
    return sorted(hits, key=lambda kv: -kv[1])


@register("health.ref_kl", "mean k3 KL to the reference over kept tokens stays under the threshold "
          "(--threshold ref_kl, default 2 nats per token)", RL_ALGORITHMS, scope="trace")
def check_ref_kl(trace: Trace, options: CheckOptions, keys: list[StepKey]):
    values = _values(trace, options, keys, "ref_kl")
    above = _above(values, options.ref_kl_max)
    if not above:
        return []
    worst = above[0][1]
    return [_finding("health.ref_kl", "ref_kl", above, len(values),
                     "mean ref KL (k3, over kept tokens)", f"above the threshold {options.ref_kl_max:g} nats",
                     f"{worst:.4g} nats at its largest",
                     "The policy has moved far from the reference: the KL penalty "
                     f"(beta {_coef(trace, above[0][0])}) no longer holds it near the reference model.",
                     largest=worst, limit=options.ref_kl_max,
                     values={k.label: v for k, v in above[:20]})]


def _coef(trace: Trace, key: StepKey) -> str:
    coef = StepHeader(trace, key).kl_coef()
    return "not recorded" if coef is None else f"{coef:g}"


@register("health.clip_fraction", "share of kept tokens whose gradient the clip removes after the first update "
          "stays under the threshold (--threshold clip_fraction, default 0.5)", RL_ALGORITHMS, scope="trace")
def check_clip_fraction(trace: Trace, options: CheckOptions, keys: list[StepKey]):
    values = _values(trace, options, keys, "clip_fraction")
    above = _above(values, options.clip_fraction_max, persistent=False)  # one pass that clips most tokens is too far
    if not above:
        return []
    key, worst = above[0]
    header = StepHeader(trace, key)
    eps = f"clip_epsilon_low {header.hyper('clip_epsilon_low', '?')}, clip_epsilon_high {header.hyper('clip_epsilon_high', '?')}"
    return [_finding("health.clip_fraction", "clip_fraction", above, len(values),
                     f"share of kept tokens whose gradient the clip removes (ratio past the bound on the side its "
                     f"advantage pushes; {eps})",
                     f"above the threshold {options.clip_fraction_max:.0%}", f"{worst:.0%} at its largest",
                     "The updates move the policy further per step than the trust region allows, so the clip "
                     "removes the gradient of most tokens (a learning rate or number of inner steps too large "
                     "for this clip range).",
                     largest=worst, limit=options.clip_fraction_max, values={k.label: v for k, v in above[:20]})]


@register("health.sampler_gap", "mean |old - sampler| over kept tokens stays under the threshold "
          "(--threshold sampler_gap, default 0.1 nats)", RL_ALGORITHMS, scope="trace")
def check_sampler_gap(trace: Trace, options: CheckOptions, keys: list[StepKey]):
    values = _values(trace, options, keys, "sampler_gap")
    above = _above(values, options.sampler_gap_max)
    if not above:
        return []
    key, worst = above[0]
    return [_finding("health.sampler_gap", "sampler_gap", above, len(values),
                     "mean |old − sampler| over kept tokens", f"above the threshold {options.sampler_gap_max:g} nats",
                     f"{worst:.4g} nats at its largest",
                     "The inference engine's logprobs drift from the trainer's, so the rollout is off-policy "
                     "by this much before any update.",
                     largest=worst, limit=options.sampler_gap_max, values={k.label: v for k, v in above[:20]},
                     covered_by=["sampler."])]


@register("health.entropy_collapse", "mean token entropy stays above a floor and above a share of its first "
          "value (--threshold entropy_floor, default 0.05 nats; entropy_drop, default 0.9)", RL_ALGORITHMS,
          scope="trace")
def check_entropy_collapse(trace: Trace, options: CheckOptions, keys: list[StepKey]):
    values = _values(trace, options, keys, "entropy")
    if len(values) < 2:
        return []
    first_key, first = values[0]
    if first <= 0:
        return []
    limit = max(options.entropy_floor if first > options.entropy_floor else 0.0, (1 - options.entropy_drop) * first)
    low = sorted([(k, v) for k, v in values[1:] if v < limit], key=lambda kv: kv[1])
    if not low:
        return []
    key, lowest = low[0]
    steps = sorted({k.step for k, _ in low})
    message = (f"mean token entropy fell from {first:.4g} nats (step {first_key.step}) to {lowest:.4g} nats "
               f"(step {key.step}), under {limit:.4g} nats at step{'s' if len(steps) > 1 else ''} {steps_text(steps)} "
               f"({len(low)} of {len(values)} updates): the threshold is the larger of the floor "
               f"{options.entropy_floor:g} nats and {1 - options.entropy_drop:.0%} of the first value "
               f"(--threshold entropy_floor=..., entropy_drop=...). The policy has become nearly deterministic "
               "on these prompts, so its samples stop exploring and the group advantages lose their spread.")
    return [Finding("health.entropy_collapse", WARNING, message, step=key.step, inner_step=key.inner_step,
                    micro_batch=key.micro_batch, rank=key.rank, path=str(key.path),
                    details=dict(steps=steps, first=first, lowest=lowest, threshold=limit,
                                 cause="health.entropy_collapse", values={k.label: v for k, v in low[:20]}))]


@register("health.reward_flat", "the share of groups whose G rewards are all equal stays under the threshold "
          "(--threshold reward_flat, default 1.0: every group)", GROUPED, scope="trace")
def check_reward_flat(trace: Trace, options: CheckOptions, keys: list[StepKey]):
    values = _values(trace, options, keys, "reward_flat")
    above = _above(values, options.reward_flat_share, lambda v, lim: v >= lim and v > 0)
    if not above:
        return []
    key, worst = above[0]
    return [_finding("health.reward_flat", "reward_flat", above, len(values),
                     "share of groups with zero reward std (all G rewards equal)",
                     f"at or above the threshold {options.reward_flat_share:.0%}", f"{worst:.0%} at its largest",
                     "The reward does not tell these groups' completions apart, so they give the update no signal.",
                     largest=worst, limit=options.reward_flat_share, values={k.label: v for k, v in above[:20]},
                     covered_by=["advantages.zero_variance"])]


__all__ = ["HEALTH_THRESHOLDS", "step_health"]
