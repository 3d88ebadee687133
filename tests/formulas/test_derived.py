"""Derived fields (tracer/formulas/derived.py): a trace written as the README's hand-written loop records
it (policy and old logprobs, no ratio / KL tensors) reads with ``ratio``, ``approx_kl_k2`` (and
``ref_kl_k3`` when ``ref_logprobs`` is recorded) computed from the recorded inputs, marked as
derived; recorded values are never replaced; the recompute checks skip a derived field."""

from __future__ import annotations

import math

import pytest
import torch

from tracer.checks import run_checks

from tests.fixtures.snippet_traces import snippet_step, write_snippet_trace


def test_snippet_trace_reads_with_ratio_and_k2_derived(tmp_path):
    tensors = snippet_step()
    trace = write_snippet_trace(tmp_path / "t", tensors)
    key = trace.steps()[0]
    assert trace.derived_fields(key) == ["ratio", "approx_kl_k2"]  # no ref_logprobs: no k3
    data = trace.load_step(key)
    policy, old = tensors["policy_logprobs"].tolist(), tensors["old_logprobs"].tolist()
    for b in range(4):
        for t in range(3):
            d = policy[b][t] - old[b][t]
            assert float(data["ratio"][b, t]) == pytest.approx(math.exp(d), rel=1e-6)
            assert float(data["approx_kl_k2"][b, t]) == pytest.approx(0.5 * d * d, abs=1e-7)
    assert "ratio" not in trace.load_step(key, derive=False)
    assert set(trace.load_step(key, ["ratio"])) == {"ratio"}  # the inputs read to derive it are not returned
    row = trace.load_sequence(key, 3)
    assert float(row["ratio"][2]) == pytest.approx(math.exp(0.4), rel=1e-6)


def test_k3_derived_from_ref_and_marked_in_tables(tmp_path):
    trace = write_snippet_trace(tmp_path / "t", snippet_step(with_ref=True))
    key = trace.steps()[0]
    assert trace.derived_fields(key) == ["ratio", "ref_kl_k3", "approx_kl_k2"]
    k3 = trace.load_step(key, ["ref_kl_k3"])["ref_kl_k3"]
    assert float(k3[0, 0]) == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-5)  # d = ref - policy = -0.5
    table = trace.token_table(key, 0)
    assert table.attrs["derived"] == ["ratio", "ref_kl_k3", "approx_kl_k2"]
    summary = trace.step_summary()
    assert summary.loc[0, "derived"] == "ratio, ref_kl_k3, approx_kl_k2"
    keep = snippet_step()["completion_mask"]
    d = (snippet_step()["policy_logprobs"] - snippet_step()["old_logprobs"])[keep]
    assert summary.loc[0, "mean_ratio"] == pytest.approx(float(d.double().exp().mean()), rel=1e-6)
    assert summary.loc[0, "mean_ref_kl_k3"] == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-5)


def test_recorded_fields_are_never_replaced(tmp_path):
    tensors = snippet_step()
    tensors["ratio"] = torch.full((4, 3), 7.0)  # a (wrong) recorded ratio stays what was recorded
    trace = write_snippet_trace(tmp_path / "t", tensors)
    key = trace.steps()[0]
    assert trace.derived_fields(key) == ["approx_kl_k2"]
    assert torch.equal(trace.load_step(key)["ratio"], torch.full((4, 3), 7.0))
    findings = [f for f in run_checks(trace) if f.check == "recompute.ratio"]
    assert findings and findings[0].severity == "error"  # the recorded ratio is still tested


def test_sequence_level_ratio_is_not_derived(tmp_path):
    trace = write_snippet_trace(tmp_path / "t", snippet_step(), importance_sampling_level="sequence")
    assert trace.derived_fields(trace.steps()[0]) == ["approx_kl_k2"]


def test_recompute_checks_skip_a_derived_field_and_say_why(tmp_path):
    trace = write_snippet_trace(tmp_path / "t", snippet_step(with_ref=True))
    by_check = {f.check: f for f in run_checks(trace)}
    for check in ("recompute.ratio", "recompute.ref_kl_k3", "recompute.approx_kl_k2", "kl.k3_sign"):
        assert by_check[check].severity == "skipped", check
        assert "derives it from the recorded inputs" in by_check[check].message
    assert not [f for f in by_check.values() if f.severity in ("error", "warning")]  # healthy: no false alarm


@pytest.mark.parametrize("reduction", ["sequence_mean", "token_mean", "constant"])
def test_loss_contributions_sum_to_the_reduced_loss(reduction):
    from tracer import formulas

    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    shares = formulas.loss_contributions(loss, mask, reduction, divisor=12.0)
    # by hand: sequence_mean = ((1+2)/2 + (4+5+6)/3) / 2 = 3.25; token_mean = 18/5; constant = 18/12
    expected = {"sequence_mean": 3.25, "token_mean": 3.6, "constant": 1.5}[reduction]
    assert float(shares.sum()) == pytest.approx(expected)
    assert float(shares[0, 2]) == 0.0  # a masked token has no share
    if reduction == "sequence_mean":
        assert float(shares[0, 0]) == pytest.approx(1.0 / 4)  # 1 / (B=2 * 2 kept)


def test_the_writer_derives_from_staged_copies_without_detaching_them():
    """``for_maths`` detaches only a tensor that needs it: a staged copy (no grad) is used as it is
    (each torch call on the writer thread lets the interpreter lock go), one with a graph is detached;
    the derived values are the formulas' either way."""
    from tracer import formulas
    from tracer.formulas.derived import derive_recorded, for_maths

    policy = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9], [-0.5, -2.5]])
    assert for_maths(old) is old
    detached = for_maths(policy)
    assert not detached.requires_grad and detached.data_ptr() == policy.data_ptr()
    assert for_maths(old.to(torch.float8_e4m3fn)).dtype == torch.float32
    out = derive_recorded({"policy_logprobs": policy, "old_logprobs": old}, ["ratio", "approx_kl_k2"])
    assert torch.equal(out["ratio"], torch.exp(policy.detach() - old))
    assert torch.equal(out["approx_kl_k2"], formulas.approx_kl_k2(policy.detach(), old))
    assert not any(t.requires_grad for t in out.values())
