"""First-step identity (SPEC.md section 6): on fresh rollouts, before any optimizer step, the policy
is the behaviour policy, so ``policy_logprobs == old_logprobs`` token by token, the ratio is 1 and
nothing is clipped. After an optimizer step the policy has moved, so a ratio of exactly 1 on every
token means ``old_logprobs`` alias the policy.

A step is on fresh rollouts when metadata ``fresh_rollouts`` says so, otherwise when
``inner_step == 0`` (and, for PPO, ``micro_batch == 0``: each PPO minibatch is an optimizer step; for
TRL, a ``generation_slice`` consumed before the first optimizer step), see :func:`is_fresh`.
"""

from __future__ import annotations

import math

import torch

from tracer import formulas
from tracer.checks.alignment import SHIFT_RATIO, shifted_mae
from tracer.checks.context import TOLERANCES, StepContext, StepHeader, check_memo, loosest_dtype
from tracer.checks import turns
from tracer.checks import sampler_patterns
from tracer.checks import staleness
from tracer.checks.text import count
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, Skip, register

POLICY_DETACHED = "policy_detached"
# Largest |policy - old| (nats) that still counts as "the same model" after an optimizer step: the noise of
# recomputing logprobs from the same weights (another batch shape, kernel or eval/train pass). Half-precision
# noise is as large as a real small-learning-rate update, so only an exact match counts there.
ALIAS_NOISE = {"float64": 1e-9, "float32": 1e-5, "float16": 0.0, "bfloat16": 0.0}


def _rows_scored(ctx: StepHeader, key) -> dict[int, torch.Tensor]:
    """``{hash of a row's prompt and completion ids: its policy logprobs at the kept tokens}`` of the
    step file ``key`` (the first of identical rows); {} without those fields (:func:`check_memo`)."""
    memo = check_memo(ctx.trace, "rows_scored")
    if key not in memo:
        out: dict[int, torch.Tensor] = {}
        try:
            data = ctx.trace.load_step(key, fields=["prompt_ids", "completion_ids", "completion_mask",
                                                    "policy_logprobs"])
        except Exception:  # noqa: BLE001  (an unreadable file is other checks' finding)
            data = {}
        ids, mask, policy = data.get("completion_ids"), data.get("completion_mask"), data.get("policy_logprobs")
        if ids is not None and mask is not None and policy is not None and ids.dim() == 2 \
                and ids.shape == mask.shape == policy.shape:
            prompts = data.get("prompt_ids")
            rows = torch.cat([prompts, ids], dim=1) if prompts is not None and prompts.shape[0] == ids.shape[0] else ids
            for b, row in enumerate(rows.contiguous()):
                out.setdefault(hash(row.numpy().tobytes()), policy[b][mask[b].bool()].double())
        memo[key] = out
    return memo[key]


def updated_since_earlier_micro_batch(ctx: StepHeader) -> list:
    """For a micro-batch that a zero-edit capture numbered by counting backwards (metadata
    ``micro_batch_counted``: the frame named no micro-batch or inner step), the earlier micro-batch
    files of its pass (same step, inner step and rank) that hold one of its rows scored by other
    weights (policy logprobs beyond the dtype's identity tolerance): an optimizer step came in
    between, so this file is a later pass over the rollout, not fresh rollouts. [] otherwise: a
    micro-batch the trainer numbered is taken at its word (identical rows scored apart by dropout or
    kernel noise under gradient accumulation are no optimizer step), and so is one whose rows do not
    repeat or repeat with the same logprobs."""
    if ctx.key.micro_batch == 0 or ctx.metadata.get("micro_batch_counted") is not True:
        return []
    mine = _rows_scored(ctx, ctx.key)
    if not mine:
        return []
    tol = TOLERANCES[loosest_dtype(ctx.declared_dtypes())].identity_atol  # the header's: same for any caller
    found = []
    for key in ctx.pass_keys():
        if key.micro_batch >= ctx.key.micro_batch:
            break
        theirs = _rows_scored(ctx, key)
        if any(h in theirs and theirs[h].shape == lp.shape and lp.numel()
               and float((theirs[h] - lp).abs().max()) > tol for h, lp in mine.items()):
            found.append(key)
    return found


