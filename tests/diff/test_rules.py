"""The diff rules against plain loops and on the cases the hand-built pairs of test_known_pairs.py miss:
DPO masks, non-finite values, step files written without tracer's metadata."""

import math

import pytest
import torch
from safetensors.torch import save_file

from tracer import TraceWriter, diff
from tracer.diff.locations import Tolerance


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_differential_against_a_plain_loop(tmp_path, seed):
    # random logprobs, random masks and a few perturbations of mixed size; the report's counts
    # and extremes must equal those of an element-by-element loop over positions both sides keep
    g = torch.Generator().manual_seed(seed)
    B, T, tol = 4, 7, Tolerance(1e-5, 1.3e-6)
    steps = {}
    for step in range(2):
        a = -torch.rand(B, T, generator=g) * 3
        scale = torch.tensor([0.0, 1e-6, 1e-3])[torch.randint(0, 3, (B, T), generator=g)]  # (B, T)
        noise = torch.randn(B, T, generator=g) * scale
        mask_a = torch.rand(B, T, generator=g) < 0.8
        mask_b = mask_a ^ (torch.rand(B, T, generator=g) < 0.1)
        steps[step] = (a, a + noise, mask_a, mask_b)
    for side, index in (("a", 0), ("b", 1)):
        with TraceWriter(tmp_path / side, "grpo") as writer:
            for step, tensors in steps.items():
                writer.record(step, {"completion_ids": torch.zeros(B, T, dtype=torch.long),
                                     "completion_mask": tensors[2 + index], "policy_logprobs": tensors[index]})
    field = diff(tmp_path / "a", tmp_path / "b", drift=False).fields["policy_logprobs"]

    compared = differing = 0
    max_abs = min_rtol = 0.0
    for a, b, mask_a, mask_b in steps.values():
        for i in range(B):
            for t in range(T):
                if not (mask_a[i, t] and mask_b[i, t]):
                    continue
                x, y = float(a[i, t]), float(b[i, t])  # float32 values, compared in float64
                compared += 1
                differing += abs(y - x) > tol.atol + tol.rtol * abs(x)
                max_abs = max(max_abs, abs(y - x))
                min_rtol = max(min_rtol, abs(y - x) / abs(x))
    assert (field.compared, field.differing) == (compared, differing)
    assert field.max_abs_diff == max_abs and field.min_rtol == pytest.approx(min_rtol, rel=1e-12)
    worst = field.worst[0] if field.worst else None
    assert worst is None or worst.abs_diff == max_abs


def test_dpo_fields_use_their_own_side_mask(tmp_path):
    chosen_mask = torch.tensor([[1, 1, 1, 0]]).bool()
    rejected_mask = torch.tensor([[1, 1, 0, 0]]).bool()

    def tensors(rejected_change_at=None):
        rejected = torch.full((1, 4), -1.0)
        if rejected_change_at is not None:
            rejected[0, rejected_change_at] = -2.0
        return {"chosen_ids": torch.tensor([[3, 4, 5, 0]]), "rejected_ids": torch.tensor([[6, 7, 0, 0]]),
                "chosen_mask": chosen_mask, "rejected_mask": rejected_mask,
                "chosen_policy_logprobs": torch.full((1, 4), -1.0), "rejected_policy_logprobs": rejected}

    for name, change in (("a", None), ("masked", 2), ("kept", 1)):
        with TraceWriter(tmp_path / name, "dpo") as writer:
            writer.record(0, tensors(change))
    # position 2: chosen keeps it, rejected does not -> not compared for a rejected_* field
    assert diff(tmp_path / "a", tmp_path / "masked").equal
    field = diff(tmp_path / "a", tmp_path / "kept").fields["rejected_policy_logprobs"]
    assert field.mask == "rejected_mask" and field.compared == 2 and field.differing == 1
    assert field.worst[0].token_text == "<id 7>"  # the rejected token at that position, not the chosen one


def test_non_finite_values(tmp_path):
    a = torch.tensor([[0.0, math.nan, math.inf, -1.0, 1.0]])
    b = torch.tensor([[0.0, math.nan, math.inf, math.nan, -math.inf]])
    for name, values in (("a", a), ("b", b)):
        with TraceWriter(tmp_path / name, "grpo") as writer:
            writer.record(0, {"completion_mask": torch.ones(1, 5, dtype=torch.bool), "policy_logprobs": values})
    field = diff(tmp_path / "a", tmp_path / "b").fields["policy_logprobs"]
    # NaN == NaN and inf == inf pass; NaN or -inf against a finite value fail with |Δ| = inf
    assert field.differing == 2 and field.max_abs_diff == math.inf
    assert [loc.index for loc in field.worst] == [(0, 3), (0, 4)]
    assert diff(tmp_path / "a", tmp_path / "b").to_dict()["fields"]["policy_logprobs"]["max_abs_diff"] == "inf"


def test_step_files_without_metadata_are_compared_in_full(tmp_path):
    # files a user saved with safetensors directly: no checksum, no algorithm, no step numbers
    values = torch.tensor([[-0.5, -0.25]])
    save_file({"policy_logprobs": values}, str(tmp_path / "a.safetensors"))
    save_file({"policy_logprobs": values.clone()}, str(tmp_path / "b.safetensors"))
    save_file({"policy_logprobs": values + 1e-3}, str(tmp_path / "c.safetensors"))
    same = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert same.equal and same.identical_by_checksum == 0 and same.fields["policy_logprobs"].compared == 2
    assert not diff(tmp_path / "a.safetensors", tmp_path / "c.safetensors").equal
