"""Bad tensors at record time: NaN/Inf are recorded and marked, not rejected; non-contiguous,
requires_grad, bfloat16, integer and 0/1 float masks are normalised; a float mask holding other
values and B or T disagreeing across fields are errors that name the fields. CUDA tensors take
the same path through pinned buffers (tested when a GPU is present)."""

from __future__ import annotations

import pytest
import torch

from tracer import SchemaError, Trace, TraceError, TraceWriter
from tracer.checks import run_checks

B, T = 3, 4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


def step(device: str = "cpu") -> dict[str, torch.Tensor]:
    """A GRPO step of B = 3, T = 4: logprobs -0.1 * (position + 1) + row, masks keep 3, 4, 2 tokens."""
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    policy = -0.1 * (torch.arange(T) + 1.0) + torch.arange(B).unsqueeze(1)  # (B, T)
    tensors = {"completion_ids": torch.arange(B * T).reshape(B, T), "completion_mask": completion_mask,
               "policy_logprobs": policy, "old_logprobs": policy.clone(),
               "rewards": torch.tensor([1.0, 0.0, 0.5]), "advantages": torch.tensor([1.0, -1.0, 0.0]),
               "group_ids": torch.tensor([0, 0, 1])}
    return {name: t.to(device) for name, t in tensors.items()}


def write_one(root, tensors, **kwargs) -> tuple[Trace, dict[str, torch.Tensor], dict]:
    with TraceWriter(root, "grpo", hyperparameters={"num_generations": 2}, **kwargs) as writer:
        writer.record(0, tensors)
    trace = Trace(root)
    (key,) = trace.steps()
    return trace, trace.load_step(key), trace.metadata(key)


def test_nan_and_inf_are_recorded_and_marked_not_rejected(tmp_path):
    tensors = step()
    tensors["policy_logprobs"][0, 1] = float("nan")
    tensors["old_logprobs"][2, 3] = float("-inf")  # a masked position: still kept, still marked
    tensors["rewards"][1] = float("inf")
    trace, got, meta = write_one(tmp_path / "run", tensors)
    assert torch.isnan(got["policy_logprobs"][0, 1]) and got["old_logprobs"][2, 3] == float("-inf")
    assert got["rewards"][1] == float("inf")
    assert sorted(meta["nonfinite_fields"]) == ["old_logprobs", "policy_logprobs", "rewards"]
    found = {(f.field, f.severity) for f in run_checks(trace, select=["nonfinite"])}
    assert {("policy_logprobs", "error"), ("old_logprobs", "warning")} <= found  # first kept tensor, masked ones


def test_finite_steps_carry_no_nonfinite_mark(tmp_path):
    _, _, meta = write_one(tmp_path / "run", step())
    assert "nonfinite_fields" not in meta


def test_non_contiguous_and_requires_grad_tensors_are_stored_as_values(tmp_path):
    tensors = step()
    base = tensors["policy_logprobs"].t().contiguous().requires_grad_(True)  # (T, B) leaf with grad
    tensors["policy_logprobs"] = base.t()  # (B, T), a non-contiguous view that requires grad
    tensors["old_logprobs"] = tensors["old_logprobs"] * 1.0  # computed, no grad
    assert not tensors["policy_logprobs"].is_contiguous() and tensors["policy_logprobs"].requires_grad
    tensors["completion_ids"] = torch.arange(B * T).reshape(T, B).t()  # non-contiguous ids
    _, got, _ = write_one(tmp_path / "run", tensors)
    assert torch.equal(got["policy_logprobs"], base.detach().t())
    assert not got["policy_logprobs"].requires_grad
    assert torch.equal(got["completion_ids"], torch.arange(B * T).reshape(T, B).t())


def test_bfloat16_is_stored_as_float32_and_its_source_dtype_recorded(tmp_path):
    tensors = step()
    tensors["policy_logprobs"] = tensors["policy_logprobs"].bfloat16()
    _, got, meta = write_one(tmp_path / "run", tensors)
    assert got["policy_logprobs"].dtype == torch.float32
    assert torch.equal(got["policy_logprobs"], tensors["policy_logprobs"].float())  # bf16 values, exactly
    assert meta["source_dtype"] == "bfloat16,float32"


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.float32, torch.float16])
def test_integer_and_0_1_float_masks_become_bool(tmp_path, dtype):
    tensors = step()
    tensors["completion_mask"] = tensors["completion_mask"].to(dtype)
    _, got, _ = write_one(tmp_path / "run", tensors)
    assert got["completion_mask"].dtype == torch.bool
    assert torch.equal(got["completion_mask"], step()["completion_mask"])


def test_a_float_mask_with_other_values_is_an_error(tmp_path):
    tensors = step()
    tensors["completion_mask"] = tensors["completion_mask"].float() * 0.5
    writer = TraceWriter(tmp_path / "run", "grpo")
    with pytest.raises(SchemaError, match=r"^field 'completion_mask': a mask must hold only 0 and 1 \(True = keep\), "
                                          r"got values \[0.5, 0.5, 0.5\]; pass a bool tensor or a 0/1 tensor$"):
        writer.record(0, tensors)
    writer.close()
    assert Trace(tmp_path / "run").steps() == []


def test_b_disagreeing_between_a_sequence_field_and_a_token_field_names_both(tmp_path):
    tensors = step()
    tensors["rewards"] = torch.zeros(B + 1)
    writer = TraceWriter(tmp_path / "run", "grpo")
    with pytest.raises(SchemaError, match=r"^field 'rewards': dimension B is 4, but field 'completion_ids' has B = 3; "
                                          r"all fields of one step must share B, T, L and F$"):
        writer.record(0, tensors)


