"""The RL maths of the seed (SPEC.md section 3), once. Torch (numpy and plain loops inside the two batch
statistics the writer thread computes for every step: :func:`masked_row_quantiles`,
:func:`zero_variance_groups`), no I/O.

One package, themed submodules; every name is re-exported here, so callers write
``from tracer import formulas; formulas.ratio(...)`` whichever submodule holds it:

- :mod:`tracer.formulas.logprobs`: completion-token logprobs (the alignment rule), sequence sums,
  ratio, the k1/k2/k3 KL estimators, sampler vs trainer (log ratios, importance weights, probability gap).
- :mod:`tracer.formulas.reductions`: masked sum and mean, quantiles (torch and host-side numpy rows).
- :mod:`tracer.formulas.losses`: loss reductions and per-token shares, clip fractions, GRPO / CISPO /
  PPO per-token losses, DPO terms.
- :mod:`tracer.formulas.advantages`: group z-scores (seed, TRL, verl), group mean, RLOO, token rewards,
  GAE, whitening, zero-variance groups, and the named advantage rules (SPEC.md section 10).

A test that monkeypatches one of these names patches the submodule that reads it (a function calls
its siblings through its own module's globals, not through this package).

Sources: the seed lesson (shared/seed/lesson-25-reward-logprob-kl.txt), which restates MiniMind's
``trainer/rollout_engine.py``, ``trainer/train_ppo.py``, ``trainer/train_grpo.py`` and
``trainer/train_dpo.py``; k2/k3 estimators from J. Schulman, "Approximating KL Divergence" (2020).

Every mask is True/1 = keep. Logprobs are natural-log (nats).
"""

from tracer.formulas.advantages import (
    ADVANTAGE_RULE_ALIASES,
    ADVANTAGE_RULES,
    GROUP_STD_EPS,
    VERL_GRPO_EPS,
    VERL_RULE_PREFIX,
    WHITEN_EPS,
    ZERO_VARIANCE_LOOP_VALUES,
    advantage_rule_name,
    gae,
    group_advantages,
    group_mean_advantages,
    kl_reward_token_rewards,
    last_kept_index,
    rloo_advantages,
    token_rewards_from_sequence,
    trl_group_advantages,
    verl_grpo_advantages,
    whiten,
    zero_variance_counts,
    zero_variance_groups,
)
from tracer.formulas.logprobs import (
    IS_MODES,
    K3_SWAPPED,
    KL_ESTIMATOR_ALIASES,
    KL_ESTIMATORS,
    approx_kl_k2,
    is_weights,
    kl_estimator_name,
    kl_k1,
    probability_gap,
    ratio,
    ref_kl,
    ref_kl_k3,
    sampler_log_ratio,
    sampler_prob_diff,
    sequence_log_ratio,
    sequence_logprobs,
    token_logprobs,
)
from tracer.formulas.losses import (
    clip_fractions,
    cispo_per_token_loss,
    constant_divisor_loss,
    dpo_terms,
    grpo_per_token_loss,
    loss_contributions,
    ppo_per_token_loss,
    sequence_mean_loss,
    kept_rows_sequence_mean_loss,
    token_mean_loss,
    unmasked_mean_loss,
)
from tracer.formulas.reductions import (
    host_array,
    masked_mean,
    masked_quantiles,
    masked_row_quantiles,
    masked_sum,
    row_quantiles,
)

__all__ = [
    # logprobs
    "token_logprobs", "ratio", "ref_kl_k3", "approx_kl_k2", "kl_k1", "ref_kl", "KL_ESTIMATORS", "K3_SWAPPED", "KL_ESTIMATOR_ALIASES",
    "kl_estimator_name", "sequence_logprobs", "IS_MODES",
    "sampler_log_ratio", "sampler_prob_diff", "sequence_log_ratio", "is_weights", "probability_gap",
    # reductions
    "masked_sum", "masked_mean", "masked_quantiles", "row_quantiles", "host_array", "masked_row_quantiles",
    # losses
    "sequence_mean_loss", "kept_rows_sequence_mean_loss", "token_mean_loss", "unmasked_mean_loss", "constant_divisor_loss", "loss_contributions", "clip_fractions",
    "grpo_per_token_loss", "cispo_per_token_loss", "ppo_per_token_loss", "dpo_terms",
    # advantages
    "GROUP_STD_EPS", "group_advantages", "ZERO_VARIANCE_LOOP_VALUES", "zero_variance_groups", "zero_variance_counts",
    "last_kept_index", "token_rewards_from_sequence", "kl_reward_token_rewards", "gae", "trl_group_advantages", "rloo_advantages", "WHITEN_EPS",
    "whiten", "group_mean_advantages", "ADVANTAGE_RULES", "ADVANTAGE_RULE_ALIASES", "advantage_rule_name",
    "VERL_GRPO_EPS", "VERL_RULE_PREFIX", "verl_grpo_advantages",
]
