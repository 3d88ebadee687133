"""Live runs: the background writer updates the manifest's ``steps_written`` while the run
goes on, at a bounded rate; ``scan()`` lists the steps folder once, so a file a live writer adds is
never called foreign, and ``tracer info`` on a live run never does either."""

from __future__ import annotations

import json
import math
import threading
import time

import tracer.record.writer as writer_module
from tracer import Trace, TraceWriter
from tracer.format.names import MANIFEST_NAME
from tracer.read.trace_info import trace_info

from tests.fixtures.toy_traces import ToyTokenizer, grpo_step_tensors, write_trace


# -- live runs: the manifest's live counts, info during writing --------------------------------


def test_the_background_writer_updates_steps_written_while_the_run_goes_on(tmp_path):
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2})
    for step in range(6):
        writer.record(step, grpo_step_tensors(step))
    deadline, manifest = time.monotonic() + 30, {}
    while time.monotonic() < deadline:  # no flush(): the writer thread must do it on its own
        manifest = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
        if manifest.get("steps_written") == 6:
            break
        time.sleep(0.1)
    assert manifest["steps_written"] == 6 and manifest["status"] == "running"
    writer.close()


def test_manifest_updates_are_rate_bounded(tmp_path, monkeypatch):
    writes: list[float] = []
    real_json = writer_module.write_json_atomic

    def counted(path, payload):
        if path.name == MANIFEST_NAME:
            writes.append(time.monotonic())
        real_json(path, payload)

    monkeypatch.setattr(writer_module, "write_json_atomic", counted)
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2})
    t0 = time.monotonic()
    for step in range(60):
        writer.record(step, grpo_step_tensors(step))
    writer.close()
    elapsed = time.monotonic() - t0
    # the constructor's write, one per MANIFEST_INTERVAL_S at most, and the final one
    assert len(writes) <= 2 + math.ceil(elapsed / writer_module.MANIFEST_INTERVAL_S)


def test_scan_lists_the_directory_once_so_a_new_file_is_never_foreign(tmp_path, monkeypatch):
    """A live writer adds a step file between two listings: before, scan() called it "not listed
    as a step"; now it lists once."""
    run = write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=2)
    trace = Trace(run)
    real = Trace._step_paths
    calls = []

    def growing(self):
        paths = real(self)
        calls.append(1)
        return paths[:-1] if len(calls) == 1 else paths  # the last file appears after the first listing

    monkeypatch.setattr(Trace, "_step_paths", growing)
    assert trace.scan() == {}


def test_info_on_a_live_run_never_calls_a_new_file_foreign(tmp_path):
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2})
    stop = threading.Event()

    def train():
        step = 0
        while not stop.is_set():
            writer.record(step, grpo_step_tensors(step))
            step += 1
            time.sleep(0.002)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        for _ in range(40):
            assert trace_info(tmp_path / "run")["unreadable"] == {}
    finally:
        stop.set()
        thread.join()
        writer.close()
