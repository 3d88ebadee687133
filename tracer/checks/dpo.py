"""DPO's reference (SPEC.md section 3): the reference model is a frozen copy of the policy's initial
weights. Before the first optimizer step the two are the same model, so ``ref == policy`` on every
token is expected there (a fresh copy). After an update the policy has moved and the reference has
not: a reference that still equals the policy on every kept token of every pair scores with the
weights being trained (``ref_model = model``, or a shallow copy sharing its parameters). Then
``(π_c - π_r) - (ref_c - ref_r) = 0`` for every pair, every DPO logit is 0, the loss is
``-logsigmoid(0) = log 2`` on every step and the implicit rewards are 0: the preference baseline is
gone (Rafailov et al., "Direct Preference Optimization", 2023, eq. 7).

The check is trace-level: it needs to know which step files come after an optimizer step (an earlier
step file of the trace, with a learning rate other than 0 before it) and reports one finding naming
every aliased step.
"""

from __future__ import annotations

import math

import torch

from tracer import formulas
from tracer.checks.context import StepHeader, loosest_dtype
from tracer.checks.finding import ERROR, INFO, Finding, Skip, register
from tracer.checks.text import steps_text
from tracer.checks.identity import ALIAS_NOISE
from tracer.format.schema import REF_SEQUENCE_SUMS
from tracer.read import StepKey, Trace

SIDES = ("chosen", "rejected")
LOG_2 = math.log(2.0)  # -logsigmoid(0): the DPO loss of a pair whose logit is 0
_FIELDS = [f"{s}_{n}" for s in SIDES for n in ("mask", "policy_logprobs", "ref_logprobs")] + \
    list(REF_SEQUENCE_SUMS.values()) + ["loss", "dpo_loss"]


def _ref_gap(data: dict[str, torch.Tensor]) -> tuple[float, int, int, str] | None:
    """(max |ref - policy| in nats over both sides, pairs B, kept tokens compared, what was compared)
    for one step file: per token when the per-token reference is recorded, else per pair on the masked
    sums (TRL's precomputed reference); None when neither is recorded."""
    gaps, tokens, pairs = [], 0, None
    for side in SIDES:
        mask, policy = data.get(f"{side}_mask"), data.get(f"{side}_policy_logprobs")
        if mask is None or policy is None:
            return None
        keep = mask.bool()
        pairs = keep.shape[0]
        ref = data.get(f"{side}_ref_logprobs")
        if ref is not None and ref.shape == policy.shape:
            gaps.append((ref.double() - policy.double()).abs()[keep])
            tokens += int(keep.sum())
            continue
        sums = data.get(REF_SEQUENCE_SUMS[f"{side}_ref_logprobs"])
        if sums is None:
            return None
        gaps.append((sums.double().reshape(-1) - formulas.sequence_logprobs(policy.double(), keep)).abs())
    what = "per token" if tokens else "per pair (sums of the kept tokens)"
    flat = torch.cat(gaps)
    return (float(flat.max()) if flat.numel() else 0.0), int(pairs or 0), tokens, what


def _recorded_loss(trace: Trace, key: StepKey, data: dict[str, torch.Tensor]) -> float | None:
    """The step's recorded scalar ``loss``, else the mean of a recorded (not derived) ``dpo_loss``."""
    derived = set(trace.derived_fields(key))
    if "loss" in data and data["loss"].numel() == 1:
        return float(data["loss"].reshape(()))
    if "dpo_loss" in data and "dpo_loss" not in derived and data["dpo_loss"].numel():
        return float(data["dpo_loss"].double().mean())
    return None


def _previous_learning_rate(trace: Trace, keys: list[StepKey], key: StepKey) -> float | None:
    """Metadata ``learning_rate`` of the step file just before ``key`` (the optimizer step that moved the
    weights to where ``key`` scores them); None when not recorded."""
    earlier = [k for k in keys if (k.step, k.inner_step, k.micro_batch) < (key.step, key.inner_step, key.micro_batch)]
    value = trace.metadata(earlier[-1]).get("learning_rate") if earlier else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@register("dpo.reference_aliasing", "after an optimizer step the DPO reference logprobs do not equal the "
          "policy's on every pair (the reference must stay frozen, not alias the model being trained)", {"dpo"},
          scope="trace")
