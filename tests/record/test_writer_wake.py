"""The writer process's wake pipe (tracer.record.process.parent, tracer.record.process.child): while the child
lingers for more steps it waits on the wake pipe alone, so a step handed over then does not wake it
(a write to a pipe its reader waits on costs the training thread about twice a plain write); the
parent wakes it when the steps it holds reach what would end the linger, and for a flush, including
a flush or close left behind a full command pipe (so every way a message that must end a linger
reaches the command pipe wakes it)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest

from tracer.read import Trace
from tracer.record.process import parent as writer_process
from tracer.record.writer import TraceWriter

from tests.fixtures.writer_process import grpo_step, lingering_child

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")


def _wakes(pid: int) -> int:
    """The child's voluntary context switches so far: each wait it returns from is one."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


def test_steps_handed_over_while_the_child_lingers_do_not_wake_it(tmp_path, monkeypatch):
    batches = lingering_child(monkeypatch)
    with TraceWriter(tmp_path / "p", "grpo", writer="process") as writer:  # 128 steps: woken at 64
        writer.record(0, grpo_step(0))
        writer.flush()
        pid = writer._process.pid
        writer.record(1, grpo_step(1))  # wakes the idle child, which then lingers over it
        time.sleep(0.5)
        before = _wakes(pid)
        for step in range(2, 22):
            writer.record(step, grpo_step(step))
            time.sleep(0.02)
        woken = _wakes(pid) - before
        assert woken <= 3, woken  # before the wake pipe: at least one per step (20)
        assert batches == [1]
        writer.flush()
        assert batches == [1, 21]
    assert [k.step for k in Trace(tmp_path / "p").steps()] == list(range(22))


def test_the_parent_wakes_the_lingering_child_at_half_the_steps_bound(tmp_path, monkeypatch):
    """max_queue_steps=8: a child holding 4 steps stops lingering; it learns that it holds them only
    when the parent wakes it (its linger here is an hour)."""
    batches = lingering_child(monkeypatch)
    with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_steps=8) as writer:
        writer.record(0, grpo_step(0))
        writer.flush()
        for step in range(1, 5):
            writer.record(step, grpo_step(step))
            time.sleep(0.2)  # the child has read it and lingers, unwoken by the next ones
        deadline = time.monotonic() + 30
        while batches == [1] and time.monotonic() < deadline:
            time.sleep(0.05)
            writer._process.poll()
        assert batches == [1, 4]  # without a flush: the linger ended at 4 steps held
    assert [k.step for k in Trace(tmp_path / "p").steps()] == list(range(5))


BIG = {"note": "x" * (3 * 2**20)}  # a step frame three times the command pipe (1 MiB)


def _slow_waits(monkeypatch) -> None:
    """Each wait of the parent sleeps first (a busy training process): the child, woken because the
    pipe was full, has read what it holds and lingers again before the parent writes the rest."""
    real = writer_process.ProcessWriter._wait

    def wait(self, since, waiting):
        time.sleep(0.05)
        return real(self, since, waiting)

    monkeypatch.setattr(writer_process.ProcessWriter, "_wait", wait)


@pytest.mark.parametrize("end", ["flush", "close"])
def test_a_flush_or_close_left_behind_a_full_command_pipe_still_ends_the_linger(tmp_path, monkeypatch, end):
    """A step whose frame is larger than the command pipe (big metadata) fills it while the child
    lingers: the parent wakes the child when a write finds the pipe full, but the rest of its outbox
    (the flush or close frame with it) goes in later, by a write that finds room. Without a wake
    after that write the child lingers on with the flush unread: flush() (close()) waits for the
    linger (an hour here) until the stall rule kills the healthy child."""
    batches = lingering_child(monkeypatch)
    _slow_waits(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = TraceWriter(tmp_path / "p", "grpo", writer="process", writer_stall_s=5)
        writer.record(0, grpo_step(0))
        writer.flush()
        process = writer._process
        writer.record(1, grpo_step(1))
        time.sleep(0.3)  # the child lingers over step 1
        writer.record(2, grpo_step(2), metadata=BIG)
        if end == "flush":
            writer.flush()
            assert process.dead is None, process.dead
            assert batches == [1, 2]
        writer.close()
    assert process.dead is None, process.dead
    assert not process.stalled
    assert batches == [1, 2]
    assert not [w for w in caught if "no progress" in str(w.message)]
    assert [k.step for k in Trace(tmp_path / "p").steps()] == [0, 1, 2]
