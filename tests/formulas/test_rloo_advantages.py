"""tracer.formulas.rloo_advantages on values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from tracer import formulas


def test_leave_one_out_by_hand():
    # group 0: r = [1, 0, 0, 1]; each row's baseline is the mean of the other three:
    #   row 0: (0 + 0 + 1) / 3 = 1/3 -> A = 1 - 1/3 = 2/3;  row 1: (1 + 0 + 1) / 3 = 2/3 -> A = -2/3
    # group 1: r = [2, 2, 2, 5]; rows 0-2: baseline (2 + 2 + 5) / 3 = 3 -> A = -1; row 3: baseline 2 -> A = 3
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, -1.0, -1.0, -1.0, 3.0])
    torch.testing.assert_close(formulas.rloo_advantages(rewards, 4), expected)


def test_leave_one_out_is_the_group_centred_reward_scaled_by_g_over_g_minus_1():
    # A_i = r_i - (S - r_i) / (G - 1) = G / (G - 1) * (r_i - S / G): with G = 2, r = [3, 1]:
    # A = [3 - 1, 1 - 3] = [2, -2] = 2 * ([3, 1] - 2)
    torch.testing.assert_close(formulas.rloo_advantages(torch.tensor([3.0, 1.0]), 2), torch.tensor([2.0, -2.0]))


def test_each_group_sums_to_zero_and_a_constant_group_gets_zero():
    rewards = torch.tensor([0.5, 0.5, 0.5, -1.0, 4.0, 0.25])
    advantages = formulas.rloo_advantages(rewards, 3)  # groups [0.5, 0.5, 0.5] and [-1, 4, 0.25]
    torch.testing.assert_close(advantages[:3], torch.zeros(3))
    torch.testing.assert_close(advantages.view(2, 3).sum(dim=1), torch.zeros(2))
    # row 3: -1 - (4 + 0.25) / 2 = -3.125
    assert advantages[3].item() == pytest.approx(-3.125)


@pytest.mark.parametrize("B, G", [(6, 4), (4, 1), (4, 0)])
def test_rejects_a_group_size_that_does_not_fit(B, G):
    with pytest.raises(ValueError, match=rf"rewards has B = {B} rows; RLOO needs num_generations >= 2 dividing B"):
        formulas.rloo_advantages(torch.zeros(B), G)
