"""tracer.formulas.importance against TRL's own importance-sampling code: the block of
``GRPOTrainer._generate_and_score_completions`` (TRL as installed) that turns ``old_per_token_logps``
and the engine's ``sampling_per_token_logps`` into ``importance_sampling_ratio`` is read from TRL's
source and run here, for every ``vllm_importance_sampling_mode`` and cap pair, on logprobs with
ratios on both sides of the caps, padding and NaN sampler logprobs (which TRL counts as 0)."""

from __future__ import annotations

import inspect
import math
import textwrap
import types

import pytest
import torch
from trl import GRPOTrainer

from tracer.formulas import importance


def _trl_is_block() -> str:
    """The source of TRL's IS-ratio block, dedented: from ``if self.use_vllm and
    self.vllm_importance_sampling_correction:`` (the one that builds ``per_token_logps_diff``) to the
    reference-logprobs comment after it."""
    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    start = next(i for i, line in enumerate(lines) if "vllm_importance_sampling_correction:" in line
                 and "per_token_logps_diff" in lines[i + 2])
    end = next(i for i in range(start + 1, len(lines)) if "per-token log probabilities for the reference" in lines[i])
    return textwrap.dedent("\n".join(lines[start:end]))


def _run_trl(old, sampling, mask, mode, clip_min, clip_max):
    trainer = types.SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                                    vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                                    vllm_importance_sampling_clip_max=clip_max)
    scope = {"self": trainer, "old_per_token_logps": old, "sampling_per_token_logps": sampling,
             "completion_mask": mask, "tool_mask": None, "torch": torch, "math": math}
    exec(compile(_trl_is_block(), "trl_is_block", "exec"), scope)
    return scope["vllm_importance_sampling_ratio"]


def _batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    sampling = old + torch.randn(6, 9, generator=g, dtype=torch.float64) * 0.6  # ratios from ~0.2 to ~5
    mask = torch.ones(6, 9)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    sampling[2, 4] = float("nan")  # an engine that did not report this token
    return old, sampling, mask


@pytest.mark.parametrize("mode", importance.IS_MODES)
@pytest.mark.parametrize("caps", [(None, 3.0), (0.5, 2.0), (0.8, 1.25)])
def test_correction_weights_equal_trl_block(mode, caps):
    old, sampling, mask = _batch()
    expected = _run_trl(old, sampling, mask, mode, *caps)
    ours = importance.correction_weights(old, sampling, mask, mode, *caps)
    if mode.startswith("sequence"):
        expected = expected.reshape(-1)  # TRL keeps (B, 1)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    raw = importance.raw_is_ratio(old, sampling, mask, mode)
    cut = importance.outside_caps(raw, *caps)
    changed = (raw != expected)
    assert torch.equal(cut, changed), "the weights TRL changed are exactly those outside the caps"


def test_tight_caps_cut_something_and_mask_zeroes_it():
    """The batch above does exercise the caps: with [0.8, 1.25] TRL's token_mask zeroes kept tokens
    and token_truncate clamps the same ones to the cap values."""
    old, sampling, mask = _batch()
    masked = _run_trl(old, sampling, mask, "token_mask", 0.8, 1.25)
    truncated = _run_trl(old, sampling, mask, "token_truncate", 0.8, 1.25)
    zeroed = (masked == 0) & mask.bool()
    assert int(zeroed.sum()) > 5
    assert set(truncated[zeroed].tolist()) <= {0.8, 1.25}


def test_sequence_mean_is_the_geometric_mean():
    """aggregation="mean" (trl#5814's fix, GSPO's sequence ratio) is exp of the mean kept log ratio,
    worked out by hand for one row: log ratios 0.3, -0.1, 0.4 over 3 kept tokens -> exp(0.2)."""
    old = torch.tensor([[0.3, -0.1, 0.4, 9.0]], dtype=torch.float64)
    sampling = torch.zeros(1, 4, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = importance.correction_weights(old, sampling, mask, "sequence_truncate", None, 10.0, aggregation="mean")
    assert float(w[0]) == pytest.approx(math.exp(0.2), rel=1e-12)
    w_sum = importance.correction_weights(old, sampling, mask, "sequence_truncate", None, 10.0)
    assert float(w_sum[0]) == pytest.approx(math.exp(0.6), rel=1e-12)


def test_policy_lag_per_row():
    lag = importance.policy_lag(torch.tensor([7, 5, 7, 4]), 7)
    assert lag.tolist() == [0, 2, 0, 3] and lag.dtype == torch.int64
