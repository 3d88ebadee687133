"""The writer process (``TraceWriter(writer="process")``, ``TRACER_WRITER=process``): the real child,
real shared memory, real files; each guarantee of the thread writer checked against it. The
failures that only a process has (child killed, parent killed, Ctrl-C) are in
test_writer_process_failures.py, the child's batching in test_writer_process_batching.py; the
helpers they share (``grpo_step``, ``lingering_child``...) are in tests/fixtures/writer_process.py."""

from __future__ import annotations

import json
import os
import random
import signal
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import tracer
from tracer.format import summary as summary_format
from tracer.formulas import summaries
from tracer.record.capture import SamplingPolicy
from tracer.errors import TraceError
from tracer.format.integrity import verify_step_file
from tracer.read import Trace
from tracer.record.writer import TraceWriter
from tracer.record import writer as writer_module

from tests.fixtures.loops import tiny_loop
from tests.fixtures.random_steps import as_stored, random_step
from tests.fixtures.writer_process import WRITERS, child_of, grpo_step


def _index_lines(root: Path) -> list[dict]:
    lines = (root / "summary_index.rank_0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


def _header(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as fh:
        return fh.metadata()


def test_the_process_writes_what_the_thread_writes(tmp_path, monkeypatch):
    """Same steps through both writers: the same step files (tensors, header values, checksum that
    verifies, summary equal to compute_summary of the file), the same summary index lines and
    manifest counts; the manifest names the writer."""
    monkeypatch.setattr(writer_module, "wall_clock", lambda: 1.8e9)  # the same wall_time in both traces
    hyper = {"num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28, "beta": 0.04}
    for kind in WRITERS:
        with TraceWriter(tmp_path / kind, "grpo", hyperparameters=hyper, writer=kind) as writer:
            for step in range(12):
                tensors = grpo_step(step)
                metadata = {"note": f"step {step}", "lr": 1e-4 * step} if step % 3 == 0 else None
                writer.record(step, tensors, metadata=metadata)
                for t in tensors.values():  # the loop reuses its tensors at once
                    t.zero_() if t.dtype != torch.bool else t.logical_not_()
            if kind == "process":
                writer.flush()
                assert writer.steps_written == 12 and writer.dropped_steps == 0
    thread, process = Trace(tmp_path / "thread"), Trace(tmp_path / "process")
    assert [k.step for k in process.steps()] == [k.step for k in thread.steps()] == list(range(12))
    for a, b in zip(thread.steps(), process.steps()):
        assert a.path.name == b.path.name
        data_a, data_b = thread.load_step(a, derive=False), process.load_step(b, derive=False)
        assert data_a.keys() == data_b.keys()
        for name in data_a:
            assert torch.equal(data_a[name], data_b[name]), name
        assert _header(a.path) == _header(b.path)
        meta = process.metadata(b)
        assert verify_step_file(b.path) == meta["content_sha256"]
        stored, own = summary_format.read_summary(meta), summaries.compute_summary(process.load_step(b), meta)
        assert stored == own
    assert _index_lines(tmp_path / "thread") == _index_lines(tmp_path / "process")
    manifests = {kind: json.loads((tmp_path / kind / "manifest.json").read_text()) for kind in WRITERS}
    for kind, manifest in manifests.items():
        assert manifest["capture"]["writer"] == kind
        assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (12, 0, "finished")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_written_tensor_equals_a_copy_taken_at_record_time(tmp_path, seed):
    """The property test of the thread writer (test_written_equals_recorded), through the writer process:
    random dtypes, layouts, empty dims, NaNs, first_k_sequences, the anomaly ring, both policies."""
    rng = random.Random(seed)
    algorithm = rng.choice(["ppo", "grpo", "rloo"])
    keep, k, ring = rng.random() < 0.4, rng.choice([None, 1, 2]), rng.choice([0, 3])
    sampling = SamplingPolicy(every_n_steps=rng.choice([1, 2]), first_k_sequences=k, anomaly_ring=ring)
    g = torch.Generator().manual_seed(seed)
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with TraceWriter(tmp_path / "t", algorithm, keep_source_dtype=keep, sampling=sampling, writer="process",
                         when_full=rng.choice(["block", "drop"]), max_queue_steps=rng.choice([1, 4, 16]),
                         hyperparameters={"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28}) as writer:
            for step in range(16):
                tensors = random_step(rng, algorithm, g)
                expected[step] = {n: as_stored(n, t, keep, algorithm, k) for n, t in tensors.items()}
                writer.record(step, tensors)
                for t in tensors.values():
                    t.fill_(7) if t.dtype != torch.bool else t.logical_not_()
    trace = Trace(tmp_path / "t")
    assert trace.steps()
    for key in trace.steps():
        data, meta = trace.load_step(key, derive=False), trace.metadata(key)
        for name, tensor in expected[key.step].items():
            assert data[name].dtype == tensor.dtype and data[name].shape == tensor.shape, name
            torch.testing.assert_close(data[name], tensor, rtol=0, atol=0, equal_nan=True, msg=name)
        assert verify_step_file(key.path) == meta["content_sha256"]
        stored, own = summary_format.read_summary(meta), summaries.compute_summary(trace.load_step(key), meta)
        assert all(stored[n] == own[n] or (stored[n] != stored[n] and own[n] != own[n]) for n in own)
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["steps_written"] == len(trace.steps())
    assert manifest["steps_written"] + manifest["dropped_steps"] + manifest["skipped_steps"] == 16


@pytest.mark.parametrize("kind", WRITERS)
def test_the_anomaly_ring_writes_the_steps_before_a_blow_up(tmp_path, kind):
    """Only step 0 is sampled; step 7 holds a NaN: the ring (3) brings out steps 4-6 with it."""
    sampling = SamplingPolicy(every_n_steps=1000, anomaly_ring=3)
    with TraceWriter(tmp_path / "r", "grpo", sampling=sampling, writer=kind) as writer:
        for step in range(10):
            tensors = grpo_step(step)
            if step == 7:
                tensors["policy_logprobs"][1, 2] = float("nan")
            writer.record(step, tensors)
        writer.flush()
        assert (writer.steps_written, writer.skipped_steps) == (5, 5)
    trace = Trace(tmp_path / "r")
    assert [k.step for k in trace.steps()] == [0, 4, 5, 6, 7]
    assert trace.metadata(trace.steps()[1])["anomaly"].startswith("before anomaly at step 7: non-finite")
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["skipped_steps"], manifest["dropped_steps"]) == (5, 5, 0)


def test_when_full_drop_counts_what_it_drops(tmp_path):
    """One step in flight at most; a child kept from reading (SIGSTOP) makes the rest drop, counted
    in the writer and in the manifest right after flush() and close()."""
    writer = TraceWriter(tmp_path / "d", "grpo", writer="process", max_queue_steps=1, when_full="drop")
    writer.record(0, grpo_step(0))
    writer.flush()  # the child is up: the steps bound applies from now on
    child = child_of(writer)
    os.kill(child.pid, signal.SIGSTOP)
    try:
        with pytest.warns(RuntimeWarning, match=r"dropped a step \(\d+ so far\): step \d+: queue full \(1 steps"):
            returned = [writer.record(step, grpo_step(step)) for step in range(1, 6)]
    finally:
        os.kill(child.pid, signal.SIGCONT)
    assert returned[0] is not None and returned[1:] == [None] * 4
    writer.flush()
    assert (writer.steps_written, writer.dropped_steps) == (2, 4)
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"], len(manifest["drop_reasons"])) == (2, 4, 4)
    writer.close()
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (2, 4, "finished")
    assert [k.step for k in Trace(tmp_path / "d").steps()] == [0, 1]


def test_the_environment_variable_chooses_the_writer(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACER_WRITER", "process")
    with TraceWriter(tmp_path / "env", "grpo") as writer:
        assert writer.writer == "process"
        writer.record(0, grpo_step(0))
    assert json.loads((tmp_path / "env" / "manifest.json").read_text())["capture"]["writer"] == "process"
    with TraceWriter(tmp_path / "sync", "grpo", async_write=False) as writer:  # writes inside record
        assert writer.writer == "inline"
    monkeypatch.setenv("TRACER_WRITER", "fork")
    with pytest.raises(TraceError, match=r"TRACER_WRITER='fork' is not one of \['auto', 'thread', 'process'\]"):
        TraceWriter(tmp_path / "bad", "grpo")
    with pytest.raises(TraceError, match=r"writer='proc' is not one of"):
        TraceWriter(tmp_path / "bad2", "grpo", writer="proc")


def test_a_step_larger_than_the_ring_goes_through_the_pipe(tmp_path):
    with TraceWriter(tmp_path / "big", "grpo", writer="process", max_queue_bytes=256) as writer:
        for step in range(3):
            writer.record(step, grpo_step(step, B=8, T=64))  # ~6 KB per step
    trace = Trace(tmp_path / "big")
    for key in trace.steps():
        want = grpo_step(key.step, B=8, T=64)
        assert torch.equal(trace.load_step(key, derive=False)["policy_logprobs"], want["policy_logprobs"])
        assert verify_step_file(key.path) == trace.metadata(key)["content_sha256"]


def test_zero_edit_capture_and_paused_with_the_writer_process(tmp_path):
    """tracer.watch with writer="process": each backward outside paused() is one step."""
    with tracer.watch(algo="grpo", out=tmp_path / "w", writer="process") as w:
        tiny_loop(steps=2)
        with w.paused():
            tiny_loop(steps=3)
        tiny_loop(steps=1)
    assert w.writer.writer == "process" and w.steps_recorded == 3
    trace = Trace(tmp_path / "w")
    assert [k.step for k in trace.steps()] == [0, 1, 2]
    manifest = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert manifest["capture"]["writer"] == "process" and manifest["capture_report"]["steps_recorded"] == 3
