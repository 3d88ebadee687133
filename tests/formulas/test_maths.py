"""tracer.formulas against values worked out by hand (and one independent loop)."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tracer import formulas

LN2, LN3, LN4 = math.log(2), math.log(3), math.log(4)
GARBAGE = [100.0, -100.0, 0.0]  # at positions the alignment rule must never read


def test_token_logprobs_reads_prompt_len_minus_one_plus_j_on_left_padded_rows():
    # Two rows, padded prompt width L = 2, T = 2 completion tokens, V = 3.
    # Row 1 is left-padded ([pad, p, c0, c1]); the rule still reads logits positions 1 and 2.
    input_ids = torch.tensor([[2, 2, 1, 0],
                              [0, 1, 0, 2]])
    logits = torch.tensor([
        [GARBAGE, [0.0, 0.0, 0.0], [LN2, 0.0, 0.0], GARBAGE],
        [GARBAGE, [LN3, 0.0, 0.0], [0.0, LN4, 0.0], GARBAGE],
    ])
    got = formulas.token_logprobs(logits, input_ids, prompt_len=2)
    # row 0: pos 1 uniform -> log(1/3) for token 1; pos 2 probs [2/4, 1/4, 1/4] -> token 0: log(1/2)
    # row 1: pos 1 probs [3/5, 1/5, 1/5] -> token 0: log(3/5); pos 2 probs [1/6, 4/6, 1/6] -> token 2: log(1/6)
    expected = torch.tensor([[math.log(1 / 3), math.log(1 / 2)],
                             [math.log(3 / 5), math.log(1 / 6)]])
    torch.testing.assert_close(got, expected)


def test_token_logprobs_divides_logits_by_temperature():
    input_ids = torch.tensor([[1, 0]])
    logits = torch.tensor([[[2 * LN2, 0.0, 0.0], GARBAGE]])
    # logits / 2 = [ln 2, 0, 0] -> probs [2/4, 1/4, 1/4]; token 0 -> log(1/2)
    got = formulas.token_logprobs(logits, input_ids, prompt_len=1, temperature=2.0)
    torch.testing.assert_close(got, torch.tensor([[math.log(0.5)]]))


def test_token_logprobs_equals_a_plain_loop_on_random_data():
    g = torch.Generator().manual_seed(0)
    B, L, T, V = 3, 4, 5, 7
    logits = torch.randn(B, L + T, V, generator=g)
    input_ids = torch.randint(0, V, (B, L + T), generator=g)
    got = formulas.token_logprobs(logits, input_ids, prompt_len=L, temperature=0.7)
    expected = torch.empty(B, T)
    for b in range(B):
        for j in range(T):
            row = logits[b, L - 1 + j] / 0.7
            expected[b, j] = row[input_ids[b, L + j]] - torch.logsumexp(row, dim=0)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt_len": 0}, "prompt_len must be in"),
    ({"prompt_len": 2, "temperature": 0.0}, "temperature must be > 0"),
])
def test_token_logprobs_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        formulas.token_logprobs(torch.zeros(1, 3, 2), torch.zeros(1, 3, dtype=torch.long), **kwargs)


def test_ratio_k2_k1_by_hand():
    policy = torch.tensor([[0.0, LN2, -0.2]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    # exp(0) = 1, exp(ln 2) = 2, exp(-0.2)
    torch.testing.assert_close(formulas.ratio(policy, old), torch.tensor([[1.0, 2.0, math.exp(-0.2)]]))
    # 0.5 * d^2: 0, 0.5 * ln2^2, 0.5 * 0.04 = 0.02
    torch.testing.assert_close(formulas.approx_kl_k2(policy, old), torch.tensor([[0.0, 0.5 * LN2**2, 0.02]]))
    torch.testing.assert_close(formulas.kl_k1(policy, old), policy)


def test_ref_kl_k3_by_hand_zero_when_equal():
    policy = torch.tensor([[0.0, 0.0, 0.0]])
    ref = torch.tensor([[0.0, LN2, -LN2]])
    # d = ref - policy: d = 0 -> 0; d = ln 2 -> 2 - ln2 - 1; d = -ln 2 -> 1/2 + ln2 - 1
    expected = torch.tensor([[0.0, 1 - LN2, LN2 - 0.5]])
    torch.testing.assert_close(formulas.ref_kl_k3(policy, ref), expected)


@settings(max_examples=200, deadline=None)
@example([-5.596421979718679e-11], [0.0])  # exp(d) - d - 1 cancels to a negative number here
@given(st.lists(st.floats(-20, 0), min_size=1, max_size=16), st.lists(st.floats(-20, 0), min_size=1, max_size=16))
def test_ref_kl_k3_is_non_negative(policy, ref):
    n = min(len(policy), len(ref))
    got = formulas.ref_kl_k3(torch.tensor(policy[:n], dtype=torch.float64), torch.tensor(ref[:n], dtype=torch.float64))
    assert (got >= 0).all()


def test_masked_mean_and_reductions_with_ragged_masks():
    values = torch.tensor([[1.0, 2.0, 3.0],
                           [4.0, 5.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0],
                         [1, 0, 0]])
    # kept: 1, 2 | 4 -> token mean 7/3; the NaN sits on a masked slot and must not leak
    torch.testing.assert_close(formulas.masked_mean(values, mask), torch.tensor(7 / 3))
    torch.testing.assert_close(formulas.masked_mean(values, mask, dim=1), torch.tensor([1.5, 4.0]))
    # per sequence then batch mean: (1.5 + 4) / 2 = 2.75 (differs from the token mean on ragged rows)
    torch.testing.assert_close(formulas.sequence_mean_loss(values, mask), torch.tensor(2.75))
    torch.testing.assert_close(formulas.token_mean_loss(values, mask), torch.tensor(7 / 3))
    # Dr. GRPO constant divisor B * T = 6: 7 / 6
    torch.testing.assert_close(formulas.constant_divisor_loss(values, mask, 6.0), torch.tensor(7 / 6))


def test_masked_mean_of_an_all_masked_row_is_zero_not_nan():
    got = formulas.masked_mean(torch.tensor([[3.0, 4.0]]), torch.tensor([[0, 0]]), dim=1)
    torch.testing.assert_close(got, torch.tensor([0.0]))


def test_group_advantages_population_std_and_zero_variance_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    got = formulas.group_advantages(rewards, num_generations=3)
    # group 0: mean 1/3, population std sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2)/3
    std = math.sqrt(2) / 3
    expected0 = [(1 - 1 / 3) / (std + 1e-4), (0 - 1 / 3) / (std + 1e-4), (0 - 1 / 3) / (std + 1e-4)]
    # group 1: all rewards equal -> std 0 -> every advantage 0
    torch.testing.assert_close(got, torch.tensor(expected0 + [0.0, 0.0, 0.0]))
    assert abs(float(got[:3].sum())) < 1e-6  # advantages sum to zero within a group


def test_group_advantages_rejects_rows_not_multiple_of_g():
    with pytest.raises(ValueError, match="B = 5 rows, not a multiple of num_generations = 2"):
        formulas.group_advantages(torch.zeros(5), 2)


def test_clip_fractions_count_only_where_the_clip_binds_for_the_sign():
    ratio = torch.tensor([[0.5, 1.0, 1.5],
                          [0.5, 1.0, 1.5]])
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 3)
    got = formulas.clip_fractions(ratio, advantages, mask, 0.2, 0.2)
    # A > 0 row: 1.5 > 1.2 binds (high); 0.5 does not bind for a positive advantage.
    # A < 0 row: 0.5 < 0.8 binds (low); 1.5 does not bind for a negative advantage.
    torch.testing.assert_close(got["high"], torch.tensor(1 / 6))
    torch.testing.assert_close(got["low"], torch.tensor(1 / 6))
    torch.testing.assert_close(got["region"], torch.tensor(4 / 6))


def test_grpo_per_token_loss_by_hand():
    policy = torch.tensor([[math.log(1.5), math.log(0.5)]])
    old = torch.zeros(1, 2)
    # ratio [1.5, 0.5]; A = +1: min(1.5, 1.2) = 1.2 -> loss -1.2; min(0.5, 0.8) = 0.5 -> loss -0.5
    got = formulas.grpo_per_token_loss(policy, old, torch.tensor([1.0]), 0.2, 0.2)
    torch.testing.assert_close(got, torch.tensor([[-1.2, -0.5]]))
    # A = -1: min(-1.5, -1.2) = -1.5 -> 1.5; min(-0.5, -0.8) = -0.8 -> 0.8
    got = formulas.grpo_per_token_loss(policy, old, torch.tensor([-1.0]), 0.2, 0.2)
    torch.testing.assert_close(got, torch.tensor([[1.5, 0.8]]))
    # beta * k3 is added to the loss: ref = policy + ln 2 -> k3 = 1 - ln 2 per token
    ref = policy + LN2
    got = formulas.grpo_per_token_loss(policy, old, torch.tensor([1.0]), 0.2, 0.2, beta=0.1, ref_logprobs=ref)
    torch.testing.assert_close(got, torch.tensor([[-1.2, -0.5]]) + 0.1 * (1 - LN2))


def test_ref_kl_estimators_and_a_k1_or_k2_kl_term_by_hand():
    policy = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = policy + LN2  # ref - policy = ln 2 on both tokens
    # k1 = policy - ref = -ln 2; k2 = 0.5 (ln 2)^2; k3 = e^{ln 2} - ln 2 - 1 = 1 - ln 2
    torch.testing.assert_close(formulas.ref_kl(policy, ref, "k1"), torch.full((1, 2), -LN2))
    torch.testing.assert_close(formulas.ref_kl(policy, ref, "mse"), torch.full((1, 2), 0.5 * LN2 ** 2))
    torch.testing.assert_close(formulas.ref_kl(policy, ref, "low_var_kl"), torch.full((1, 2), 1 - LN2))
    with pytest.raises(ValueError, match="unknown KL estimator 'abs'; known: k1, k2, k3"):
        formulas.ref_kl(policy, ref, "abs")
    # the loss's KL term follows the estimator: ratio 1 (policy == old), A = 0, beta 0.1
    got = formulas.grpo_per_token_loss(policy, policy, torch.tensor([0.0]), 0.2, 0.2, beta=0.1, ref_logprobs=ref,
                                       kl_estimator="k2")
    torch.testing.assert_close(got, torch.full((1, 2), 0.1 * 0.5 * LN2 ** 2))
    got = formulas.ppo_per_token_loss(policy, policy, torch.zeros(1, 2), 0.2, 0.2, kl_coef=0.1, ref_logprobs=ref,
                                      kl_estimator="k1")
    torch.testing.assert_close(got, torch.full((1, 2), -0.1 * LN2))


def test_kl_reward_token_rewards_by_hand():
    """InstructGPT eq. 2: r_t = -kl_coef * (old - ref) on each kept token, plus the score on the last one."""
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.5, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    got = formulas.kl_reward_token_rewards(torch.tensor([1.0, 2.0]), old, ref, mask, 0.1)
    # row 0: k1 = [0.5, 0, -2 (masked)] -> [-0.05, 0 + 1.0 (last kept), 0]; row 1: k1 0.5 -> -0.05 + 2.0
    torch.testing.assert_close(got, torch.tensor([[-0.05, 1.0, 0.0], [1.95, 0.0, 0.0]]))
    # k3 of (old || ref): row 1, d = ref - old = -0.5: e^-0.5 + 0.5 - 1
    k3 = math.exp(-0.5) + 0.5 - 1
    got = formulas.kl_reward_token_rewards(torch.tensor([0.0, 0.0]), old, ref, mask, 0.1, "k3")
    assert got[1, 0].item() == pytest.approx(-0.1 * k3)


def test_token_rewards_land_on_the_last_kept_token():
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    got = formulas.token_rewards_from_sequence(torch.tensor([1.0, -2.0, 5.0]), mask)
    expected = torch.zeros(3, 6)
    expected[0, 3], expected[1, 0] = 1.0, -2.0  # row 2 keeps nothing: its reward lands nowhere
    torch.testing.assert_close(got, expected)
    assert formulas.last_kept_index(mask).tolist() == [3, 0, -1]


def test_gae_on_a_masked_2x4_example_by_hand():
    gamma, lam = 1.0, 0.95
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    values = torch.tensor([[0.5, 0.4, 0.3, 9.0], [0.2, 0.1, 5.0, 5.0]])  # 9.0 and 5.0 sit on padding
    rewards = formulas.token_rewards_from_sequence(torch.tensor([1.0, -1.0]), mask)
    advantages, returns = formulas.gae(rewards, values, mask, gamma, lam)
    # row 0, values on padding count as 0:
    #   t=2: delta = 1 + 0 - 0.3 = 0.7                      A2 = 0.7
    #   t=1: delta = 0 + 0.3 - 0.4 = -0.1                   A1 = -0.1 + 0.95 * 0.7 = 0.565
    #   t=0: delta = 0 + 0.4 - 0.5 = -0.1                   A0 = -0.1 + 0.95 * 0.565 = 0.43675
    # row 1: t=1: delta = -1 + 0 - 0.1 = -1.1              A1 = -1.1
    #        t=0: delta = 0 + 0.1 - 0.2 = -0.1              A0 = -0.1 + 0.95 * -1.1 = -1.145
    torch.testing.assert_close(advantages, torch.tensor([[0.43675, 0.565, 0.7, 0.0], [-1.145, -1.1, 0.0, 0.0]]))
    # returns = advantages + values on kept positions
    torch.testing.assert_close(returns, torch.tensor([[0.93675, 0.965, 1.0, 0.0], [-0.945, -1.0, 0.0, 0.0]]))


def test_gae_equals_a_plain_python_loop_on_random_data():
    g = torch.Generator().manual_seed(1)
    B, T, gamma, lam = 5, 9, 0.99, 0.9
    lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
    mask = torch.tensor([[1 if t < n else 0 for t in range(T)] for n in lengths])
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages, returns = formulas.gae(rewards, values, mask, gamma, lam)
    for b, n in enumerate(lengths):
        v = values[b, :n].tolist() + [0.0]  # bootstrap value after the last kept token is 0
        r = rewards[b, :n].tolist()
        acc, expected = 0.0, [0.0] * n
        for t in reversed(range(n)):
            acc = r[t] + gamma * v[t + 1] - v[t] + gamma * lam * acc
            expected[t] = acc
        torch.testing.assert_close(advantages[b], torch.tensor(expected + [0.0] * (T - n), dtype=torch.float64))
        torch.testing.assert_close(returns[b, :n], advantages[b, :n] + values[b, :n])


def test_grpo_and_cispo_losses_on_ragged_masks_with_sequence_mean():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    policy = torch.full((2, 3), math.log(0.5))
    old = policy.clone()  # ratio 1 everywhere
    advantages = torch.tensor([1.0, -2.0])
    grpo = formulas.grpo_per_token_loss(policy, old, advantages, 0.2, 0.2)
    # per token -A: row 0 -> -1 (3 kept), row 1 -> 2 (1 kept); per sequence [-1, 2] -> mean 0.5
    torch.testing.assert_close(formulas.sequence_mean_loss(grpo, mask), torch.tensor(0.5))
    # the token mean weighs rows by length instead: (-1 * 3 + 2) / 4 = -0.25
    torch.testing.assert_close(formulas.token_mean_loss(grpo, mask), torch.tensor(-0.25))
    cispo = formulas.cispo_per_token_loss(policy, old, advantages, clip_epsilon_high=5.0)
    # per token -(1 * A * ln 0.5) = A ln 2: row 0 ln 2, row 1 -2 ln 2 -> mean (ln2 - 2 ln2) / 2
    torch.testing.assert_close(formulas.sequence_mean_loss(cispo, mask), torch.tensor(-LN2 / 2))


def test_cispo_gradient_reaches_only_policy_logprobs():
    policy = torch.tensor([[math.log(1.5)]], requires_grad=True)
    old = torch.tensor([[0.0]], requires_grad=True)
    loss = formulas.cispo_per_token_loss(policy, old, torch.tensor([2.0]), clip_epsilon_high=1.2).sum()
    loss.backward()
    # ratio 1.5 clamped to 1.2 and detached: d(-1.2 * 2 * policy)/d policy = -2.4; old gets no gradient
    torch.testing.assert_close(policy.grad, torch.tensor([[-2.4]]))
    assert old.grad is None


def test_dpo_terms_for_a_pair_by_hand():
    # prompt 2 + response 2 tokens; masks keep only the response ([0, 0, 1, 1]); beta 0.1
    mask = torch.tensor([[0, 0, 1, 1]])
    pc = formulas.sequence_logprobs(torch.tensor([[-3, -2, -0.5, -0.4]]), mask)  # -0.9
    rc = formulas.sequence_logprobs(torch.tensor([[-3.2, -2.3, -0.6, -0.5]]), mask)  # -1.1
    pr = formulas.sequence_logprobs(torch.tensor([[-3, -2, -1.5, -1.6]]), mask)  # -3.1
    rr = formulas.sequence_logprobs(torch.tensor([[-3.2, -2.3, -1.4, -1.5]]), mask)  # -2.9
    got = formulas.dpo_terms(pc, pr, rc, rr, beta=0.1)
    # logits = (-0.9 + 3.1) - (-1.1 + 2.9) = 2.2 - 1.8 = 0.4; loss = log(1 + exp(-0.04)) = 0.67334
    torch.testing.assert_close(got["dpo_logits"], torch.tensor([0.4]))
    torch.testing.assert_close(got["dpo_loss"], torch.tensor([math.log1p(math.exp(-0.04))]))
    assert abs(float(got["dpo_loss"]) - 0.6733) < 1e-4
    torch.testing.assert_close(got["chosen_rewards"], torch.tensor([0.02]))  # 0.1 * (-0.9 + 1.1)
    torch.testing.assert_close(got["rejected_rewards"], torch.tensor([-0.02]))  # 0.1 * (-3.1 + 2.9)


def test_grpo_per_token_loss_two_sided_clipping_by_hand():
    # r = 1.5 on both tokens, eps 0.2 (clip to [0.8, 1.2]), delta 1.3 (TRL's two-sided clipping).
    # A = -1: min(min(1.5, 1.3) * -1, 1.2 * -1) = min(-1.3, -1.2) = -1.3 -> loss 1.3 (1.5 without delta).
    # A = +1: min(1.3, 1.2) = 1.2 -> loss -1.2, as without delta (delta only bounds negative advantages).
    old = torch.zeros(2, 1)
    policy = torch.full((2, 1), math.log(1.5))
    advantages = torch.tensor([-1.0, 1.0])
    with_delta = formulas.grpo_per_token_loss(policy, old, advantages, 0.2, 0.2, delta=1.3)
    without = formulas.grpo_per_token_loss(policy, old, advantages, 0.2, 0.2)
    assert torch.allclose(with_delta, torch.tensor([[1.3], [-1.2]]), atol=1e-6)
    assert torch.allclose(without, torch.tensor([[1.5], [-1.2]]), atol=1e-6)
