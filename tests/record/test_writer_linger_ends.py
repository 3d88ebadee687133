"""The writer process's child killed (SIGKILL), stopped (SIGSTOP) or orphaned while it lingers over
steps, waits on a lingering child that raise no stall false alarm, and a writer dropped without
close(): every step written, none twice. From the seventh adversarial review (the child that
lingers for more steps): real child processes, real shared memory, real files, the steps written
checked as exact lists with exact values."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from tracer.record.writer import TraceWriter
from tracer.record.process.pipe import ALIGN, RingLayout

from tests.fixtures.paths import REPO
from tests.fixtures.writer_linger import assert_steps
from tests.fixtures.writer_process import grpo_step, lingering_child, process_alive, read_manifest, wait_gone


# -- the child killed, stopped or orphaned while it lingers --------------------------------------------


def test_a_child_killed_while_it_lingers_loses_no_step_and_writes_none_twice(tmp_path, monkeypatch):
    """Steps 1-5 read by the child, which lingers over them (nothing written); SIGKILL: they are
    still in the ring, rescued and written by the thread, each once, with its own values; the
    loop changed its tensors after each record."""
    batches = lingering_child(monkeypatch)
    expected = {0: grpo_step(0)}
    writer = TraceWriter(tmp_path / "k", "grpo", writer="process")
    writer.record(0, grpo_step(0))
    writer.flush()
    for step in range(1, 6):
        tensors = grpo_step(step)
        expected[step] = {n: t.clone() for n, t in tensors.items()}
        writer.record(step, tensors)
        for t in tensors.values():
            t.zero_() if t.dtype != torch.bool else t.logical_not_()
    time.sleep(0.3)  # the child has read them (if not, they are in the ring all the same)
    writer._process.poll()
    assert batches == [1]
    pid = writer._process.pid
    os.kill(pid, signal.SIGKILL)
    with pytest.warns(RuntimeWarning, match=r"killed by signal 9 \(SIGKILL\); the 5 step\(s\) it had not written"):
        writer.flush()
    writer.record(6, grpo_step(6))
    expected[6] = grpo_step(6)
    writer.close()
    assert_steps(tmp_path / "k", expected)
    lines = (tmp_path / "k" / "summary_index.rank_0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines[1:]] == list(range(7))
    manifest = read_manifest(tmp_path / "k")
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (7, 0, "finished")
    assert manifest["capture"]["writer"] == "process, then thread"


def test_a_child_stopped_while_it_lingers_is_taken_for_stalled_and_its_steps_rescued(tmp_path, monkeypatch):
    """The child lingers over steps 1-3, then is stopped (SIGSTOP): flush() hurries it, hears nothing
    for the stall limit (1 s), kills it and the thread writes the 3 steps."""
    lingering_child(monkeypatch)
    writer = TraceWriter(tmp_path / "s", "grpo", writer="process", writer_stall_s=1.0)
    writer.record(0, grpo_step(0))
    writer.flush()
    for step in range(1, 4):
        writer.record(step, grpo_step(step))
    time.sleep(0.3)
    pid = writer._process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.warns(RuntimeWarning, match=rf"pid {pid}\) made no progress for .* while flush\(\) waited .*"
                                                r"holding 3 step\(s\) not yet written \(steps 1 to 3"):
            writer.flush()
    finally:
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)
    writer.close()
    assert_steps(tmp_path / "s", {step: grpo_step(step) for step in range(4)})
    manifest = read_manifest(tmp_path / "s")
    assert (manifest["steps_written"], manifest["dropped_steps"]) == (4, 0)


def test_waits_on_a_lingering_child_raise_no_stall_false_alarm(tmp_path, monkeypatch):
    """A child lingering (for an hour) is quiet, yet every wait hurries it: a flush, a record
    waiting for room, a step larger than the ring and close() all get their answer well within a
    stall limit of 1 s (a false alarm would warn; warnings are errors here)."""
    batches = lingering_child(monkeypatch)
    big = grpo_step(2, B=16, T=64)
    ring = RingLayout(0, big, "float32").size + ALIGN
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with TraceWriter(tmp_path / "q", "grpo", writer="process", max_queue_bytes=ring, writer_stall_s=1.0,
                         strict=True) as writer:
            for step in range(12):
                tensors = big if step % 4 == 2 else grpo_step(step, B=64, T=200) if step % 4 == 3 else grpo_step(step)
                expected[step] = tensors
                writer.record(step, tensors)  # steps 3, 7, 11 are larger than the ring
                if step % 5 == 0:
                    time.sleep(1.2)  # longer than the stall limit, lingering
                    writer.flush()
            pid = writer._process.pid
            assert writer.writer == "process"
    assert not process_alive(pid) and sum(batches) == 12
    assert_steps(tmp_path / "q", expected)
    assert read_manifest(tmp_path / "q")["capture"]["writer"] == "process"


_ORPHAN = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from tests.fixtures.writer_process import grpo_step
from tracer.record.writer import TraceWriter
real = TraceWriter._child_config
TraceWriter._child_config = lambda self: {{**real(self), "linger_s": 3600.0}}  # only the bounds end a linger
writer = TraceWriter({root!r}, "grpo", writer="process")
writer.record(0, grpo_step(0))
writer.flush()
for step in range(1, 8):
    writer.record(step, grpo_step(step))
time.sleep(0.3)  # the child lingers over steps 1-7
print(writer._process.pid, flush=True)
{end}
"""


@pytest.mark.parametrize("end", ["os.kill(os.getpid(), signal.SIGKILL)", "os._exit(0)", "pass"])
def test_the_training_process_ending_while_the_child_lingers_leaves_every_step_written(tmp_path, end):
    """The training process is SIGKILLed, leaves with os._exit (no close, no atexit) or simply ends
    (the atexit hook closes the writer) while the child lingers over 7 steps: the child writes them
    all and exits; only a clean exit marks the trace finished."""
    script = tmp_path / "loop.py"
    script.write_text(_ORPHAN.format(repo=str(REPO), root=str(tmp_path / "run"), end=end))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    child = int(proc.stdout.readline())
    proc.wait(timeout=60)
    assert wait_gone(child, 30), "the writer process outlived its parent"
    assert_steps(tmp_path / "run", {step: grpo_step(step) for step in range(8)})
    lines = (tmp_path / "run" / "summary_index.rank_0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines[1:]] == list(range(8))
    manifest = read_manifest(tmp_path / "run")
    assert manifest["steps_written"] == 8
    assert manifest["status"] == ("finished" if end == "pass" else "running")

def test_a_writer_dropped_without_close_ends_the_linger_and_every_step_is_written(tmp_path, monkeypatch):
    """A TraceWriter the program drops without close(): its finaliser closes the command pipe; the
    child lingering over steps 1-5 sees the pipe's end, writes them and exits."""
    import gc

    lingering_child(monkeypatch)
    writer = TraceWriter(tmp_path / "g", "grpo", writer="process")
    for step in range(6):
        writer.record(step, grpo_step(step))
        if step == 0:
            writer.flush()
    child = writer._process._child
    del writer
    gc.collect()
    assert child.wait(timeout=30) == 0
    assert_steps(tmp_path / "g", {step: grpo_step(step) for step in range(6)})
    assert read_manifest(tmp_path / "g")["steps_written"] == 6
