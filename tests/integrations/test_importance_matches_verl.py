"""tracer.formulas.importance against verl 0.9.1's own rollout-correction code, run here on CPU:
``compute_rollout_correction_and_rejection_mask`` (IS weights: token and sequence level, TIS with one
threshold, IcePop with ``lower_upper``, batch normalisation) and its rejection sampling
(``rollout_rs``, every criterion verl lists, and a chained pair), on logprobs whose ratios fall on
both sides of the thresholds, with padding.

Runs in the verl venv only (``make test-verl``); skipped where verl is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")
from verl.trainer.ppo import rollout_corr_helper as rch  # noqa: E402

from tracer.formulas import importance  # noqa: E402


def _batch():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(8, 7, generator=g, dtype=torch.float64) * 3
    rollout = old + torch.randn(8, 7, generator=g, dtype=torch.float64) * 0.5
    mask = torch.ones(8, 7, dtype=torch.float64)
    mask[2, 3:] = 0
    mask[5, 1:] = 0
    return old, rollout, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "1.5", "0.5_2.0", "0.3_3.0"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_equal_verl(level, threshold, normalize):
    old, rollout, mask = _batch()
    proto, _, _ = rch.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=normalize)
    expected = proto.batch["rollout_is_weights"]
    ours = importance.verl_is_weights(old, rollout, mask, level, threshold, normalize)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0"])
def test_canonical_mode_reproduces_verl_on_kept_tokens(level, threshold):
    """verl's settings mapped to the canonical is_mode and caps (what a trace records) give verl's
    weights on kept tokens through the canonical rule (correction_weights), so one check serves both."""
    old, rollout, mask = _batch()
    mode, low, high = importance.verl_is_settings(level, threshold)
    expected = rch.compute_rollout_correction_weights(old - rollout, mask, level, threshold)[0]
    ours = importance.correction_weights(old, rollout, mask, mode, low, high)
    ours = ours.unsqueeze(-1).expand_as(mask) if level == "sequence" else ours
    keep = mask.bool()
    torch.testing.assert_close(ours[keep], expected[keep], rtol=1e-12, atol=1e-12)
    assert mode == f"{level}_{'truncate' if isinstance(threshold, float) else 'mask'}"


_RS = [("token_k1", "0.7_1.4"), ("token_k1", "1.5"), ("token_k2", "0.05"), ("token_k3", "0.05"),
       ("seq_sum_k1", "0.3_3.0"), ("seq_sum_k2", "0.3"), ("seq_sum_k3", "0.3"), ("seq_mean_k1", "0.8_1.2"),
       ("seq_mean_k2", "0.05"), ("seq_mean_k3", "0.05"), ("seq_max_k2", "0.2"), ("seq_max_k3", "0.2"),
       ("token_k2,seq_max_k3", "0.1,0.5")]


@pytest.mark.parametrize("rollout_rs,threshold", _RS)
def test_rejection_mask_equals_verl(rollout_rs, threshold):
    old, rollout, mask = _batch()
    _, expected, _ = rch.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=None, rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    ours = importance.verl_rejection_mask(old, rollout, mask, rollout_rs, threshold)
    assert torch.equal(ours, expected)
    assert ours.dtype == expected.dtype


def test_every_verl_rejection_criterion_is_modelled():
    assert set(importance.VERL_RS_OPTIONS) == rch.SUPPORTED_ROLLOUT_RS_OPTIONS


def test_rejection_sampling_rejects_something_here():
    """The batch is not trivially kept: k2 at 0.05 rejects kept tokens, seq_mean_k1 at [0.8, 1.2] whole rows."""
    old, rollout, mask = _batch()
    token = importance.verl_rejection_mask(old, rollout, mask, "token_k2", "0.05")
    seq = importance.verl_rejection_mask(old, rollout, mask, "seq_mean_k1", "0.8_1.2")
    assert int((mask - token).sum()) > 3
    rejected_rows = ((mask - seq).sum(dim=1) > 0)
    assert 0 < int(rejected_rows.sum()) < 8
