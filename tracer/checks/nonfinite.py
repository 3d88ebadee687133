"""Non-finite values (SPEC.md section 6): no NaN/Inf anywhere, even at masked slots.

At a kept position a NaN/Inf reaches the loss: error. At a masked position it is a warning: a
guarded masked mean (``torch.where``) ignores it, but ``(x * mask).sum()`` gives NaN because
NaN * 0 = NaN. The finding names the *first* tensor that went non-finite in the dependency order
raw logprobs -> rewards/values/advantages -> ratio -> KL -> loss: that is where to look.
"""

from __future__ import annotations

import torch

from tracer.checks.context import StepContext, first_true, where_text
from tracer.checks.finding import ERROR, INFO, WARNING, register

# Dependency order: inputs first, derived tensors after the tensors they are computed from.
DEPENDENCY_ORDER = (
    "sampler_logprobs", "old_logprobs", "policy_logprobs", "ref_logprobs",
    "chosen_policy_logprobs", "rejected_policy_logprobs", "chosen_ref_logprobs", "rejected_ref_logprobs",
    "entropy", "rewards", "reward_components", "values", "token_rewards", "advantages", "returns",
    "ratio", "approx_kl_k2", "ref_kl_k3", "dpo_logits", "chosen_rewards", "rejected_rewards",
    "per_token_loss", "dpo_loss", "loss",
)
_MASK_OF = {"chosen_": "chosen_mask", "rejected_": "rejected_mask"}
# Rewards a trainer may mark "not applicable" with NaN: TRL's reward functions may return None for a
# completion they do not score (GRPOTrainer docs), which TRL turns into NaN and leaves out (nansum over
# the functions, nanmean / nanstd over the group; a row no function scores gets advantage 0).
NOT_APPLICABLE = ("rewards", "reward_components")


