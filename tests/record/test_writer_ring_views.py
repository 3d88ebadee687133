"""The writer process's child keeps its ring views per (layout, offset): a step's tensors are its
own (the anomaly ring's held steps, fields the child derives, layouts sharing an offset, steps
larger than the ring between lingered ones), and a batched child writes the same bytes as the
writer thread. From the seventh adversarial review (the child that lingers for more steps and
caches its ring views): real child processes, real shared memory, real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tracer.record.capture import SamplingPolicy
from tracer.read import Trace
from tracer.record.writer import TraceWriter
from tracer.record.process.pipe import RingLayout
from tracer.record import writer as writer_module

from tests.fixtures.writer_process import grpo_step, lingering_child, read_manifest
from tests.fixtures.writer_linger import assert_steps


# -- cached ring views: a step's tensors are its own ---------------------------------------------------


@pytest.mark.parametrize("linger", ["flush each step", "batched"])
def test_the_anomaly_ring_keeps_each_held_steps_own_values_at_a_reused_offset(tmp_path, monkeypatch, linger):
    """Only step 0 is sampled; the ring (3) holds unsampled steps that the child read through the
    same cached views (each step at the ring's start when flushed one by one); step 9 holds a NaN,
    step 5 a KL spike: each brings out the 3 steps before it, each with its own values (a held
    step aliasing the ring would hold the last step's values)."""
    if linger == "batched":
        lingering_child(monkeypatch)
    sampling = SamplingPolicy(every_n_steps=1000, anomaly_ring=3, kl_spike=5.0)
    expected = {}
    with TraceWriter(tmp_path / "r", "grpo", sampling=sampling, writer="process") as writer:
        for step in range(12):
            tensors = grpo_step(step)
            if step == 9:
                tensors["policy_logprobs"][1, 2] = float("nan")
            if step == 5:
                tensors["policy_logprobs"] = tensors["old_logprobs"] + 12.0  # ref-free k2 from old: a spike
            expected[step] = {n: t.clone() for n, t in tensors.items()}
            writer.record(step, tensors)
            for t in tensors.values():
                t.fill_(3) if t.dtype != torch.bool else t.logical_not_()
            if linger == "flush each step" or step in (4, 8):
                writer.flush()
    written = [0, 2, 3, 4, 5, 6, 7, 8, 9]
    assert_steps(tmp_path / "r", {step: expected[step] for step in written})
    trace = Trace(tmp_path / "r")
    anomalies = {k.step: trace.metadata(k).get("anomaly", "") for k in trace.steps()}
    assert [s for s in written if anomalies[s].startswith("before anomaly at step 5")] == [2, 3, 4]
    assert [s for s in written if anomalies[s].startswith("before anomaly at step 9")] == [6, 7, 8]
    assert anomalies[5].startswith("approx_kl_k2") and anomalies[9].startswith("non-finite")
    manifest = read_manifest(tmp_path / "r")
    assert (manifest["steps_written"], manifest["skipped_steps"], manifest["dropped_steps"]) == (9, 3, 0)


def test_fields_derived_by_the_child_are_each_steps_own_through_cached_views(tmp_path):
    """Zero-edit capture leaves ratio and approx_kl_k2 to the writer (derive=...): the child adds
    them to the step's tensors; a cached view's tensors shared by the next step at that offset
    would keep the first step's derived fields (derive_recorded skips a field present)."""
    from tracer.formulas import approx_kl_k2, ratio

    with TraceWriter(tmp_path / "z", "grpo", writer="process") as writer:
        for step in range(5):
            writer._record(step, grpo_step(step), derive=("ratio", "approx_kl_k2"))
            writer.flush()  # each step at the ring's start: the same cached views
    trace = Trace(tmp_path / "z")
    assert [k.step for k in trace.steps()] == list(range(5))
    for key in trace.steps():
        got, want = trace.load_step(key, derive=False), grpo_step(key.step)
        assert torch.equal(got["ratio"], ratio(want["policy_logprobs"], want["old_logprobs"])), key.step
        assert torch.equal(got["approx_kl_k2"], approx_kl_k2(want["policy_logprobs"], want["old_logprobs"])), key.step


def test_steps_of_different_layouts_at_one_offset_keep_their_own_shapes_and_dtypes(tmp_path):
    """Layouts alternate at the ring's start (each step flushed): shapes (4x6, 2x6, 4x3), the dtype of
    a field (float32, bfloat16) and the set of fields (one without rewards' neighbours); each file
    holds its own step's fields, shapes, dtypes and values."""
    def variant(step: int) -> dict[str, torch.Tensor]:
        kind = step % 4
        tensors = grpo_step(step, *[(4, 6), (2, 6), (4, 3), (4, 6)][kind])
        if kind == 3:
            tensors["policy_logprobs"] = tensors["policy_logprobs"].to(torch.bfloat16)
            tensors["old_logprobs"] = tensors["old_logprobs"].to(torch.bfloat16)
        return tensors

    with TraceWriter(tmp_path / "l", "grpo", writer="process", keep_source_dtype=True) as writer:
        for step in range(12):
            writer.record(step, variant(step))
            if step % 3 != 1:
                writer.flush()
    trace = Trace(tmp_path / "l")
    assert [k.step for k in trace.steps()] == list(range(12))
    for key in trace.steps():
        got, want = trace.load_step(key, derive=False), variant(key.step)
        assert set(got) == set(want), key.step
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), (key.step, name)


def test_steps_larger_than_the_ring_between_lingered_small_ones(tmp_path, monkeypatch):
    """Small steps the child lingers over, steps larger than the ring (through the pipe, once the
    lingered ones are written) in between, in every order: all written, each with its values."""
    batches = lingering_child(monkeypatch)
    big = lambda step: grpo_step(step, B=16, T=64)  # noqa: E731
    ring = 4 * RingLayout(0, grpo_step(0), "float32").size
    kinds = ["small", "big", "small", "small", "big", "big", "small", "big"]
    expected = {}
    with TraceWriter(tmp_path / "b", "grpo", writer="process", max_queue_bytes=ring) as writer:
        for step, kind in enumerate(kinds):
            expected[step] = grpo_step(step) if kind == "small" else big(step)
            writer.record(step, expected[step])
        writer.flush()
        assert sum(batches) == len(kinds)
    assert_steps(tmp_path / "b", expected)

# -- the same bytes as the writer thread ----------------------------------------------------------------


def test_batched_process_files_are_byte_identical_to_the_threads(tmp_path, monkeypatch):
    """Steps of two layouts, metadata on some, a step larger than the ring, the anomaly ring and a
    KL threshold on, in batches of uneven sizes (flushes between): every step file holds the same
    bytes as the writer thread's (the header's values are the same; their order is safetensors'
    hash order, which differs from one process to the next whichever writer), and the summary index
    and the counts are the same."""
    monkeypatch.setattr(writer_module, "wall_clock", lambda: 1.8e9)  # the same wall_time in both traces
    import struct

    lingering_child(monkeypatch)
    hyper = {"num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28, "beta": 0.04}
    sampling = SamplingPolicy(every_n_steps=2, anomaly_ring=2, kl_spike=50.0)
    ring = 6 * RingLayout(0, grpo_step(0), "float32").size

    def steps():
        for step in range(20):
            tensors = grpo_step(step, *((2, 6) if step % 3 == 1 else (16, 64) if step == 12 else (4, 6)))
            if step == 11:
                tensors["policy_logprobs"][0, 0] = float("inf")
            yield step, tensors, ({"note": f"s{step}", "lr": 1e-5 * step} if step % 4 == 0 else None)

    for kind in ("thread", "process"):
        with TraceWriter(tmp_path / kind, "grpo", hyperparameters=hyper, sampling=sampling, writer=kind,
                         max_queue_bytes=ring) as writer:
            for step, tensors, metadata in steps():
                writer.record(step, tensors, metadata=metadata)
                if step in (2, 9, 10, 17):
                    writer.flush()

    def parts(path: Path) -> tuple[dict, bytes]:
        data = path.read_bytes()
        (size,) = struct.unpack_from("<Q", data)
        return json.loads(data[8:8 + size]), data[8 + size:]

    thread, process = (sorted((tmp_path / kind / "steps").iterdir()) for kind in ("thread", "process"))
    # the 10 sampled (even) steps; 7 and 9, held by the ring (2) when 11 showed an infinity, and 11
    written = [0, 2, 4, 6, 7, 8, 9, 10, 11, 12, 14, 16, 18]
    assert [p.name for p in process] == [p.name for p in thread] == [
        f"step_{step:08d}.inner_0.mb_0.rank_0.safetensors" for step in written]
    for a, b in zip(thread, process):
        (header_a, bytes_a), (header_b, bytes_b) = parts(a), parts(b)
        assert header_a == header_b and bytes_a == bytes_b, a.name
        assert len(a.read_bytes()) == len(b.read_bytes())
    index = {kind: (tmp_path / kind / "summary_index.rank_0.jsonl").read_text().splitlines()[1:]
             for kind in ("thread", "process")}
    # in the order written: 7 and 9 come out of the anomaly ring with 11
    assert [json.loads(line)["step"] for line in index["process"]] == [0, 2, 4, 6, 8, 10, 7, 9, 11, 12, 14, 16, 18]
    assert [json.loads(line) for line in index["thread"]] == [json.loads(line) for line in index["process"]]
    counts = {kind: {k: read_manifest(tmp_path / kind)[k] for k in ("steps_written", "dropped_steps", "skipped_steps")}
              for kind in ("thread", "process")}
    assert counts["thread"] == counts["process"] == {"steps_written": 13, "dropped_steps": 0, "skipped_steps": 7}
