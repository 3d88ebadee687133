"""KL sanity (SPEC.md section 6): the k3 estimator is finite and ≥ 0 per token, ``ref - policy`` stays
far from the range where ``exp`` overflows, k1 = policy - ref is not persistently negative, and the
reference does not move with the policy (ref == old at every rollout after the first).

k3 = exp(d) - d - 1 with d = ref - policy grows like exp(d): d = 20 nats already gives
k3 ≈ 4.85e8 per token, and in float32 exp overflows to inf past d ≈ 88.72 nats.
"""

from __future__ import annotations

import math

import torch

from tracer import formulas
from tracer.checks.context import CheckOptions, StepContext, StepHeader, loosest_dtype, worst_positions
from tracer.checks.text import count
from tracer.checks.finding import ERROR, INFO, RL_ALGORITHMS, WARNING, Finding, Skip, register
from tracer.checks.identity import ALIAS_NOISE, is_fresh
from tracer.read import Trace

REF_GAP_WARNING = 10.0  # nats: k3 ≈ 2.2e4 per token
REF_GAP_ERROR = 20.0  # nats: k3 ≈ 4.85e8 per token
FLOAT32_EXP_MAX = math.log(torch.finfo(torch.float32).max)  # 88.72: exp overflows past it
K1_MIN_STEPS = 3  # "persistently": at least this many step files, all significantly negative
K1_Z = 3.0  # significantly negative: mean < -K1_Z standard errors
K1_STEP_Z = 10.0  # within one step file: mean < -K1_STEP_Z standard errors ...
K1_STEP_MIN_TOKENS = 256  # ... over at least this many kept tokens


@register("kl.k3_sign", "recorded ref_kl_k3 is >= 0 on every kept token", RL_ALGORITHMS)
def check_k3_sign(ctx: StepContext):
    (k3,) = ctx.require_recorded("ref_kl_k3")
    keep = ctx.mask()
    negative = (k3 < -ctx.tol.atol) & keep
    if not bool(negative.any()):
        return []
    (b, t), = worst_positions(-k3, negative, 1)
    message = (
        f"ref_kl_k3 is {float(k3[b, t]):.6g} at seq {b}, token {t}; {int(negative.sum())} kept tokens are "
        f"negative. k3 = exp(d) - d - 1 with d = ref - policy is >= 0 for every d. Why it matters: the "
        "recorded value is not the k3 estimator (k1 = policy - ref stored under the k3 name, or a sign or "
        "constant wrong), so the KL penalty rewards moving away from the reference. Likely fix: compute it "
        "with tracer.formulas.ref_kl_k3(policy, ref)."
    )
    return [ctx.finding("kl.k3_sign", ERROR, message, b, t, field="ref_kl_k3", negative_tokens=int(negative.sum()))]


@register("kl.ref_gap", "ref - policy stays below 20 nats (k3 = exp(ref - policy) explodes, "
          "float32 overflows past 88.7)", RL_ALGORITHMS)
def check_ref_gap(ctx: StepContext):
    policy, ref = ctx.require("policy_logprobs", "ref_logprobs")
    keep = ctx.mask()
    gap = ref - policy  # (B, T)
    finite = keep & torch.isfinite(gap)
    if not bool(finite.any()):
        return []
    (b, t), = worst_positions(gap, finite, 1)
    worst = float(gap[b, t])
    if worst < REF_GAP_WARNING:
        return []
    k3 = float(formulas.ref_kl_k3(policy[b, t].float(), ref[b, t].float()))
    n_harmful = int(((gap >= REF_GAP_ERROR) & finite).sum())
    if worst > FLOAT32_EXP_MAX:
        rule = (f"exp({worst:.4g}) overflows float32 (largest exp argument {FLOAT32_EXP_MAX:.2f}), so "
                f"ref_kl_k3 = {k3:.4g} and the loss becomes inf/NaN")
    else:
        rule = f"k3 = exp({worst:.4g}) - {worst:.4g} - 1 = {k3:.4g} nats for this one token"
    severity = ERROR if worst >= REF_GAP_ERROR else WARNING
    message = (
        f"ref - policy = {worst:.4g} nats at seq {b}, token {t} (ref {float(ref[b, t]):.4g}, policy "
        f"{float(policy[b, t]):.4g}): {rule}; {count(n_harmful, 'kept token is', 'kept tokens are')} at or past {REF_GAP_ERROR:g} nats, "
        f"where k3 ≈ 4.85e8 is already harmful. Why it matters: one token the policy has all but ruled out "
        "while the reference still likes it dominates the KL term and its gradient. Likely fix: clamp "
        "ref - policy before exp (e.g. to ±20 nats), and check that policy and reference score the same "
        "tokens with the same temperature."
    )
    return [ctx.finding("kl.ref_gap", severity, message, b, t, field="ref_logprobs", ref_minus_policy=worst,
                        ref_kl_k3=k3, harmful_tokens=n_harmful)]


