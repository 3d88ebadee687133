"""First-step identity (SPEC.md section 6): on fresh rollouts, before any optimizer step, the policy
is the behaviour policy, so ``policy_logprobs == old_logprobs`` token by token, the ratio is 1 and
nothing is clipped. After an optimizer step the policy has moved, so a ratio of exactly 1 on every
token means ``old_logprobs`` alias the policy.

A step is on fresh rollouts when metadata ``fresh_rollouts`` says so, otherwise when
``inner_step == 0`` (and, for PPO, ``micro_batch == 0``: each PPO minibatch is an optimizer step; for
TRL, a ``generation_slice`` consumed before the first optimizer step), see :func:`is_fresh`.
"""

from __future__ import annotations

from tracer import formulas
from tracer.checks.context import StepContext
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, Skip, register

POLICY_DETACHED = "policy_detached"


def is_fresh(ctx: StepContext) -> bool:
    """True when no optimizer step has used this step's rollouts yet.

    Metadata ``fresh_rollouts`` decides when present. Otherwise inner step 0, and: for PPO the first
    minibatch (each minibatch is an optimizer step); for TRL, whose generation batch may span several
    optimizer steps, a ``generation_slice`` within the first ``gradient_accumulation_steps`` slices.
    """
    declared = ctx.metadata.get("fresh_rollouts")
    if declared is not None:
        return bool(declared)
    if ctx.key.inner_step != 0:
        return False
    generation_slice = ctx.metadata.get("generation_slice")
    if generation_slice is not None:
        accumulation = int(ctx.hyper("gradient_accumulation_steps", 1) or 1)
        return int(generation_slice) // accumulation == 0
    return ctx.key.micro_batch == 0 or ctx.algorithm != "ppo"


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


@register("identity.first_step", "on fresh rollouts policy == old per token (dtype tolerance), "
          "mean ratio 1, clip fraction 0", RL_ALGORITHMS)
def check_first_step(ctx: StepContext):
    if not is_fresh(ctx) or ctx.metadata.get("old_logprobs_source") == POLICY_DETACHED:
        return []  # not a first step, or old = policy.detach(): ratio 1 by construction
    policy, old = ctx.require("policy_logprobs", "old_logprobs")
    keep = ctx.mask()
    n_kept = int(keep.sum())
    if n_kept == 0:
        raise Skip("no kept token in completion_mask")
    delta = (policy - old).abs()  # (B, T)
    ratio = formulas.ratio(policy, old)  # (B, T)
    beyond = (delta > ctx.tol.identity_atol) & keep
    mean_ratio = float(formulas.masked_mean(ratio, keep))
    if not bool(beyond.any()) and abs(mean_ratio - 1.0) <= ctx.tol.mean_ratio:
        return []
    b, t = divmod(int(delta.masked_fill(~keep, -1.0).argmax()), delta.shape[1])
    region = _clip_region(ctx)
    clip_text = ""
    n_out = None
    if region is not None:
        low, high = region
        n_out = int((((ratio < low) | (ratio > high)) & keep).sum())
        clip_text = (f"; {n_out} of {n_kept} kept tokens have a ratio outside [{low:g}, {high:g}] "
                     f"(clip fraction {n_out / n_kept:.3f}, expected 0)")
    message = (
        f"inner step {ctx.key.inner_step} on fresh rollouts: policy_logprobs must equal old_logprobs "
        f"(same weights, same tokens), but {int(beyond.sum())} of {n_kept} kept tokens differ by more than "
        f"{ctx.tol.identity_atol:g} nats ({ctx.dtype}){clip_text}; mean ratio {mean_ratio:.4f} "
        f"(expected 1 ± {ctx.tol.mean_ratio:g}). Worst: seq {b}, token {t}: policy {float(policy[b, t]):.4f}, "
        f"old {float(old[b, t]):.4f}, ratio {float(ratio[b, t]):.4f}. Why it matters: the first update "
        "clips and weights tokens for a mismatch, not for a policy change. Likely fix: compute old and "
        "policy logprobs the same way (eval vs train mode/dropout, temperature, padding and masking, "
        "the same model copy), and make sure old_logprobs come from this rollout, not an earlier one."
    )
    return [ctx.finding("identity.first_step", ERROR, message, b, t, field="policy_logprobs",
                        tokens_beyond_tolerance=int(beyond.sum()), kept_tokens=n_kept,
                        tokens_outside_clip=n_out, mean_ratio=mean_ratio,
                        tolerance=ctx.tol.identity_atol, dtype=ctx.dtype)]


@register("identity.old_aliases_policy", "after an optimizer step the ratio is not exactly 1 on "
          "every token (old must not alias policy)", RL_ALGORITHMS)
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
    ratio = formulas.ratio(policy, old)  # (B, T)
    if not bool(((ratio == 1.0) | ~keep).all()):
        return []
    advantages = ctx.data.get("advantages")
    if advantages is not None and not bool(advantages.bool().any()):
        return [ctx.finding("identity.old_aliases_policy", INFO,
                            f"ratio is exactly 1 on all {n_kept} kept tokens at {where}, but every advantage "
                            "is 0, so the previous update may have had no gradient to move the policy",
                            field="ratio")]
    return [ctx.finding("identity.old_aliases_policy", ERROR,
                        f"ratio exp(policy - old) is exactly 1.000000 on all {n_kept} kept tokens at {where}, "
                        f"after an optimizer step on these rollouts: old_logprobs alias policy_logprobs. {why}",
                        field="ratio", kept_tokens=n_kept)]
