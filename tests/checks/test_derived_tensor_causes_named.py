"""recompute.ratio / ref_kl_k3 / approx_kl_k2 name the one known wrong variant that reproduces a recorded
derived tensor (issue 43), kl.k1_negative_step names a policy/reference swap from sampler_logprobs,
identity.first_step names a one-sided gap, and counts of 1 read in the singular. Every trace is
written by TraceWriter; every expected number is worked out here with math, not tracer.formulas."""

from __future__ import annotations

import math

import torch

from tests.fixtures.check_traces import EOS, found, write_trace
from tracer.checks import ERROR, WARNING, run_checks

POLICY = [[-1.0, -0.4, -2.0], [-0.7, -1.5, -0.3]]
OLD = [[-1.2, -0.4, -1.5], [-0.7, -1.1, -0.3]]  # policy - old: [0.2, 0, -0.5], [0, -0.4, 0]
REF = [[-1.3, -0.9, -1.0], [-0.6, -1.5, -0.8]]  # policy - ref: [0.3, 0.5, -1.0], [-0.1, 0, 0.5]
MASK = [[1, 1, 1], [1, 1, 0]]  # 5 kept tokens; the masked slot's values are never compared


def _trace(tmp_path, **recorded):
    tensors = {"completion_ids": torch.tensor([[5, 6, 7], [8, 9, EOS]]),
               "completion_mask": torch.tensor(MASK, dtype=torch.bool), "policy_logprobs": torch.tensor(POLICY),
               "old_logprobs": torch.tensor(OLD), "ref_logprobs": torch.tensor(REF)}
    tensors.update({k: torch.tensor(v, dtype=torch.float32) for k, v in recorded.items()})
    return write_trace(tmp_path / "r", "grpo", [(0, 1, tensors)])  # inner step 1: not a first-step check