def _keep_for(ctx: StepContext, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Which elements of ``tensor`` enter the loss: per token via its mask, per row when the row keeps
    any token, everything for a scalar or when no mask is recorded."""
    mask_name = next((m for prefix, m in _MASK_OF.items() if name.startswith(prefix) and "logprobs" in name),
                     "completion_mask")
    if mask_name not in ctx.data and "chosen_mask" in ctx.data:
        mask_name = "chosen_mask"
    mask = ctx.data.get(mask_name)
    if mask is None or tensor.dim() == 0:
        return torch.ones_like(tensor, dtype=torch.bool)
    mask = mask.bool()
    if tensor.shape == mask.shape:
        return mask
    if tensor.dim() >= 1 and tensor.shape[0] == mask.shape[0]:
        row = mask.any(dim=1)  # (B,)
        return row.view(-1, *([1] * (tensor.dim() - 1))).expand_as(tensor)
    return torch.ones_like(tensor, dtype=torch.bool)


def _ordered_floats(ctx: StepContext) -> list[str]:
    floats = [n for n, t in ctx.data.items() if t.is_floating_point() and n not in ctx.derived]  # recorded only
    known = [n for n in DEPENDENCY_ORDER if n in floats]
    return known + sorted(n for n in floats if n not in DEPENDENCY_ORDER)


def _locate(tensor: torch.Tensor, flags: torch.Tensor) -> tuple[int | None, int | None]:
    idx = first_true(flags)
    if idx is None or not idx:
        return None, None
    return idx[0], (idx[1] if len(idx) > 1 and tensor.dim() == 2 else None)


def _rows_with_finite_advantages(ctx: StepContext) -> torch.Tensor | None:
    """``[B]`` bool: rows whose recorded advantages are finite (on their kept tokens, for per-token
    advantages); None without recorded advantages."""
    adv = ctx.data.get("advantages")
    if adv is None or adv.dim() == 0 or not adv.is_floating_point():
        return None
    finite = torch.isfinite(adv)
    if adv.dim() >= 2:
        finite = (finite | ~_keep_for(ctx, "advantages", adv)).reshape(adv.shape[0], -1).all(dim=1)
    return finite


def _not_applicable(ctx: StepContext, name: str, tensor: torch.Tensor, bad: torch.Tensor) -> torch.Tensor | None:
    """The NaN of a reward field (:data:`NOT_APPLICABLE`) on rows whose advantages are finite: a reward
    the trainer left out, not a value that reaches the loss. None when there is none."""
    if name not in NOT_APPLICABLE or tensor.dim() == 0:
        return None
    rows_ok = _rows_with_finite_advantages(ctx)
    if rows_ok is None or rows_ok.shape[0] != tensor.shape[0]:
        return None
    na = bad & torch.isnan(tensor) & rows_ok.view(-1, *([1] * (tensor.dim() - 1)))
    return na if bool(na.any()) else None


def _token(name: str, t: int | None) -> int | None:
    """The token position a finding points at: none for ``reward_components`` (its columns are reward functions)."""
    return None if name == "reward_components" else t


def _where(name: str, b: int | None, t: int | None) -> str:
    if name == "reward_components" and b is not None and t is not None:
        return f"seq {b}, reward function {t}"  # [B, F]: a column per reward function
    return where_text(b, t) or "the scalar"


@register("nonfinite.values", "no NaN/Inf in any float tensor (kept: error, masked: warning; a NaN reward on a "
          "row whose advantages are finite: info)")
def check_nonfinite(ctx: StepContext):
    kept_hits, masked_hits, left_out = [], [], []
    for name in _ordered_floats(ctx):
        tensor = ctx.data[name]
        bad = ~torch.isfinite(tensor)
        if not bool(bad.any()):
            continue
        na = _not_applicable(ctx, name, tensor, bad)
        if na is not None:
            left_out.append((name, na))
            bad = bad & ~na
            if not bool(bad.any()):
                continue
        keep = _keep_for(ctx, name, tensor)
        if bool((bad & keep).any()):
            kept_hits.append((name, bad & keep))
        if bool((bad & ~keep).any()):
            masked_hits.append((name, bad & ~keep))
    findings = []
    for hits, severity, where in ((kept_hits, ERROR, "kept"), (masked_hits, WARNING, "masked")):
        if not hits:
            continue
        name, flags = hits[0]
        tensor = ctx.data[name]
        b, t = _locate(tensor, flags)
        value = float(tensor[first_true(flags)])
        others = [f"{n} ({int(f.sum())})" for n, f in hits[1:]]
        then = f"; downstream also non-finite: {', '.join(others)}" if others else ""
        if where == "kept":
            why = ("Why it matters: the NaN/Inf enters the loss and the gradient, and one optimizer step "
                   "poisons every weight. Likely fix: find why this tensor overflowed (log of 0, exp of a "
                   "large log-ratio, division by a zero count) and clamp or mask before the operation.")
        else:
            why = ("Why it matters: a guarded masked mean (torch.where) ignores it, but an unguarded "
                   "(x * mask).sum() / mask.sum() is NaN because NaN * 0 = NaN, and the step's loss "
                   "becomes NaN. Likely fix: fill masked slots with 0 (masked_fill / torch.where) "
                   "before any arithmetic, not by multiplying with the mask.")
        message = (f"{name} is the first tensor (in the order logprobs -> ratio -> KL -> loss) with a "
                   f"non-finite value at a {where} position: {value} at {_where(name, b, t)}; {int(flags.sum())} "
                   f"{where} positions are non-finite in {name}{then}. {why}")
        findings.append(ctx.finding("nonfinite.values", severity, message, b, _token(name, t), field=name,
                                    tensors=[n for n, _ in hits], count=int(flags.sum())))
    if left_out:
        name, flags = left_out[0]
        b, t = _locate(ctx.data[name], flags)
        rows = int(torch.stack([f.reshape(f.shape[0], -1).any(dim=1) for _, f in left_out]).any(dim=0).sum())
        counts = ", ".join(f"{n} {int(f.sum())}" for n, f in left_out)
        message = (f"{name} is NaN at {_where(name, b, t)} (NaN values: {counts}; {rows} rows), and the "
                   "advantages of those rows are finite: the trainer left these rewards out, so no NaN reaches the "
                   "loss from them. TRL's reward functions may return None for a completion they do not apply to; "
                   "TRL records it as NaN and sums and normalises with nansum / nanmean / nanstd. If no reward "
                   "function of yours returns None, find where this reward became NaN.")
        findings.append(ctx.finding("nonfinite.values", INFO, message, b, _token(name, t), field=name,
                                    tensors=[n for n, _ in left_out], count=sum(int(f.sum()) for _, f in left_out)))
    return findings
