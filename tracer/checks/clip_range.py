"""The clip range of a per-token loss at fault: the clip epsilons the recorded per-token loss follows
when they are not the recorded ``clip_epsilon_low`` / ``clip_epsilon_high`` (GRPO and PPO clipped
surrogate), and the run config's keys that hold them (a zero-edit capture that read the wrong variable)."""

from __future__ import annotations

import math
import re

import torch

from tracer import formulas
from tracer.checks.context import StepContext
from tracer.checks.finding import INFO, Skip
from tracer.checks.objective import (
    corrects_pg_term,
    recomputed_per_token_loss,
    trl_loss_type,
)


def _implied_clip(ctx: StepContext, recorded: torch.Tensor) -> tuple[float, float, set[str]] | None:
    """The clip epsilons ``(low, high, unbound_sides)`` the recorded per-token loss follows when they are
    not the recorded ones (GRPO / PPO clipped surrogate), else None. Where the clip binds, the recorded
    value is ``-(1 + eps_high) * A + kl`` (A > 0) or ``-(1 - eps_low) * A + kl`` (A < 0), so each
    disagreeing token names an epsilon; the largest named one on each side is tried (tokens the loop
    leaves unclipped only bound it from below), and kept when the whole loss then agrees. A side where
    the recorded clip would bind but the recorded values are the unclipped ones (a typo such as
    ``1 + 2.0`` for ``1 + 0.2`` with no ratio beyond 3) is unbound: its epsilon is only known to be at
    least the largest (high) or smallest (low) ratio's distance from 1, which is returned."""
    if ctx.algorithm == "cispo" or trl_loss_type(ctx) == "cispo" or ctx.hyper("delta", None) is not None:
        return None
    try:
        eps_high = float(ctx.hyper("clip_epsilon_high"))
        eps_low = float(ctx.hyper("clip_epsilon_low", eps_high))
        unclipped = recomputed_per_token_loss(ctx, clip=(float("inf"), float("inf"))).double()
        advantages = ctx.tensor("advantages").double()
        r = formulas.ratio(ctx.tensor("policy_logprobs"), ctx.old_logprobs()).double()
    except Skip:
        return None
    if corrects_pg_term(ctx):
        return None
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    keep, value = ctx.mask(), recorded.double()
    kl = unclipped + r * adv  # the KL term (0 without one)
    off = ((value - unclipped).abs() > ctx.tol.atol + ctx.tol.rtol * unclipped.abs()) & keep & torch.isfinite(value)
    off_high, off_low = off & (adv > 0), off & (adv < 0)
    named_high = ((kl - value) / adv - 1)[off_high]
    named_low = (1 - (kl - value) / adv)[off_low]
    unbound = set()
    high = float(named_high.max()) if named_high.numel() else eps_high
    low = float(named_low.max()) if named_low.numel() else eps_low
    high, low = (float(f"{x:.4g}") for x in (high, low))
    free_high = keep & ~off & (adv > 0) & (r > 1 + eps_high)  # the recorded clip binds here, the loop's did not
    free_low = keep & ~off & (adv < 0) & (r < 1 - eps_low)
    if not named_high.numel() and bool(free_high.any()):
        high, unbound = float((r - 1)[free_high].max()), unbound | {"high"}
    if not named_low.numel() and bool(free_low.any()):
        low, unbound = min(float((1 - r)[free_low].max()), 1.0), unbound | {"low"}
    if (low, high) == (eps_low, eps_high) or not (0 <= low <= 1 and high >= 0):
        return None
    try:
        implied = recomputed_per_token_loss(ctx, clip=(math.inf if "low" in unbound else low,
                                                       math.inf if "high" in unbound else high)).double()
    except Skip:
        return None
    tol = ctx.tol.atol + ctx.tol.rtol * implied.abs()
    return (low, high, unbound) if bool((((value - implied).abs() <= tol) | ~keep).all()) else None


def _config_keys_holding(ctx: StepContext, value: float) -> list[str]:
    """Names in the manifest's ``config`` (a zero-edit capture keeps the script's argparse namespace
    there) that name a clip range (``eps`` or ``clip`` in the name) and whose number is ``value`` to
    4 significant digits (``steps = 2`` is no clip bound)."""
    config = ctx.trace.manifest.get("config")
    if not isinstance(config, dict):
        return []
    return [str(k) for k, v in config.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and any(w.startswith(("eps", "clip")) for w in re.split(r"[\W_]+", str(k).lower())) and math.isfinite(v)
            and float(f"{float(v):.4g}") == value]


def clip_explanation(ctx: StepContext, finding, recorded: torch.Tensor):
    """Rewrite ``finding`` when the recorded loss follows other clip epsilons than the recorded ones:
    name them (and the config keys holding them); an info when a zero-edit capture read the epsilons
    by the name map and the script's config holds the implied ones under a name of their side (the
    map read the wrong variable: DAPO's ``epsilon_high`` beside ``epsilon``), else the error, explained."""
    implied = _implied_clip(ctx, recorded)
    if implied is None:
        return finding
    low, high, unbound = implied
    eps_high = float(ctx.hyper("clip_epsilon_high"))
    eps_low = float(ctx.hyper("clip_epsilon_low", eps_high))
    parts, named_all = [], True
    for side, now, was in (("low", low, eps_low), ("high", high, eps_high)):
        if side in unbound:
            parts.append(f"clip_epsilon_{side} ≥ {now:.4g} (the {'upper' if side == 'high' else 'lower'} clip binds "
                         f"on no token: the {'largest' if side == 'high' else 'smallest'} ratio with A "
                         f"{'>' if side == 'high' else '<'} 0 is {1 + now if side == 'high' else 1 - now:.4g}), not the "
                         f"recorded {was:g}")
            named_all = False
            continue
        if now == was:
            continue
        keys = _config_keys_holding(ctx, now)
        named_all &= any(side in k.lower() for k in keys)
        where = f" (config {', '.join(keys)})" if keys else ""
        parts.append(f"clip_epsilon_{side} = {now:g}{where}, not the recorded {was:g}")
    shown_low, shown_high = (f"{1 - low:.4g}" if "low" not in unbound else f"≤ {1 - low:.4g}",
                             f"{1 + high:.4g}" if "high" not in unbound else f"≥ {1 + high:.4g}")
    text = (f"clip range: the recorded per_token_loss follows the clipped surrogate with {' and '.join(parts)} "
            f"(ratio clipped to [{shown_low}, {shown_high}] instead of [{1 - eps_low:.4g}, {1 + eps_high:.4g}]) on "
            f"every kept token: the loop clips with other epsilons than the step metadata says. ")
    config = ctx.trace.manifest.get("config") if isinstance(ctx.trace.manifest.get("config"), dict) else {}
    if named_all and config.get("trainer") == "tracer.watch":
        return ctx.finding("recompute.per_token_loss", INFO, text + (
            "The zero-edit capture read the epsilons by its name map, and the script's config names the implied "
            "ones: record those (tracer run --meta clip_epsilon_high=..., or map the variable under [metadata] "
            "clip_epsilon_high / clip_epsilon_low in --map), and the loss checks use them."),
            finding.sequence, finding.token, field="per_token_loss", implied_clip_epsilon_low=low,
            implied_clip_epsilon_high=high)
    finding.message = text + finding.message
    finding.details.update(implied_clip_epsilon_low=low, implied_clip_epsilon_high=high,
                           clip_unbound=sorted(unbound))
    return finding
