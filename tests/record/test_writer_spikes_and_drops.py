"""Two capture options on real writers (thread and process), real files: the anomaly ring's KL spike
when the loop records only the logprobs (the KL is derived as readers derive it), and the warnings of
``when_full="drop"`` (the first drop, then one summary per 100 drops or per interval; exact counts)."""

from __future__ import annotations

import json
import logging
import math
import time
import warnings

import pytest
import torch

import tracer.record.manifest as manifest_book
from tracer.record.capture import SamplingPolicy
from tracer.read.trace_info import trace_info
from tracer.read import Trace
from tracer.record.writer import TraceWriter

from tests.fixtures.writer_process import WRITERS, grpo_step, stalled_writer

B, T = 4, 6


def logprobs_only(step: int) -> dict[str, torch.Tensor]:
    """What the README's hand-written loop records: ids, mask, policy/old (and here ref) logprobs;
    no ``approx_kl_k2``, no ``ref_kl_k3``. The last token of every row is masked out.

    Healthy steps: policy -4, old -4.1, ref -4.05 on every token, so per kept token
    k2 = 0.5 * 0.1^2 = 0.005 and k3 = exp(-0.05) + 0.05 - 1 = 0.00123 nats.
    Step 2: old is -14 on the masked column only (k2 = 50 there, masked out: still healthy).
    Step 4: old = -6 everywhere: k2 = 0.5 * 2^2 = 2 nats on every kept token (> 1).
    Step 7: ref = -1 everywhere: d = ref - policy = 3, k3 = e^3 - 3 - 1 = 16.09 nats (> 1)."""
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, -1] = False
    policy, old, ref = torch.full((B, T), -4.0), torch.full((B, T), -4.1), torch.full((B, T), -4.05)
    if step == 2:
        old[:, -1] = -14.0
    if step == 4:
        old.fill_(-6.0)
    if step == 7:
        ref.fill_(-1.0)
    return {"completion_ids": torch.arange(B * T).reshape(B, T), "completion_mask": mask,
            "policy_logprobs": policy, "old_logprobs": old, "ref_logprobs": ref}


@pytest.mark.parametrize("kind", WRITERS)
def test_a_kl_spike_fires_on_the_kl_derived_from_the_recorded_logprobs(tmp_path, kind):
    """No step is sampled (every_n_steps=1000, steps 1..8); the ring (2) holds the steps before an
    anomaly. Step 4's derived k2 (2 nats) and step 7's derived k3 (16.09 nats) exceed kl_spike=1:
    steps 2, 3, 4 and 5, 6, 7 are written. Before, nothing fired without a recorded KL field."""
    sampling = SamplingPolicy(every_n_steps=1000, anomaly_ring=2, kl_spike=1.0)
    with TraceWriter(tmp_path / "r", "grpo", sampling=sampling, writer=kind) as writer:
        for step in range(1, 9):
            writer.record(step, logprobs_only(step))
    trace = Trace(tmp_path / "r")
    assert [k.step for k in trace.steps()] == [2, 3, 4, 5, 6, 7]
    meta = {k.step: trace.metadata(k) for k in trace.steps()}
    k2 = "approx_kl_k2 (derived from policy_logprobs, old_logprobs) masked mean 2 > kl_spike 1"
    k3 = f"ref_kl_k3 (derived from policy_logprobs, ref_logprobs) masked mean {math.exp(3) - 4:.4g} > kl_spike 1"
    assert meta[4]["anomaly"] == k2 and meta[7]["anomaly"] == k3
    assert meta[2]["anomaly"] == f"before anomaly at step 4: {k2}"  # step 2's masked 50 nats did not fire
    assert meta[6]["anomaly"] == f"before anomaly at step 7: {k3}"
    step4 = trace.steps()[2]
    assert "approx_kl_k2" not in trace.fields(step4)  # not recorded: the reader derives the same 2 nats
    data = trace.load_step(step4)
    assert float(data["approx_kl_k2"][data["completion_mask"]].mean()) == 2.0
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["skipped_steps"], manifest["dropped_steps"]) == (6, 2, 0)


