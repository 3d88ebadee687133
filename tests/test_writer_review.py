"""Review of the batched writer thread and the staging buffer pool (issue 16): faults that must not
corrupt a step held for later, lose an error in strict mode, or hand back a buffer a copy may still
be writing into. Each test failed before its fix; values are worked out by hand in the test."""

from __future__ import annotations

import json
import threading
import warnings

import pytest
import torch

from tracer.record import capture
from tracer.record.capture import BufferPool, StagedStep, stage
from tracer.record.thread import BackgroundWriter
from tracer.errors import TraceError
from tracer.read.reader import Trace
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


def _ppo_like(seed: int, B: int, T: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    policy = -torch.rand(B, T, generator=g)
    old = policy + 0.1 * torch.randn(B, T, generator=g)
    return {"completion_mask": torch.rand(B, T, generator=g) > 0.2, "ratio": torch.exp(policy - old),
            "old_logprobs": old, "sampler_logprobs": old + 0.01, "rewards": torch.randn(B, generator=g),
            "advantages": torch.randn(B, generator=g)}


def test_large_steps_are_not_stacked_into_one_summary_batch(monkeypatch):
    """Stacking copies every step's fields, masks and sort indices at once (several times the steps'
    bytes): 16 large steps summarised together needed about 7x the memory of one at a time. A stack
    holds at most MAX_STACKED_VALUES values per field; small steps are still stacked 16 at a time,
    and either way the numbers are those of each step alone."""
    from tracer.format import summary as summary_format
    from tracer.formulas import summaries

    sizes: list[int] = []
    real = summaries._summarise_group

    def spy(tensors, metadata, S):
        sizes.append(S)
        return real(tensors, metadata, S)

    monkeypatch.setattr(summaries, "_summarise_group", spy)
    eps = {"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28}
    T = summaries.MAX_STACKED_VALUES // 8 // 4  # B = 8: a quarter of the bound per field, so 4 steps per stack
    large = [(_ppo_like(s, 8, T), eps) for s in range(10)]
    got = summaries.compute_summaries(large)
    assert sizes == [4, 4, 2]
    small = [(_ppo_like(s, 4, 6), eps) for s in range(16)]
    sizes.clear()
    got_small = summaries.compute_summaries(small)
    assert sizes == [16]
    for steps, batched in ((large, got), (small, got_small)):
        for (tensors, meta), summary in zip(steps, batched):
            alone = summaries.compute_summary(tensors, meta)
            assert summary.keys() == alone.keys()
            assert all(summary[k] == alone[k] for k in alone)  # no NaN here: exact equality


def test_pauses_nest_and_a_watcher_ended_during_a_pause_stays_off(tmp_path):
    import tracer

    weight = torch.nn.Parameter(torch.zeros(3))

    def train_step():
        policy_logprobs = torch.log_softmax(weight.expand(2, 3), dim=-1)
        completion_mask = torch.ones(2, 3, dtype=torch.bool)
        (-(policy_logprobs * completion_mask).mean()).backward()
        return completion_mask

    original = torch.Tensor.backward
    with tracer.watch(algo="grpo", out=tmp_path / "run", nothing_traced="ignore") as w:
        train_step()
        with w.paused():  # an evaluation helper that pauses, called inside a paused probe
            with w.paused():
                train_step()
            assert torch.Tensor.backward is original  # leaving the inner pause does not resume tracing
            train_step()
        train_step()
    assert w.steps_recorded == 2 and w.backward_calls == 2
    assert torch.Tensor.backward is original

    other = tracer.watch(algo="grpo", out=tmp_path / "other", nothing_traced="ignore")
    other.__enter__()
    pause = other.paused()
    pause.__enter__()
    other.__exit__(None, None, None)  # the watcher's block ends inside the pause
    pause.__exit__(None, None, None)
    assert torch.Tensor.backward is original, "a finished watcher was put back on backward"


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


# -- property: what is on disk is what was recorded ---------------------------------------------------

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tracer.record.capture import SamplingPolicy  # noqa: E402
from tracer.format.schema import FIELDS  # noqa: E402

_FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _random_tensor(rng, shape: tuple[int, ...], kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "float":
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(rng.choice(_FLOATS))
        if t.numel() and rng.random() < 0.2:
            t.view(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf")])
    elif kind == "int64":
        t = torch.randint(0, 50, shape, generator=g, dtype=rng.choice([torch.int64, torch.int32]))
    else:
        t = (torch.rand(shape, generator=g) > 0.3).to(rng.choice([torch.bool, torch.float32, torch.uint8]))
    if len(shape) == 2 and rng.random() < 0.2:
        return t.t().contiguous().t()  # not contiguous
    if shape and rng.random() < 0.2:  # a view at an offset into a larger tensor
        big = torch.zeros((shape[0] + 2, *shape[1:]), dtype=t.dtype)
        big[1:1 + shape[0]] = t
        return big[1:1 + shape[0]]
    return t


def _random_step(rng, algorithm: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    dims = {"B": rng.choice([0, 1, 3, 4]), "T": rng.choice([0, 1, 5]), "L": 2, "F": 3}
    names = [n for n, s in FIELDS.items() if algorithm in s.required_for]
    names += [n for n in ("ref_logprobs", "sampler_logprobs", "old_logprobs", "ratio", "ref_kl_k3", "loss")
              if n not in names and rng.random() < 0.5]
    step = {n: _random_tensor(rng, tuple(dims[d] for d in FIELDS[n].dims_for(algorithm)), FIELDS[n].kind, g)
            for n in names}
    if "old_logprobs" in step and "sampler_logprobs" in step and rng.random() < 0.3:
        step["sampler_logprobs"] = step["old_logprobs"]  # one tensor under two names
    return step


def _as_stored(name: str, t: torch.Tensor, keep: bool, algorithm: str, k: int | None) -> torch.Tensor:
    """The stored form, worked out independently of the writer (SPEC section 4)."""
    spec, t = FIELDS[name], t.detach().clone()
    t = t != 0 if spec.kind == "bool" else t.long() if spec.kind == "int64" else t if keep else t.float()
    return t[:k] if k is not None and spec.dims_for(algorithm)[:1] == ("B",) else t


@settings(max_examples=30, deadline=None, phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rng=st.randoms(use_true_random=False))
def test_every_written_tensor_equals_a_copy_taken_at_record_time(tmp_path_factory, rng):
    """Random steps (dtypes, layouts, empty dims, NaNs, one tensor under two names) through the
    batched writer thread with buffer reuse, the anomaly ring, first_k_sequences, both queue
    policies; the loop overwrites its tensors right after each record. Every file holds the values
    recorded, its checksum verifies, and its header summary is compute_summary of its own tensors."""
    from tracer.format import summary as summary_format
    from tracer.formulas import summaries
    from tracer.format.integrity import verify_step_file

    algorithm = rng.choice(["ppo", "grpo", "rloo"])
    keep, k = rng.random() < 0.4, rng.choice([None, 1, 2])
    ring = rng.choice([0, 3])
    sampling = SamplingPolicy(every_n_steps=rng.choice([1, 2]), first_k_sequences=k, anomaly_ring=ring)
    root = tmp_path_factory.mktemp("run") / "t"
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # drops (when_full="drop") are allowed here
        with TraceWriter(root, algorithm, keep_source_dtype=keep, sampling=sampling,
                         when_full=rng.choice(["block", "drop"]), max_queue_steps=rng.choice([1, 4, 16]),
                         hyperparameters={"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28},
                         async_write=bool(ring) or rng.random() < 0.8) as writer:
            for step in range(16):
                tensors = _random_step(rng, algorithm, g)
                expected[step] = {n: _as_stored(n, t, keep, algorithm, k) for n, t in tensors.items()}
                writer.record(step, tensors)
                for t in tensors.values():  # the loop reuses its tensors in place
                    t.fill_(7) if t.dtype != torch.bool else t.logical_not_()
    trace = Trace(root)
    for key in trace.steps():
        data, meta = trace.load_step(key, derive=False), trace.metadata(key)
        want = expected[key.step]
        assert data.keys() == want.keys()
        for name, tensor in want.items():
            assert data[name].dtype == tensor.dtype and data[name].shape == tensor.shape, name
            # exact; NaN where NaN was recorded (its payload bits follow torch's conversion path, not the data)
            torch.testing.assert_close(data[name], tensor, rtol=0, atol=0, equal_nan=True, msg=name)
        assert verify_step_file(key.path) == meta["content_sha256"]
        stored, own = summary_format.read_summary(meta), summaries.compute_summary(trace.load_step(key), meta)
        assert stored.keys() == own.keys()
        assert all(stored[n] == own[n] or (stored[n] != stored[n] and own[n] != own[n]) for n in own)
