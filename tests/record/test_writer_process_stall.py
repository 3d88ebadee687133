"""A writer process that stalls (SIGSTOP: the real child, stopped) never hangs the training script:
after ``writer_stall_s`` seconds of a wait that hears nothing from it, ``flush``,
``close`` or a ``record`` waiting for room warns naming the child's pid, its state and the steps it
holds, kills it, and a thread of the training process writes those steps (and every later one):
each file holds its own step's values and the counts are exact. Strict mode raises a TraceError
saying so, after the steps are written. A child stopped for less than the limit is waited for."""

from __future__ import annotations

import json
import os
import signal
import threading
import warnings

import pytest

from tracer.cli import main
from tracer.errors import TraceError
from tracer.read import Trace
from tracer.record.writer import TraceWriter

import torch

from tests.fixtures.writer_process import process_alive, stopped_with_steps_in_flight
from tests.fixtures.writer_process import healthy_grpo_step as grpo_step


@pytest.fixture
def watchdog():
    """Kills the stopped child after 120 s, so that a writer that waits forever fails the test
    (its warning then names SIGKILL, not a stall) instead of hanging the suite."""
    timers = []

    def arm(pid: int) -> None:
        timer = threading.Timer(120, lambda: process_alive(pid) and os.kill(pid, signal.SIGKILL))
        timer.daemon = True
        timer.start()
        timers.append(timer)

    yield arm
    for timer in timers:
        timer.cancel()


