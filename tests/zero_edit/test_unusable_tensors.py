"""Zero-edit capture (tracer/zero_edit/frames.py, tracer/zero_edit/frame_lookup.py) of tensors no field can
take: nested, jagged, sparse, meta, quantized tensors and subclasses with their own ``__torch_function__``
are rejected candidates (left out with a warning, the step traced), never a failed step; a subclass
running no code of its own and logprobs kept in float8 are recorded.

The loops are hand-written and unmodified (no tracing code in them); the plan tests run each loop twice
(tests/fixtures/site_plans.py's ``assert_same_runs``: with call-site plans, each plan's capture also
compared with a full read, and with plans off), and the values asserted are worked out by hand."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import tracer
from tracer import Trace

from tests.fixtures.site_plans import assert_same_runs, run_in


# -- a tensor no field can take is a rejected candidate, never a failed step -------------------------

class Refusing(torch.Tensor):
    """A tensor subclass whose every torch operation raises, attribute reads included (as a wrapper tensor
    of some framework does for what it does not support)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"Refusing does not support {getattr(func, '__name__', func)}")


class Tagged(torch.Tensor):
    """A subclass running no code of its own (no __torch_function__ / __torch_dispatch__): a tensor."""


def odd(kind: str, like: torch.Tensor) -> torch.Tensor:
    """``like``'s values as a tensor of ``kind``."""
    like = like.detach()
    rows = list(like.reshape(like.shape[0], -1)) if like.dim() else [like.reshape(1)]
    if kind == "nested":  # strided layout: its shape cannot be read at all
        return torch.nested.nested_tensor(rows)
    if kind == "jagged":  # a tensor subclass of torch.nested
        return torch.nested.nested_tensor(rows, layout=torch.jagged)
    if kind == "sparse":
        return like.to_sparse()
    if kind == "meta":
        return torch.empty(like.shape, dtype=like.dtype, device="meta")
    if kind == "quantized":
        return torch.quantize_per_tensor(like.float(), 0.1, 0, torch.qint8)
    if kind == "refusing":
        return like.as_subclass(Refusing)
    assert kind == "zero_d"  # one float where rows are expected
    return like.float().flatten()[0]


# kind -> what the rejection says (zero_d: the schema's shape rule), whether a 1-element one has a value
KINDS = {
    "nested": ("got a nested tensor (torch.nested)", False),
    "jagged": ("got a nested tensor (torch.nested)", False),
    "sparse": ("got a torch.sparse_coo tensor", True),
    "meta": ("got a tensor on the meta device, which holds no values", False),
    "quantized": ("got a quantized tensor (torch.qint8)", True),
    "refusing": ("got a tensor subclass (" + __name__ + ".Refusing) with its own __torch_function__", False),
    "zero_d": ("got []", True),
}
ODD_STEPS = (False, True, True, False)


