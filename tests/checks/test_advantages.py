"""`tracer check`'s advantage checks, each on its own input: group sums, the z-score bound (and the
undeclared rules without a group std it leaves to recompute.advantages), zero variance, the declared
and recognised advantage rules (group z-score, group mean, RLOO with its KL penalty, PPO's GAE).
Values are worked out by hand in the comments."""

import math

import pytest
import torch

from tracer import formulas
from tracer.checks import ERROR, INFO, SKIPPED, run_checks

from tests.fixtures.check_traces import found, write_trace


def grpo_rows(rewards, advantages, **extra):
    return {"rewards": torch.tensor(rewards), "advantages": torch.tensor(advantages), **extra}


def test_group_sum_and_z_bound(tmp_path):
    # Batch z-score of group-constant rewards [1]*4 + [-1]*4: mean 0, std 1, so A = r; each group sums
    # to +4 or -4 instead of 0. Group [3, -1, -1, -1] sums to 0 but |3| > sqrt(4 - 1) = 1.732.
    write_trace(tmp_path / "sum", "grpo", [(0, 0, grpo_rows([1.0] * 4 + [-1.0] * 4, [1.0] * 4 + [-1.0] * 4))],
                {"num_generations": 4})
    write_trace(tmp_path / "z", "grpo", [(0, 0, grpo_rows([0.0] * 4, [3.0, -1.0, -1.0, -1.0]))],
                {"num_generations": 4})
    (f,) = found(run_checks(tmp_path / "sum"), "advantages.group_sum")
    assert (f.severity, f.sequence) == (ERROR, 0) and "rows [0, 1, 2, 3] sum to 4 (mean 1)" in f.message
    assert "2 of 2 groups do not sum to 0" in f.message
    (f,) = found(run_checks(tmp_path / "z"), "advantages.z_bound")
    assert (f.severity, f.sequence) == (ERROR, 0) and "|A| = 3 at seq 0 exceeds sqrt(G - 1) = 1.732" in f.message


def test_z_bound_leaves_undeclared_group_mean_advantages_to_recompute(tmp_path):
    # Dr. GRPO / TRL scale_rewards="none": A = r - group mean. Group [0, 0, 0, 5]: mean 1.25, A[3] = 3.75 >
    # sqrt(3). Undeclared, any known rule passes (recompute.advantages names it); declared z-score, an error.
    rewards = [0.0, 0.0, 0.0, 5.0, 1.0, 2.0, 1.0, 2.0]
    advantages = [-1.25, -1.25, -1.25, 3.75, -0.5, 0.5, -0.5, 0.5]
    write_trace(tmp_path / "u", "grpo", [(0, 0, grpo_rows(rewards, advantages))], {"num_generations": 4})
    write_trace(tmp_path / "d", "grpo", [(0, 0, grpo_rows(rewards, advantages))],
                {"num_generations": 4, "scale_rewards": "group"})
    findings = run_checks(tmp_path / "u")
    assert not found(findings, "advantages.z_bound")
    (z,) = [f for f in findings if f.check == "advantages.z_bound"]
    assert z.severity == SKIPPED and "'group_mean' rule" in z.message
    (rule,) = found(findings, "recompute.advantages")
    assert rule.severity == INFO and rule.details["rule"] == "group_mean"
    (z,) = found(run_checks(tmp_path / "d"), "advantages.z_bound")
    assert (z.severity, z.sequence) == (ERROR, 3) and "|A| = 3.75 at seq 3" in z.message
    # a z-score declared another way (the seed's population std), or a batch normalisation that never
    # happened: still an error
    for name, declared in (("p", {"advantage_std": "population"}), ("n", {"normalize_advantages": True})):
        write_trace(tmp_path / name, "grpo", [(0, 0, grpo_rows(rewards, advantages))],
                    {"num_generations": 4, **declared})
        (z,) = found(run_checks(tmp_path / name), "advantages.z_bound")
        assert (z.severity, z.sequence) == (ERROR, 3), name


def test_z_bound_leaves_undeclared_batch_scaled_advantages_to_recompute(tmp_path):
    # TRL scale_rewards="batch": (r - group mean) / (batch std + eps). Rewards [0, 0, 0, 10, 0, 0, 0, 0]:
    # group means 2.5 and 0, batch std (Bessel) sqrt(87.5 / 7) = sqrt(12.5); A[3] = 7.5 / sqrt(12.5) = 2.12 > sqrt(3).
    std = math.sqrt(12.5) + formulas.GROUP_STD_EPS
    rewards = [0.0, 0.0, 0.0, 10.0, 0.0, 0.0, 0.0, 0.0]
    advantages = [-2.5 / std] * 3 + [7.5 / std] + [0.0] * 4
    write_trace(tmp_path / "u", "grpo", [(0, 0, grpo_rows(rewards, advantages))], {"num_generations": 4})
    findings = run_checks(tmp_path / "u")
    (z,) = [f for f in findings if f.check == "advantages.z_bound"]
    assert z.severity == SKIPPED and "'batch_zscore_unbiased' rule" in z.message
    (rule,) = found(findings, "recompute.advantages")
    assert rule.severity == INFO and rule.details["rule"] == "batch_zscore_unbiased"