def _untruncated_sampling(ctx: StepHeader) -> bool:
    """True unless metadata says the sampling distribution was not the policy's softmax: truncated
    (``top_p`` < 1, ``top_k`` > 0, ``min_p`` > 0) or reshaped (``repetition_penalty`` != 1, which
    transformers' and vLLM's samplers apply to the logits but TRL's logprobs leave out). Under such a
    distribution E[policy - ref] over the sampled tokens may be negative legitimately."""
    top_p, top_k = ctx.hyper("top_p", None), ctx.hyper("top_k", None)
    min_p, penalty = ctx.hyper("min_p", None), ctx.hyper("repetition_penalty", None)
    try:
        return ((top_p is None or float(top_p) >= 1.0) and (top_k is None or int(top_k) <= 0)
                and (min_p is None or float(min_p) <= 0.0) and (penalty is None or float(penalty) == 1.0))
    except (TypeError, ValueError):
        return False


TRUNCATED = ("sampling was truncated or reshaped (metadata top_p < 1, top_k > 0, min_p > 0 or "
             "repetition_penalty != 1): k1 may average below 0")


@register("kl.k1_negative_step", "on fresh rollouts, mean k1 = policy - ref over a large step's kept tokens "
          "is not negative by many standard errors", RL_ALGORITHMS)
def check_k1_negative_step(ctx: StepContext):
    if not is_fresh(ctx):
        return []  # after an update the tokens were sampled from old, not from this policy
    if not _untruncated_sampling(ctx):
        raise Skip(TRUNCATED)
    policy, ref = ctx.require("policy_logprobs", "ref_logprobs")
    keep = ctx.mask()
    k1 = formulas.kl_k1(policy.double(), ref.double())[keep]
    k1 = k1[torch.isfinite(k1)]
    n = k1.numel()
    if n < K1_STEP_MIN_TOKENS:
        return []
    mean, se = float(k1.mean()), float(k1.std() / math.sqrt(n))
    if not (mean < 0 and mean < -K1_STEP_Z * se):
        return []
    share = float((k1 < 0).double().mean())
    message = (
        f"mean k1 = policy - ref over the {n} kept tokens of this step is {mean:.4g} nats, {abs(mean) / se if se else float('inf'):.1f} "
        f"standard errors below 0 ({share:.0%} of tokens negative). On fresh rollouts the tokens are sampled "
        "from this policy, so k1 averages to KL(policy || ref) >= 0. "
        f"{k1_cause(ctx.data, keep)}"
    )
    return [ctx.finding("kl.k1_negative_step", WARNING, message, field="policy_logprobs", mean_k1=mean,
                        standard_error=se, tokens=n)]


def k1_cause(data: dict, keep: torch.Tensor | None) -> str:
    """The one cause of a negative mean k1 the recorded logprobs show, for kl.k1_negative(_step):
    ref_logprobs match the sampling model's logprobs (sampler_logprobs, else old_logprobs on fresh
    rollouts) better than policy_logprobs do (policy and reference swapped), or policy matches
    sampler_logprobs and the reference is then scored another way; without either tensor, the most likely cause."""
    policy, ref = data["policy_logprobs"].double(), data["ref_logprobs"].double()
    keep = data["completion_mask"].bool() if keep is None else keep
    for name in ("sampler_logprobs", "old_logprobs"):
        if name not in data or data[name].shape != policy.shape:
            continue
        sampled = data[name].double()
        ok = keep & torch.isfinite(sampled) & torch.isfinite(policy) & torch.isfinite(ref)
        if not bool(ok.any()):
            continue
        to_policy, to_ref = float((policy - sampled).abs()[ok].mean()), float((ref - sampled).abs()[ok].mean())
        if to_ref < 0.5 * to_policy:
            return (f"Policy and reference are swapped: ref_logprobs match {name} (mean |Δ| {to_ref:.4f} nats) "
                    f"where policy_logprobs are off by {to_policy:.4f}, so the reference tensor holds the sampling "
                    "policy's logprobs and every KL estimate has its sign turned. Pass the two tensors the other "
                    "way round.")
        if to_policy < 0.5 * to_ref and name == "sampler_logprobs":  # old == policy on fresh rollouts anyway
            return (f"policy_logprobs match {name} (mean |Δ| {to_policy:.4f} nats, ref_logprobs {to_ref:.4f}), so "
                    "the tokens were sampled from this policy: ref_logprobs are scored another way than policy's "
                    "(another temperature, template or model revision). Score the reference exactly as the policy.")
    return ("Neither sampler_logprobs nor old_logprobs are recorded to tell a policy/reference swap from tokens "
            "sampled by another policy; the most likely cause is that the tokens were not sampled from this "
            "policy (off-policy data or another sampling temperature). Record sampler_logprobs to tell them apart.")


