"""The writer process's lingering child (tracer.record.process.child) never holds ring room a record needs,
and never lingers under a bound of one to three steps; a flush right after a record, and a close
with steps lingered over. From the seventh adversarial review (the child that lingers for more
steps, is hurried by a record waiting for room): real child processes, real shared memory, real
files, the steps written checked as exact lists with exact values."""

from __future__ import annotations

import os
import signal
import warnings

import pytest

from tracer.read import Trace
from tracer.record.writer import TraceWriter
from tracer.record.process.pipe import ALIGN, RingLayout

from tests.fixtures.writer_process import grpo_step, lingering_child, process_alive, read_manifest
from tests.fixtures.writer_linger import assert_steps, poll_until, tiny_step


# -- the linger never holds ring room a record needs -------------------------------------------------


def test_a_lingering_child_leaves_room_for_small_padded_steps_under_drop(tmp_path, monkeypatch):
    """Steps of many small fields take far more ring room (each field on a 64-byte boundary) than
    their bytes: a ring of 4 such steps holds 4 x 100 bytes. A child that lingers until half the
    ring's bytes are its steps' own bytes would hold all 4 and make the 5th drop (when_full="drop"),
    although it writes in a moment whatever it is given; it must stop lingering once half the
    ring's room is held, so that every step finds room once the child has written."""
    lingering_child(monkeypatch)  # only the bounds end a linger
    size = RingLayout(0, tiny_step(0), "float32").size
    assert size == 7 * ALIGN
    ring = 4 * size
    expected = {}
    with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_bytes=ring, when_full="drop") as writer:
        writer.record(0, tiny_step(0))
        writer.flush()
        expected[0] = tiny_step(0)
        process = writer._process
        for step in range(1, 13):
            assert writer.record(step, tiny_step(step)) is not None, step
            expected[step] = tiny_step(step)
            # the next step finds room once the child has done what it does without being told
            assert poll_until(lambda: process._place(size) is not None, process, 5.0), step
        assert writer.dropped_steps == 0
    assert_steps(tmp_path / "p", expected)
    assert (read_manifest(tmp_path / "p")["steps_written"], read_manifest(tmp_path / "p")["dropped_steps"]) == (13, 0)


def test_a_step_dropped_for_want_of_room_ends_the_linger_so_the_next_finds_room(tmp_path, monkeypatch):
    """when_full="drop" never waits: a large step finding the ring held by a lingering child's small
    one is dropped. The child is told to hurry all the same, so that the steps after it are not
    dropped too for as long as the linger lasts: once the child has written, the next large step
    finds room (before 94be6fc the child wrote each step at once)."""
    lingering_child(monkeypatch)
    big = {step: grpo_step(step, B=16, T=64) for step in (2, 3)}
    size = RingLayout(0, big[2], "float32").size
    ring = size + ALIGN  # the big step fits only in an empty ring
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the drop's warning
        with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_bytes=ring, when_full="drop") as writer:
            writer.record(0, grpo_step(0))
            writer.flush()
            process = writer._process
            writer.record(1, grpo_step(1))  # the child lingers over it
            assert writer.record(2, big[2]) is None and writer.dropped_steps == 1
            assert poll_until(lambda: process._place(size) is not None, process, 5.0)
            assert writer.record(3, big[3]) is not None
    assert_steps(tmp_path / "p", {0: grpo_step(0), 1: grpo_step(1), 3: big[3]})
    manifest = read_manifest(tmp_path / "p")
    assert (manifest["steps_written"], manifest["dropped_steps"]) == (3, 1)
    assert [reason.startswith("step 2: queue full") for reason in manifest["drop_reasons"]] == [True]