def is_fresh(ctx: StepHeader) -> bool:
    """True when no optimizer step has used this step's rollouts yet.

    Metadata ``fresh_rollouts`` decides when present. Otherwise inner step 0, and: for PPO the first
    minibatch (each minibatch is an optimizer step), or the first ``gradient_accumulation_steps``
    minibatches when gradients accumulate; for TRL, whose generation batch may span several
    optimizer steps, a ``generation_slice`` within the first ``gradient_accumulation_steps`` slices;
    never a micro-batch holding a row that an earlier micro-batch of the pass scored with other
    weights (:func:`updated_since_earlier_micro_batch`).
    """
    declared = ctx.metadata.get("fresh_rollouts")
    if declared is not None:
        return bool(declared)
    if ctx.key.inner_step != 0:
        return False
    if ctx.key.micro_batch and ctx.metadata.get("generation_slice") is None and updated_since_earlier_micro_batch(ctx):
        return False
    generation_slice = ctx.metadata.get("generation_slice")
    if generation_slice is not None:
        return int(generation_slice) // ctx.accumulation_steps() == 0
    if ctx.algorithm != "ppo":
        return True
    # PPO: each minibatch is an optimizer step, unless gradients accumulate over several of them
    return ctx.key.micro_batch // ctx.accumulation_steps() == 0


def _clip_region(ctx: StepContext) -> tuple[float, float] | None:
    """The ratio interval the clip keeps, ``(low, high)``; None when the epsilons are not recorded.
    CISPO has only an upper bound (:meth:`StepContext.cispo_ratio_max`)."""
    eps_high = ctx.hyper("clip_epsilon_high", None)
    if ctx.algorithm == "cispo":
        return (0.0, ctx.cispo_ratio_max()) if eps_high is not None else None
    eps_low = ctx.hyper("clip_epsilon_low", eps_high)
    if eps_low is None or eps_high is None:
        return None
    return 1.0 - float(eps_low), 1.0 + float(eps_high)


def _shift_evidence(ctx: StepContext, policy, old, keep):
    """An error finding when policy and old logprobs (or policy and ref) agree once one of them is
    shifted by one position, where unshifted they disagree: a logprob window read at ``prompt_len``
    instead of ``prompt_len - 1`` (or the reverse) on one side; else None."""
    pairs = ([("old_logprobs", old)] if old is not None else []) + (
        [("ref_logprobs", ctx.tensor("ref_logprobs"))] if ctx.has("ref_logprobs") else [])
    for name, other in pairs:
        mae0, n0 = shifted_mae(policy, other, keep, 0)
        fits = {s: shifted_mae(policy, other, keep, s) for s in (-1, 1)}
        best = min((s for s in fits if fits[s][1] > 0), key=lambda s: fits[s][0], default=None)
        if best is None or n0 == 0 or not mae0 > ctx.tol.identity_atol:
            continue
        mae, n = fits[best]
        if not (mae <= ctx.tol.identity_atol and mae < SHIFT_RATIO * mae0):
            continue
        T = policy.shape[1]
        lo = max(0, -best)
        ok = keep[:, lo : min(T, T - best)]
        b = int(ok.any(dim=1).float().argmax())
        t = lo + int(ok[b].float().argmax())
        side = f"{name}[:, j + {best}]" if best > 0 else f"{name}[:, j - 1]"
        message = (
            f"policy_logprobs and {name} are shifted by one position: policy_logprobs[:, j] equals {side} "
            f"(mean |Δ| {mae:.3g} nats over {n} kept tokens) while unshifted they differ by {mae0:.4g} nats "
            f"on average over {n0} tokens. At seq {b}, token {t}: policy {float(policy[b, t]):.6g}, "
            f"{name}[{b}, {t + best}] {float(other[b, t + best]):.6g}, {name}[{b}, {t}] {float(other[b, t]):.6g}. "
            "Why it matters: one side scores each completion token with its neighbour's logprob, so ratio, KL "
            "and loss compare different tokens. Likely fix: read completion token j at logits position "
            "prompt_len - 1 + j on both sides (logits[:, k] predicts input_ids[:, k + 1]); a window starting "
            "at prompt_len is one token late."
        )
        return ctx.finding("identity.first_step", ERROR, message, b, t, field="policy_logprobs", shift=best,
                           shifted_against=name, mae_shifted=mae, mae_unshifted=mae0)
    return None


