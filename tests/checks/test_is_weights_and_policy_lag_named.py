"""sampler.is_weights and sampler.policy_lag on hand-made steps whose values are worked out here:
each wrong form of a correction is named, derived weights are marked, verl's form is read from its own
settings, a correction without a mode is reported as not checked, and the lag edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from tracer.checks import ERROR, INFO, SKIPPED, WARNING, run_checks
from tracer.formulas import importance

from tests.fixtures.check_traces import write_trace

# old - sampler: row 0 [0.1, -0.4, 0.3, 0.0], row 1 [1.0, 0.2, 0.0, <masked>]
DELTA = torch.tensor([[0.1, -0.4, 0.3, 0.0], [1.0, 0.2, 0.0, 5.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)


def _step(weights: dict, **extra) -> dict:
    old = torch.full((2, 4), -1.5, dtype=torch.float64)
    return {"completion_ids": torch.full((2, 4), 5), "completion_mask": MASK, "policy_logprobs": old.float(),
            "old_logprobs": old.float(), "sampler_logprobs": (old - DELTA).float(), **weights, **extra}


def _findings(tmp_path, weights: dict, hyper: dict, meta: dict | None = None, check="sampler.is_weights", **extra):
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, _step(weights, **extra), meta or {})], hyper)
    return [f for f in run_checks(root, select=[check]) if f.check in (check, "trace.not_checked")]


TOKEN_MASK = {"is_correction": True, "is_mode": "token_mask", "is_clip_min": 0.8, "is_clip_max": 1.25}


def test_declared_icepop_weights_pass_and_zeroed_tokens_are_counted(tmp_path):
    raw = torch.exp(DELTA)
    weights = torch.where((raw < 0.8) | (raw > 1.25), 0.0, raw).float()  # exp(-0.4), exp(0.3), exp(1.0) zeroed
    (f,) = _findings(tmp_path, {"is_weights": weights}, TOKEN_MASK)
    assert f.severity == INFO and f.details["zeroed_tokens"] == 3 and f.details["count"] == 7
    assert f.details["raw_max"] == pytest.approx(math.e, rel=1e-5)


@pytest.mark.parametrize("recorded, named", [
    (lambda raw: raw.clamp(0.8, 1.25), "clamped to [0.8, 1.25] (token_truncate) where token_mask declares them zeroed"),
    (lambda raw: torch.where((1 / raw < 0.8) | (1 / raw > 1.25), 0.0, 1 / raw), "the inverted ratio exp(sampler − old)"),
])
def test_wrong_token_form_is_named(tmp_path, recorded, named):
    (f,) = _findings(tmp_path, {"is_weights": recorded(torch.exp(DELTA)).float()}, TOKEN_MASK)
    assert f.severity == ERROR and f.message.startswith(f"is_weights are {named}")


def test_no_weights_recorded_they_are_derived(tmp_path):
    (f,) = _findings(tmp_path, {}, {**TOKEN_MASK})
    assert f.severity == INFO and f.details["is_weights_source"] == "derived" and "derived" in f.message


def test_weights_without_a_mode_are_not_checked(tmp_path):
    findings = _findings(tmp_path, {"is_weights": torch.exp(DELTA).float()}, {})
    assert [f.severity for f in findings if f.check == "sampler.is_weights"] == [SKIPPED]
    assert any(f.check == "trace.not_checked" and "importance-sampling correction" in f.message for f in findings)


@pytest.mark.parametrize("threshold", [2.0, "0.8_1.25"])
def test_verl_form_from_its_own_settings(tmp_path, threshold):
    old = torch.full((2, 4), -1.5, dtype=torch.float64)
    weights = importance.verl_is_weights(old, old - DELTA, MASK.double(), "token", threshold)
    hyper = {"rollout_is": "token", "rollout_is_threshold": threshold}
    (f,) = _findings(tmp_path, {"rollout_is_weights": weights.float()}, hyper)
    assert f.severity == INFO, f.message
    (g,) = _findings(tmp_path / "bad", {"rollout_is_weights": torch.exp(DELTA).float() * MASK}, hyper)
    assert g.severity == ERROR and "rollout_is = token" in g.message


def _lag(tmp_path, versions, meta):
    return _findings(tmp_path, {}, {}, meta, check="sampler.policy_lag", policy_version=torch.tensor(versions))


def test_lag_per_row_and_share_beyond_the_maximum(tmp_path):
    (f,) = _lag(tmp_path, [9, 6], {"trainer_version": 9, "max_policy_lag": 2})
    assert f.severity == ERROR and f.details["policy_lag"] == [0, 3] and f.details["share_beyond_max"] == 0.5
    assert f.message.startswith("policy_lag beyond max_policy_lag = 2: 1 row of 2 (50%)")


def test_a_row_newer_than_the_trainer_is_a_bookkeeping_error(tmp_path):
    (f,) = _lag(tmp_path, [9, 10], {"trainer_version": 9})
    assert f.severity == ERROR and f.message.startswith("policy_version: 1 row of 2 claim a policy version newer")


def test_lagged_rows_trained_as_on_policy_are_a_warning(tmp_path):
    # old == policy (recomputed with the trainer's weights), old - sampler up to 1 nat, no weights recorded
    (f,) = _lag(tmp_path, [4, 3], {"trainer_version": 5})
    assert f.severity == WARNING and "uncorrected" in f.message


def test_policy_version_without_trainer_version_is_skipped_with_the_fix(tmp_path):
    skipped, note = sorted(_lag(tmp_path, [4, 3], {}), key=lambda f: f.check != "sampler.policy_lag")
    assert skipped.severity == SKIPPED and "trainer_version" in skipped.message
    # the report opens with it too: a run that records the versions is asynchronous, and its lag went unchecked
    assert note.check == "trace.not_checked" and note.message.startswith(
        "not checked: policy lag — on 1 of 1 step files none of sampler.policy_lag could run: policy_version is "
        "recorded but metadata trainer_version is not")


@pytest.mark.parametrize("old_is_behaviour, fires", [(True, False), (False, True)])
def test_first_step_leaves_out_lagged_rows_only_when_old_is_the_behaviour_policy(tmp_path, old_is_behaviour, fires):
    """Rows lagged by 2 updates, policy 0.3 nats above old on every token. When old equals the sampler
    (the behaviour policy's logprobs) the ratio is the lag; when old was recomputed (0.5 nats from the
    sampler) it must equal the policy, so identity.first_step reports the gap."""
    old = torch.full((2, 4), -1.5)
    sampler = old if old_is_behaviour else old - 0.5
    step = {"completion_ids": torch.full((2, 4), 5), "completion_mask": MASK, "policy_logprobs": old + 0.3,
            "old_logprobs": old, "sampler_logprobs": sampler, "policy_version": torch.tensor([3, 3])}
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, step, {"trainer_version": 5})])
    errors = [f for f in run_checks(root, select=["identity.first_step"]) if f.severity == ERROR]
    assert bool(errors) == fires