def test_partly_zero_variance_is_an_info_with_the_share(tmp_path):
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    write_trace(tmp_path / "r", "grpo", [(0, 0, grpo_rows(rewards.tolist(), formulas.group_advantages(rewards, 4).tolist()))],
                {"num_generations": 4})
    (f,) = found(run_checks(tmp_path / "r"), "advantages.zero_variance")
    assert f.severity == INFO and "1 of 2 groups (50%) have zero reward variance" in f.message


@pytest.mark.parametrize("declared, expected", [
    ({"advantage_std": "unbiased", "scale_rewards": "group"}, None),  # what TRL records: matches
    ({}, (INFO, "advantages follow the 'group_zscore_unbiased' rule")),  # undeclared: say which rule
    ({"advantage_std": "population"}, (ERROR, "differ from the 'group_zscore' rule recomputed from rewards (metadata "
                                              "declares 'group_zscore'); the recorded values match "
                                              "['group_zscore_unbiased', 'verl_grpo'] instead")),  # eps 1e-4 ~ 1e-6 here
])
def test_advantage_rule_follows_metadata(tmp_path, declared, expected):
    # G = 4, group 0 rewards [1, 0, 0, 0]: mean 0.25, population std 0.433, Bessel's std 0.5.
    # TRL: A_0 = 0.75 / (0.5 + 1e-4) = 1.4997; the seed's rule would give 0.75 / 0.4331 = 1.7317.
    # (Group 1, [0, 0, 1, 1], makes the batch std differ from the group stds: batch_zscore_unbiased does not match.)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    advantages = formulas.trl_group_advantages(rewards, 4)
    assert math.isclose(float(advantages[0]), 0.75 / 0.5001, rel_tol=1e-5)
    write_trace(tmp_path / "r", "grpo", [(0, 0, grpo_rows(rewards.tolist(), advantages.tolist()))],
                {"num_generations": 4, **declared})
    findings = found(run_checks(tmp_path / "r"), "recompute.advantages")
    if expected is None:
        assert findings == []
    else:
        (f,) = findings
        assert f.severity == expected[0] and expected[1] in f.message


@pytest.mark.parametrize("advantages, expected", [([0.8, -0.8], None), ([1.0, -1.0], ERROR)])
def test_rloo_advantages_with_the_kl_penalty_in_the_reward(tmp_path, advantages, expected):
    # TRL RLOO, G = 2, beta 0.5: k1 sums over kept tokens (old - ref) = [0.2 + 0.2, 0] = [0.4, 0], so
    # r' = [1 - 0.5 * 0.4, 0] = [0.8, 0] and leave-one-out A = [0.8 - 0, 0 - 0.8] = [0.8, -0.8].
    # [1, -1] is the leave-one-out of the raw rewards: the KL penalty was forgotten.
    old = torch.tensor([[-1.0, -1.0], [-0.5, -0.5]])
    ref = torch.tensor([[-1.2, -1.2], [-0.5, -0.5]])
    tensors = {"completion_mask": torch.ones(2, 2, dtype=torch.bool), "old_logprobs": old, "ref_logprobs": ref,
               "policy_logprobs": old.clone(), "rewards": torch.tensor([1.0, 0.0]),
               "advantages": torch.tensor(advantages), "group_ids": torch.tensor([0, 0])}
    write_trace(tmp_path / "r", "rloo", [(0, 0, tensors)], {"num_generations": 2, "beta": 0.5,
                                                            "advantage_rule": "rloo_kl"})
    findings = found(run_checks(tmp_path / "r"), "recompute.advantages")
    assert [f.severity for f in findings] == ([] if expected is None else [expected])
    if findings:
        assert "the recorded values match ['rloo'] instead" in findings[0].message


def test_ppo_gae_recompute_catches_bootstrapping_from_padding(tmp_path):
    # Row 1 keeps 2 of 4 tokens; its padded values are 5.0. Unmasked GAE (gamma = lam = 1) gives the
    # last kept token A = r + V_pad - V = 1 + 5 - 0.5 = 5.5; masked GAE gives 1 - 0.5 = 0.5.
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.2, 0.5, 5.0, 5.0]])
    token_rewards = formulas.token_rewards_from_sequence(torch.tensor([1.0, 1.0]), mask)
    right, returns = formulas.gae(token_rewards, values, mask, 1.0, 1.0)
    wrong = right.clone()
    wrong[1, 1] = 1.0 + 5.0 - 0.5
    hyper = {"gamma": 1.0, "lam": 1.0}
    base = {"completion_mask": mask, "values": values, "token_rewards": token_rewards, "returns": returns}
    write_trace(tmp_path / "good", "ppo", [(0, 0, {**base, "advantages": right})], hyper)
    write_trace(tmp_path / "bad", "ppo", [(0, 0, {**base, "advantages": wrong})], hyper)
    assert found(run_checks(tmp_path / "good"), "recompute.advantages") == []
    (f,) = found(run_checks(tmp_path / "bad"), "recompute.advantages")
    assert (f.severity, f.sequence, f.token) == (ERROR, 1, 1)
    assert "worst at seq 1, token 1: recorded 5.5, recomputed 0.5" in f.message
