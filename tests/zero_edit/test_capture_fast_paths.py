"""The shortcuts the zero-edit capture and the writer process take at every backward  give what the long way gives: rows by ``index_select`` are ``value[index]``, a
layout found by the signature tuple's identity is the layout of that step's own fields (another
``derive`` or source dtype with the same tuple is another layout), a record that asks for no path
still writes its file, the metadata's header size is checked on every step, and the call-site and
code-variable caches keyed by a code object's identity keep each code object's own entry."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer.errors import SchemaError
from tracer.zero_edit.frame_lookup import _MISSING, _as_int, code_variables, take_rows
from tracer.read import Trace
from tracer.record.writer import TraceWriter

from tests.fixtures.writer_process import grpo_step


# -- rows by index_select ------------------------------------------------------------------------


def _indexing(value: torch.Tensor, index: torch.Tensor):
    """``value[index]``, or _MISSING where indexing refuses it: what take_rows must give."""
    try:
        return value[index]
    except (IndexError, RuntimeError):
        return _MISSING


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(0, 3), picks=st.lists(st.integers(-8, 8), max_size=6),
       dtype=st.sampled_from([torch.float32, torch.int64, torch.bool, torch.bfloat16]),
       index_dtype=st.sampled_from([torch.int64, torch.int32]), column_view=st.booleans())
def test_take_rows_is_indexing_for_any_rows_in_or_out_of_range(rows, cols, picks, dtype, index_dtype, column_view):
    """Rows in range, negative rows (counted from the end), rows out of range (no rows: _MISSING),
    no rows, an int32 index (indexing's own path), a non-contiguous value: the same values, dtype
    and shape as ``value[index]``, or _MISSING exactly where indexing refuses."""
    value = (torch.arange(rows * (cols + 1) * 2).reshape(rows, cols + 1, 2) % 5).to(dtype)
    if column_view:
        value = value[:, :, 1]  # strided: a column of a wider tensor
    index = torch.tensor(picks, dtype=index_dtype)
    got, want = take_rows(value, index), _indexing(value, index)
    if want is _MISSING:
        assert got is _MISSING
    else:
        assert got is not _MISSING and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_take_rows_gives_no_rows_of_a_0_d_tensor_or_a_non_tensor():
    assert take_rows(torch.tensor(3.0), torch.tensor([0])) is _MISSING  # index_select would take it
    assert take_rows([1, 2, 3], torch.tensor([0])) is _MISSING


def test_as_int_refuses_what_has_no_index_and_reads_what_has_one():
    class Counter:
        def __index__(self):
            return 7

    assert [_as_int(v) for v in (len, "3", 3.0, None, True, _MISSING)] == [None] * 6
    assert [_as_int(v) for v in (3, Counter(), torch.tensor(4))] == [3, 7, 4]


# -- the writer process: the layout by the signature's identity ---------------------------------


def _signature(tensors: dict[str, torch.Tensor]) -> tuple:
    return tuple((n, t.shape, t.dtype, t.device) for n, t in tensors.items())


def test_one_signature_tuple_with_another_derive_or_source_dtype_is_another_layout(tmp_path):
    """The same tuple object given for every step (as a call-site plan gives it): a step that asks
    the child to derive ratio gets a ratio field, the next one that asks for none gets none, and a
    step whose source dtype changes (bfloat16 policy logprobs, stored as float32) is recorded as
    such: each step's layout is its own, not the last one's."""
    from tracer.formulas import ratio

    steps = [grpo_step(s) for s in range(4)]
    steps[3]["policy_logprobs"] = steps[3]["policy_logprobs"].to(torch.bfloat16)
    shared = _signature(steps[0])
    with TraceWriter(tmp_path / "s", "grpo", writer="process") as writer:
        writer._record(0, steps[0], derive=("ratio",), signature=shared, path_wanted=False)
        writer._record(1, steps[1], signature=shared, path_wanted=False)
        writer._record(2, steps[2], derive=("ratio",), signature=shared, path_wanted=False)
        writer._record(3, steps[3], derive=("ratio",), signature=_signature(steps[3]), path_wanted=False)
        assert writer.writer == "process"
    trace = Trace(tmp_path / "s")
    keys = trace.steps()
    assert [k.step for k in keys] == [0, 1, 2, 3]
    loaded = [trace.load_step(k, derive=False) for k in keys]
    assert ["ratio" in t for t in loaded] == [True, False, True, True]
    for s in (0, 2):
        assert torch.equal(loaded[s]["ratio"], ratio(steps[s]["policy_logprobs"], steps[s]["old_logprobs"]))
    assert [trace.metadata(k)["source_dtype"] for k in keys] == ["float32"] * 3 + ["bfloat16,float32"]
    for s in range(3):
        assert torch.equal(loaded[s]["policy_logprobs"], steps[s]["policy_logprobs"])


def test_a_record_that_asks_for_no_path_returns_none_and_writes_its_file(tmp_path):
    with TraceWriter(tmp_path / "p", "grpo", writer="process") as writer:
        assert writer._record(0, grpo_step(0), path_wanted=False) is None
        returned = writer.record(1, grpo_step(1))
    assert returned == tmp_path / "p" / "steps" / "step_00000001.inner_0.mb_0.rank_0.safetensors"
    assert [k.step for k in Trace(tmp_path / "p").steps()] == [0, 1]


def test_metadata_too_large_for_a_header_raises_at_every_step_that_carries_it(tmp_path):
    """The header size is remembered with the metadata's encoding: the same oversized metadata
    raises again at the next step, and metadata that shrinks back is recorded."""
    big = {"note": "x" * (4 * 2**20 + 1)}  # over MAX_METADATA_BYTES
    with TraceWriter(tmp_path / "m", "grpo", writer="thread") as writer:
        writer.record(0, grpo_step(0), metadata={"note": "small"})
        for step in (1, 2):
            try:
                writer.record(step, grpo_step(step), metadata=big)
            except SchemaError as err:
                assert "exceeds" in str(err)
            else:
                raise AssertionError(f"step {step}: oversized metadata was recorded")
        writer.record(3, grpo_step(3), metadata={"note": "small"})
    trace = Trace(tmp_path / "m")
    assert [k.step for k in trace.steps()] == [0, 3]


# -- caches keyed by a code object's identity ---------------------------------------------------


def test_code_variables_are_each_code_objects_own():
    source = "def f(a):\n    b = a\n    return b\n"
    one, two = {}, {}
    exec(compile(source, "<one>", "exec"), one)  # noqa: S102  (fixed source)
    exec(compile(source.replace("b", "c"), "<two>", "exec"), two)  # noqa: S102
    assert code_variables(one["f"].__code__) == {"a", "b"}
    assert code_variables(two["f"].__code__) == {"a", "c"}
    assert code_variables(one["f"].__code__) == {"a", "b"}  # the cached entry
