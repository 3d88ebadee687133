"""Write faults, each pinned to the message: with ``when_full="drop"`` the training thread
never waits on the disk (no fsync, no manifest write in ``record``), strict mode raises for every
failed write and counts them all (non-strict mode counts the same), and a writer inherited through
fork() refuses the child at once."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

import tracer.record.writer as writer_module
from tracer import Trace, TraceWriter
from tracer.errors import TraceError
from tracer.format.names import MANIFEST_NAME

from tests.fixtures.toy_traces import grpo_step_tensors


# -- drops off the training thread; strict mode counts and raises every failure -----------------


def test_with_when_full_drop_record_never_touches_the_disk(tmp_path, monkeypatch):
    """Slow writes fill the queue, steps are dropped; no fsync and no manifest write happens on the
    training thread during record(), and the manifest's count is true after close()."""
    training = threading.current_thread()
    disk_on_training_thread: list[str] = []
    real_fsync, real_save, real_json = os.fsync, writer_module._save_atomic, writer_module.write_json_atomic

    def slow_fsync(fd):
        if threading.current_thread() is training:
            disk_on_training_thread.append("fsync")
        time.sleep(0.03)
        real_fsync(fd)

    def watched_json(path, payload):
        if threading.current_thread() is training:
            disk_on_training_thread.append(f"write {path.name}")
        real_json(path, payload)

    def slow_save(path, tensors, metadata, *specs):
        time.sleep(0.02)
        real_save(path, tensors, metadata, *specs)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    monkeypatch.setattr(writer_module, "_save_atomic", slow_save)
    monkeypatch.setattr(writer_module, "write_json_atomic", watched_json)
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}, max_queue_steps=1,
                         when_full="drop")
    disk_on_training_thread.clear()  # the constructor writes the first manifest, before training
    with pytest.warns(RuntimeWarning, match=r"tracer: dropped a step \(1 so far\): step \d+: queue full \(1 steps"):
        returned = [writer.record(step, grpo_step_tensors(step)) for step in range(30)]
    assert disk_on_training_thread == []
    dropped = returned.count(None)
    assert dropped >= 10 and writer.dropped_steps == dropped
    writer.close()
    manifest = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
    assert manifest["dropped_steps"] == dropped and manifest["steps_written"] == 30 - dropped
    assert len(Trace(tmp_path / "run").steps()) == 30 - dropped


def _full_disk_from(monkeypatch, first_failing_step: int) -> None:
    real_save = writer_module._save_atomic

    def save(path, tensors, metadata, *specs):
        if int(path.name[5:13]) >= first_failing_step:
            raise OSError(28, "No space left on device")
        real_save(path, tensors, metadata, *specs)

    monkeypatch.setattr(writer_module, "_save_atomic", save)


def test_strict_mode_raises_for_every_failed_write_and_counts_them_all(tmp_path, monkeypatch):
    """The disk is full from step 5 of 40: every write from then on fails on the writer thread.
    Every failure is reported by a raise (the next record/flush/close raises the first pending one
    with the count of all), and the manifest counts them all."""
    _full_disk_from(monkeypatch, 5)
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}, strict=True)
    errors: list[str] = []
    recorded = []  # a record() that raises a pending failure does not take its own step
    for step in range(40):
        try:
            writer.record(step, grpo_step_tensors(step))
            recorded.append(step)
        except TraceError as err:
            errors.append(str(err))
    failed = len([s for s in recorded if s >= 5])
    for verb in (writer.flush, writer.close):
        try:
            verb()
        except TraceError as err:
            errors.append(str(err))
    pattern = (rf"tracer: writing {re.escape(str(tmp_path / 'run'))} failed: step_(\d{{8}})\.inner_0\.mb_0\.rank_0"
               r"\.safetensors: OSError: \[Errno 28\] No space left on device(?: \((\d+) writes failed since the "
               r"last error raised; all are counted in the trace's dropped_steps, shown by `tracer info`\))?$")
    matches = [re.match(pattern, e) for e in errors]
    assert all(matches), errors
    assert int(matches[0].group(1)) == 5
    assert failed >= 10 and sum(int(m.group(2) or 1) for m in matches) == failed
    manifest = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
    assert manifest["dropped_steps"] == failed and manifest["steps_written"] == 5 and manifest["status"] == "finished"


def test_non_strict_mode_counts_the_same_failures(tmp_path, monkeypatch):
    _full_disk_from(monkeypatch, 5)
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        with TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}) as writer:
            for step in range(12):
                writer.record(step, grpo_step_tensors(step))
    manifest = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
    assert (manifest["dropped_steps"], manifest["steps_written"]) == (7, 5)


# -- fork ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.parametrize("async_write", [True, False])
def test_a_forked_child_using_an_inherited_writer_gets_a_trace_error_at_once(tmp_path, async_write):
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}, async_write=async_write)
    writer.record(0, grpo_step_tensors(0))
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: 20 records and a flush, each must raise at once
        messages = []
        for call in [*(lambda s=s: writer.record(s, grpo_step_tensors(s)) for s in range(1, 21)), writer.flush,
                     lambda: writer.count_drop("x")]:
            try:
                call()
                messages.append("no error")
            except TraceError as err:
                messages.append(str(err))
        writer.close()  # quiet: the parent owns the trace
        os.write(write_end, json.dumps(messages).encode())
        os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        assert time.monotonic() < deadline, "the forked child hung"
        time.sleep(0.05)
    with os.fdopen(read_end) as fh:
        messages = json.loads(fh.read())
    assert len(messages) == 22
    assert all(m.startswith(f"tracer: this TraceWriter for {tmp_path / 'run'} was created by process {os.getpid()} "
                            f"and inherited through fork() by process {pid}, which cannot use it") for m in messages)
    assert "create a new TraceWriter in the child" in messages[0]
    writer.record(1, grpo_step_tensors(1))  # the parent goes on
    writer.close()
    assert [k.step for k in Trace(tmp_path / "run").steps()] == [0, 1]