def _cause_fields(trace: Trace, key) -> dict:
    return trace.load_step(key, ["policy_logprobs", "ref_logprobs", "completion_mask", "sampler_logprobs",
                                 "old_logprobs"])


def _k1_stats(trace: Trace, key) -> tuple[float, float] | None:
    data = trace.load_step(key, ["policy_logprobs", "ref_logprobs", "completion_mask"])
    if len(data) < 3:
        return None
    keep = data["completion_mask"].bool()
    k1 = formulas.kl_k1(data["policy_logprobs"].double(), data["ref_logprobs"].double())[keep]
    k1 = k1[torch.isfinite(k1)]
    if k1.numel() < 2:
        return None
    return float(k1.mean()), float(k1.std() / math.sqrt(k1.numel()))


def _sampling(trace: Trace, key) -> tuple[bool, bool]:
    """``(fresh, untruncated)`` of a step: its tokens were sampled from its policy_logprobs' policy
    (fresh rollouts, :func:`tracer.checks.identity.is_fresh`; after an update they were sampled from
    old), and no truncating or reshaping sampler option in metadata (:func:`_untruncated_sampling`)."""
    header = StepHeader(trace, key)
    return is_fresh(header), _untruncated_sampling(header)


@register("kl.k1_negative", "on fresh rollouts, mean k1 = policy - ref over kept tokens is not significantly "
          "negative in every step", RL_ALGORITHMS, scope="trace")
def check_k1_negative(trace: Trace, options: CheckOptions, keys: list) -> list[Finding]:
    sampling = {key: _sampling(trace, key) for key in keys}
    fresh = [key for key in keys if all(sampling[key])]
    moving = _all_significantly_negative(trace, fresh or [key for key in keys if sampling[key][1]])
    if moving is None:
        return []
    key, m, _ = min(moving, key=lambda x: x[1])
    where = dict(step=key.step, inner_step=key.inner_step, micro_batch=key.micro_batch, rank=key.rank,
                 field="policy_logprobs", path=str(key.path))
    if not fresh:
        # recorded only after updates, or an off-policy trainer's fresh_rollouts = false: a negative mean
        # k1 is what a healthy run gives when the sampling policy (old) was the reference, and also what a
        # policy/ref swap gives. Not judged, but not silent.
        message = (
            f"mean k1 = policy - ref is significantly negative in all {len(moving)} step files (lowest {m:.4g} "
            f"nats at step {key.step}, inner {key.inner_step}), but none of them is of fresh rollouts: their "
            "tokens were sampled from old, so k1 < 0 is what a healthy run gives when old was the reference "
            "(the first rollout), and also what policy and reference swapped give. Not judged; record a fresh "
            "step (inner step 0) or compare old_logprobs with ref_logprobs to tell them apart."
        )
        return [Finding("kl.k1_negative", INFO, message, **where)]
    message = (
        f"mean k1 = policy - ref over kept tokens is significantly negative in all {len(moving)} step files "
        f"of fresh rollouts that moved (lowest {m:.4g} nats at step {key.step}, inner {key.inner_step}). "
        "Sampled from the policy, k1 averages to KL(policy || ref) >= 0. "
        f"{k1_cause(_cause_fields(trace, key), None)}"
    )
    return [Finding("kl.k1_negative", WARNING, message, **where,
                    details={"mean_k1_by_step": {f"{k.step}.{k.inner_step}.{k.micro_batch}.{k.rank}": mean
                                                 for k, mean, _ in moving}})]


def _all_significantly_negative(trace: Trace, keys: list) -> list | None:
    """``[(key, mean k1, standard error)]`` of the step files among ``keys`` whose k1 moved, when there
    are at least :data:`K1_MIN_STEPS` of them and every one is below ``-K1_Z`` standard errors; else None."""
    stats = [(key, s) for key in keys if (s := _k1_stats(trace, key)) is not None]
    moving = [(key, m, se) for key, (m, se) in stats if se > 0 or m != 0]
    if len(moving) < K1_MIN_STEPS or not all(m < -K1_Z * se and m < 0 for _, m, se in moving):
        return None
    return moving


REF_TRACKS_MIN_STEPS = 2  # later rollouts (after the run's first step) that must all show it


