"""``TraceWriter.record_captured``: the public entry for a step captured outside the loop's own
``record`` call (zero-edit watcher, integrations). The file holds the captured tensors, the fields
asked for in ``derive`` computed from them, the coordinates and metadata given; the schema and
coordinate rules of ``record`` apply."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from tracer.errors import SchemaError, TraceError
from tracer.format.names import STEPS_DIR, step_file_name
from tracer.read import Trace
from tracer.record import CapturedStep, TraceWriter


def _fields():
    policy = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -3.0]])
    old = torch.tensor([[-1.5, -2.0, -0.25], [-0.1, -1.2, -3.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return {"policy_logprobs": policy, "old_logprobs": old, "completion_mask": mask}


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_captured_step_is_written_with_its_derived_ratio(tmp_path, writer):
    fields = _fields()
    with TraceWriter(tmp_path / "run", "grpo", writer=writer) as tw:
        returned = tw.record_captured(CapturedStep(
            step=2, tensors=dict(fields), inner_step=1, micro_batch=3, metadata={"epoch": 0},
            owned=frozenset({"policy_logprobs"}), derive=("ratio",)))
    assert returned is None  # a watcher wants no path: none is made
    path = tmp_path / "run" / STEPS_DIR / step_file_name(2, 1, 3, 0)
    with safe_open(str(path), "pt") as fh:
        stored = {name: fh.get_tensor(name) for name in fh.keys()}
        meta = fh.metadata()
    assert set(stored) == {"policy_logprobs", "old_logprobs", "completion_mask", "ratio"}
    # ratio = exp(policy - old), worked out per token: e.g. exp(-1.0 - -1.5) = e^0.5
    expected = [math.exp(0.5), 1.0, math.exp(-0.25), 1.0, math.exp(1.0), 1.0]
    assert stored["ratio"].flatten().tolist() == pytest.approx(expected, rel=1e-6)
    assert torch.equal(stored["policy_logprobs"], fields["policy_logprobs"])
    assert (meta["step"], meta["inner_step"], meta["micro_batch"], meta["epoch"]) == ("2", "1", "3", "0")
    trace = Trace(tmp_path / "run")
    key = trace.steps()[0]
    assert trace.derived_fields(key) == ["approx_kl_k2"]  # ratio is recorded; k2 is left to the reader


def test_a_captured_step_obeys_records_rules(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo", writer="thread") as tw:
        tw.record_captured(CapturedStep(step=0, tensors=_fields()))
        with pytest.raises(SchemaError, match="already recorded"):
            tw.record_captured(CapturedStep(step=0, tensors=_fields()))
        with pytest.raises(SchemaError, match="set by the writer"):
            tw.record_captured(CapturedStep(step=1, tensors=_fields(), metadata={"step": 5}))
        bad = {**_fields(), "old_logprobs": torch.zeros(2, 4)}
        with pytest.raises(SchemaError):
            tw.record_captured(CapturedStep(step=2, tensors=bad))
    assert tw.steps_written == 1


def test_a_captured_step_that_is_not_what_it_says_is_refused(tmp_path):
    fields = _fields()
    signature = tuple((name, t.shape, t.dtype, t.device) for name, t in fields.items())
    with TraceWriter(tmp_path / "run", "grpo", writer="thread") as tw:
        tw.record_captured(CapturedStep(step=0, tensors=dict(fields), signature=signature))  # checked in full once
        # the same names and dtypes, another T: a signature seen before must not wave these through
        wider = {**fields, "old_logprobs": torch.zeros(2, 4)}
        with pytest.raises(SchemaError, match="CapturedStep.signature does not describe its tensors"):
            tw.record_captured(CapturedStep(step=1, tensors=wider, signature=signature))
        with pytest.raises(TraceError, match="CapturedStep.tensors must be a dict"):
            tw.record_captured(CapturedStep(step=2, tensors=list(fields.items())))
        with pytest.raises(TraceError, match="CapturedStep.derive must be a tuple of field names"):
            tw.record_captured(CapturedStep(step=3, tensors=dict(fields), derive="ratio"))
        with pytest.raises(TraceError, match="CapturedStep.derive must be a tuple of field names"):
            tw.record_captured(CapturedStep(step=4, tensors=dict(fields), derive=("foo",)))
    assert tw.steps_written == 1
