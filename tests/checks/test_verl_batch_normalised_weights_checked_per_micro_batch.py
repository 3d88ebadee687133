"""verl's ``rollout_is_batch_normalize``: verl divides the IS weights by their mean over the whole batch,
and a worker's step file holds one micro-batch of it, whose own mean differs. sampler.is_weights
checks such a file up to one scale per file: the healthy micro-batch passes (no false alarm) with
the scale it found, and weights of another form than the declared one (here the sequence product
where token weights are declared) are still an error."""

from __future__ import annotations

import torch

from tracer.checks import ERROR, INFO, run_checks
from tracer.formulas import importance

from tests.fixtures.check_traces import write_trace

# old - sampler of a batch of 4 rows; the worker's file holds rows 0-1 (its micro-batch)
DELTA = torch.tensor([[0.1, -0.4, 0.3, 0.0], [0.5, 0.2, 0.0, 0.0],
                      [-0.3, 0.6, 0.1, 0.2], [0.0, 0.9, -0.1, 0.4]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
HYPER = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True}


def _micro_batch_findings(tmp_path, weights_of_batch: torch.Tensor):
    old = torch.full((2, 4), -1.5, dtype=torch.float64)
    step = {"completion_ids": torch.full((2, 4), 5), "completion_mask": MASK[:2], "policy_logprobs": old.float(),
            "old_logprobs": old.float(), "sampler_logprobs": (old - DELTA[:2]).float(),
            "rollout_is_weights": weights_of_batch[:2].float()}
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, step, {})], HYPER)
    return [f for f in run_checks(root, select=["sampler.is_weights"]) if f.check == "sampler.is_weights"]


def test_a_micro_batch_of_batch_normalised_weights_passes(tmp_path):
    old = torch.full((4, 4), -1.5, dtype=torch.float64)
    batch = importance.verl_is_weights(old, old - DELTA, MASK, "token", 2.0, batch_normalize=True)  # over 4 rows
    plain = importance.verl_is_weights(old, old - DELTA, MASK, "token", 2.0)
    expected_scale = float(MASK.sum() / plain[MASK].sum())  # 1 / the whole batch's mean kept weight
    micro = importance.verl_is_weights(old[:2], (old - DELTA)[:2], MASK[:2], "token", 2.0, batch_normalize=True)
    assert not torch.allclose(batch[:2], micro)  # the micro-batch's own normalisation would not reproduce them
    (f,) = _micro_batch_findings(tmp_path, batch)
    assert f.severity == INFO, f.message
    assert abs(f.details["batch_normalize_scale"] - expected_scale) < 1e-5


def test_another_form_under_batch_normalisation_is_still_an_error(tmp_path):
    sequence_product = torch.exp((DELTA * MASK).sum(dim=1, keepdim=True)).expand(4, 4) * MASK
    (f,) = _micro_batch_findings(tmp_path, sequence_product.double())
    assert f.severity == ERROR and "rollout_is = token" in f.message