def _previous_learning_rate(ctx: StepContext) -> float | None:
    """Metadata ``learning_rate`` of the step file just before this one (the optimizer step that moved
    the weights to where this one scores them), as the TRL hook records it; None when unknown."""
    earlier = [k for k in ctx.trace.steps() if (k.step, k.inner_step, k.micro_batch) < (ctx.key.step, ctx.key.inner_step,
                                                                                       ctx.key.micro_batch)]
    if not earlier:
        return None
    value = ctx.trace.metadata(earlier[-1]).get("learning_rate")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _temperature_cause(ctx: StepContext, policy: torch.Tensor, old: torch.Tensor, keep: torch.Tensor) -> str | None:
    """old and policy scored at two temperatures (one forward divides the logits by the sampling
    temperature, the other does not): ``log(1 - p)`` of confident tokens scales by the ratio of the two
    temperatures (:func:`tracer.checks.sampler_patterns.temperature_pattern`, policy as the trainer's
    side, old as the sampler's). Names the side that left the recorded temperature out when the factor
    is that temperature or its inverse (within 10 %)."""
    found = sampler_patterns.temperature_pattern(policy.double()[keep], old.double()[keep],
                                                 (policy.double() - old.double())[keep], ctx.dtype, None, None)
    if found is None:
        return None
    _, slope = found  # log(1 - p_old) ≈ slope · log(1 - p_policy): slope = T_policy / T_old
    recorded = ctx.hyper("temperature", None)
    side = ""
    if isinstance(recorded, (int, float)) and recorded > 0 and recorded != 1 and slope > 0:
        # one side at the recorded T, the other at 1: T_policy / T_old is 1 / T (policy left it out) or T (old
        # did); the approximation log(1 - p) ∝ 1 / T is rough on a small vocabulary, so the direction decides,
        # with the factor at least half way there in log scale
        toward = math.log(slope) / -math.log(recorded)  # 1 at 1 / T, -1 at T
        if toward >= 0.5:
            side = (f" With the recorded temperature {recorded:g}, that factor (1 / {recorded:g} = {1 / recorded:.3g} "
                    "exactly, for a dominant runner-up token) says the policy forward leaves the temperature out.")
        elif toward <= -0.5:
            side = (f" With the recorded temperature {recorded:g}, that factor ({recorded:g} exactly, for a dominant "
                    "runner-up token) says the old forward leaves the temperature out.")
    return (f"old and policy follow one model at two temperatures: log(1 − p_old) ≈ {slope:.3f} × log(1 − p_policy) "
            f"on the confident tokens (the ratio of the two forwards' temperatures, T_policy / T_old), so one of "
            f"them divides the logits by another temperature than the other.{side} Score both at the sampling "
            "temperature.")


def _first_step_cause(ctx: StepContext, policy: torch.Tensor, old: torch.Tensor, keep: torch.Tensor) -> str:
    """The one cause the recorded differences point at, with its numbers, for identity.first_step:
    rows of padded prompts alone differ (padding / position ids), a one-sided gap (other weights), or
    zero-mean noise (dropout: a train-mode forward)."""
    d = (policy.double() - old.double()).masked_fill(~keep, 0.0)  # (B, T) signed, 0 off the mask
    temperature = _temperature_cause(ctx, policy, old, keep)
    if temperature is not None:
        return temperature
    beyond = (d.abs() > ctx.tol.identity_atol) & keep  # (B, T)
    rows_off = beyond.any(dim=1)  # (B,)
    if ctx.has("prompt_mask") and ctx.data["prompt_mask"].shape[0] == keep.shape[0]:
        padded = ~ctx.data["prompt_mask"].bool().all(dim=1)  # (B,) prompt shorter than the padded width
        if bool(padded.any()) and bool((rows_off <= padded).all()) and bool((padded & ~rows_off).sum() == 0) \
                and bool((~padded & keep.any(dim=1)).any()):
            return (f"Only the {count(int(padded.sum()), 'row')} with a padded prompt differ "
                    f"(seqs {padded.nonzero().flatten().tolist()[:8]}); the {count(int((~padded).sum()), 'unpadded row')} "
                    "match: one side scores padded rows with other attention masks or position ids than the "
                    "other. Pass the same attention_mask (and position_ids) to both forwards.")
    n = int(keep.sum())
    mean, mean_abs = float(d.sum()) / n, float(d.abs().sum()) / n
    if abs(mean) >= 0.5 * mean_abs:
        side = "higher" if mean > 0 else "lower"
        return (f"The gap is one-sided: policy is {side} than old on average (mean policy − old {mean:+.4f} nats, "
                f"mean |policy − old| {mean_abs:.4f}), as when old_logprobs come from other weights than "
                "policy_logprobs (an earlier rollout's, or another model copy). Compute old_logprobs from the "
                "weights that sampled this rollout.")
    return (f"The gap is zero-mean noise (mean policy − old {mean:+.4f} nats against mean |policy − old| "
            f"{mean_abs:.4f}), the signature of dropout: one of the two forwards ran in train mode. Score both "
            "under model.eval() (or with dropout 0).")