def test_the_anomaly_test_derives_k2_as_the_reader_does(tmp_path):
    """With ``old_logprobs_source = policy_detached`` the reader takes old to be the policy, so its k2
    is 0 whatever old_logprobs holds; the anomaly test derives the same 0 (no spike on step 4's
    old = -6, which alone would give 2 nats). Step 0 is sampled: written, with no anomaly."""
    sampling = SamplingPolicy(every_n_steps=1000, anomaly_ring=2, kl_spike=1.0)
    with TraceWriter(tmp_path / "r", "grpo", sampling=sampling) as writer:
        tensors = logprobs_only(4)
        del tensors["ref_logprobs"]
        writer.record(0, tensors, metadata={"old_logprobs_source": "policy_detached"})
    trace = Trace(tmp_path / "r")
    (key,) = trace.steps()
    data = trace.load_step(key)
    assert float(data["approx_kl_k2"][data["completion_mask"]].mean()) == 0.0
    assert "anomaly" not in trace.metadata(key)


@pytest.mark.parametrize("kind", WRITERS)
def test_drops_warn_once_then_once_per_100_and_count_every_one(tmp_path, kind, monkeypatch, caplog):
    """Step 1 takes the one place (thread: queued behind step 0 in flight; process: in flight), so
    steps 2..250 are dropped: 249 drops, warned at the 1st, 101st and 201st (the interval is made
    too long to matter), the 246 others logged at debug. Before: one warning per drop (249)."""
    monkeypatch.setattr(manifest_book, "QUEUE_DROP_WARN_INTERVAL_S", 1e9, raising=False)
    caplog.set_level(logging.DEBUG, logger="tracer.record.manifest")
    writer, release = stalled_writer(kind, monkeypatch, tmp_path / "d")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            returned = [writer.record(step, grpo_step(step)) for step in range(1, 251)]
    finally:
        release()
    assert returned[0] is not None and returned[1:] == [None] * 249
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 3, said
    assert said[0].startswith("tracer: dropped a step (1 so far): step 2: queue full (1 steps")
    assert "Further drops are counted in the manifest's dropped_steps (shown by `tracer info`) without a " \
           "warning each: one warning sums them up per 100 drops or 1e+09 s." in said[0]
    assert said[1].startswith("tracer: dropped 100 more steps because the queue was full (101 dropped so far; "
                              "the latest: step 102: queue full")
    assert said[2].startswith("tracer: dropped 100 more steps because the queue was full (201 dropped so far; "
                              "the latest: step 202: queue full")
    debug = [r.getMessage() for r in caplog.records if r.name == "tracer.record.manifest" and r.levelno == logging.DEBUG]
    assert len(debug) == 246 and debug[0].startswith("tracer: dropped a step (2 so far): step 3: queue full")
    writer.close()
    assert (writer.steps_written, writer.dropped_steps) == (2, 249)
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (2, 249, "finished")
    assert trace_info(tmp_path / "d")["dropped_steps"] == 249
    assert [k.step for k in Trace(tmp_path / "d").steps()] == [0, 1]


def test_a_summary_warning_also_comes_after_the_interval(tmp_path, monkeypatch, caplog):
    """Interval 2 s: drop 1 warns, drop 2 (right after) does not, drop 3 (2.1 s later) sums up the
    two since the last warning, drop 4 (right after) does not."""
    monkeypatch.setattr(manifest_book, "QUEUE_DROP_WARN_INTERVAL_S", 2.0, raising=False)
    writer, release = stalled_writer("thread", monkeypatch, tmp_path / "d")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            writer.record(1, grpo_step(1))  # queued
            writer.record(2, grpo_step(2))
            writer.record(3, grpo_step(3))
            time.sleep(2.1)
            writer.record(4, grpo_step(4))
            writer.record(5, grpo_step(5))
    finally:
        release()
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 2, said
    assert said[0].startswith("tracer: dropped a step (1 so far): step 2: queue full")
    assert said[1].startswith("tracer: dropped 2 more steps because the queue was full (3 dropped so far; "
                              "the latest: step 4: queue full")
    writer.close()
    assert (writer.steps_written, writer.dropped_steps) == (2, 4)
