"""What ``tracer check`` validates its arguments against before it imports the checks (and torch):
the ids of the registered checks and the names of the ``health`` thresholds with their defaults.
Importing this module imports nothing but the standard library, so a misspelt ``--select`` or
``--threshold`` is refused in tens of milliseconds (issue 49: every error for a bad argument answers
without torch). ``tests/checks/test_catalogue_matches_the_registry.py`` keeps :data:`CHECK_IDS` equal
to the registry (:data:`tracer.checks.CHECKS`): a new check is added here too.
"""

from __future__ import annotations

# Every registered check id (``family.name``), sorted.
CHECK_IDS: tuple[str, ...] = (
    "advantages.group_size", "advantages.group_sum", "advantages.masked_positions", "advantages.reward_placement",
    "advantages.z_bound", "advantages.zero_variance", "alignment.completion_start", "alignment.logprob_shift",
    "dpo.reference_aliasing", "fields.required", "health.clip_fraction", "health.entropy_collapse",
    "health.ref_kl", "health.reward_flat", "health.sampler_gap", "identity.first_step",
    "identity.micro_batch_position", "identity.old_aliases_policy", "integrity.checksum", "kl.k1_negative",
    "kl.k1_negative_step", "kl.k3_sign", "kl.ref_gap", "kl.ref_tracks_policy", "logprobs.positive",
    "masks.after_eos", "masks.dpo_rule", "masks.empty_row", "masks.padding", "nonfinite.values",
    "recompute.advantage_std", "recompute.advantages", "recompute.approx_kl_k2", "recompute.clip_fractions",
    "recompute.declared_settings", "recompute.dpo", "recompute.loss", "recompute.loss_agg_mode",
    "recompute.per_token_loss", "recompute.ratio", "recompute.ref_kl_k3", "recompute.token_rewards",
    "sampler.is_weights", "sampler.mismatch", "sampler.policy_lag", "sampler.probs_diff",
    "turns.advantage_assignment", "turns.placeholder_logprobs", "turns.tool_output_trained", "turns.turn_shift",
    "turns.untrained_turn",
)

# ``tracer check --threshold NAME=VALUE`` names -> the :class:`tracer.checks.context.CheckOptions`
# attribute each sets.
HEALTH_THRESHOLDS = {"ref_kl": "ref_kl_max", "clip_fraction": "clip_fraction_max", "sampler_gap": "sampler_gap_max",
                     "entropy_floor": "entropy_floor", "entropy_drop": "entropy_drop",
                     "reward_flat": "reward_flat_share"}
# Their defaults (the CheckOptions field defaults; why each value: CheckOptions' docstring).
HEALTH_DEFAULTS = {"ref_kl_max": 2.0, "clip_fraction_max": 0.5, "sampler_gap_max": 0.1, "entropy_floor": 0.05,
                   "entropy_drop": 0.9, "reward_flat_share": 1.0}
# Thresholds that are shares (in [0, 1]); the others are values >= 0.
SHARE_THRESHOLDS = ("clip_fraction_max", "entropy_drop", "reward_flat_share")


def unknown_check_names(names: list[str], families: tuple[str, ...]) -> list[str]:
    """The names among ``names`` that are neither a check id of :data:`CHECK_IDS` nor a family."""
    return [n for n in names if n not in CHECK_IDS and n not in families]


def threshold_problem(name: str, value: float) -> str | None:
    """Why ``--threshold name=value`` is refused (an unknown name, a value out of its range), or None."""
    attribute = HEALTH_THRESHOLDS.get(name, name if name in HEALTH_THRESHOLDS.values() else None)
    if attribute is None:
        return (f"unknown threshold {name!r}; known: "
                + ", ".join(f"{n} (default {HEALTH_DEFAULTS[a]:g})" for n, a in HEALTH_THRESHOLDS.items()))
    if not value >= 0 or (attribute in SHARE_THRESHOLDS and value > 1):
        return (f"threshold {name} = {value:g} is out of range: "
                + ("a share in [0, 1]" if attribute in SHARE_THRESHOLDS else "a value >= 0"))
    return None