def test_a_child_stopped_under_drop_is_told_to_hurry_once_not_at_every_drop(tmp_path, monkeypatch):
    """A stopped child (SIGSTOP) under when_full="drop": every record drops; the hurry the first
    drop sends is not repeated by each later one (a message per drop would fill the command pipe,
    and a full pipe makes every step drop until the child reads it)."""
    from tracer.record.process.pipe import frame

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        writer = TraceWriter(tmp_path / "d", "grpo", writer="process", max_queue_steps=1, when_full="drop")
        writer.record(0, grpo_step(0))
        writer.flush()
        process, pid = writer._process, writer._process.pid
        sent = []
        real_send = process._send
        process._send = lambda data, *args, **kwargs: (sent.append(bytes(data)), real_send(data, *args, **kwargs))[1]
        os.kill(pid, signal.SIGSTOP)
        try:
            returned = [writer.record(step, grpo_step(step)) for step in range(1, 30)]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert returned[0] is not None and returned[1:] == [None] * 28
        assert sent.count(frame({"k": "hurry"})) <= 1
        writer.close()
    assert [k.step for k in Trace(tmp_path / "d").steps()] == [0, 1]
    assert (read_manifest(tmp_path / "d")["steps_written"], read_manifest(tmp_path / "d")["dropped_steps"]) == (2, 28)


def test_a_padded_step_carried_by_the_pipe_is_never_lingered_over(tmp_path, monkeypatch):
    """A step larger than the ring travels through the pipe and cannot be rescued from the ring if
    the child dies: the child writes it at once, even one whose own bytes (100) are far fewer than
    half the ring (256): its room, padding included (448), is more than the ring."""
    batches = lingering_child(monkeypatch)
    with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_bytes=256) as writer:
        writer.record(0, grpo_step(0))  # larger than the ring too
        writer.flush()
        writer.record(1, tiny_step(1))
        assert poll_until(lambda: writer.steps_written == 2, writer._process, 5.0)
        assert batches == [1, 1]
    assert_steps(tmp_path / "p", {0: grpo_step(0), 1: tiny_step(1)})


# -- tight bounds, flush, close ----------------------------------------------------------------------


@pytest.mark.parametrize("max_steps", [1, 2, 3])
@pytest.mark.parametrize("when_full", ["block", "drop"])
def test_a_bound_of_one_to_three_steps_is_never_lingered_over(tmp_path, monkeypatch, max_steps, when_full):
    """With at most 1-3 steps in flight half the bound is at most one step: the child writes each
    step as it comes (never lingers for an hour), so a record neither waits for the linger nor,
    under drop, drops a step once the one before it is written."""
    batches = lingering_child(monkeypatch)
    with TraceWriter(tmp_path / "t", "grpo", writer="process", max_queue_steps=max_steps,
                     when_full=when_full) as writer:
        writer.record(0, grpo_step(0))
        writer.flush()
        for step in range(1, 8):
            assert writer.record(step, grpo_step(step)) is not None
            assert poll_until(lambda: writer.steps_written == step + 1, writer._process, 5.0), step
        assert writer.dropped_steps == 0 and batches == [1] * 8
    assert_steps(tmp_path / "t", {step: grpo_step(step) for step in range(8)})


def test_a_flush_right_after_each_record_and_a_close_with_steps_lingered_over(tmp_path, monkeypatch):
    """flush() right after a record returns with that step on disk; close() with 9 steps lingered
    over writes them all and marks the trace finished."""
    batches = lingering_child(monkeypatch)
    root = tmp_path / "f"
    writer = TraceWriter(root, "grpo", writer="process")
    for step in range(3):
        writer.record(step, grpo_step(step))
        writer.flush()
        assert [k.step for k in Trace(root).steps()] == list(range(step + 1))
    for step in range(3, 12):
        writer.record(step, grpo_step(step))
    writer._process.poll()
    assert batches == [1, 1, 1]
    pid = writer._process.pid
    writer.close()
    assert not process_alive(pid) and batches == [1, 1, 1, 9]
    assert_steps(root, {step: grpo_step(step) for step in range(12)})
    manifest = read_manifest(root)
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (12, 0, "finished")
