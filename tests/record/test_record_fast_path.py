"""record()'s fast path: the schema check is cached per field signature, yet every
contract holds on later records; summaries are computed on the writer thread, never the caller's."""

from __future__ import annotations

import threading
from unittest import mock

import pytest
import torch
from safetensors import safe_open

from tracer.formulas import summaries
from tracer.errors import SchemaError
from tracer.read import Trace
from tracer.record.validation import MAX_SIGNATURES
from tracer.record.writer import TraceWriter


def _step(B=4, T=5, mask_dtype=torch.bool):
    return {"completion_ids": torch.zeros(B, T, dtype=torch.int64),
            "completion_mask": torch.ones(B, T).to(mask_dtype),
            "policy_logprobs": -torch.rand(B, T), "ratio": torch.ones(B, T),
            "rewards": torch.rand(B), "advantages": torch.randn(B)}


def test_a_cached_signature_still_checks_float_mask_values_every_step(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        writer.record(0, _step(mask_dtype=torch.float32))
        bad = _step(mask_dtype=torch.float32)
        bad["completion_mask"][1, 2] = 0.5  # same names, shapes, dtypes: the signature is cached
        with pytest.raises(SchemaError, match=r"'completion_mask': a mask must hold only 0 and 1.*\[0.5\]"):
            writer.record(1, bad)
        writer.record(2, _step(mask_dtype=torch.float32))
    assert [k.step for k in Trace(tmp_path / "run").steps()] == [0, 2]


def test_a_new_signature_after_a_cached_one_gets_the_full_check(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        writer.record(0, _step())
        wrong = _step()
        wrong["rewards"] = torch.rand(3)  # B = 3 against B = 4
        with pytest.raises(SchemaError, match=r"field 'rewards': dimension B is 3, but field 'completion_ids' has B = 4"):
            writer.record(1, wrong)
        with pytest.raises(SchemaError, match=r"field 'ratio': expected a torch.Tensor, got list"):
            writer.record(2, {**_step(), "ratio": [1.0]})
        with pytest.raises(SchemaError, match=r"field 'advantages': expected a floating-point tensor"):
            writer.record(3, {**_step(), "advantages": torch.zeros(4, dtype=torch.int64)})
        writer.record(4, _step())  # the cached signature still passes
        assert len(writer._checks.signatures) == 1  # refused signatures are never cached


def test_the_signature_cache_is_bounded(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo", async_write=True) as writer:
        for step in range(MAX_SIGNATURES + 20):
            writer.record(step, _step(B=1, T=step + 1))
        assert len(writer._checks.signatures) == MAX_SIGNATURES
    assert len(Trace(tmp_path / "run").steps()) == MAX_SIGNATURES + 20


def test_source_dtype_follows_each_signature(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo", keep_source_dtype=True) as writer:
        writer.record(0, _step())
        half = _step()
        half["policy_logprobs"] = half["policy_logprobs"].to(torch.bfloat16)
        writer.record(1, half)
        writer.record(2, _step())
    trace = Trace(tmp_path / "run")
    assert [trace.metadata(k)["source_dtype"] for k in trace.steps()] == ["float32", "bfloat16,float32", "float32"]


def test_summaries_are_computed_on_the_writer_thread(tmp_path):
    threads = []
    real = summaries.compute_summaries

    def spy(steps):
        threads.extend([threading.get_ident()] * len(steps))
        return real(steps)

    with mock.patch.object(summaries, "compute_summaries", spy):
        with TraceWriter(tmp_path / "run", "grpo") as writer:
            for step in range(3):
                writer.record(step, _step())
    assert len(threads) == 3 and threading.get_ident() not in threads
    assert (Trace(tmp_path / "run").step_summary()["summary_source"] == "header").all()


def test_a_failing_summary_never_costs_the_step(tmp_path):
    with mock.patch.object(summaries, "compute_summaries", side_effect=RuntimeError("boom")):
        with TraceWriter(tmp_path / "run", "grpo") as writer:
            writer.record(0, _step())
    trace = Trace(tmp_path / "run")
    assert "summary" not in trace.metadata(trace.step_key(0))
    assert trace.step_summary()["summary_source"].tolist() == ["tensors"]


@pytest.mark.parametrize("writer_kind", ["thread", "process"])
def test_step_metadata_is_encoded_again_whenever_it_changes_even_by_type_or_in_place(tmp_path, writer_kind):
    """record() keeps the last metadata's encoding (a zero-edit capture repeats it every step); each
    file's header (read with safetensors itself) still holds that step's own values: 1, then 1.0
    and True (equal in Python, not in JSON), a NaN, a list changed in place after its step was
    recorded (the writer thread encodes later: it must not see the change), a key added."""
    listed = [1, 2]
    metas = [{"beta": 1}, {"beta": 1}, {"beta": 1.0}, {"beta": True}, {"beta": float("nan")},
             {"beta": float("nan")}, {"beta": 1, "ids": listed}, None, {"beta": 1, "ids": listed}, {"beta": 1, "x": "a"}]
    with TraceWriter(tmp_path / "run", "grpo", writer=writer_kind) as writer:
        for step, meta in enumerate(metas):
            if step == 8:
                listed.append(3)  # the same list object, changed in place since step 6
            writer.record(step, _step(), metadata=meta)
    headers = []
    for step in range(len(metas)):
        with safe_open(str(tmp_path / "run" / "steps" / f"step_{step:08d}.inner_0.mb_0.rank_0.safetensors"), "pt") as f:
            headers.append(f.metadata())
    assert [h.get("beta") for h in headers] == ["1", "1", "1.0", "true", "NaN", "NaN", "1", None, "1", "1"]
    assert [h.get("ids") for h in headers] == [None] * 6 + ["[1, 2]", None, "[1, 2, 3]", None]
    assert [h.get("x") for h in headers] == [None] * 9 + ["a"]


class _Tagged(torch.Tensor):
    """A tensor subclass running no code of its own (as a library's marker type would)."""


def test_a_tensor_subclass_is_staged_through_the_one_call_group_copy(tmp_path):
    """From the second record on, a known all-CPU signature is copied in one ``_foreach_copy_``
    into a buffer group; a tensor subclass among the sources must not make torch rebuild the
    group's own list type (it raised TypeError, and every later step was dropped)."""
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        for step in range(3):
            tensors = _step()
            tensors["old_logprobs"] = (tensors["policy_logprobs"] - 0.5).as_subclass(_Tagged)
            writer.record(step, tensors)
    trace = Trace(tmp_path / "run")
    assert [k.step for k in trace.steps()] == [0, 1, 2]
    step = trace.load_step(trace.steps()[2])
    torch.testing.assert_close(step["old_logprobs"], step["policy_logprobs"] - 0.5)


@pytest.mark.parametrize("writer_kind", ["thread", "process"])
def test_metadata_equal_in_python_but_not_in_json_is_never_taken_from_the_last_step(tmp_path, writer_kind):
    """-0.0 == 0.0 (same type) and {True: ..} has the same keys as {1: ..} in Python, yet JSON and
    the header tell them apart: each file's header (read with safetensors) holds its own step's."""
    metas = [{"beta": 0.0}, {"beta": -0.0}, {"beta": -0.0}, {"beta": 0.0}, {1: "a"}, {True: "a"}, {1.0: "a"}]
    with TraceWriter(tmp_path / "run", "grpo", writer=writer_kind) as writer:
        for step, meta in enumerate(metas):
            writer.record(step, _step(), metadata=meta)
    headers = []
    for step in range(len(metas)):
        with safe_open(str(tmp_path / "run" / "steps" / f"step_{step:08d}.inner_0.mb_0.rank_0.safetensors"), "pt") as f:
            headers.append(f.metadata())
    assert [h.get("beta") for h in headers[:4]] == ["0.0", "-0.0", "-0.0", "0.0"]
    assert [sorted(set(h) & {"1", "True", "1.0"}) for h in headers[4:]] == [["1"], ["True"], ["1.0"]]


@pytest.mark.parametrize("writer_kind", ["thread", "process"])
def test_an_int_too_long_for_json_is_a_schema_error_every_time(tmp_path, writer_kind):
    """An int of more digits than Python converts to text (sys.get_int_max_str_digits, 4300) is
    refused like any other non-JSON value, naming the key, at each record; the writer goes on."""
    with TraceWriter(tmp_path / "run", "grpo", writer=writer_kind) as writer:
        writer.record(0, _step(), metadata={"seed": 7})
        for step in (1, 2):
            with pytest.raises(SchemaError, match="metadata key 'seed'"):
                writer.record(step, _step(), metadata={"seed": 10 ** 5000})
        writer.record(3, _step(), metadata={"seed": 7})
    assert [k.step for k in Trace(tmp_path / "run").steps()] == [0, 3]
