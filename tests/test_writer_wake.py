"""The writer process's wake pipe (tracer.record.process.parent, tracer.record.process.child): while the child
lingers for more steps it waits on the wake pipe alone, so a step handed over then does not wake it
(a write to a pipe its reader waits on costs the training thread about twice a plain write); the
parent wakes it when the steps it holds reach what would end the linger, and for a flush."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tracer.read.reader import Trace
from tracer.record.writer import TraceWriter

from test_writer_process import _lingering_child, grpo_step

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")


def _wakes(pid: int) -> int:
    """The child's voluntary context switches so far: each wait it returns from is one."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


def test_steps_handed_over_while_the_child_lingers_do_not_wake_it(tmp_path, monkeypatch):
    batches = _lingering_child(monkeypatch)
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
    batches = _lingering_child(monkeypatch)
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
