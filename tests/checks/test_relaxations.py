"""The checks relaxed to stop false alarms on healthy TRL / verl runs (commits 9e1ecc5..a2aa232), tried
against plausible bugs of hand-written loops: the bugs each relaxation still catches (regression
protection), each new info path firing only where intended, and five bugs the first relaxations let
through (each caught before them, checked against a worktree of 84b6f79), caught again since the
conditions were tightened (a non-fresh trace's negative k1 is an info, not silent; zero-variance
rewards with non-zero advantages warn unless the rule has another term; a group is left out of
group_sum only for a masked row whose advantage is exactly 0, and only rules known not to centre
on the group mean skip it; token_advantages stand in only when they vary along a row). The
micro-batch, logprob-shift and cut-row rules: tests/checks/test_micro_batch_shift_and_cut_rules.py.
Values are worked out by hand in the comments."""

import math

import pytest
import torch

from tracer import formulas
from tracer.checks import ERROR, INFO, SKIPPED, WARNING, run_checks

from tests.fixtures.check_traces import EOS, PAD, dpo_pair, found, write_trace


def bad(findings, check=None):
    return [f for f in findings if f.severity in (ERROR, WARNING) and (check is None or f.check == check)]


# -- 1. masks.dpo_rule: a prompt at different offsets per side is info ---------------------------------

# A hand-written loop that left-pads prompt + answer per side (its own tokenizer call per side):
# prompt P = 20 21 22; chosen answer 30 31 EOS, rejected answer 40 41 42 43 EOS, T = 9.
LEFT_CHOSEN = [PAD, PAD, PAD, 20, 21, 22, 30, 31, EOS]  # answer from 6
LEFT_REJECTED = [PAD, 20, 21, 22, 40, 41, 42, 43, EOS]  # answer from 4


def test_dpo_prompt_left_padded_per_side_is_info(tmp_path):
    # Starts 6 and 4. Positions 4..5 hold 21 22 (chosen's prompt) and 40 41 (rejected's answer): not shared.
    # The tokens before each start, chosen[2:6] = [0 20 21 22] and rejected[0:4] = [0 20 21 22], agree.
    root = write_trace(tmp_path / "r", "dpo", [(0, 0, dpo_pair(LEFT_CHOSEN, 6, LEFT_REJECTED, 4))], {"beta": 0.1})
    (f,) = found(run_checks(root), "masks.dpo_rule")
    assert (f.severity, f.details["chosen_start"], f.details["rejected_start"]) == (INFO, 6, 4)


@pytest.mark.parametrize("rejected_start, positions", [
    # one late: drops its own first answer token 40. lo..hi = 5..5: chosen 22 vs rejected 41 (not shared);
    # before the starts chosen[1:6] = [0 0 20 21 22] vs rejected[0:5] = [0 20 21 22 40]: differ
    (5, "5..5"),
    # one early: keeps its prompt token 22. 3..5: [20 21 22] vs [22 40 41]; chosen[3:6] = [20 21 22] vs
    # rejected[0:3] = [0 20 21]: differ
    (3, "3..5"),
    # keeps its whole prompt (mask = attention mask): 1..5; chosen[5:6] = [22] vs rejected[0:1] = [0]
    (1, "1..5"),
])
def test_dpo_one_side_off_under_left_padding_is_still_an_error(tmp_path, rejected_start, positions):
    root = write_trace(tmp_path / "r", "dpo", [(0, 0, dpo_pair(LEFT_CHOSEN, 6, LEFT_REJECTED, rejected_start))],
                       {"beta": 0.1})
    (f,) = found(run_checks(root), "masks.dpo_rule")
    assert (f.severity, f.field) == (ERROR, "rejected_mask")
    assert f"rejected_mask keeps positions {positions} that chosen_mask drops" in f.message


