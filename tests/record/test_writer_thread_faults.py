"""Faults of the batched writer thread and the staging buffer pool that must not corrupt a
step held for later, lose an error in strict mode, hand back a buffer a copy may still be writing
into, kill the writer thread under ``-W error``, keep a tensor of another device than the CPU, or cost
a step of float8 / complex extra fields. Each test failed before its fix; values are worked out by hand
in the test. (The property test of what is written: test_written_equals_recorded.py.)"""

from __future__ import annotations

import json
import threading
import warnings

import pytest
import torch

from tracer.record.capture import BufferPool, StagedStep, stage
from tracer.record.thread import BackgroundWriter
from tracer.errors import TraceError
from tracer.read import Trace
from tracer.record.writer import TraceWriter


def _staged(step: int, pool: BufferPool, value: float, sampled: bool = True) -> StagedStep:
    tensors, event, buffers, nbytes = stage({"x": torch.full((4,), value)}, pool, reuse=True)
    return StagedStep(step, 0, 0, tensors, {}, nbytes, sampled, event, buffers)


def _join(target) -> None:
    worker = threading.Thread(target=target)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the writer thread hangs"


def test_a_writer_thread_error_leaves_the_steps_the_anomaly_ring_holds_and_those_written_alone():
    """Steps 0 (not sampled: held in the anomaly ring) and 1 (whose write fails unexpectedly) are one
    batch. Only step 1 is lost: step 0 stays in the ring with its own buffer, so when step 3 (a NaN:
    an anomaly) brings the ring out, step 0 is written with the zeros it was recorded with."""
    pool = BufferPool(per_key=8)
    written: dict[int, list[float]] = {}
    errors: list[tuple[int, str]] = []

    def write(item, reason):
        if item.step == 1:
            raise RuntimeError("a bug in the write path")
        written[item.step] = item.tensors["x"].tolist()

    bg = BackgroundWriter(write, lambda it: None, lambda it, err: errors.append((it.step, str(err))),
                          lambda reason: errors.append((-1, reason)), max_steps=16, max_bytes=10_000, ring=4, pool=pool)
    with bg._cond:  # both queued before the writer thread looks: one batch
        bg.put(_staged(0, pool, 0.0, sampled=False))
        bg.put(_staged(1, pool, 1.0))
    _join(bg.flush)
    bg.put(_staged(2, pool, 2.0, sampled=False))  # held too: takes a buffer from the pool
    bg.put(_staged(3, pool, float("nan")))  # an anomaly: the ring (0, 2) is written before it
    _join(bg.flush)
    _join(bg.stop)
    assert written[0] == [0.0] * 4, "step 0's buffer was handed back while the ring still held it"
    assert written[2] == [2.0] * 4 and sorted(written) == [0, 2, 3]
    assert [step for step, _ in errors] == [1]  # only the step that failed is lost, and it is reported once


def test_strict_mode_raises_a_step_lost_to_an_unexpected_writer_thread_error(tmp_path):
    def broken(items):
        raise RuntimeError("a bug while preparing the batch")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loose = TraceWriter(tmp_path / "loose", "grpo")
        loose._background._prepare = broken  # a fault on the writer thread
        loose.record(0, {"policy_logprobs": torch.zeros(2, 3)})
        loose.flush()  # not strict: counted, training goes on
        loose.close()
    manifest = json.loads((tmp_path / "loose" / "manifest.json").read_text())
    assert manifest["dropped_steps"] == 1 and manifest["steps_written"] == 0
    assert "a bug while preparing the batch" in manifest["drop_reasons"][0]

    strict = TraceWriter(tmp_path / "strict", "grpo", strict=True)
    strict._background._prepare = broken
    strict.record(0, {"policy_logprobs": torch.zeros(2, 3)})
    with pytest.raises(TraceError, match="step 0: .*RuntimeError: a bug while preparing the batch"):
        strict.flush()
    strict.close()


