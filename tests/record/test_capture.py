"""Background capture: bounded queue, drop/block policies, sampling, anomaly ring, staging copies,
live reading, exit flush. Behaviour only; no wall-time assertions."""

import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from tracer import Trace, TraceWriter
from tracer.record.capture import SamplingPolicy, StagedStep
from tracer.record.thread import BackgroundWriter
from tracer.record.writer import MANIFEST_NAME


def step_tensors(value=0.0, B=4, T=3):
    return {
        "completion_ids": torch.arange(B * T).reshape(B, T),
        "completion_mask": torch.ones(B, T, dtype=torch.bool),
        "policy_logprobs": torch.full((B, T), -1.0 - value),
        "ref_kl_k3": torch.zeros(B, T),
        "rewards": torch.arange(B, dtype=torch.float32) + value,
        "loss": torch.tensor(float(value)),
    }


def item(step, nbytes=100):
    return StagedStep(step, 0, 0, {"x": torch.zeros(1)}, {}, nbytes)


def gated_writer(**kwargs):
    """A BackgroundWriter whose writes wait for ``gate``; ``started`` is set when the first begins."""
    gate, started, written, drops = threading.Event(), threading.Event(), [], []

    def write(it, reason):
        started.set()
        gate.wait()
        written.append(it.step)

    bg = BackgroundWriter(write, lambda it: None, lambda it, err: None, drops.append, **kwargs)
    return bg, gate, started, written, drops


def test_drop_policy_bounds_the_queue_and_counts_drops():
    bg, gate, started, written, drops = gated_writer(max_steps=2, max_bytes=10_000, when_full="drop")
    assert bg.put(item(0))
    started.wait(5)  # step 0 is being written (blocked); the queue is empty
    results = [bg.put(item(s)) for s in range(1, 6)]
    # steps 1 and 2 fill the queue (2 steps); 3, 4, 5 find it full and are dropped
    assert results == [True, True, False, False, False]
    assert len(drops) == 3 and "step 3: queue full" in drops[0]
    assert bg.peak_bytes == 3 * 100  # the step being written + the two queued, never more
    gate.set()
    bg.stop()
    assert written == [0, 1, 2]


def test_byte_bound_counts_bytes_not_only_steps():
    bg, gate, started, written, drops = gated_writer(max_steps=100, max_bytes=250, when_full="drop")
    bg.put(item(0))
    started.wait(5)
    # held bytes count the step being written: 100 (in flight) + 100 (step 1) = 200 <= 250;
    # step 2 would make 300 > 250 and is dropped, and so is step 3
    assert [bg.put(item(s)) for s in (1, 2, 3)] == [True, False, False]
    assert bg.peak_bytes == 200 and len(drops) == 2
    gate.set()
    bg.stop()


def test_block_policy_waits_for_room_and_loses_nothing():
    bg, gate, started, written, drops = gated_writer(max_steps=1, max_bytes=10_000, when_full="block")
    bg.put(item(0))
    started.wait(5)
    bg.put(item(1))  # fills the queue
    producer = threading.Thread(target=bg.put, args=(item(2),))
    producer.start()
    producer.join(0.2)
    assert producer.is_alive()  # blocked: the queue holds one step already
    gate.set()
    producer.join(5)
    assert not producer.is_alive()
    bg.stop()
    assert written == [0, 1, 2] and drops == []


