"""The checks added for verl traces, on hand-written traces (no verl needed; tests/integrations/test_verl.py runs
them on traces from verl's own code): verl's GRPO rule and the probability-space gap in
tracer.formulas, ``recompute.advantages`` with the rule ``verl_grpo``, ``sampler.probs_diff`` and
``identity.micro_batch_position``."""

from __future__ import annotations

import math

import pytest
import torch

from tracer import formulas
from tracer.checks import run_checks
from tracer.record.writer import TraceWriter

from tests.fixtures.toy_traces import healthy_step_tensors


def test_verl_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0, 3.0])
    group_ids = torch.tensor([0, 1, 0, 1, 2])  # groups interleaved, group 2 has one row
    a = formulas.verl_grpo_advantages(rewards, group_ids)
    # group 0: [1, 2], mean 1.5, Bessel std sqrt(0.5); group 1: [0, 0], std 0 -> 0 / 1e-6 = 0;
    # group 2: one row -> verl uses mean 0, std 1
    s = math.sqrt(0.5)
    assert a.tolist() == pytest.approx([-0.5 / (s + 1e-6), 0.0, 0.5 / (s + 1e-6), 0.0, 3.0 / (1 + 1e-6)])
    centred = formulas.verl_grpo_advantages(rewards, group_ids, norm_by_std=False)
    assert centred.tolist() == pytest.approx([-0.5, 0.0, 0.5, 0.0, 3.0])


def test_probability_gap_by_hand():
    trainer = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    sampler = torch.log(torch.tensor([[0.4, 0.25, 0.1]]))
    mask = torch.tensor([[True, True, False]])
    gap = formulas.probability_gap(trainer, sampler, mask)
    # kept gaps |0.5 - 0.4| = 0.1 and 0; std with Bessel's correction of [0.1, 0] = 0.1 / sqrt(2)
    assert gap["max"] == pytest.approx(0.1) and gap["mean"] == pytest.approx(0.05)
    assert gap["std"] == pytest.approx(0.1 / math.sqrt(2))
    assert gap["pearson"] == pytest.approx(1.0)  # two points lie on a line


def _write(out, steps):
    """``steps``: list of (micro_batch, position, fresh, tensors edit)."""
    with TraceWriter(out, "grpo", hyperparameters={"num_generations": 2}) as writer:
        for micro_batch, position, fresh, edit in steps:
            tensors = healthy_step_tensors(0, 0)
            edit(tensors)
            writer.record(0, tensors, micro_batch=micro_batch,
                          metadata={"fresh_rollouts": fresh, "micro_batch_in_mini_batch": position})
    return out


def _shift(tensors):
    tensors["policy_logprobs"] = tensors["policy_logprobs"] + 0.05
    tensors["ratio"] = formulas.ratio(tensors["policy_logprobs"], tensors["old_logprobs"])
    tensors["approx_kl_k2"] = formulas.approx_kl_k2(tensors["policy_logprobs"], tensors["old_logprobs"])
    tensors["ref_kl_k3"] = formulas.ref_kl_k3(tensors["policy_logprobs"], tensors["ref_logprobs"])


def _same(tensors):
    pass


def test_micro_batch_position_names_the_position_that_deviates(tmp_path):
    trace = _write(tmp_path / "t", [(0, 0, True, _same), (1, 1, True, _shift), (2, 0, False, _shift)])
    (finding,) = [f for f in run_checks(trace) if f.check == "identity.micro_batch_position"]
    assert finding.severity == "error" and (finding.step, finding.micro_batch) == (0, 1)
    assert finding.details == {"deviating_positions": [1], "exact_positions": [0], "ranks": [0]}
    assert "position 1: 1 of 1 files, max |policy - old| 0.05 nats" in finding.message


def test_micro_batch_position_is_silent_when_healthy_or_when_every_position_deviates(tmp_path):
    healthy = _write(tmp_path / "a", [(0, 0, True, _same), (1, 1, True, _same), (2, 0, False, _shift)])
    everywhere = _write(tmp_path / "b", [(0, 0, True, _shift), (1, 1, True, _shift)])
    assert not [f for f in run_checks(healthy) if f.check == "identity.micro_batch_position"]
    assert not [f for f in run_checks(everywhere) if f.check == "identity.micro_batch_position"]
    assert len([f for f in run_checks(everywhere) if f.check == "identity.first_step"]) == 2


def test_probs_diff_reports_verl_numbers_and_warns_on_a_large_gap(tmp_path):
    def far(tensors):
        tensors["sampler_logprobs"] = tensors["old_logprobs"] * 0.3

    quiet = _write(tmp_path / "a", [(0, 0, True, _same)])
    loud = _write(tmp_path / "b", [(0, 0, True, far)])
    for trace, severity, edit in ((quiet, "info", _same), (loud, "warning", far)):
        (finding,) = [f for f in run_checks(trace) if f.check == "sampler.probs_diff"]
        tensors = healthy_step_tensors(0, 0)
        edit(tensors)
        keep = tensors["completion_mask"]
        gaps = (tensors["old_logprobs"].exp() - tensors["sampler_logprobs"].exp()).abs()[keep].double()
        assert finding.severity == severity
        assert finding.details["probs_diff_mean"] == pytest.approx(float(gaps.mean()), rel=1e-5)
        assert finding.details["probs_diff_max"] == pytest.approx(float(gaps.max()), rel=1e-5)


def test_verl_advantages_rule_checked_only_when_declared(tmp_path):
    def verl_rule(tensors):
        tensors["advantages"] = formulas.verl_grpo_advantages(tensors["rewards"], tensors["group_ids"])

    def wrong(tensors):
        tensors["advantages"] = formulas.verl_grpo_advantages(tensors["rewards"], tensors["group_ids"]) * 2

    for edit, expected in ((verl_rule, []), (wrong, ["error"])):
        out = tmp_path / edit.__name__
        with TraceWriter(out, "grpo", hyperparameters={"num_generations": 2, "advantage_rule": "verl_grpo"}) as w:
            tensors = healthy_step_tensors(0, 0)
            edit(tensors)
            w.record(0, tensors)
        found = [f.severity for f in run_checks(out) if f.check == "recompute.advantages"]
        assert found == expected