def _ref_equals_old(trace: Trace, key) -> bool | None:
    """Whether ``ref_logprobs`` equal ``old_logprobs`` on every kept token of one step file, to the
    noise of scoring with the same weights (:data:`tracer.checks.identity.ALIAS_NOISE`); None when the
    file lacks them, keeps no token, or carries no KL coefficient (``kl_coef`` / ``beta``)."""
    header = StepHeader(trace, key)
    if header.kl_coef() is None:
        return None
    data = trace.load_step(key, ["old_logprobs", "ref_logprobs", "completion_mask"])
    if len(data) < 3 or data["old_logprobs"].shape != data["ref_logprobs"].shape:
        return None
    keep = data["completion_mask"].bool()
    if keep.shape != data["old_logprobs"].shape or not bool(keep.any()):
        return None
    dtype = loosest_dtype(header.declared_dtypes() + [str(data["old_logprobs"].dtype), str(data["ref_logprobs"].dtype)])
    gap = (data["old_logprobs"].double() - data["ref_logprobs"].double()).abs()[keep]
    return bool(torch.isfinite(gap).all()) and float(gap.max()) <= ALIAS_NOISE.get(dtype, 0.0)


@register("kl.ref_tracks_policy", "the reference model does not score every later rollout exactly like the "
          "policy that sampled it (ref == old on every token of the fresh step files of every rollout after "
          "the first: the KL penalty is 0 throughout)", RL_ALGORITHMS,
          scope="trace")
def check_ref_tracks_policy(trace: Trace, options: CheckOptions, keys: list) -> list[Finding]:
    # one pass of each rollout: its fresh files (a rollout's later inner steps or generation slices
    # score the same old logprobs, TRL numbering each optimizer step over it as a step of its own)
    fresh = [key for key in keys if key.inner_step == 0 and is_fresh(StepHeader(trace, key))]
    first = min((key.step for key in fresh), default=None)
    by_step: dict[int, list[bool]] = {}
    for key in fresh:
        if key.step == first:  # the run's first rollout: ref is the policy that sampled it
            continue
        try:
            same = _ref_equals_old(trace, key)
        except Exception:  # noqa: BLE001  (an unreadable file is other checks' finding)
            continue
        if same is False:  # a healthy run stops here, at its second rollout's first file
            return []
        if same:
            by_step.setdefault(key.step, []).append(same)
    if len(by_step) < REF_TRACKS_MIN_STEPS:
        return []
    key = next(k for k in keys if k.step == min(by_step))
    header = StepHeader(trace, key)
    if header.flag("sync_ref_model"):  # TRL: the reference is replaced by the policy, as asked
        alpha, every = header.hyper("ref_model_mixup_alpha", None), header.hyper("ref_model_sync_steps", None)
        message = (
            f"ref_logprobs equal old_logprobs on every kept token of every step file of the {len(by_step)} rollouts "
            f"after the first (steps {min(by_step)}-{max(by_step)}): the run syncs its reference model with the "
            f"policy (TRL's sync_ref_model, ref_model_mixup_alpha = {alpha}, ref_model_sync_steps = {every}), "
            "so the reference is the policy that sampled each rollout and KL(policy || ref) is about 0 there. "
            "As configured; with mixup alpha 1 the KL penalty (beta) holds the policy only to its last sync."
        )
        return [Finding("kl.ref_tracks_policy", INFO, message, step=key.step, inner_step=key.inner_step,
                        micro_batch=key.micro_batch, rank=key.rank, field="ref_logprobs", path=str(key.path),
                        details={"steps": sorted(by_step), "sync_ref_model": True})]
    message = (
        f"ref_logprobs equal old_logprobs on every kept token of every step file of the {len(by_step)} rollouts "
        f"after the first (steps {min(by_step)}-{max(by_step)}), to the noise of scoring with the same weights: "
        "the reference model scores each rollout exactly like the policy that sampled it, though that policy "
        "has been updated since the first step. Why it matters: KL(policy || ref) is then about 0 at every "
        "rollout, so the KL penalty (kl_coef / beta) never holds the policy near where it started. Likely fix: "
        "give the reference its own frozen copy of the initial weights (copy.deepcopy(model).eval(), "
        "requires_grad_(False)), not the training model itself, and do not load the policy's weights into it "
        "(unless that is meant: TRL's sync_ref_model)."
    )
    return [Finding("kl.ref_tracks_policy", WARNING, message, step=key.step, inner_step=key.inner_step,
                    micro_batch=key.micro_batch, rank=key.rank, field="ref_logprobs", path=str(key.path),
                    details={"steps": sorted(by_step)})]