def odd_loop(kind: str) -> None:
    """A GRPO-style loop with MiniMind's names and no step index; at steps 1 and 2 every mapped variable
    but ``per_token_logps`` holds ``kind``: a first policy candidate ``mb_resp_logp``, the old logprobs,
    the mask, the advantages and metadata ``beta`` (one element)."""
    weight = torch.nn.Parameter(torch.zeros(2, 3, 5))  # never stepped: every logprob is log(1/5)
    completion_ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    for odd_step in ODD_STEPS:
        per_token_logps = weight.log_softmax(-1).gather(2, completion_ids.unsqueeze(-1)).squeeze(-1)  # [2, 3]
        old_per_token_logps = per_token_logps.detach() - 0.5  # ratio e^0.5
        completion_mask = completion_ids != 0
        advantages = torch.tensor([1.0, -1.0])
        mb_resp_logp, beta = None, 0.1
        if odd_step:
            mb_resp_logp, old_per_token_logps = odd(kind, per_token_logps), odd(kind, old_per_token_logps)
            completion_mask, advantages = odd(kind, completion_mask), odd(kind, advantages)
            beta = odd(kind, torch.tensor([0.1]))
        objective = -(per_token_logps * (completion_ids != 0)).sum()
        objective.backward()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_tensor_no_field_can_take_is_left_out_with_a_warning_and_the_step_traced(kind, tmp_path):
    """Before: a nested tensor's shape raised RuntimeError in the schema check (every step failed), a sparse
    or meta one failed the writer's staging (every step dropped), a quantized or sparse mask failed the mask
    value check, a subclass's own operations raised, a meta tensor's ``.item()`` raised for ``beta``."""
    why, has_value = KINDS[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "nested tensors are a prototype"
        planned = assert_same_runs(lambda w: run_in(w, lambda: odd_loop(kind)), tmp_path, algo="grpo")
    assert (planned.steps_recorded, planned.failures, planned.writer.dropped_steps) == (4, 0, 0)
    assert planned.plans.hits == 2  # step 2 by step 1's plan, step 3 by step 0's: both replay the rejections
    rejected = {key: message for (key, _), message in planned.rejected.items()}
    assert sorted(planned.rejected) == [("advantages", "advantages"), ("completion_mask", "completion_mask"),
                                        ("old_logprobs", "old_per_token_logps"), ("policy_logprobs", "mb_resp_logp")]
    assert all(why in message for message in rejected.values()), rejected
    trace = Trace(tmp_path / "planned")
    keys = trace.steps()
    assert [(k.step, k.inner_step, k.micro_batch) for k in keys] == [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)]
    for key, odd_step in zip(keys, ODD_STEPS):
        step = trace.load_step(key)
        assert torch.allclose(step["policy_logprobs"], torch.full((2, 3), -math.log(5)))
        assert step["completion_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
        taken = {"old_logprobs", "completion_mask", "advantages", "ratio"} & set(step)
        if odd_step:
            assert taken == set()
            assert ("beta" in trace.metadata(key)) == has_value  # a 1-element tensor's value, if it has one
        else:
            assert taken == {"old_logprobs", "completion_mask", "advantages", "ratio"}
            assert torch.allclose(step["ratio"], torch.full((2, 3), math.exp(0.5)))
            assert step["advantages"].tolist() == [1.0, -1.0] and trace.metadata(key)["beta"] == pytest.approx(0.1)


def test_a_row_index_no_field_can_take_reads_no_rows(tmp_path):
    """``old_resp_logp[inds]`` with ``inds`` a nested, meta or refusing tensor: no rows (before: the nested
    and refusing ones raised in ``row_index``); ``inds`` itself is refused as ``row_ids``; a micro-batch
    index ``mb`` of those kinds is no integer (before: the meta one raised)."""
    def loop():
        weight = torch.nn.Parameter(torch.zeros(2, 3, 5))
        old_resp_logp = torch.full((4, 3), -1.0)  # the whole rollout's: 4 rows
        for kind in ("nested", "meta", "refusing", "nested"):
            per_token_logps = weight.log_softmax(-1)[..., 0]  # [2, 3]
            inds = odd(kind, torch.tensor([[2], [0]]).flatten())
            mb = odd(kind, torch.tensor([1]))
            per_token_logps.sum().backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        planned = assert_same_runs(lambda w: run_in(w, loop), tmp_path, algo="grpo")
    assert (planned.steps_recorded, planned.failures) == (4, 0)
    assert "got a nested tensor" in planned.rejected[("row_ids", "inds")]
    trace = Trace(tmp_path / "planned")  # the whole-rollout tensor is refused too: 4 rows, B = 2
    assert not any({"old_logprobs", "row_ids"} & set(trace.fields(k)) for k in trace.steps())
    assert [(k.step, k.micro_batch) for k in trace.steps()] == [(0, 0), (1, 0), (2, 0), (3, 0)]  # mb not read


def test_a_tensor_subclass_running_no_code_of_its_own_is_recorded(tmp_path):
    def loop():
        weight = torch.nn.Parameter(torch.zeros(2, 3, 5))
        for _ in range(2):
            per_token_logps = weight.log_softmax(-1)[..., 0]
            old_per_token_logps = (per_token_logps.detach() - 0.5).as_subclass(Tagged)
            per_token_logps.sum().backward()

    planned = assert_same_runs(lambda w: run_in(w, loop), tmp_path, algo="grpo")
    assert planned.rejected == {} and planned.failures == 0
    step = Trace(tmp_path / "planned").load_step(Trace(tmp_path / "planned").steps()[1])
    assert torch.allclose(step["ratio"], torch.full((2, 3), math.exp(0.5)))  # derived from the subclass


def test_logprobs_kept_in_float8_are_recorded_and_derive_in_float32(tmp_path):
    """Old and reference logprobs a loop keeps in float8 (to save memory) pass the schema (float), but torch
    promotes no float8 dtype with float32: deriving the ratio and the KLs raised (every step failed)."""
    def loop():
        weight = torch.nn.Parameter(torch.zeros(2, 3, 5))
        for _ in range(2):
            per_token_logps = weight.log_softmax(-1)[..., 0]  # log(1/5) everywhere, float32
            old_per_token_logps = (per_token_logps.detach() - 0.5).to(torch.float8_e4m3fn)
            ref_per_token_logps = (per_token_logps.detach() + 0.25).to(torch.float8_e5m2)
            per_token_logps.sum().backward()

    planned = assert_same_runs(lambda w: run_in(w, loop), tmp_path, algo="grpo")
    assert (planned.steps_recorded, planned.failures) == (2, 0)
    trace = Trace(tmp_path / "planned")
    step = trace.load_step(trace.steps()[1])
    policy = torch.full((2, 3), -math.log(5))
    old = (policy - 0.5).to(torch.float8_e4m3fn).float()  # the values the loop holds, rounded to float8
    ref = (policy + 0.25).to(torch.float8_e5m2).float()
    assert torch.equal(step["old_logprobs"], old) and torch.equal(step["ref_logprobs"], ref)
    assert torch.allclose(step["ratio"], torch.exp(policy - old))
    assert torch.allclose(step["approx_kl_k2"], 0.5 * (policy - old) ** 2)
    assert torch.allclose(step["ref_kl_k3"], torch.exp(ref - policy) - (ref - policy) - 1)


def test_a_frame_without_policy_logprobs_names_its_tensors_even_a_nested_one(tmp_path):
    """The 'nothing traced' message lists the frame's tensors with their shapes: a nested tensor has none
    (before: reading it raised, and the backward counted as a failed capture)."""
    def evaluate():
        weight = torch.nn.Parameter(torch.zeros(2, 3))
        hidden = torch.nested.nested_tensor([torch.zeros(3), torch.zeros(2)])
        weight.sum().backward()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracer.watch(algo="grpo", out=tmp_path / "t", nothing_traced="ignore") as w:
            evaluate()
    assert (w.unmatched_calls, w.failures) == (1, 0)
    assert "tensor variables ['weight [2, 3]', \"hidden ['?: a nested tensor (torch.nested)" in w.last_unmatched