@register("identity.first_step", "on fresh rollouts policy == old per token (dtype tolerance), "
          "mean ratio 1, clip fraction 0", RL_ALGORITHMS)
def check_first_step(ctx: StepContext):
    if (ctx.key.inner_step == 0 and ctx.key.micro_batch and ctx.metadata.get("fresh_rollouts") is None
            and ctx.metadata.get("generation_slice") is None and ctx.algorithm != "ppo"):
        repeated = updated_since_earlier_micro_batch(ctx)
        if repeated:
            return [ctx.finding("identity.first_step", INFO, (
                f"micro-batch {ctx.key.micro_batch} holds rows that micro-batch"
                f"{'es' if len(repeated) > 1 else ''} {', '.join(str(k.micro_batch) for k in repeated)} of this "
                "step scored with other weights: an optimizer step came in between, so this file is a later "
                "pass over the rollout numbered as a micro-batch, and it is not checked as a fresh rollout. A "
                "zero-edit capture (tracer run, tracer.watch) numbers passes from a variable the name map lists "
                "under [indices] inner_step (ppo_epoch, inner_step, grpo_iteration); add the name of your pass "
                "loop's variable there (--map) to record them as inner steps."),
                field="completion_ids", updated_since_micro_batches=[k.micro_batch for k in repeated])]
    if not is_fresh(ctx) or ctx.metadata.get("old_logprobs_source") == POLICY_DETACHED:
        return []  # not a first step, or old = policy.detach(): ratio 1 by construction
    policy, old = ctx.require("policy_logprobs", "old_logprobs")
    keep = ctx.mask()
    if int(keep.sum()) == 0:
        raise Skip("no kept token in completion_mask")
    explained = turns.explained_positions(ctx) if ctx.has("completion_ids") else torch.zeros_like(keep)
    n_explained = int(explained.sum())
    keep = keep & ~explained  # tool output, placeholders or shifted turns: the turns checks name them
    # rows sampled by a policy some updates old (asynchronous loops): old may be the behaviour policy's, so their
    # first-pass ratio is the lag, not a mismatch; sampler.policy_lag reports them
    keep, n_lagged = staleness.lagged_mask(ctx, keep, behaviour_old_only=True)
    n_kept = int(keep.sum())
    if n_kept == 0:
        return []
    delta = (policy - old).abs()  # (B, T)
    ratio = formulas.ratio(policy, old)  # (B, T)
    beyond = (delta > ctx.tol.identity_atol) & keep
    mean_ratio = float(formulas.masked_mean(ratio, keep))
    if not bool(beyond.any()) and abs(mean_ratio - 1.0) <= ctx.tol.mean_ratio:
        if ctx.has("ref_logprobs"):  # a window bug on the reference side only shows against ref
            shifted = _shift_evidence(ctx, policy, None, keep)
            return [shifted] if shifted is not None else []
        return []
    shifted = _shift_evidence(ctx, policy, old, keep)
    if shifted is not None:
        return [shifted]
    b, t = divmod(int(delta.masked_fill(~keep, -1.0).argmax()), delta.shape[1])
    region = _clip_region(ctx)
    clip_text = ""
    n_out = None
    if region is not None:
        low, high = region
        n_out = int((((ratio < low) | (ratio > high)) & keep).sum())
        clip_text = (f"; {n_out} of {n_kept} kept tokens have a ratio outside [{low:g}, {high:g}] "
                     f"(clip fraction {n_out / n_kept:.3f}, expected 0)")
    left_out = f"over the other tokens, leaving out {n_explained} that the turns checks name " if n_explained else ""
    if n_lagged:
        left_out += f"(rows sampled by an older policy left out: {n_lagged} tokens, sampler.policy_lag) "
    message = (
        f"inner step {ctx.key.inner_step} on fresh rollouts: policy_logprobs must equal old_logprobs "
        f"(same weights, same tokens), but {int(beyond.sum())} of {n_kept} kept tokens differ by more than "
        f"{ctx.tol.identity_atol:g} nats ({ctx.dtype}){clip_text}; mean ratio {mean_ratio:.4f} "
        f"{left_out}(expected 1 ± {ctx.tol.mean_ratio:g}). Worst: seq {b}, token {t}: policy {float(policy[b, t]):.4f}, "
        f"old {float(old[b, t]):.4f}, ratio {float(ratio[b, t]):.4f}. {_first_step_cause(ctx, policy, old, keep)}"
    )
    return [ctx.finding("identity.first_step", ERROR, message, b, t, field="policy_logprobs",
                        tokens_beyond_tolerance=int(beyond.sum()), kept_tokens=n_kept,
                        tokens_outside_clip=n_out, mean_ratio=mean_ratio,
                        tolerance=ctx.tol.identity_atol, dtype=ctx.dtype)]