def _assert_written_by_thread(root, steps: list[int], pid: int) -> dict:
    trace = Trace(root)
    assert [k.step for k in trace.steps()] == steps
    for key in trace.steps():
        torch.testing.assert_close(trace.load_step(key)["policy_logprobs"], grpo_step(key.step)["policy_logprobs"])
    assert trace.step_summary()["step"].tolist() == steps
    manifest = json.loads((root / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (len(steps), 0, "finished")
    assert manifest["capture"]["writer"] == "process, then thread"
    assert manifest["capture"]["writer_process_exit"].startswith(f"the writer process (pid {pid}) made no progress")
    assert not process_alive(pid)  # killed, and reaped
    assert main(["check", str(root)]) == 0
    return manifest


@pytest.mark.parametrize("call", ["close", "flush"])
def test_close_or_flush_with_a_stopped_child_warns_and_writes_every_step(tmp_path, call, monkeypatch, watchdog):
    """Steps 1-3 handed to the child, then SIGSTOP: the wait of close() (or flush()) hears nothing
    for the limit (2 s: set by writer_stall_s, or for flush by the TRACER_WRITER_STALL_S variable)."""
    if call == "flush":
        monkeypatch.setenv("TRACER_WRITER_STALL_S", "2")
        options = {}
    else:
        options = {"writer_stall_s": 2.0}
    writer, pid = stopped_with_steps_in_flight(tmp_path / "k", range(1, 4), **options)
    watchdog(pid)
    expected = (rf"writer process \(pid {pid}\) made no progress for [23]\.\d s while {call}\(\) waited for it "
                r"\(stopped \(T\); holding 3 step\(s\) not yet written \(steps 1 to 3, \d+ bytes\); stall limit 2 s.*"
                r"and was killed; the 3 step\(s\) it had not written and all later steps are written by a thread")
    with pytest.warns(RuntimeWarning, match=expected):
        getattr(writer, call)()
    if call == "flush":  # flush() waited for the rescued steps too
        assert [k.step for k in Trace(tmp_path / "k").steps()] == [0, 1, 2, 3]
        writer.record(4, grpo_step(4))  # the thread goes on
    writer.close()
    _assert_written_by_thread(tmp_path / "k", [0, 1, 2, 3] + ([4] if call == "flush" else []), pid)


def test_a_child_in_the_kernels_io_sleep_is_busy_not_stalled(tmp_path, monkeypatch, watchdog):
    """A child in uninterruptible sleep (state D: the kernel doing its I/O, an fsync on a slow disk or
    an NFS server that may recover) uses no CPU and sends nothing, yet is not stalled: the wait goes
    on while /proc says D (here for 3.5 s of a 2 s limit: the real child is stopped, its state read as
    D), and only a quiet limit after that is it declared stalled."""
    import time

    from tracer.record.process import lifecycle as writer_lifecycle

    real = writer_lifecycle._activity
    until = [float("inf")]

    def in_io_sleep(pid):
        found = real(pid)
        return ("D", found[1]) if found and time.monotonic() < until[0] else found

    monkeypatch.setattr(writer_lifecycle, "_activity", in_io_sleep)
    writer, pid = stopped_with_steps_in_flight(tmp_path / "k", range(1, 4), writer_stall_s=2.0)
    watchdog(pid)
    t0 = time.monotonic()
    until[0] = t0 + 3.5
    with pytest.warns(RuntimeWarning, match=rf"pid {pid}\) made no progress for [23]\.\d s while flush\(\)"):
        writer.flush()
    assert time.monotonic() - t0 >= 3.5 + 2.0 - 2 * writer_lifecycle.POLL_S  # the last D seen, a poll before 3.5 s
    writer.close()
    _assert_written_by_thread(tmp_path / "k", [0, 1, 2, 3], pid)


def test_a_record_waiting_for_room_in_the_ring_of_a_stopped_child_goes_on(tmp_path, watchdog):
    """when_full="block", 2 steps in flight at most: steps 1 and 2 fill the queue of the stopped
    child; record(3) waits for room, hears nothing for 2 s: it warns, steps 1 and 2 are rescued and
    step 3 itself is written by the thread."""
    writer, pid = stopped_with_steps_in_flight(tmp_path / "k", range(1, 3), max_queue_steps=2, writer_stall_s=2.0)
    watchdog(pid)
    with pytest.warns(RuntimeWarning, match=rf"pid {pid}\) made no progress .* while record\(\) of step 3, for room "
                                            r"in the ring waited .*holding 2 step\(s\)"):
        writer.record(3, grpo_step(3))
    assert writer.writer == "thread"
    writer.record(4, grpo_step(4))
    writer.close()
    _assert_written_by_thread(tmp_path / "k", [0, 1, 2, 3, 4], pid)


@pytest.mark.parametrize("call", ["close", "flush"])
def test_strict_mode_raises_a_stall_once_the_steps_are_written(tmp_path, call, watchdog):
    writer, pid = stopped_with_steps_in_flight(tmp_path / "s", range(1, 4), strict=True, writer_stall_s=2.0)
    watchdog(pid)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TraceError, match=rf"writing .* failed: the writer process \(pid {pid}\) made no progress "
                                             r"for .* while " + call + r"\(\) waited .*holding 3 step\(s\).*and was "
                                             "killed; its steps were written by a thread instead"):
            getattr(writer, call)()
    writer.close()  # raised once: nothing more to raise
    _assert_written_by_thread(tmp_path / "s", [0, 1, 2, 3], pid)


def test_a_child_stopped_for_less_than_the_limit_is_waited_for(tmp_path, watchdog):
    """No false alarm: the child is stopped for 0.5 s of a 5 s limit, and a flush() made while it
    starts up (importing torch) waits for it however long that takes: no warning, the child
    writes every step."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        starting = TraceWriter(tmp_path / "start", "grpo", writer="process", writer_stall_s=0.2)
        starting.record(0, grpo_step(0))
        starting.flush()
        starting.close()
        writer, pid = stopped_with_steps_in_flight(tmp_path / "k", range(1, 4), writer_stall_s=5.0)
        watchdog(pid)
        threading.Timer(0.5, os.kill, (pid, signal.SIGCONT)).start()
        writer.flush()
        assert writer.writer == "process"
        writer.close()
    for root, steps in ((tmp_path / "start", [0]), (tmp_path / "k", [0, 1, 2, 3])):
        manifest = json.loads((root / "manifest.json").read_text())
        assert (manifest["steps_written"], manifest["capture"]["writer"]) == (len(steps), "process")
        assert [k.step for k in Trace(root).steps()] == steps


@pytest.mark.parametrize("value", [0, -1, float("nan"), "soon"])
def test_a_stall_limit_that_is_not_a_positive_number_is_refused(tmp_path, value, monkeypatch):
    with pytest.raises(TraceError, match=rf"writer_stall_s={value!r} is not a number of seconds > 0"):
        TraceWriter(tmp_path / "a", "grpo", writer="process", writer_stall_s=value)
    monkeypatch.setenv("TRACER_WRITER_STALL_S", str(value))
    with pytest.raises(TraceError, match=rf"TRACER_WRITER_STALL_S='{value}' is not a number of seconds > 0"):
        TraceWriter(tmp_path / "b", "grpo", writer="process")