def test_t_disagreeing_between_a_mask_and_logprobs_names_both(tmp_path):
    tensors = step()
    tensors["completion_mask"] = torch.ones(B, T + 2, dtype=torch.bool)
    writer = TraceWriter(tmp_path / "run", "grpo")
    with pytest.raises(SchemaError, match=r"field 'completion_mask': dimension T is 6, but field 'completion_ids' "
                                          r"has T = 4"):
        writer.record(0, tensors)


@CUDA
def test_cuda_tensors_are_normalised_like_cpu_ones(tmp_path):
    tensors = step("cuda")
    tensors["policy_logprobs"] = tensors["policy_logprobs"].t().contiguous().t().bfloat16().requires_grad_(True)
    tensors["completion_mask"] = tensors["completion_mask"].float()
    tensors["old_logprobs"][0, 0] = float("nan")
    _, got, meta = write_one(tmp_path / "run", tensors)
    want = step()
    assert got["policy_logprobs"].device.type == "cpu" and got["policy_logprobs"].dtype == torch.float32
    assert torch.equal(got["policy_logprobs"], want["policy_logprobs"].bfloat16().float())
    assert torch.equal(got["completion_mask"], want["completion_mask"])
    assert meta["nonfinite_fields"] == ["old_logprobs"]


@CUDA
def test_a_cuda_float_mask_with_other_values_is_dropped_or_raised(tmp_path):
    """A CUDA mask's values are checked on the writer thread (reading them on the training
    thread would synchronise it): the step is dropped and counted, or strict mode raises."""
    tensors = step("cuda")
    tensors["completion_mask"] = tensors["completion_mask"].float() * 0.5
    with pytest.warns(RuntimeWarning, match="a mask must hold only 0 and 1"):
        with TraceWriter(tmp_path / "run", "grpo") as writer:
            writer.record(0, tensors)
    assert Trace(tmp_path / "run").manifest["dropped_steps"] == 1
    strict = TraceWriter(tmp_path / "strict", "grpo", strict=True)
    strict.record(0, tensors)
    with pytest.raises(TraceError, match="a mask must hold only 0 and 1"):
        strict.flush()


@CUDA
def test_a_cuda_tensor_overwritten_right_after_record_is_written_as_it_was_at_record(tmp_path):
    """The copy to host is queued on the loop's own stream, so an overwrite queued after ``record``
    (while the GPU is still busy with earlier work) runs after it: the file holds the values at
    record. Steps after a first, flushed one: on the H200 the side-stream race spared step 0 (its
    pinned buffers' first allocation synchronised) and hit every later step (BENCHMARKS.md, GPU)."""
    want = {}
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}) as writer:
        for k in range(5):
            tensors = {name: t + k if t.is_floating_point() else t for name, t in step("cuda").items()}
            want[k] = {name: t.to("cpu", copy=True) for name, t in tensors.items()}
            busy = torch.ones(4096, 4096, device="cuda")
            for _ in range(8):  # keeps the GPU busy while the copies and the overwrites are queued
                busy = busy @ busy / 4096
            writer.record(k, tensors)
            for t in tensors.values():
                t.zero_() if t.dtype != torch.bool else t.logical_not_()
            if k == 0:
                writer.flush()
    trace = Trace(tmp_path / "run")
    assert [key.step for key in trace.steps()] == list(range(5))
    for key in trace.steps():
        got = trace.load_step(key)
        for name, value in want[key.step].items():
            assert torch.equal(got[name].to(value.dtype), value), (key.step, name)


@CUDA
def test_a_cuda_step_is_staged_into_one_group_of_pinned_buffers_that_later_steps_reuse():
    """Every tensor of a step on one CUDA device: one group of pinned host buffers, filled by one
    foreach copy (a non-contiguous source included), handed back and filled again by the next step
    of the same field signature."""
    from tracer.record.capture import BufferPool, stage

    tensors = step("cuda")
    tensors["policy_logprobs"] = tensors["policy_logprobs"].t().contiguous().t()  # (B, T), non-contiguous
    key = tuple((name, t.shape, t.dtype, t.device) for name, t in tensors.items())
    pool = BufferPool()
    staged, event, buffers, nbytes = stage(tensors, pool, group_key=key)
    event.synchronize()
    assert len(buffers) == 1 and buffers[0][1] is True  # one group, pinned
    assert nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in step().items():
        assert staged[name].is_pinned() and staged[name].is_contiguous() and torch.equal(staged[name], t), name
    pool.give(buffers)
    again, event, _, _ = stage({name: t + 1 if t.is_floating_point() else t for name, t in tensors.items()}, pool,
                               group_key=key)
    event.synchronize()
    assert [t.data_ptr() for t in again.values()] == [t.data_ptr() for t in staged.values()]
    assert torch.equal(again["policy_logprobs"], step()["policy_logprobs"] + 1)


@CUDA
def test_a_step_of_cpu_and_cuda_tensors_is_written_as_it_was(tmp_path):
    tensors = step("cuda")
    tensors["rewards"] = tensors["rewards"].cpu()  # one field on the host: the per-tensor path
    _, got, _ = write_one(tmp_path / "run", tensors)
    for name, want in step().items():
        assert torch.equal(got[name].to(want.dtype), want), name
