"""Where a run puts the reference-KL penalty: in the rewards (InstructGPT, OpenRLHF, TRL's PPOTrainer,
verl's ``use_kl_in_reward``) or in the loss.

The recompute checks need the answer twice: ``recompute.token_rewards`` expects the penalty in PPO's
``token_rewards`` only when it is in the rewards, and the loss checks expect a KL term in the loss
only when it is not. Metadata ``kl_in_reward`` says so when recorded; else the recorded
``token_rewards`` show it (the sequence reward on the last kept token plus ``-kl_coef * KL(old || ref)``
on every kept token), in this step file or in the run's latest ones.
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.comparison import compare
from tracer.checks.context import StepContext, check_memo, step_memo
from tracer.checks.finding import Skip

MAX_KL_PLACEMENT_PROBES = 8  # other step files read to tell where the KL penalty is, once per trace


def reward_kl(ctx: StepContext) -> tuple[float, str] | None:
    """``(kl_coef, estimator)`` of a KL penalty in the rewards (``kl_coef``, else ``beta``;
    ``kl_estimator``, default k1); None without a non-zero coefficient. Skip for an unknown estimator."""
    coef = ctx.kl_coef()
    if coef is None:
        return None
    try:
        return coef, formulas.kl_estimator_name(ctx.hyper("kl_estimator", None) or "k1")
    except ValueError as err:
        raise Skip(f"metadata kl_estimator: {err}") from None


def _token_rewards_carry_kl(ctx: StepContext) -> bool | None:
    """What this step's recorded ``token_rewards`` show (PPO): True when they are the sequence reward
    on the last kept token plus ``-kl_coef * KL(old || ref)`` on every kept token (or that penalty
    with its sign flipped: recompute.token_rewards names it), False when the penalty would show and
    does not, None when it cannot show (fields missing, no coefficient, or old == ref on every kept
    token, as at a run's first rollout). The estimator found is kept in the ``reward_kl_estimator``
    memo of the run."""
    if ctx.algorithm not in ("ppo", "") or not ctx.has("token_rewards", "rewards", "ref_logprobs"):
        return None
    try:
        found = reward_kl(ctx)
        old = ctx.old_logprobs()
    except Skip:
        return None
    if found is None:
        return None
    coef, declared = found
    keep = ctx.mask()
    recorded, ref, rewards = ctx.tensor("token_rewards"), ctx.tensor("ref_logprobs"), ctx.tensor("rewards")
    penalty = torch.where(keep, coef * formulas.ref_kl(old, ref, declared), torch.zeros_like(recorded))
    if not bool((penalty.abs() > ctx.tol.atol + ctx.tol.rtol * recorded.abs()).any()):
        return None
    # undeclared, any of the three estimators (OpenRLHF's kl_estimator, verl's kl_penalty) may be the loop's
    estimators = (declared,) if ctx.hyper("kl_estimator", None) else (declared, *[e for e in formulas.KL_ESTIMATORS
                                                                                    if e != declared])
    for estimator in estimators:
        for sign in (1.0, -1.0):  # a flipped sign too: recompute.token_rewards names it
            if not compare(ctx, "recompute.token_rewards", "token_rewards", recorded,
                           formulas.kl_reward_token_rewards(rewards, old, ref, keep, sign * coef, estimator), keep, ""):
                check_memo(ctx.trace, "reward_kl_estimator").setdefault("value", estimator)
                return True
    return False


def _run_kl_in_reward(ctx: StepContext) -> bool | None:
    """Where the run puts the KL penalty, from its latest step files whose token rewards can show it
    (at most :data:`MAX_KL_PLACEMENT_PROBES`, newest first: old == ref only at the start); None when
    none can. Worked out once per run of the checks (:func:`check_memo`)."""
    memo = check_memo(ctx.trace, "kl_in_reward")
    if "value" not in memo:
        memo["value"] = None
        for key in list(reversed(ctx.trace.steps()))[:MAX_KL_PLACEMENT_PROBES]:
            if key == ctx.key:
                continue
            try:
                seen = _token_rewards_carry_kl(StepContext(ctx.trace, key, ctx.options))
            except Exception:  # noqa: BLE001  (an unreadable step file is other checks' finding)
                continue
            if seen is not None:
                memo["value"] = seen
                break
    return memo["value"]


def kl_in_reward(ctx: StepContext) -> bool:
    """The reference-KL penalty is in the rewards, not the loss: metadata ``kl_in_reward`` when
    recorded, else what this step's recorded ``token_rewards`` show (:func:`_token_rewards_carry_kl`),
    else what the run's latest ones show (:func:`_run_kl_in_reward`). Worked out once per step file
    (:func:`tracer.checks.context.step_memo`: the live guard forgets it before each check, so that a
    check reading it is seen to depend on the run's other files)."""
    return bool(kl_placement(ctx))


def kl_placement(ctx: StepContext) -> bool | None:
    """:func:`kl_in_reward`, or None when it cannot be told yet: not declared, the run records
    ``token_rewards`` (PPO), neither this step file's nor any probed one's can show a penalty (old ==
    ref on every kept token: the penalty is 0 wherever it is) and the run holds only one step's files
    (its first rollout, as the live guard sees it before later step files exist). With later steps
    whose old still equals ref the reference moves with the policy (``kl.ref_tracks_policy``) and the
    answer is False, as before. False without ``token_rewards``: a sequence reward carries no
    per-token penalty."""
    memo = step_memo(ctx, "kl_in_reward")
    if "value" not in memo:
        declared = ctx.flag("kl_in_reward")
        if declared is None:
            seen = _token_rewards_carry_kl(ctx)
            if seen is not None:
                declared = seen
            elif ctx.algorithm in ("ppo", "") and ctx.has("token_rewards"):
                declared = _run_kl_in_reward(ctx)
                if declared is None:  # no step file shows it: undecided on a first rollout only
                    declared = None if len({k.step for k in ctx.trace.steps()}) <= 1 else False
            else:
                declared = False
        memo["value"] = declared
    return memo["value"]
