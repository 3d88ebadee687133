"""Coverage: which common bug classes a run of the checks could not judge, and which fields would let
it. A check that cannot run yields a ``skipped`` finding; a class of bugs whose every check was skipped
on a step file is *not checked* there, and ``tracer check`` opens its report with
``not checked: <class> — record <fields>`` (and exits 1 on it with ``--strict-coverage``), so a green
PASS never hides a class that was never looked at.

Each class lists the checks that can catch it (any one of them running on a step file covers the
class there) and the fields they read, in the words of SPEC.md section 4. The importance-sampling
correction class (``sampler.is_weights``) applies where a step declares a correction or records
``is_weights`` / ``sequence_is_weights``, the policy-lag class (``sampler.policy_lag``) where it declares
``trainer_version`` or ``max_policy_lag``: their checks judge that themselves, returning nothing on a
step that declares neither and skipping on one that declares it without the fields to check it.

Objectives and settings: a check that meets an objective or a setting it does not model (TRL's
``sapo`` loss, verl's ``clip_cov`` policy loss, an entropy bonus whose entropy is not recorded, TRL's
``off_policy_mask_threshold``) raises :func:`not_modelled`; the report then opens with
``not checked: <objective or setting> — <why, and what to record>`` whatever other checks ran, since a
loss the checks cannot recompute is a loss nobody checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.checks.finding import NOT_APPLICABLE, RL_ALGORITHMS, SKIPPED, Finding, Skip

NOT_CHECKED = "trace.not_checked"  # finding id of a bug class none of whose checks could run
NOT_MODELLED = "not modelled: "  # how a skip's reason starts when an objective or setting is not modelled


def not_modelled(what: str, why: str) -> Skip:
    """The Skip a check raises for an objective or setting it does not model: its reason is
    ``not modelled: <what> — <why>`` (``why`` says what to record, or which field would let it check),
    and :func:`not_checked` turns it into a ``not checked: <what> — <why>`` finding."""
    return Skip(f"{NOT_MODELLED}{what} — {why}")


@dataclass(frozen=True)
class BugClass:
    """A common class of RL tensor bugs.

    Attributes:
        name: what a user calls the bug (``"loss reduction and loss over padding"``).
        checks: ids of the checks that catch it (any one that runs covers it).
        fields: the recorded fields those checks read (what to record to cover it).
        algorithms: the algorithms it applies to.
        condition: ``"kl"``: only where a KL penalty is in use (not where ``kl_coef`` / ``beta`` is
            recorded as 0); ``"engine"``: only where an inference engine sampled (metadata ``use_vllm``
            true, a ``rollout_engine``, or ``sampler_logprobs`` recorded in some step file: a loop
            that samples with the policy itself has no sampler to mismatch); ``""``: always.
    """

    name: str
    checks: tuple[str, ...]
    fields: tuple[str, ...]
    algorithms: frozenset[str] = RL_ALGORITHMS
    condition: str = ""


BUG_CLASSES: tuple[BugClass, ...] = (
    BugClass("loss reduction and loss over padding", ("recompute.loss", "recompute.per_token_loss"),
             ("loss", "per_token_loss", "completion_mask")),
    BugClass("KL penalty sign", ("kl.k3_sign", "kl.ref_gap", "recompute.ref_kl_k3", "recompute.per_token_loss"),
             ("ref_logprobs", "per_token_loss"), condition="kl"),
    BugClass("sampler mismatch", ("sampler.mismatch", "sampler.probs_diff", "alignment.logprob_shift"),
             ("sampler_logprobs", "old_logprobs"), condition="engine"),
    BugClass("first-step identity and old aliasing policy", ("identity.first_step", "identity.old_aliases_policy"),
             ("policy_logprobs", "old_logprobs", "completion_mask")),
    BugClass("masks after EOS and on padding", ("masks.after_eos", "masks.padding"),
             ("completion_ids", "completion_mask")),
    BugClass("group advantages", ("advantages.group_sum", "advantages.zero_variance", "recompute.advantages"),
             ("rewards", "advantages", "group_ids"), frozenset({"grpo", "cispo", "rloo", ""})),
    BugClass("DPO reference aliasing the policy", ("dpo.reference_aliasing",),
             ("chosen_ref_logprobs", "rejected_ref_logprobs"), frozenset({"dpo"})),
    BugClass("DPO loss", ("recompute.dpo",), ("chosen_policy_logprobs", "rejected_policy_logprobs", "loss"),
             frozenset({"dpo"})),
    # the two below apply where a step declares them: their checks return nothing on a step that declares no
    # correction (no is_correction / vllm_importance_sampling_correction / rollout_is, no is_weights /
    # sequence_is_weights recorded) or no lag (no policy_version, no max_policy_lag), and skip where it does
    BugClass("importance-sampling correction", ("sampler.is_weights",), ("sampler_logprobs", "old_logprobs")),
    BugClass("policy lag", ("sampler.policy_lag",), ("policy_version",)),
)


def applies(bug: BugClass, algorithm: str, conditions: set[str]) -> bool:
    """Whether ``bug`` applies to a step file of ``algorithm`` that meets ``conditions`` (of ``kl``, ``engine``)."""
    return algorithm in bug.algorithms and (not bug.condition or bug.condition in conditions)


def not_checked(selected: set[str], ran: dict[str, set], skipped: dict[str, dict], fields: dict,
                keys: list, algorithm_of: dict, conditions: dict) -> list[Finding]:
    """One ``trace.not_checked`` finding (severity ``skipped``) per bug class that none of its selected
    checks judged on some step file.

    Args:
        selected: ids of the checks this run was asked for (a class none of whose checks is selected
            is not reported: the user chose not to look).
        ran: check id -> the step keys it ran on without skipping.
        skipped: check id -> {step key: the skip's reason}.
        fields: step key -> the set of field names the file records (derived fields left out).
        keys: the readable step keys, in order.
        algorithm_of: step key -> its algorithm.
        conditions: step key -> the :attr:`BugClass.condition` values it meets.
    """
    out = _objectives_not_checked(skipped, keys)
    for bug in BUG_CLASSES:
        checks = [c for c in bug.checks if c in selected]
        if not checks:
            continue
        missed = [k for k in keys if applies(bug, algorithm_of[k], conditions[k])
                  and any(_could_not_run(skipped, c, k) for c in checks)
                  and not any(k in ran.get(c, set()) for c in checks)]
        if not missed or any(skipped[c][k].startswith(NOT_MODELLED) for c in checks for k in missed
                             if k in skipped.get(c, {})):
            continue  # an objective not modelled is named by its own finding, with what to record
        absent = [f for f in bug.fields if any(f not in fields[k] for k in missed)]
        reasons = sorted({skipped[c][k] for c in checks for k in missed if _could_not_run(skipped, c, k)})
        first = missed[0]
        applicable = sum(applies(bug, algorithm_of[k], conditions[k]) for k in keys)
        why = f"on {len(missed)} of {applicable} step files none of {', '.join(checks)} could run: {'; '.join(reasons[:2])}"
        # a missing field says what to record; otherwise (rows cut by first_k_sequences...) the reason is the news
        message = f"not checked: {bug.name} — " + (f"record {', '.join(absent)} ({why})" if absent else why)
        out.append(Finding(NOT_CHECKED, SKIPPED, message, step=first.step, inner_step=first.inner_step,
                           micro_batch=first.micro_batch, rank=first.rank, path=str(first.path),
                           details={"class": bug.name, "fields": absent, "checks": checks,
                                    "steps": [k.label for k in missed[:50]], "reasons": reasons[:5]}))
    return out


def _could_not_run(skipped: dict[str, dict], check: str, key) -> bool:
    """Whether ``check`` was skipped on ``key`` for want of something (not because it does not apply
    to the run: :func:`tracer.checks.finding.not_applicable`)."""
    reason = skipped.get(check, {}).get(key)
    return reason is not None and not reason.startswith(NOT_APPLICABLE)


def _objectives_not_checked(skipped: dict[str, dict], keys: list) -> list[Finding]:
    """One ``trace.not_checked`` finding per objective or setting a check did not model
    (:func:`not_modelled`), with the checks that skipped for it and the step files."""
    where: dict[str, dict] = {}
    for check_id, reasons in skipped.items():
        for key, reason in reasons.items():
            if reason.startswith(NOT_MODELLED):
                seen = where.setdefault(reason.removeprefix(NOT_MODELLED), {"checks": set(), "keys": set()})
                seen["checks"].add(check_id)
                seen["keys"].add(key)
    out = []
    for text, seen in where.items():
        missed = [k for k in keys if k in seen["keys"]]
        first = missed[0]
        what = text.split(" — ", 1)[0]
        out.append(Finding(NOT_CHECKED, SKIPPED, f"not checked: {text} (on {len(missed)} of {len(keys)} step files; "
                           f"{', '.join(sorted(seen['checks']))} skipped)", step=first.step,
                           inner_step=first.inner_step, micro_batch=first.micro_batch, rank=first.rank,
                           path=str(first.path), details={"objective": what, "checks": sorted(seen["checks"]),
                                                          "steps": [k.label for k in missed[:50]]}))
    return out
