"""The writer process's batching (the real child): the parent reads the child's results only when
due yet the bounds hold, a lingering child batches the steps it is handed (a flush, or a record
waiting for room, ends the linger), and a layout id given again never reuses stale ring views."""

from __future__ import annotations

import time
import warnings

import torch

from tracer.read import Trace
from tracer.record.writer import TraceWriter

from tests.fixtures.writer_process import grpo_step, lingering_child, process_alive


def test_record_reads_the_childs_results_only_when_due_yet_the_bounds_hold(tmp_path, monkeypatch):
    """A record reads the result pipe (a syscall) at most every RESULTS_EVERY_S, not at each step;
    a step that finds the ring's step bound reached reads it at once, so the bound holds."""
    from tracer.record.process import parent as writer_process

    polls = []
    real = writer_process.ProcessWriter.poll
    monkeypatch.setattr(writer_process.ProcessWriter, "poll", lambda self: (polls.append(1), real(self))[1])
    with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_steps=4) as writer:
        writer.record(0, grpo_step(0))
        writer.flush()
        process = writer._process
        process._polled_at = time.monotonic() + 3600  # no poll is due for the rest of the test
        polls.clear()
        for step in range(1, 4):
            writer.record(step, grpo_step(step))
        assert polls == []  # three records, no read of the result pipe
        for step in range(4, 12):  # the bound of 4 steps in flight is reached: each waits for results
            writer.record(step, grpo_step(step))
            assert len(process._inflight) <= 4
        assert polls
    assert [k.step for k in Trace(tmp_path / "p").steps()] == list(range(12))


def test_the_child_batches_the_steps_it_is_handed_and_a_flush_writes_them_at_once(tmp_path, monkeypatch):
    """Steps arriving one by one are written together (a batch's cold start is most of a small
    step's cost): none is written while the child lingers, and a flush ends the linger."""
    batches = lingering_child(monkeypatch)
    with TraceWriter(tmp_path / "p", "grpo", writer="process") as writer:
        writer.record(0, grpo_step(0))
        writer.flush()  # the child is up and has written its first batch
        assert batches == [1]
        for step in range(1, 17):
            writer.record(step, grpo_step(step))
            writer._process.poll()
        time.sleep(0.5)  # the child has read them all by now, and lingers
        writer._process.poll()
        assert batches == [1] and len(list((tmp_path / "p").rglob("*.safetensors"))) == 1
        writer.flush()
        assert batches == [1, 16]
    assert [k.step for k in Trace(tmp_path / "p").steps()] == list(range(17))


def test_a_record_waiting_for_room_makes_a_lingering_child_write(tmp_path, monkeypatch):
    """A step that finds no room in the ring while the child lingers over a small one (less than
    half the bounds in hand, so it would linger on) tells the child to hurry: it writes what it
    holds and frees the room, instead of the record waiting out the linger, or the stall limit
    that would kill the child and warn."""
    from tracer.record.process.pipe import ALIGN, RingLayout

    batches = lingering_child(monkeypatch)
    big = grpo_step(2, B=16, T=64)
    ring = RingLayout(0, big, "float32").size + ALIGN  # the big step fits only in an empty ring
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stall warning (the child taken for hung) fails the test
        with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_bytes=ring, writer_stall_s=5,
                         strict=True) as writer:
            writer.record(0, grpo_step(0))
            writer.flush()
            pid = writer._process.pid
            writer.record(1, grpo_step(1))  # the child lingers over it
            writer.record(2, big)  # no room behind step 1: waits for the child to write it
            assert batches[:2] == [1, 1] and writer._process.dead is None and process_alive(pid)
    assert [k.step for k in Trace(tmp_path / "p").steps()] == [0, 1, 2]


def test_a_layout_id_given_again_never_reuses_the_views_of_the_layout_it_replaces(tmp_path, monkeypatch):
    """Past MAX_LAYOUTS the next id is given to each new layout in turn; the ring views cached for
    an id (in the parent and in the child) must not serve the next layout of that id."""
    from tracer.record.process import parent as writer_process

    monkeypatch.setattr(writer_process, "MAX_LAYOUTS", 1)
    shapes = [(4, 6), (2, 6), (3, 5), (2, 6), (4, 3), (3, 5)]
    recorded = {}
    with TraceWriter(tmp_path / "p", "grpo", writer="process", strict=True) as writer:
        for step, (B, T) in enumerate(shapes):
            recorded[step] = grpo_step(step, B, T)
            writer.record(step, recorded[step])
            writer.flush()  # each step at the ring's start: the same (id, offset) every time
    trace = Trace(tmp_path / "p")
    assert [k.step for k in trace.steps()] == list(range(len(shapes)))
    for key in trace.steps():
        got = trace.load_step(key, derive=False)
        for name, t in recorded[key.step].items():
            assert torch.equal(got[name].to(t.dtype), t), (key.step, name)