class _CopyInFlight:
    """Stands in for the CUDA event of a copy into pinned buffers that has not completed yet (no GPU
    here): ``query()`` is False until ``synchronize()``."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_a_dropped_step_never_hands_back_a_pinned_buffer_its_copy_may_still_write_into():
    pool = BufferPool(per_key=8)
    bg = BackgroundWriter(lambda it, reason: None, lambda it: None, lambda it, err: None, lambda reason: None,
                          max_steps=1, max_bytes=10_000, when_full="drop", pool=pool)
    buffer = torch.zeros(4)  # the pinned buffer the in-flight copy writes into
    with bg._cond:  # the queue holds one step: the next one is dropped
        assert bg.put(StagedStep(0, 0, 0, {"x": torch.zeros(4)}, {}, 16))
        dropped = StagedStep(1, 0, 0, {"x": buffer}, {}, 16, event=_CopyInFlight(), pinned=[(buffer, True)])
        assert not bg.put(dropped)
    with pool._lock:
        assert not any(b is buffer for bufs in pool._free.values() for b in bufs), \
            "a buffer a copy may still write into went back to the pool (the next step would share it)"
    _join(bg.stop)
    finished = StagedStep(2, 0, 0, {"x": buffer}, {}, 16, event=_CopyInFlight(), pinned=[(buffer, True)])
    finished.wait()  # the copy is complete: its buffers may be reused
    bg._release(finished)
    with pool._lock:
        assert any(b is buffer for bufs in pool._free.values() for b in bufs)


def test_idle_pinned_buffers_are_bounded_in_bytes_across_shapes():
    """A run whose sequence length changes every step (a new shape each time) must not keep pinned
    buffers of every shape it ever saw: at most ``max_idle_pinned_bytes`` of them stay idle."""
    pool = BufferPool(per_key=4, pinned_per_key=4, max_idle_pinned_bytes=1000)
    for T in range(1, 200):  # buffers of 4 * T float32: 16 * T bytes each (flagged pinned: no GPU here)
        pool.give([(torch.zeros(4, T), True)])
    with pool._lock:
        idle = sum(b.nbytes for bufs in pool._free.values() for b in bufs)
        assert 0 < idle <= 1000
        assert len(pool._free) <= 1000 // 16  # no empty lists left behind for shapes not kept


def test_with_warnings_as_errors_a_failed_write_neither_kills_the_writer_thread_nor_hangs_training(tmp_path):
    """``python -W error`` (or pytest's ``filterwarnings = error``) turns the writer thread's
    'dropped a step' warning into an exception: it killed the thread, and the next flush() (or
    record() once the queue was full) waited forever. The drop is counted once and logged instead."""
    from unittest import mock

    import tracer.record.writer as writer_module

    real = writer_module._save_atomic

    def disk_full_at_step_1(path, tensors, metadata, *specs):  # a fault: the disk fills up for one file
        if path.name.startswith("step_00000001."):
            raise OSError(28, "No space left on device")
        return real(path, tensors, metadata, *specs)

    writer = TraceWriter(tmp_path / "run", "grpo", max_queue_steps=2)
    with warnings.catch_warnings(), mock.patch.object(writer_module, "_save_atomic", disk_full_at_step_1):
        warnings.simplefilter("error")

        def loop():
            for step in range(5):
                writer.record(step, {"policy_logprobs": torch.full((2, 3), -float(step))})
                writer.flush()
            writer.close()

        _join(loop)
    assert writer.steps_written == 4 and writer.dropped_steps == 1
    assert [k.step for k in Trace(tmp_path / "run").steps()] == [0, 2, 3, 4]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["dropped_steps"] == 1 and "No space left on device" in manifest["drop_reasons"][0]


def test_an_owned_tensor_on_a_device_other_than_the_cpu_is_copied_to_host_memory():
    """Zero-edit capture's indexed rows are staged without a copy, but only when they are host
    memory: an ``x[inds]`` on MPS or XPU (neither CPU nor CUDA) was kept on its device, and once its
    signature was remembered as stored form, its checksum pass (which reads host memory) dropped
    every later step. The meta device stands in for such a device here (no MPS/XPU on this machine):
    copying it to the host is attempted (and fails: meta tensors hold no data)."""
    rows = torch.empty(2, 3, device="meta")
    with pytest.raises(NotImplementedError):
        stage({"old_logprobs": rows}, BufferPool(), owned={"old_logprobs"}, reuse=True)
    cpu_rows = torch.zeros(2, 3)
    staged, _, _, _ = stage({"old_logprobs": cpu_rows}, BufferPool(), owned={"old_logprobs"}, reuse=True)
    assert staged["old_logprobs"] is cpu_rows  # the CPU shortcut stays


@pytest.mark.parametrize("reuse", [False, True])
def test_staged_tensors_are_host_memory_whatever_the_device(reuse):
    """``async_write=False`` (no buffer reuse) and empty tensors were cloned on their own device: on
    MPS or XPU the first step was converted to host memory by the normalisation pass, its signature
    remembered as stored form, and every later step dropped (its bytes are read from host memory).
    The meta device stands in for such a device (no MPS/XPU here): a host copy is attempted, and
    fails because meta tensors hold no data."""
    for shape in ((2, 3), (0, 3)):
        with pytest.raises(NotImplementedError):
            stage({"policy_logprobs": torch.empty(shape, device="meta")}, BufferPool(), reuse=reuse)


def test_float8_and_complex_extra_fields_are_written_and_verified(tmp_path):
    """An extra float8_e4m3fn field cost its step (torch has no isfinite for it: the non-finite scan
    raised), and ``info --verify`` could not verify a file holding a complex64 or float8_e8m0fnu
    tensor (their safetensors names C64 and F8_E8M0 were unknown)."""
    from tracer.format.integrity import verify_step_file

    fp8 = torch.tensor([0.5, float("nan"), 2.0]).to(torch.float8_e4m3fn)  # e4m3fn holds a NaN, no infinity
    extras = {"scale_fp8": fp8, "phase": torch.tensor([1 + 2j, -1j], dtype=torch.complex64)}
    if hasattr(torch, "float8_e8m0fnu"):
        extras["block_scale"] = torch.tensor([0.5, 4.0]).to(torch.float8_e8m0fnu)
    with TraceWriter(tmp_path / "run", "grpo", strict=True) as writer:
        writer.record(0, {"policy_logprobs": torch.zeros(2, 3), **extras})
    trace = Trace(tmp_path / "run")
    (key,) = trace.steps()
    data = trace.load_step(key)
    for name, tensor in extras.items():
        assert data[name].dtype == tensor.dtype
        assert data[name].view(torch.uint8).tolist() == tensor.view(torch.uint8).tolist(), name
    assert trace.metadata(key)["nonfinite_fields"] == ["scale_fp8"]
    assert verify_step_file(key.path) == trace.metadata(key)["content_sha256"]
