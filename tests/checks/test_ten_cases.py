"""`tracer check`: ten classes of RL tensor bugs, each written as real step files and checked through the
API and the CLI. Expected numbers are worked out by hand in the comments."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from tracer import TraceWriter, formulas
from tracer.checks import ERROR, INFO, WARNING, run_checks
from tracer.cli import main
from tracer.format.metadata_codec import encode_metadata

from tests.fixtures.check_traces import (EOS, PAD, ToyTokenizer, case1_tensors, case9_tensors, cli_json, dpo_pair,
                                         found, write_trace)


# -- case 1: first-step identity ------------------------------------------------------------------


def test_case1_first_step_ratio_not_one(tmp_path):
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, case1_tensors())],
                       {"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2})
    (f,) = found(run_checks(root), "identity.first_step")
    # ratio row 0 = exp([0, -0.25, 0, 0.28]) = [1, 0.7788, 1, 1.3231]; row 1 = 1 on its 3 kept tokens.
    # 2 of 7 kept tokens lie outside [0.8, 1.2]; mean ratio = (5 + 0.7788 + 1.3231) / 7 = 1.0146.
    # The worst |policy - old| is 0.28 at seq 0, token 3 (id 8, text 't8').
    assert (f.severity, f.step, f.inner_step, f.sequence, f.token) == (ERROR, 0, 0, 0, 3)
    assert (f.token_id, f.token_text) == (8, "t8")
    assert "2 of 7 kept tokens differ by more than 0.001 nats (float32)" in f.message
    assert "2 of 7 kept tokens have a ratio outside [0.8, 1.2] (clip fraction 0.286, expected 0)" in f.message
    assert "mean ratio 1.0146" in f.message
    assert "policy -2.0200, old -2.3000, ratio 1.3231" in f.message
    code, rows = cli_json(root, "--select", "identity")
    assert code == 1
    assert [(r["check"], r["severity"], r["step"], r["sequence"], r["token"]) for r in rows] == [
        ("identity.first_step", "error", 0, 0, 3)]


def test_case1_tolerance_follows_the_dtype(tmp_path):
    # |policy - old| = 0.03 nats on one token: beyond float32's 1e-3, within bfloat16's 5e-2, and the
    # mean ratio (3 + e^0.03) / 4 = 1.0076 is within bfloat16's 1e-2 but not float32's 1e-3.
    old = [[-1.0, -2.0], [-0.5, -0.7]]
    policy = [[-1.0, -1.97], [-0.5, -0.7]]
    tensors = {"completion_mask": torch.ones(2, 2, dtype=torch.bool),
               "policy_logprobs": torch.tensor(policy), "old_logprobs": torch.tensor(old)}
    f32 = write_trace(tmp_path / "f32", "grpo", [(0, 0, tensors)])
    bf16 = write_trace(tmp_path / "bf16", "grpo", [(0, 0, tensors, {"model_dtype": "bfloat16"})])
    (f,) = found(run_checks(f32), "identity.first_step")
    assert "1 of 4 kept tokens differ by more than 0.001 nats (float32)" in f.message
    assert "mean ratio 1.0076" in f.message
    assert found(run_checks(bf16), "identity.first_step") == []


# -- case 2: alignment (logprobs one position off) ------------------------------------------------

def test_case2_logprobs_shifted_by_one(tmp_path):
    # Tokens [10, 11, 12, 13]: prompt [10, 11], completion [12, 13], only token 12 is kept.
    # Per-target logprobs for targets [11, 12, 13] are [-0.7, -0.2, -3.0]; the sampler reports the
    # completion's: [-0.2 (12), -3.0 (13)]. A mask taken at input positions ([0, 0, 1, 0] over
    # tokens) applied to the per-target array picks index 2, i.e. token 13's -3.0: the trainer's
    # logprob at completion position 0 is -3.0 (sum -3.0 instead of -0.2).
    tensors = {"prompt_ids": torch.tensor([[10, 11]]), "prompt_mask": torch.ones(1, 2, dtype=torch.bool),
               "completion_ids": torch.tensor([[12, 13]]), "completion_mask": torch.tensor([[True, False]]),
               "old_logprobs": torch.tensor([[-3.0, -3.0]]), "policy_logprobs": torch.tensor([[-3.0, -3.0]]),
               "sampler_logprobs": torch.tensor([[-0.2, -3.0]])}
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, tensors)])
    (f,) = found(run_checks(root), "alignment.logprob_shift")
    # shift 0: |-3.0 - (-0.2)| = 2.8 on 1 token; shift +1: |-3.0 - (-3.0)| = 0 (old[0] vs sampler[1]);
    # shift -1 has no kept pair. +1 fits (0 < 0.5 * 2.8), so old_logprobs[j] is token j+1's logprob.
    assert (f.severity, f.step, f.sequence, f.token, f.token_id) == (ERROR, 0, 0, 0, 12)
    assert f.details["shift"] == 1
    assert "shifted by +1 (mean |Δ| 0.0000 nats over 1 token)" in f.message
    assert "unshifted (mean |Δ| 2.8000 nats over 1 token)" in f.message
    assert "the kept tokens of seq 0 sum to -3.0000 instead of -0.2000" in f.message
    assert cli_json(root, "--select", "alignment.logprob_shift")[0] == 1


# -- case 3: completion cut at the count of real prompt tokens ------------------------------------

def test_case3_completion_starts_at_real_prompt_count(tmp_path):
    # Row 0: prompt [0, 0, 11, 12, 13] left-padded (mask [0, 0, 1, 1, 1]), generated row
    # [0, 0, 11, 12, 13, 21, 22, 2]. Cut at 3 (real prompt tokens) -> [12, 13, 21, 22, 2]: it starts
    # with the prompt's last 2 tokens (as many as the row's padding). Cut at 5 -> [21, 22, 2].
    # Row 1 has no prompt padding and so cannot show the bug.
    prompt_ids = torch.tensor([[0, 0, 11, 12, 13], [14, 15, 16, 17, 18]])
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    bad = torch.tensor([[12, 13, 21, 22, EOS], [23, 24, EOS, PAD, PAD]])
    good = torch.tensor([[21, 22, EOS, PAD, PAD], [23, 24, EOS, PAD, PAD]])
    for name, ids in (("bad", bad), ("good", good)):
        mask = ids != PAD  # kept up to and including EOS
        write_trace(tmp_path / name, "grpo", [(0, 0, {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                                                       "completion_ids": ids, "completion_mask": mask})])
    (f,) = found(run_checks(tmp_path / "bad"), "alignment.completion_start")
    assert (f.severity, f.sequence, f.token, f.token_id, f.token_text) == (ERROR, 0, 0, 12, "t12")
    assert "begin with [12, 13], the last 2 real prompt tokens" in f.message
    assert "count of real prompt tokens (3) instead of the padded prompt width (5)" in f.message
    assert found(run_checks(tmp_path / "good"), "alignment.completion_start") == []


# -- case 4: PPO reward on a masked position ------------------------------------------------------

def test_case4_reward_on_masked_position(tmp_path):
    # mask [1, 1, 1, 1, 0, 0]: the last kept token is index 3; the score 1.0 was written at index 4.
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    ids = torch.tensor([[5, 6, 7, EOS, PAD, PAD]])
    wrong = torch.tensor([[0.0, 0, 0, 0, 1.0, 0]])
    right = formulas.token_rewards_from_sequence(torch.tensor([1.0]), mask)  # 1.0 at index 3
    for name, token_rewards in (("wrong", wrong), ("right", right)):
        write_trace(tmp_path / name, "ppo", [(0, 0, {"completion_ids": ids, "completion_mask": mask,
                                                      "token_rewards": token_rewards, "rewards": torch.tensor([1.0])})])
    (f,) = found(run_checks(tmp_path / "wrong"), "advantages.reward_placement")
    assert (f.severity, f.step, f.sequence, f.token, f.token_text) == (ERROR, 0, 0, 4, "<pad>")
    assert "token_rewards[0, 4] = 1 sits at a masked position; the last kept token of seq 0 is 3" in f.message
    assert found(run_checks(tmp_path / "right"), "advantages.reward_placement") == []


# -- case 5: KL overflow ----------------------------------------------------------------------------

@pytest.mark.parametrize("policy_1, gap, severity, text", [
    # ref - policy = -2 - (-92) = 90 > 88.72 = log(float32 max): exp overflows, k3 = inf.
    (-92.0, "90", ERROR, "exp(90) overflows float32 (largest exp argument 88.72), so ref_kl_k3 = inf"),
    # ref - policy = 20: k3 = e^20 - 20 - 1 = 485165195 - 21 = 4.852e8, finite but harmful.
    (-22.0, "20", ERROR, "k3 = exp(20) - 20 - 1 = 4.852e+08 nats"),
    # ref - policy = 12: k3 = e^12 - 13 = 162754.8 - 13 = 1.627e5: a warning (>= 10 nats), not an error.
    (-14.0, "12", WARNING, "k3 = exp(12) - 12 - 1 = 1.627e+05 nats"),
])
def test_case5_ref_minus_policy_too_large(tmp_path, policy_1, gap, severity, text):
    policy = torch.tensor([[-1.1, policy_1]])
    ref = torch.tensor([[-1.0, -2.0]])
    tensors = {"completion_ids": torch.tensor([[5, 6]]), "completion_mask": torch.ones(1, 2, dtype=torch.bool),
               "policy_logprobs": policy, "ref_logprobs": ref, "ref_kl_k3": formulas.ref_kl_k3(policy, ref)}
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, tensors)])
    findings = run_checks(root)
    (f,) = found(findings, "kl.ref_gap")
    assert (f.severity, f.sequence, f.token, f.token_id) == (severity, 0, 1, 6)
    assert f"ref - policy = {gap} nats at seq 0, token 1" in f.message and text in f.message
    assert json.loads(json.dumps(f.to_dict(), allow_nan=False))["details"]["ref_kl_k3"] == (
        "inf" if gap == "90" else f.details["ref_kl_k3"])  # --json stays strict JSON
    nonfinite = found(findings, "nonfinite.values", ERROR)
    assert bool(nonfinite) == (gap == "90")  # the recorded inf k3 is also a kept non-finite value
    if nonfinite:
        assert nonfinite[0].field == "ref_kl_k3" and (nonfinite[0].sequence, nonfinite[0].token) == (0, 1)


# -- case 6: a NaN at a masked slot ------------------------------------------------------------------

def case6_tensors(mask):
    policy, old = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, float("nan")]])
    advantages = torch.tensor([[1.0, 1.0]])
    ratio = formulas.ratio(policy, old)  # [1, nan]
    per_token_loss = -ratio * advantages  # [-1, nan]
    return {"completion_ids": torch.tensor([[5, 6]]), "completion_mask": torch.tensor(mask, dtype=torch.bool),
            "policy_logprobs": policy, "old_logprobs": old, "advantages": advantages, "ratio": ratio,
            "per_token_loss": per_token_loss}


def test_case6_nan_at_masked_slot_is_a_warning_naming_the_first_tensor(tmp_path):
    tensors = case6_tensors([[1, 0]])
    keep = tensors["completion_mask"]
    # The unguarded masked mean is NaN (NaN * 0 = NaN); the guarded one is -1 (only token 0 counts).
    assert math.isnan(float((tensors["per_token_loss"] * keep).sum() / keep.sum()))
    assert float(formulas.masked_mean(tensors["per_token_loss"], keep)) == -1.0
    root = write_trace(tmp_path / "r", "ppo", [(0, 0, tensors)])
    findings = run_checks(root)
    (f,) = found(findings, "nonfinite.values")
    assert (f.severity, f.field, f.sequence, f.token) == (WARNING, "old_logprobs", 0, 1)
    assert "old_logprobs is the first tensor" in f.message and "at a masked position: nan at seq 0, token 1" in f.message
    assert "downstream also non-finite: ratio (1), per_token_loss (1)" in f.message
    assert "NaN * 0 = NaN" in f.message
    assert f.details["tensors"] == ["old_logprobs", "ratio", "per_token_loss"]


def test_case6_nan_at_kept_slot_is_an_error(tmp_path):
    root = write_trace(tmp_path / "r", "ppo", [(0, 0, case6_tensors([[1, 1]]))])
    (f,) = found(run_checks(root), "nonfinite.values")
    assert (f.severity, f.field, f.sequence, f.token) == (ERROR, "old_logprobs", 0, 1)
    assert cli_json(root, "--select", "nonfinite")[0] == 1


# -- case 7: zero-variance groups -------------------------------------------------------------------

def test_case7_every_group_has_zero_variance(tmp_path):
    # G = 4, P = 2, rewards [-8]*4 + [2]*4: batch mean -3, every |r - mean| = 5, so the population std
    # is 5 and Bessel's is sqrt(8 * 25 / 7) = 5.345; yet each group is constant, so A = 0 everywhere.
    rewards = torch.tensor([-8.0] * 4 + [2.0] * 4)
    advantages = formulas.group_advantages(rewards, 4)
    assert advantages.abs().max() == 0
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, {"rewards": rewards, "advantages": advantages,
                                                        "group_ids": torch.arange(2).repeat_interleave(4)})],
                       {"num_generations": 4})
    (f,) = found(run_checks(root), "advantages.zero_variance")
    assert (f.severity, f.step, f.sequence) == (WARNING, 0, 0)
    assert f.details["zero_variance_share"] == 1.0
    assert "all 2 groups have zero reward variance (the reward each group shares: [-8.0, 2.0])" in f.message
    assert "batch std of the rewards is 5 (5.345 with Bessel's correction)" in f.message
    assert "no learning signal" in f.message


def test_case7_equal_rewards_with_kl_penalised_advantages_is_info(tmp_path):
    # RLOO with beta > 0 (TRL's rloo_kl): A_i = r'_i - mean_{j != i} r'_j with r' = r - beta * sum(old - ref).
    # Every reward 0, but the penalties differ: beta = 0.1, sums [0.2, 0.1, 0.0, 0.3] give
    # r' = [-0.02, -0.01, 0.0, -0.03]; A_0 = -0.02 - (-0.01 + 0.0 - 0.03) / 3 = -0.02 + 0.013333 = -0.006667,
    # A_2 = 0 - (-0.06) / 3 = +0.02 and A_3 = -0.03 - (-0.03) / 3 = -0.02: the largest |A| is 0.02.
    rewards = torch.zeros(4)
    penalised = rewards - 0.1 * torch.tensor([0.2, 0.1, 0.0, 0.3])
    advantages = penalised - (penalised.sum() - penalised) / 3
    assert math.isclose(float(advantages[0]), -0.02 + 0.04 / 3, abs_tol=1e-7)
    root = write_trace(tmp_path / "r", "rloo", [(0, 0, {"rewards": rewards, "advantages": advantages,
                                                        "group_ids": torch.zeros(4, dtype=torch.long)})],
                       {"num_generations": 4, "advantage_rule": "rloo_kl", "beta": 0.1})
    (f,) = found(run_checks(root), "advantages.zero_variance")
    assert f.severity == INFO and "the recorded advantages are not 0 (largest |A| 0.02)" in f.message


# -- case 8: which loss reduction produced the recorded loss ----------------------------------------

def case8_tensors(loss):
    # G = 2, advantages [+1, -1], lengths 5 and 2 padded to T = 6, ratio 1, beta 0: per-token loss = -A.
    # token-mean: (5 * -1 + 2 * +1) / 7 = -3/7 = -0.428571; sequence-mean: (-1 + 1) / 2 = 0;
    # constant divisor G * T = 12: -3 / 12 = -0.25.
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    logprobs = torch.full((2, 6), -1.0)
    return {"completion_mask": mask, "policy_logprobs": logprobs, "old_logprobs": logprobs.clone(),
            "advantages": torch.tensor([1.0, -1.0]), "loss": torch.tensor(loss)}


HYPER8 = {"num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "beta": 0.0}


def test_case8_recorded_loss_is_token_mean_not_the_declared_sequence_mean(tmp_path):
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, case8_tensors(-3 / 7))],
                       {**HYPER8, "loss_reduction": "sequence_mean"})
    (f,) = found(run_checks(root), "recompute.loss")
    assert (f.severity, f.step, f.field) == (ERROR, 0, "loss")
    assert "recorded loss -0.428571: it matches token_mean, but metadata says 'sequence_mean'" in f.message
    assert "sequence-mean 0, token-mean -0.428571, constant divisor 12 -0.25" in f.message
    assert f.details["matches"] == ["token_mean"]


@pytest.mark.parametrize("loss, declared, expected", [
    (-3 / 7, None, (INFO, "matches the token_mean reduction")),  # nothing declared: say which
    (-0.25, "constant", None),  # declared and matching: no finding
    (0.0, "sequence_mean", None),
    (-0.3, None, (ERROR, "it matches none of the three reductions")),
])
def test_case8_reduction_is_named(tmp_path, loss, declared, expected):
    meta = {**HYPER8, **({"loss_reduction": declared} if declared else {})}
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, case8_tensors(loss))], meta)
    findings = found(run_checks(root), "recompute.loss")
    if expected is None:
        assert findings == []
    else:
        (f,) = findings
        assert f.severity == expected[0] and expected[1] in f.message


def test_case8_loss_from_metadata_in_a_bare_step_file(tmp_path):
    # A single .safetensors file with canonical names, the loss as metadata key 'loss'.
    tensors = case8_tensors(0.0)
    del tensors["loss"]
    meta = {**HYPER8, "algorithm": "grpo", "loss_reduction": "sequence_mean", "loss": -3 / 7}
    path = tmp_path / "step.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=encode_metadata(meta))
    code, rows = cli_json(path, "--select", "recompute.loss")
    assert code == 1 and rows[0]["check"] == "recompute.loss" and rows[0]["severity"] == "error"
    assert "it matches token_mean" in rows[0]["message"]


# -- case 9: DPO chosen/rejected masks built by different rules --------------------------------------


def test_case9_dpo_masks_by_different_rules(tmp_path):
    # Same rule ([0, 0, 1, 1] both): pi_c = -0.9, ref_c = -1.1, pi_r = -3.1, ref_r = -2.9,
    # logits = (-0.9 + 3.1) - (-1.1 + 2.9) = 0.4, loss = -logsigmoid(0.1 * 0.4) = log(1 + e^-0.04) = 0.6733.
    # Rejected keeps the prompt ([1, 1, 1, 1]): pi_r = -8.1, ref_r = -8.4,
    # logits = (-0.9 + 8.1) - (-1.1 + 8.4) = -0.1, loss = log(1 + e^0.01) = 0.6982.
    assert math.isclose(math.log1p(math.exp(-0.04)), 0.6733, abs_tol=1e-4)
    assert math.isclose(math.log1p(math.exp(0.01)), 0.6982, abs_tol=1e-4)
    write_trace(tmp_path / "bad", "dpo", [(0, 0, case9_tensors([1, 1, 1, 1]))], {"beta": 0.1})
    write_trace(tmp_path / "good", "dpo", [(0, 0, case9_tensors([0, 0, 1, 1]))], {"beta": 0.1})
    (f,) = found(run_checks(tmp_path / "bad"), "masks.dpo_rule")
    assert (f.severity, f.sequence, f.token, f.field, f.token_text) == (ERROR, 0, 0, "rejected_mask", "t3")
    assert "chosen_mask first keeps position 2, rejected_mask position 0" in f.message
    assert "rejected_mask keeps positions 0..1 (tokens shared by both sides: the prompt)" in f.message
    assert "DPO loss of pair 0: 0.6982 with the recorded masks, 0.6733 with both masks starting at position 2" in f.message
    assert found(run_checks(tmp_path / "good"), "masks.dpo_rule") == []


def test_case9_prompt_at_different_offsets_is_info_not_an_error(tmp_path):
    # TRL's DPO collator with truncation_mode="keep_end" cuts each side from the left on its own: the
    # prompt [..., 9, 3, 4] keeps one more token on the chosen side (longer completions lose more).
    # chosen  = 9 3 4 | 5 6      (mask from 3)
    # rejected = 3 4 | 7 8 2     (mask from 2): position 2 holds 4 (chosen's prompt) and 7 (rejected's
    # answer): not shared; the tokens before each start, [9 3 4] and [3 4], end the same way.
    root = write_trace(tmp_path / "shifted", "dpo", [(0, 0, dpo_pair([9, 3, 4, 5, 6], 3, [3, 4, 7, 8, EOS], 2))],
                       {"beta": 0.1})
    (f,) = found(run_checks(root), "masks.dpo_rule")
    assert (f.severity, f.sequence, f.token) == (INFO, 0, None)
    assert "chosen_mask first keeps position 3, rejected_mask position 2, but the tokens before" in f.message
    assert (f.details["chosen_start"], f.details["rejected_start"], f.details["pairs"]) == (3, 2, [0])


def test_case9_one_side_dropping_its_first_answer_token_is_still_an_error(tmp_path):
    # chosen = 3 4 | 5 6 (mask from 2); rejected = 3 4 | 7 8 with its mask from 3: it drops 7, its own
    # first answer token. Position 2 holds 5 and 7 (not shared), and the tokens before each start,
    # [3 4] and [3 4 7], do not end the same way: a different rule, an error.
    root = write_trace(tmp_path / "dropped", "dpo", [(0, 0, dpo_pair([3, 4, 5, 6], 2, [3, 4, 7, 8], 3))],
                       {"beta": 0.1})
    (f,) = found(run_checks(root), "masks.dpo_rule")
    assert (f.severity, f.sequence, f.token, f.field) == (ERROR, 0, 2, "chosen_mask")
    assert "chosen_mask keeps positions 2..2 that rejected_mask drops" in f.message


# -- case 10: ratio exactly 1 -------------------------------------------------------------------------

def case10_tensors(policy, old):
    return {"completion_ids": torch.tensor([[5, 6, 7], [8, 9, EOS]]),
            "completion_mask": torch.ones(2, 3, dtype=torch.bool), "policy_logprobs": policy,
            "old_logprobs": old, "ratio": formulas.ratio(policy, old), "advantages": torch.tensor([0.7, -0.7])}


def test_case10_one_inner_step_with_detached_old_is_clean(tmp_path):
    # old = policy.detach(): ratio 1 and clip fraction 0 by construction; nothing to report.
    policy = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.1]])
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, case10_tensors(policy, policy.clone()))],
                       {"num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2,
                        "old_logprobs_source": "policy_detached"})
    findings = run_checks(root)
    # the case holds only the identity fields (no rewards/group_ids): fields.required says so, nothing else
    assert [f.check for f in findings if f.severity in (ERROR, WARNING)] == ["fields.required"]
    assert found(findings, "identity.first_step") == found(findings, "identity.old_aliases_policy") == []


def test_case10_ratio_exactly_one_after_an_update_means_old_aliases_policy(tmp_path):
    policy0 = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.1]])
    policy1 = policy0 + torch.tensor([[0.05, -0.02, 0.01], [0.0, 0.03, -0.01]])  # moved by the update
    hyper = {"num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2}
    # Bug: at inner step 1 old was recomputed from the updated model, so old == policy1 exactly.
    write_trace(tmp_path / "bad", "grpo", [(0, 0, case10_tensors(policy0, policy0.clone())),
                                           (0, 1, case10_tensors(policy1, policy1.clone()))], hyper)
    # Right: old is the rollout's (policy0) at both inner steps.
    write_trace(tmp_path / "good", "grpo", [(0, 0, case10_tensors(policy0, policy0.clone())),
                                            (0, 1, case10_tensors(policy1, policy0.clone()))], hyper)
    (f,) = found(run_checks(tmp_path / "bad"), "identity.old_aliases_policy")
    assert (f.severity, f.step, f.inner_step, f.sequence, f.token) == (ERROR, 0, 1, None, None)
    assert "agree on all 6 kept tokens at inner step 1" in f.message and "ratio 1 to float precision" in f.message
    assert "old_logprobs alias policy_logprobs" in f.message
    good = run_checks(tmp_path / "good")
    assert {f.check for f in good if f.severity in (ERROR, WARNING)} == {"fields.required"}  # identity fields only
    assert cli_json(tmp_path / "bad")[0] == 1 and cli_json(tmp_path / "good")[0] == 0


# -- an unfinished trace: the writer has not closed ------------------------------------------------

def test_check_of_an_open_trace_says_unfinished_and_a_closed_one_does_not(tmp_path, capsys):
    policy = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.1]])
    root = tmp_path / "live"
    writer = TraceWriter(root, "grpo", tokenizer=ToyTokenizer(),
                         hyperparameters={"num_generations": 2, "old_logprobs_source": "policy_detached"})
    writer.record(0, case10_tensors(policy, policy.clone()))
    writer.flush()  # step 0 is on disk; the manifest still says "running"
    findings = run_checks(root)
    unfinished = found(findings, "trace.unfinished")
    assert [(f.severity, f.path) for f in unfinished] == [(INFO, str(root / "manifest.json"))]
    assert "unfinished" in unfinished[0].message and "'running'" in unfinished[0].message
    # an info finding: the exit code is that of the other findings (here no error: 0)
    assert main(["check", str(root)]) == 0
    text = capsys.readouterr().out
    assert "trace.unfinished" in text and "this trace is unfinished" in text and "PASS" in text
    code, as_json = cli_json(root)
    assert code == 0 and [d["severity"] for d in as_json if d["check"] == "trace.unfinished"] == [INFO]
    writer.close()  # status "finished": the note is gone, the other findings are unchanged
    after = run_checks(root)
    assert found(after, "trace.unfinished") == []
    assert [f.to_dict() for f in after] == [f.to_dict() for f in findings if f.check != "trace.unfinished"]


def test_hyper_reads_trl_loss_options_from_the_manifest_config_of_older_traces(tmp_path):
    # A TRL trace recorded before the integration put delta & co. in step metadata keeps them only in
    # the manifest's config.trainer_args (TRL's GRPOConfig names). hyper() reads those keys there, and
    # only those: a trainer_args beta is not taken for the metadata key beta.
    from tracer.checks import CheckOptions, StepContext
    from tracer.read import Trace

    policy = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.1]])
    root = tmp_path / "old_trl"
    with TraceWriter(root, "grpo", hyperparameters={"num_generations": 2},
                     config={"trainer_args": {"delta": 1.5, "top_entropy_quantile": 0.5, "beta": 0.3}}) as writer:
        writer.record(0, case10_tensors(policy, policy.clone()))
    trace = Trace(root)
    ctx = StepContext(trace, trace.steps()[0], CheckOptions())
    assert (ctx.hyper("delta", None), ctx.hyper("top_entropy_quantile", 1.0)) == (1.5, 0.5)
    assert ctx.hyper("beta", None) is None and ctx.hyper("off_policy_mask_threshold", None) is None