def test_dpo_one_side_keeping_the_generation_header_is_still_an_error(tmp_path):
    # Chat prompt 20 21 <im_end>=10 \n=11 <im_start>=12 assistant=13 \n=11; the rejected side's prompt
    # length was taken without the generation header (3 tokens short): its mask starts at 4, chosen's at 7.
    # Positions 4..6 hold 12 13 11 on both sides: the shared prompt, kept on one side only.
    prompt = [20, 21, 10, 11, 12, 13, 11]
    root = write_trace(tmp_path / "r", "dpo", [(0, 0, dpo_pair(prompt + [30, 31, EOS], 7, prompt + [40, 41, EOS], 4))],
                       {"beta": 0.1})
    (f,) = found(run_checks(root), "masks.dpo_rule")
    assert f.severity == ERROR
    assert "rejected_mask keeps positions 4..6 (tokens shared by both sides: the prompt)" in f.message


# TRL's keep_end truncation with a completion at least max_length long: that side's window is its
# completion alone (mask from 0), the other keeps its prompt tail. Prompt P = ... 20 21 22 23, max_length 6.
KEEP_END = {"beta": 0.1, "truncation_mode": "keep_end", "max_length": 6}
CUT_CHOSEN = [32, 33, 34, 35, 36, EOS]  # the end of a 9-token answer, no prompt left: mask from 0
CUT_REJECTED = [21, 22, 23, 40, 41, EOS]  # prompt tail 21 22 23, answer from 3


def test_dpo_prompt_cut_away_on_one_side_is_info(tmp_path):
    # chosen's window [32 .. EOS] holds no run of rejected's prompt end [21 22 23] (k = min(3, 4) = 3),
    # and does not open with [22 23]: the whole prompt was cut, both masks keep only completion tokens.
    root = write_trace(tmp_path / "r", "dpo", [(0, 0, dpo_pair(CUT_CHOSEN, 0, CUT_REJECTED, 3))], KEEP_END)
    (f,) = found(run_checks(root), "masks.dpo_rule")
    assert (f.severity, f.details["chosen_start"], f.details["rejected_start"]) == (INFO, 0, 3)
    assert f.details["prompt_cut_away"] == [0]
    assert "the chosen side is its completion alone, cut from the left to max_length = 6" in f.message


@pytest.mark.parametrize("chosen, why", [
    # the same layout, but the chosen mask keeps two prompt tokens: its window opens with [22 23]
    ([22, 23, 30, 31, 32, EOS], "opens with the prompt's last 2 tokens"),
    # three of them: the run [21 22 23] occurs at position 0
    ([21, 22, 23, 30, 31, EOS], "holds the prompt end"),
])
def test_dpo_mask_from_0_keeping_prompt_tokens_is_still_an_error(tmp_path, chosen, why):
    root = write_trace(tmp_path / "r", "dpo", [(0, 0, dpo_pair(chosen, 0, CUT_REJECTED, 3))], KEEP_END)
    (f,) = found(run_checks(root), "masks.dpo_rule")
    assert (f.severity, f.field) == (ERROR, "chosen_mask"), why
    assert "chosen_mask keeps positions 0..2" in f.message


def test_dpo_prompt_cut_away_needs_keep_end_metadata(tmp_path):
    # Without truncation_mode = "keep_end" (a hand-written loop's mask from 0) the layout is not explained.
    root = write_trace(tmp_path / "r", "dpo", [(0, 0, dpo_pair(CUT_CHOSEN, 0, CUT_REJECTED, 3))], {"beta": 0.1})
    (f,) = found(run_checks(root), "masks.dpo_rule")
    assert f.severity == ERROR


def test_dpo_prompt_cut_away_needs_a_window_of_max_length(tmp_path):
    # max_length 8 > the 6 kept positions: chosen was not cut, so its mask from 0 keeps its own prompt.
    pair = dpo_pair(CUT_CHOSEN + [PAD, PAD], 0, CUT_REJECTED + [PAD, PAD], 3)
    pair["chosen_mask"][:, 6:] = pair["rejected_mask"][:, 6:] = False  # the padding is masked
    root = write_trace(tmp_path / "r", "dpo", [(0, 0, pair)], {**KEEP_END, "max_length": 8})
    (f,) = found(run_checks(root), "masks.dpo_rule")
    assert f.severity == ERROR