def test_values_are_those_at_record_time_even_if_the_loop_mutates_them(tmp_path):
    tensors = step_tensors()
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        writer.record(0, tensors)
        tensors["policy_logprobs"].fill_(123.0)  # the loop reuses its buffers right away
        tensors["rewards"].add_(1000.0)
    data = Trace(tmp_path / "run").load_step(Trace(tmp_path / "run").steps()[0])
    assert torch.equal(data["policy_logprobs"], torch.full((4, 3), -1.0))
    assert data["rewards"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_every_n_steps(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo", sampling=SamplingPolicy(every_n_steps=2)) as writer:
        paths = [writer.record(s, step_tensors(s)) for s in range(6)]
    assert [p is not None for p in paths] == [True, False, True, False, True, False]
    assert [k.step for k in Trace(tmp_path / "run").steps()] == [0, 2, 4]
    manifest = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
    assert manifest["skipped_steps"] == 3 and manifest["steps_written"] == 3
    assert manifest["sampling"]["every_n_steps"] == 2


def test_first_k_sequences(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo", sampling=SamplingPolicy(first_k_sequences=2)) as writer:
        writer.record(0, step_tensors(5.0))
    trace = Trace(tmp_path / "run")
    data = trace.load_step(trace.steps()[0])
    assert data["completion_ids"].shape == (2, 3) and data["rewards"].tolist() == [5.0, 6.0]
    assert float(data["loss"]) == 5.0  # a scalar has no B dim: kept whole


def test_anomaly_ring_writes_the_steps_before_a_nan(tmp_path):
    policy = SamplingPolicy(every_n_steps=1000, anomaly_ring=3)  # only step 0 is sampled
    with TraceWriter(tmp_path / "run", "grpo", sampling=policy) as writer:
        for s in range(10):
            tensors = step_tensors(s)
            if s == 7:
                tensors["policy_logprobs"][1, 2] = float("nan")
            writer.record(s, tensors)
    trace = Trace(tmp_path / "run")
    # step 0 (sampled), the ring's last three steps before the NaN (4, 5, 6), and step 7 itself
    assert [k.step for k in trace.steps()] == [0, 4, 5, 6, 7]
    meta = {k.step: trace.metadata(k) for k in trace.steps()}
    assert "non-finite values in ['policy_logprobs']" in meta[7]["anomaly"]
    assert meta[7]["nonfinite_fields"] == ["policy_logprobs"]
    assert meta[5]["anomaly"].startswith("before anomaly at step 7")
    assert "anomaly" not in meta[0]
    assert torch.isnan(trace.load_step(trace.steps()[-1])["policy_logprobs"][1, 2])  # recorded, not rejected


def test_kl_spike_is_an_anomaly(tmp_path):
    policy = SamplingPolicy(every_n_steps=1000, anomaly_ring=2, kl_spike=5.0)
    with TraceWriter(tmp_path / "run", "grpo", sampling=policy) as writer:
        for s in range(1, 6):
            tensors = step_tensors(s)
            if s == 4:
                tensors["ref_kl_k3"][0] = 24.0  # masked mean over 12 kept tokens: 3 * 24 / 12 = 6 > 5
            writer.record(s, tensors)
    trace = Trace(tmp_path / "run")
    assert [k.step for k in trace.steps()] == [2, 3, 4]
    assert "ref_kl_k3 masked mean 6 > kl_spike 5" in trace.metadata(trace.steps()[-1])["anomaly"]


def test_reader_sees_only_complete_steps_and_then_new_ones(tmp_path):
    writer = TraceWriter(tmp_path / "run", "grpo")
    writer.record(0, step_tensors())
    writer.flush()
    trace = Trace(tmp_path / "run")  # opened while training is still going
    assert [k.step for k in trace.steps()] == [0] and trace.status == "running"
    (tmp_path / "run" / "steps" / "step_00000001.inner_0.mb_0.rank_0.safetensors.partial").write_bytes(b"junk")
    assert [k.step for k in trace.steps()] == [0]  # a partial file is never listed
    writer.record(1, step_tensors(1))
    writer.record(2, step_tensors(2))
    writer.close()
    assert [k.step for k in trace.steps()] == [0, 1, 2]  # the same Trace object sees new steps


def test_normal_interpreter_exit_flushes_and_finishes(tmp_path):
    script = f"""
import torch
from tracer import TraceWriter
w = TraceWriter({str(tmp_path / 'run')!r}, "grpo")
for s in range(5):
    w.record(s, policy_logprobs=torch.full((64, 256), float(s)), completion_mask=torch.ones(64, 256))
# no close(): the atexit hook must flush the queue and finish the manifest
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    trace = Trace(tmp_path / "run")
    assert [k.step for k in trace.steps()] == [0, 1, 2, 3, 4]
    assert trace.status == "finished"
    assert float(trace.load_step(trace.steps()[4])["policy_logprobs"][0, 0]) == 4.0


def test_sampling_policy_rejects_nonsense():
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        SamplingPolicy(every_n_steps=0)
    with pytest.raises(ValueError, match="when_full must be 'block' or 'drop', got 'wait'"):
        BackgroundWriter(lambda *a: None, lambda it: None, lambda *a: None, lambda r: None, 1, 1, "wait")


def test_the_anomaly_ring_needs_the_background_writer(tmp_path):
    from tracer import TraceError

    with pytest.raises(TraceError, match="use async_write=True"):
        TraceWriter(tmp_path / "run", "grpo", sampling=SamplingPolicy(anomaly_ring=2), async_write=False)