def _by_hand(f, a, b):
    """[[f(a_ij, b_ij)]] over the 2 x 3 grid, plain Python floats."""
    return [[f(x, y) for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def _max_kept(values, other):
    return max(abs(v - o) for rv, ro, rm in zip(values, other, MASK) for v, o, m in zip(rv, ro, rm) if m)


def _one(trace, check):
    (f,) = found(run_checks(trace), check)
    assert f.severity == ERROR and "Likely fix" not in f.message and "Why it matters" not in f.message
    return f


def test_inverted_ratio_is_named_with_how_far_the_correct_ratio_is(tmp_path):
    inverted = _by_hand(lambda p, o: math.exp(o - p), POLICY, OLD)
    correct = _by_hand(lambda p, o: math.exp(p - o), POLICY, OLD)
    f = _one(_trace(tmp_path, ratio=inverted), "recompute.ratio")
    # the worst kept token is (0, 2): exp(0.5) - exp(-0.5) = 1.0422
    off = _max_kept(inverted, correct)
    assert abs(off - (math.exp(0.5) - math.exp(-0.5))) < 1e-6
    assert f.message.startswith("ratio inverted: recorded ratio equals exp(old − policy) on all 5 kept tokens "
                                "(max |Δ| ")  # float32 rounding of the recorded values: about 1e-7
    assert f"; exp(policy − old) is off by up to {off:.2g}. " in f.message
    assert f.details["cause"] == "ratio inverted" and (f.sequence, f.token) == (0, 2)


def test_log_ratio_recorded_as_the_ratio_is_named(tmp_path):
    log_ratio = _by_hand(lambda p, o: p - o, POLICY, OLD)
    f = _one(_trace(tmp_path, ratio=log_ratio), "recompute.ratio")
    assert f.message.startswith("exp not applied (the log ratio recorded as the ratio): recorded ratio equals "
                                "policy − old on all 5 kept tokens")


def test_swapped_k3_arguments_are_named(tmp_path):
    # KL(ref || policy) by k3: exp(policy - ref) - (policy - ref) - 1
    swapped = _by_hand(lambda p, r: math.exp(p - r) - (p - r) - 1, POLICY, REF)
    correct = _by_hand(lambda p, r: math.exp(r - p) - (r - p) - 1, POLICY, REF)
    f = _one(_trace(tmp_path, ref_kl_k3=swapped), "recompute.ref_kl_k3")
    # worst at (0, 2), d = policy - ref = -1: |(e^-1 + 1 - 1) - (e^1 - 1 - 1)| = |0.3679 - 0.7183| = 0.3504
    assert abs(_max_kept(swapped, correct) - abs(math.exp(-1) - (math.e - 2))) < 1e-6
    assert f.message.startswith("k3 arguments swapped (KL(ref ‖ policy), not KL(policy ‖ ref)): recorded ref_kl_k3 "
                                "equals exp(policy − ref) − (policy − ref) − 1 on all 5 kept tokens")
    assert "is off by up to 0.35." in f.message


def test_k1_stored_under_the_k3_name_is_named(tmp_path):
    f = _one(_trace(tmp_path, ref_kl_k3=_by_hand(lambda p, r: p - r, POLICY, REF)), "recompute.ref_kl_k3")
    assert f.message.startswith("k1 stored under the k3 name: recorded ref_kl_k3 equals policy − ref on all 5 kept "
                                "tokens")


def test_k2_missing_its_half_is_named(tmp_path):
    twice = _by_hand(lambda p, o: (p - o) ** 2, POLICY, OLD)
    f = _one(_trace(tmp_path, approx_kl_k2=twice), "recompute.approx_kl_k2")
    # worst at (0, 2): (-0.5)^2 = 0.25 recorded, 0.125 by the formula
    assert f.message.startswith("k2 missing its 0.5: recorded approx_kl_k2 equals (policy − old)² on all 5 kept "
                                "tokens (max |Δ| ")
    assert "; 0.5·(policy − old)² is off by up to 0.12. " in f.message
    assert "recorded 0.25, recomputed 0.125" in f.message


def test_a_tensor_no_variant_explains_says_so_without_a_fix_list(tmp_path):
    f = _one(_trace(tmp_path, ratio=[[7.0] * 3] * 2), "recompute.ratio")
    # the smallest kept exp(policy - old) is exp(-0.5) (seq 0, token 2): 7 - 0.6065 = 6.39; the smallest kept
    # exp(old - policy) is exp(-0.2) (seq 0, token 0): 7 - 0.8187 = 6.18
    assert f.message.startswith(f"recorded ratio matches none of: exp(policy − old) (off by up to "
                                f"{7 - math.exp(-0.5):.2g}); exp(old − policy) (off by up to {7 - math.exp(-0.2):.2g})")
    assert f.details["cause"] is None


def test_healthy_derived_tensors_give_no_finding(tmp_path):
    trace = _trace(tmp_path, ratio=_by_hand(lambda p, o: math.exp(p - o), POLICY, OLD),
                   ref_kl_k3=_by_hand(lambda p, r: math.exp(r - p) - (r - p) - 1, POLICY, REF),
                   approx_kl_k2=_by_hand(lambda p, o: 0.5 * (p - o) ** 2, POLICY, OLD))
    findings = run_checks(trace)
    for check in ("recompute.ratio", "recompute.ref_kl_k3", "recompute.approx_kl_k2"):
        assert found(findings, check) == []


def test_negative_k1_from_swapped_policy_and_reference_is_named(tmp_path):
    # 300 kept tokens sampled (seeded) from a "true policy" whose logprobs are recorded as ref_logprobs; the
    # recorded policy_logprobs are the reference's, lower on the sampled tokens: k1 = policy - ref < 0.
    g = torch.Generator().manual_seed(0)
    true_policy = -torch.rand(3, 100, generator=g) * 0.5  # (3, 100) in (-0.5, 0]
    reference = true_policy - 0.3 - torch.rand(3, 100, generator=g) * 0.2  # (3, 100) lower by 0.3..0.5
    tensors = {"completion_ids": torch.full((3, 100), 5), "completion_mask": torch.ones(3, 100, dtype=torch.bool),
               "policy_logprobs": reference, "old_logprobs": reference, "ref_logprobs": true_policy,
               "sampler_logprobs": true_policy}
    trace = write_trace(tmp_path / "r", "grpo", [(0, 0, tensors)])
    (f,) = found(run_checks(trace), "kl.k1_negative_step", WARNING)
    gap = float((reference.double() - true_policy.double()).abs().mean())  # |policy - sampler|, ref matches: 0
    assert ("Policy and reference are swapped: ref_logprobs match sampler_logprobs (mean |Δ| 0.0000 nats) where "
            f"policy_logprobs are off by {gap:.4f}") in f.message
    assert "Likely fix" not in f.message


def test_one_sided_first_step_gap_names_other_weights(tmp_path):
    # every kept token: policy - old = +0.1, so mean and mean |.| are both 0.1: one-sided
    policy = torch.tensor([[-1.0, -0.5, -2.0]])
    tensors = {"completion_ids": torch.tensor([[5, 6, 7]]), "completion_mask": torch.ones(1, 3, dtype=torch.bool),
               "policy_logprobs": policy, "old_logprobs": policy - 0.1}
    (f,) = found(run_checks(write_trace(tmp_path / "r", "grpo", [(0, 0, tensors)])), "identity.first_step")
    assert "The gap is one-sided: policy is higher than old on average (mean policy − old +0.1000 nats" in f.message
    assert "Likely fix" not in f.message and "eval vs train" not in f.message


def test_counts_of_one_are_singular(tmp_path):
    # seq 0 keeps one token (id 6) after its EOS at token 1; seq 1 ends at its EOS
    tensors = {"completion_ids": torch.tensor([[5, EOS, 6], [7, 8, EOS]]),
               "completion_mask": torch.ones(2, 3, dtype=torch.bool),
               "policy_logprobs": torch.full((2, 3), -1.0), "old_logprobs": torch.full((2, 3), -1.0)}
    (f,) = found(run_checks(write_trace(tmp_path / "r", "grpo", [(0, 0, tensors)])), "masks.after_eos")
    assert "1 of 2 rows keep 1 token after EOS." in f.message