def check_reference_aliasing(trace: Trace, options, keys: list[StepKey]):
    keys = sorted(keys, key=lambda k: (k.step, k.inner_step, k.micro_batch, k.rank))
    first_step = keys[0].step
    updated, aliased, frozen_lr, unscored, sizes, rates = [], [], [], [], set(), set()
    worst, pairs, tokens, what, losses = 0.0, 0, 0, "", {}
    for key in keys:
        # before any optimizer step, a fresh copy: the first step, or the first N batches under gradient
        # accumulation (MiniMind's train_dpo.py numbers batches as steps and steps the optimizer every N; a
        # trainer that numbers optimizer steps, TRL, is then judged from step N on: later, never early)
        if key.step - first_step < StepHeader(trace, key).accumulation_steps():
            continue
        data = trace.load_step(key, fields=_FIELDS)
        found = _ref_gap(data)
        if found is None:
            unscored.append(key)
            continue
        rate = _previous_learning_rate(trace, keys, key)
        if rate == 0.0:
            frozen_lr.append(key)
            continue
        updated.append(key)
        gap, B, n_tokens, what_now = found
        dtype = loosest_dtype(StepHeader(trace, key).declared_dtypes()
                              + [str(t.dtype).removeprefix("torch.") for t in data.values() if t.is_floating_point()])
        if gap <= ALIAS_NOISE.get(dtype, 0.0):
            aliased.append(key)
            worst, pairs, tokens, what = max(worst, gap), pairs + B, tokens + n_tokens, what_now
            sizes.add(B)
            if rate is not None:
                rates.add(rate)
            loss = _recorded_loss(trace, key, data)
            if loss is not None:  # a loop that records loss / accumulation_steps: the loss it means
                scale = trace.metadata(key).get("loss_scale")
                steps = StepHeader(trace, key).accumulation_steps()
                if isinstance(scale, (int, float)) and scale > 0:
                    loss = loss / scale
                elif steps > 1 and abs(loss * steps - LOG_2) < abs(loss - LOG_2):
                    loss = loss * steps
                losses[key.step] = loss
    if unscored and not updated and not frozen_lr:
        raise Skip("needs chosen/rejected masks and policy logprobs, and the reference as chosen_ref_logprobs / "
                   "rejected_ref_logprobs (or their per-pair sums), which these do not record")
    if not aliased:
        return []
    header = StepHeader(trace, aliased[0])
    steps = steps_text([k.step for k in aliased])
    per_step = f" ({next(iter(sizes))} per step)" if len(sizes) == 1 and len(aliased) > 1 else ""
    evidence = (f"chosen and rejected ref logprobs equal the policy's on all {pairs} pairs{per_step} at step"
                f"{'s' if len(aliased) > 1 else ''} {steps} (max |ref − policy| {worst:.3g} nats, compared {what}"
                f"{f' over {tokens} kept tokens' if tokens else ''})")
    loss_text = _loss_text(losses)
    details = dict(steps=[k.step for k in aliased], pairs=pairs, max_abs_gap=worst, losses=losses,
                   cause="dpo reference aliases policy")
    first = aliased[0]
    where = dict(step=first.step, inner_step=first.inner_step, micro_batch=first.micro_batch, rank=first.rank,
                 path=str(first.path), field="chosen_ref_logprobs")
    if header.flag("sync_ref_model"):
        return [Finding("dpo.reference_aliasing", INFO,
                        f"{evidence}: the run declares sync_ref_model (TRL's SyncRefModelCallback copies the policy "
                        f"into the reference every {header.hyper('ref_model_sync_steps', '?')} steps with mixup alpha "
                        f"{header.hyper('ref_model_mixup_alpha', '?')}), so a reference equal to the policy right after "
                        "a sync is what was asked for", details=details, **where)]
    if len(aliased) < len(updated):
        others = steps_text([k.step for k in updated if k not in aliased])
        return [Finding("dpo.reference_aliasing", INFO,
                        f"{evidence}, but not at steps {others}: the reference moved with the policy only at some "
                        "steps (a reference replaced by the policy now and then), not on every step",
                        details=details, **where)]
    sigmoid = header.hyper("dpo_loss_is_sigmoid", True) is not False
    loss_claim = (f"the loss is log 2 = {LOG_2:.4f} on every step{loss_text}" if sigmoid else
                  f"the loss stays at its value for a logit of 0 (loss type {header.hyper('loss_type', '?')}){loss_text}")
    after = (f"after optimizer steps with learning rate {', '.join(f'{r:g}' for r in sorted(rates)[:3])}" if rates
             else "after optimizer steps")
    message = (f"reference aliases the policy: {evidence}, {after}, so every DPO logit "
               f"(π_c − π_r) − (ref_c − ref_r) is 0 and {loss_claim}. "
               "At the first step a reference equal to the policy is a fresh copy; after an update the reference "
               "must keep the initial weights, but here the reference forward runs the model being trained "
               "(ref_model = model, or a copy sharing its parameters), so the preference baseline and the implicit "
               "rewards are 0 throughout.")
    return [Finding("dpo.reference_aliasing", ERROR, message, details=details, **where)]


def _loss_text(losses: dict[int, float]) -> str:
    """`` (recorded loss 0.6931 at every one of these steps)`` or the values when some differ from log 2."""
    if not losses:
        return ""
    values = list(losses.values())
    if all(abs(v - LOG_2) <= 1e-3 for v in values):
        low, high = f"{min(values):.4f}", f"{max(values):.4f}"
        return f" (recorded loss {low if low == high else f'{low}..{high}'} at steps {steps_text(list(losses))})"
    shown = ", ".join(f"step {s}: {v:.4f}" for s, v in list(losses.items())[:5])
    return f" (recorded loss {shown})"