@register("identity.old_aliases_policy", "after an optimizer step the ratio is not 1 to float precision "
          "on every token (old must not alias policy, nor be recomputed from the updated model)", RL_ALGORITHMS)
def check_old_aliases_policy(ctx: StepContext):
    if is_fresh(ctx):
        return []
    why = ("Why it matters: with old == policy the ratio is 1 by construction, so clipping never acts "
           "and the trust region is gone. Likely fix: compute old_logprobs once per rollout under "
           "no_grad before the first update and reuse them for every inner step; do not recompute them "
           "from the updated model (or use policy_logprobs.detach()) after an optimizer step.")
    where = f"inner step {ctx.key.inner_step}, micro-batch {ctx.key.micro_batch}"
    if ctx.metadata.get("old_logprobs_source") == POLICY_DETACHED:
        return [ctx.finding("identity.old_aliases_policy", ERROR,
                            f"metadata old_logprobs_source = '{POLICY_DETACHED}' at {where}, after an "
                            f"optimizer step on these rollouts: the ratio is 1 by construction. {why}",
                            field="old_logprobs")]
    policy, old = ctx.require("policy_logprobs", "old_logprobs")
    keep = ctx.mask()
    n_kept = int(keep.sum())
    if n_kept == 0:
        raise Skip("no kept token in completion_mask")
    gap = float((policy.double() - old.double()).abs().masked_fill(~keep, 0.0).max())
    noise = ALIAS_NOISE.get(ctx.dtype, 0.0)
    if gap > noise:
        return []
    previous_lr = _previous_learning_rate(ctx)
    if previous_lr == 0.0:
        return [ctx.finding("identity.old_aliases_policy", INFO,
                            f"policy and old logprobs agree on all {n_kept} kept tokens at {where}, but the optimizer "
                            "step before it ran with learning rate 0 (a warmup schedule starting at 0), so the "
                            "weights did not move", field="ratio", max_abs_gap=gap)]
    advantages = ctx.data.get("advantages")
    if advantages is not None and not bool(advantages.bool().any()):
        return [ctx.finding("identity.old_aliases_policy", INFO,
                            f"ratio is 1 to float precision on all {n_kept} kept tokens at {where}, but every advantage "
                            "is 0, so the previous update may have had no gradient to move the policy",
                            field="ratio")]
    return [ctx.finding("identity.old_aliases_policy", ERROR,
                        f"policy and old logprobs agree on all {n_kept} kept tokens at {where} (max |policy - old| "
                        f"{gap:.3g} nats, at most the {noise:g} of float noise for {ctx.dtype}: ratio 1 to float "
                        f"precision), after an optimizer step on these rollouts: old_logprobs alias "
                        f"policy_logprobs, or were recomputed from the already-updated model. {why}",
                        field="ratio", kept_tokens=n_kept, max_abs_gap=gap, noise_floor=noise)]
