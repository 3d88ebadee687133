"""The unmasked mean over B x T (a loss over padding), worked out by hand, and where it coincides with
the masked reductions (then recompute.loss cannot tell them apart)."""

import torch

from tracer import formulas
from tracer.formulas.losses import unmasked_mean_loss


def test_unmasked_mean_counts_padding_positions():
    per_token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], dtype=torch.float64)
    keep = torch.tensor([[True, True, True], [True, False, False]])
    # (1 + 2 + 3 + 4 + 9 + 9) / 6 = 28 / 6; the masked token mean is 10 / 4, the sequence mean (2 + 4) / 2
    assert unmasked_mean_loss(per_token_loss).item() == 28 / 6
    assert formulas.token_mean_loss(per_token_loss, keep).item() == 2.5
    assert formulas.sequence_mean_loss(per_token_loss, keep).item() == 3.0


def test_with_zero_loss_at_padding_it_is_the_constant_divisor_b_times_t():
    per_token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    keep = torch.tensor([[True, True, True], [True, False, False]])
    assert unmasked_mean_loss(per_token_loss).item() == formulas.constant_divisor_loss(per_token_loss, keep, 6).item()


def test_a_row_constant_loss_makes_the_unmasked_mean_the_sequence_mean():
    # GRPO's first pass: ratio 1 and k3 0, so each row's per-token loss is its -A at every position
    advantages = torch.tensor([1.5, -0.5, -1.0], dtype=torch.float64)
    per_token_loss = -advantages.unsqueeze(1).expand(3, 4)
    keep = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert unmasked_mean_loss(per_token_loss).item() == formulas.sequence_mean_loss(per_token_loss, keep).item() == 0.0
    assert formulas.token_mean_loss(per_token_loss, keep).item() == (-1.5 * 4 + 0.5 * 2 + 1.0) / 7