# -- 2. kl.k1_negative: fresh, untruncated steps only -------------------------------------------------

def swapped_k1_steps(inner, n=3, seed=0):
    """Policy and reference logprobs swapped when recorded: the 'policy' field holds ref = policy - 0.5
    (+ noise 0.05), so k1 = recorded policy - recorded ref is about -0.5 on each of the 32 tokens
    (standard error about 0.05 / sqrt(32) = 0.009: some 50 standard errors below 0)."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for step in range(n):
        policy = -torch.rand(4, 8, generator=g) * 2 - 0.6
        ref = policy - 0.5 + 0.05 * torch.randn(4, 8, generator=g)
        steps.append((step, inner, {"completion_mask": torch.ones(4, 8, dtype=torch.bool), "policy_logprobs": ref,
                                    "old_logprobs": policy.clone(), "ref_logprobs": policy}))
    return steps


def test_swapped_policy_and_ref_on_fresh_steps_is_still_a_warning(tmp_path):
    # three fresh files (inner 0) and three after an update (inner 1): only the fresh ones are counted
    steps = swapped_k1_steps(0) + swapped_k1_steps(1, seed=1)
    (f,) = found(run_checks(write_trace(tmp_path / "r", "grpo", steps)), "kl.k1_negative")
    assert f.severity == WARNING and "in all 3 step files of fresh rollouts" in f.message
    assert len(f.details["mean_k1_by_step"]) == 3 and all(k.endswith(".0.0.0") for k in f.details["mean_k1_by_step"])


@pytest.mark.parametrize("sampling", [{"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}, {"repetition_penalty": 1.2}])
def test_truncated_sampling_is_left_out_of_k1_negative(tmp_path, sampling):
    # a truncated (top_p, top_k, min_p) or reshaped (repetition_penalty) sampler: E[policy - ref] over the
    # sampled tokens may be negative; not judged
    root = write_trace(tmp_path / "r", "grpo", swapped_k1_steps(0), sampling)
    assert bad(run_checks(root), "kl.k1_negative") == []


@pytest.mark.parametrize("sampling", [{"min_p": 0.0}, {"repetition_penalty": 1.0}, {"min_p": None}])
def test_neutral_sampler_options_still_judge_k1_negative(tmp_path, sampling):
    root = write_trace(tmp_path / "r", "grpo", swapped_k1_steps(0), sampling)
    (f,) = found(run_checks(root), "kl.k1_negative")
    assert f.severity == WARNING


def test_swapped_policy_and_ref_without_fresh_steps_is_reported(tmp_path):
    root = write_trace(tmp_path / "r", "grpo", swapped_k1_steps(1))
    assert found(run_checks(root), "kl.k1_negative")


# -- 3. advantages.zero_variance: info when the recorded advantages are not 0 ---------------------------

def rows(rewards, advantages, G, mask=None, **extra):
    B = len(rewards)
    out = {"rewards": torch.tensor(rewards), "advantages": torch.tensor(advantages),
           "group_ids": torch.arange(B // G).repeat_interleave(G), **extra}
    if mask is not None:
        ids = torch.full(mask.shape, 5)  # no EOS: every emptied row is a truncated completion
        logprobs = torch.full(mask.shape, -1.0)
        out.update(completion_ids=ids, completion_mask=mask, policy_logprobs=logprobs, old_logprobs=logprobs.clone())
    return out


def test_zero_variance_with_batch_normalised_advantages_is_still_caught(tmp_path):
    # rewards [1]*4 + [0]*4: every group has zero variance, so group advantages are 0. A batch z-score
    # gives (r - 0.5) / 0.5 = +1 / -1 instead: zero_variance says so (an info since a652cb1), and the groups
    # sum to +4 / -4 (group_sum) and the group_zscore rule recomputes 0 (recompute.advantages).
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, rows([1.0] * 4 + [0.0] * 4, [1.0] * 4 + [-1.0] * 4, 4))],
                       {"num_generations": 4})
    findings = run_checks(root)
    assert "recorded advantages are not 0 (largest |A| 1)" in found(findings, "advantages.zero_variance")[0].message
    (s,) = found(findings, "advantages.group_sum")
    assert s.severity == ERROR and "sum to 4 (mean 1)" in s.message
    (r,) = found(findings, "recompute.advantages")
    assert r.severity == ERROR and "recomputed 0" in r.message


def test_zero_variance_with_advantages_from_nowhere_is_a_warning(tmp_path):
    # G = 2, rewards [1, 1, 0, 0]: leave-one-out gives 0 everywhere (0 / (0 + 1e-4) after normalising);
    # the recorded [0.7071, -0.7071, 0.7071, -0.7071] sum to 0 per group but come from another batch.
    root = write_trace(tmp_path / "r", "rloo", [(0, 0, rows([1.0, 1.0, 0.0, 0.0], [0.7071, -0.7071] * 2, 2))],
                       {"num_generations": 2, "beta": 0.0, "advantage_rule": "rloo", "normalize_advantages": True})
    (f,) = found(run_checks(root), "advantages.zero_variance")
    assert f.severity == WARNING


# -- 4. group_sum / recompute.advantages: empty rows and non-centred rules ------------------------------

TRUNC_REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]


def truncated_mask():
    mask = torch.ones(8, 4, dtype=torch.bool)
    mask[3] = mask[7] = False  # one truncated completion per group, masked (mask_truncated_completions)
    return mask


def test_masked_truncated_rows_in_a_healthy_trl_step(tmp_path):
    # TRL keeps the advantages of masked rows: group 0 [1, 0, 0, 0] has mean 0.25 and Bessel std 0.5, so
    # A = [0.75, -0.25, -0.25, -0.25] / 0.5001 = [1.4997, -0.4999, ...]; each group sums to 0.
    advantages = formulas.trl_group_advantages(torch.tensor(TRUNC_REWARDS), 4)
    assert math.isclose(float(advantages[0]), 0.75 / 0.5001, rel_tol=1e-5)
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, rows(TRUNC_REWARDS, advantages.tolist(), 4, truncated_mask()))],
                       {"num_generations": 4, "mask_truncated_completions": True,
                        "advantage_rule": "group_zscore_unbiased"})
    assert bad(run_checks(root)) == []


def test_verl_rejected_rows_recorded_as_zero_are_left_out(tmp_path):
    # verl's rollout rejection: rows 3 and 7 keep no token and read as advantage 0; the others keep the
    # values computed with their rewards in the group, so groups sum to -A_3 = 0.4999 and -A_7 = 1.4997.
    advantages = formulas.trl_group_advantages(torch.tensor(TRUNC_REWARDS), 4)
    advantages[3] = advantages[7] = 0.0
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, rows(TRUNC_REWARDS, advantages.tolist(), 4, truncated_mask()))],
                       {"num_generations": 4, "rollout_rs": "token", "advantage_rule": "group_zscore_unbiased"})
    findings = run_checks(root)
    assert bad(findings, "advantages.group_sum") == bad(findings, "recompute.advantages") == []
    assert found(findings, "masks.empty_row")[0].severity == INFO


def test_batch_centred_advantages_with_masked_rows_are_still_caught_by_recompute(tmp_path):
    # Bug: centred on the batch mean 0.5 instead of the group means: A = r - 0.5 (no std). The live rows
    # 0..2 should be (r - 0.25) / 0.5001 = [1.4997, -0.4999, -0.4999], recorded [0.5, -0.5, -0.5].
    advantages = [r - 0.5 for r in TRUNC_REWARDS]
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, rows(TRUNC_REWARDS, advantages, 4, truncated_mask()))],
                       {"num_generations": 4, "mask_truncated_completions": True})
    (f,) = found(run_checks(root), "recompute.advantages")
    assert f.severity == ERROR


def test_wrong_baseline_hidden_by_masked_truncated_rows(tmp_path):
    # RLOO, G = 4, normalize_advantages: bug, the baseline is the batch mean 0.5, not the other three
    # rows' mean. Raw A = r - 0.5 = [0.5, -0.5, -0.5, -0.5 | 0.5, 0.5, 0.5, -0.5]: groups sum to -1 and +1
    # (batch mean 0, so normalising by the batch std 0.5345 keeps the sums at -1.871 and +1.871).
    raw = torch.tensor(TRUNC_REWARDS) - 0.5
    advantages = (raw / raw.std()).tolist()
    root = write_trace(tmp_path / "r", "rloo", [(0, 0, rows(TRUNC_REWARDS, advantages, 4, truncated_mask()))],
                       {"num_generations": 4, "mask_truncated_completions": True, "normalize_advantages": True,
                        "advantage_rule": "rloo"})
    (f,) = found(run_checks(root), "advantages.group_sum")
    assert f.severity == ERROR


def test_non_centred_verl_estimator_skips_group_sum(tmp_path):
    # verl's REINFORCE++ whitens over the batch: its advantages need not sum to 0 per group
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, rows(TRUNC_REWARDS, [r - 0.5 for r in TRUNC_REWARDS], 4))],
                       {"num_generations": 4, "advantage_rule": "verl_reinforce_plus_plus"})
    (f,) = [f for f in run_checks(root) if f.check == "advantages.group_sum"]
    assert f.severity == SKIPPED


def test_unknown_rule_name_does_not_hide_a_group_sum_bug(tmp_path):
    # batch-centred A = r - 0.5: groups sum to -1 and +1
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, rows(TRUNC_REWARDS, [r - 0.5 for r in TRUNC_REWARDS], 4))],
                       {"num_generations": 4, "advantage_rule": "grpo_unbiased"})
    (f,) = found(run_checks(root), "advantages.group_sum")
    assert f.severity == ERROR


# -- 5. advantages.masked_positions: one masked slot holding GAE's whitening shift ----------------------

GAE_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
GAE_VALUES = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.2, 0.5, 0.1, 0.0]])
GAE_HYPER = {"gamma": 1.0, "lam": 1.0, "advantage_rule": "gae_whitened"}


def whitened_gae():
    """γ = λ = 1, reward 1 on row 0's last token, 0 on row 1: raw A = return - V = [0.9, 0.8, 0.7, 0.6] and
    [-0.2, -0.5, -0.1] (0 on the masked slot). Over the 7 kept tokens mean 2.2 / 7 = 0.314286, E[x²] =
    2.6 / 7 = 0.371429, var 0.272653, std 0.522162; whitening without re-masking leaves the masked slot at
    -0.314286 / 0.522162 = -0.6019 (verl's masked_whiten)."""
    token_rewards = formulas.token_rewards_from_sequence(torch.tensor([1.0, 0.0]), GAE_MASK)
    raw, returns = formulas.gae(token_rewards, GAE_VALUES, GAE_MASK, 1.0, 1.0)
    kept = raw[GAE_MASK]
    whitened = (raw - kept.mean()) * torch.rsqrt(kept.var(unbiased=False) + 1e-8)
    assert math.isclose(float(whitened[1, 3]), -0.314286 / 0.522162, abs_tol=1e-4)
    return {"completion_mask": GAE_MASK, "values": GAE_VALUES, "token_rewards": token_rewards, "returns": returns,
            "advantages": whitened}


def test_one_masked_slot_at_the_whitening_shift_is_info(tmp_path):
    (f,) = found(run_checks(write_trace(tmp_path / "r", "ppo", [(0, 0, whitened_gae())], GAE_HYPER)),
                 "advantages.masked_positions")
    assert f.severity == INFO and "-0.6019" in f.message


@pytest.mark.parametrize("case", ["off_shift", "no_gamma"])
def test_one_masked_slot_elsewhere_is_still_a_warning(tmp_path, case):
    tensors, hyper = whitened_gae(), GAE_HYPER
    if case == "off_shift":
        tensors["advantages"][1, 3] += 0.5  # -0.1019: not the shift
    else:
        hyper = {}  # no gamma / lam: the shift cannot be recomputed
    root = write_trace(tmp_path / "r", "ppo", [(0, 0, tensors)], hyper)
    (f,) = found(run_checks(root), "advantages.masked_positions")
    assert f.severity == WARNING


def test_gae_bootstrapped_from_padding_then_whitened_is_still_caught(tmp_path):
    # Bug: row 1's last kept token bootstraps from the padded value 5.0: raw A[1, 2] = 0 + 5.0 - 0.1 = 4.9
    # instead of -0.1; whitened over the kept tokens, the masked slot again holds the shift of that fit.
    tensors = whitened_gae()
    values = GAE_VALUES.clone()
    values[1, 3] = 5.0
    raw, _ = formulas.gae(tensors["token_rewards"], GAE_VALUES, GAE_MASK, 1.0, 1.0)
    raw[1, 2] = 4.9
    kept = raw[GAE_MASK]
    scale = torch.rsqrt(kept.var(unbiased=False) + 1e-8)
    tensors.update(values=values, advantages=torch.where(GAE_MASK, (raw - kept.mean()) * scale, -kept.mean() * scale))
    findings = run_checks(write_trace(tmp_path / "r", "ppo", [(0, 0, tensors)], GAE_HYPER))
    assert found(findings, "advantages.masked_positions")[0].severity == WARNING
    assert found(findings, "recompute.advantages")[0].severity == ERROR


# -- 6. fields.required: stand-ins for required fields ---------------------------------------------------

def dpo_with_ref_sums():
    tensors = dpo_pair([3, 4, 5, 6], 2, [3, 4, 7, 8], 2)
    del tensors["chosen_ref_logprobs"], tensors["rejected_ref_logprobs"]
    return {**tensors, "chosen_ref_sequence_logprobs": torch.tensor([-2.0]),
            "rejected_ref_sequence_logprobs": torch.tensor([-2.0])}


@pytest.mark.parametrize("meta, severity", [({"ref_logprobs_source": "trl_precomputed_sums"}, INFO), ({}, WARNING)])
def test_ref_sums_stand_in_only_when_declared_precomputed(tmp_path, meta, severity):
    root = write_trace(tmp_path / "r", "dpo", [(0, 0, dpo_with_ref_sums(), meta)], {"beta": 0.1})
    assert [f.severity for f in found(run_checks(root), "fields.required")] == [severity]


def test_row_constant_token_advantages_do_not_hide_a_group_bug(tmp_path):
    # batch-centred A = r - 0.5 (groups sum to -1 and +1), broadcast over 4 tokens per row
    advantages = torch.tensor(TRUNC_REWARDS) - 0.5
    tensors = rows(TRUNC_REWARDS, [0.0] * 8, 4, torch.ones(8, 4, dtype=torch.bool))
    del tensors["advantages"]
    tensors["token_advantages"] = advantages.unsqueeze(1).expand(8, 4).clone()
    findings = run_checks(write_trace(tmp_path / "r", "grpo", [(0, 0, tensors)], {"num_generations": 4}))
    warned = [f for f in bad(findings, "fields.required") if "advantages" in f.message]
    assert warned or bad(findings, "advantages.group_sum")


# -- 7 and 8. hyper() reads config.trainer_args; recompute.loss applies delta --------------------------

# One sequence, A = -1, eps 0.2: token 0 has ratio e^0.6 = 1.8221, tokens 1..3 ratio 1.
# With delta 1.5: -min(min(r, 1.5) * A, clip(r, 0.8, 1.2) * A) = -min(-1.5, -1.2) = 1.5 on token 0, 1 on the
# others: sequence mean (1.5 + 3) / 4 = 1.125. Without delta: -min(-1.8221, -1.2) = 1.8221, mean 1.20553.
WITH_DELTA, WITHOUT_DELTA = 1.125, (math.exp(0.6) + 3) / 4
LOSS_HYPER = {"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "loss_reduction": "sequence_mean"}


def loss_step(loss):
    return {"completion_ids": torch.tensor([[5, 6, 7, EOS]]), "completion_mask": torch.ones(1, 4, dtype=torch.bool),
            "policy_logprobs": torch.tensor([[-0.4, -1.0, -1.0, -1.0]]), "old_logprobs": torch.full((1, 4), -1.0),
            "advantages": torch.tensor([-1.0]), "loss": torch.tensor(loss)}


def loss_findings(tmp_path, loss, hyper, config=None):
    from tracer import TraceWriter

    with TraceWriter(tmp_path / "r", "grpo", hyperparameters=hyper, config=config) as writer:
        writer.record(0, loss_step(loss), inner_step=1)
    return [f for f in run_checks(tmp_path / "r") if f.check == "recompute.loss"]


@pytest.mark.parametrize("where", ["metadata", "trainer_args"])
@pytest.mark.parametrize("loss, caught", [(WITH_DELTA, False), (WITHOUT_DELTA, True)])
def test_delta_from_metadata_or_trainer_args(tmp_path, where, loss, caught):
    # a trainer that ignores its configured delta is now an error (84b6f79 skipped recompute.loss on delta)
    assert math.isclose(WITHOUT_DELTA, 1.20553, abs_tol=1e-5)
    hyper, config = ({**LOSS_HYPER, "delta": 1.5}, None) if where == "metadata" else (
        LOSS_HYPER, {"trainer_args": {"delta": 1.5}})
    findings = loss_findings(tmp_path, loss, hyper, config)
    assert [f.severity for f in findings] == ([ERROR] if caught else [])
    if caught:
        assert "recorded loss 1.20553" in findings[0].message


def test_metadata_wins_over_trainer_args(tmp_path):
    # metadata delta 2.0 > 1.8221: the clamp does not bind, so the unclamped 1.20553 is right
    assert loss_findings(tmp_path, WITHOUT_DELTA, {**LOSS_HYPER, "delta": 2.0}, {"trainer_args": {"delta": 1.5}}) == []


# GSPO read from trainer_args: one sequence ratio s = exp(mean(policy - old)) = exp(0.6 / 4) = 1.16183, inside the
# clip range [0.8, 1.2]; with A = -1 every token's loss is -min(-s, -s) = s, so the sequence mean is s itself.
SEQUENCE_LEVEL = math.exp(0.6 / 4)


def test_sequence_level_ratio_from_trainer_args_is_the_rule_the_loss_is_checked_with(tmp_path):
    gspo = {"trainer_args": {"importance_sampling_level": "sequence"}}
    assert loss_findings(tmp_path / "healthy", SEQUENCE_LEVEL, LOSS_HYPER, gspo) == []
    (f,) = loss_findings(tmp_path / "token", WITH_DELTA, LOSS_HYPER, gspo)  # a loss of neither level: not skipped
    assert f.severity == ERROR and f"gives {SEQUENCE_LEVEL:.6g}" in f.message


@pytest.mark.parametrize("masked, severity", [(True, INFO), (False, ERROR)])
def test_mask_truncated_completions_from_trainer_args(tmp_path, masked, severity):
    # row 1 is a truncated completion (no EOS) that keeps no token
    from tracer import TraceWriter

    tensors = {"completion_ids": torch.tensor([[5, 6, EOS], [5, 6, 7]]),
               "completion_mask": torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool)}
    with TraceWriter(tmp_path / "r", "grpo", config={"trainer_args": {"mask_truncated_completions": masked}}) as writer:
        writer.record(0, tensors)
    (f,) = found(run_checks(tmp_path / "r"), "masks.empty_row")
    assert (f.severity, f.sequence) == (severity, 1)
