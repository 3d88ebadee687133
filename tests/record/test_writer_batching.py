"""The writer thread's batching and its cheaper per-step work: steps that arrive close
together are handled as one batch (their summaries computed together), without ever making a step
wait or drop, and without changing a byte of what is written. Values are checked against
step-by-step and numpy computations; no wall-time assertions (a hang is caught by a join timeout)."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from unittest import mock

import numpy as np
import pytest
import torch

import tracer
from tracer import formulas
from tracer.zero_edit import frames
from tracer.formulas import summaries
from tracer.format import summary as summary_format
from tracer.record.batches import nonfinite_fields
from tracer.record.capture import StagedStep
from tracer.record.thread import BackgroundWriter
from tracer.errors import TraceError
from tracer.format.hashing import content_sha256, tensor_bytes
from tracer.zero_edit.name_maps import load_name_map
from tracer.read import Trace
from tracer.format.metadata_codec import encode_metadata, jsonable
from tracer.record.writer import TraceWriter

QS = (0.1, 0.5, 0.9, 1.0)


def _step(seed: int, B: int = 4, T: int = 6, per_token_adv: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    policy = -2 * torch.rand(B, T, generator=g)
    old = policy + 0.2 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    ratio = torch.exp(policy - old)
    if seed % 3 == 1:
        ratio[0, 1], mask[0, 1] = float("nan"), True  # a NaN at a kept position
    return {"completion_ids": torch.randint(0, 30, (B, T), generator=g), "completion_mask": mask,
            "policy_logprobs": policy, "old_logprobs": old, "sampler_logprobs": old + 0.01, "ratio": ratio,
            "approx_kl_k2": 0.5 * (policy - old) ** 2, "rewards": torch.rand(B, generator=g),
            "advantages": torch.randn(B, T, generator=g) if per_token_adv else torch.randn(B, generator=g)}


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7, nan_ok=True), key


def test_batched_summaries_equal_step_by_step_ones_across_mixed_shapes():
    eps = {"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28}
    steps = [(_step(0), eps), (_step(1), eps), (_step(2, T=3), eps), (_step(3, per_token_adv=True), eps),
             (_step(4), {}), (_step(5), eps), (_step(6, B=2, T=0), eps)]
    batched = summaries.compute_summaries(steps)
    assert len(batched) == len(steps)
    for (tensors, meta), got in zip(steps, batched):
        _close(got, summaries.compute_summary(tensors, meta))
    # and against numpy for one of the stacked steps (a NaN kept: the mean is NaN, quantiles leave it out)
    t = steps[1][0]
    kept = t["ratio"].numpy()[t["completion_mask"].numpy()]
    assert np.isnan(batched[1]["mean_ratio"])
    assert batched[1]["ratio_p90"] == pytest.approx(np.nanquantile(kept, 0.9), rel=1e-6)
    assert batched[6]["kept_tokens"] == 0 and np.isnan(batched[6]["ratio_p50"])


def test_masked_row_quantiles_match_numpy_row_by_row():
    g = torch.Generator().manual_seed(7)
    values = torch.randn(6, 11, generator=g)
    mask = torch.rand(6, 11, generator=g) > 0.4
    values[1, 3], mask[1, 3] = float("nan"), True
    values[2, 0], mask[2, 0] = float("inf"), True
    mask[3] = False  # nothing kept
    mask[4] = True
    got = formulas.masked_row_quantiles(values, mask, QS)
    for r in range(6):
        kept = values[r].numpy()[mask[r].numpy()]
        kept = kept[~np.isnan(kept)]
        if np.isfinite(kept).all():  # numpy interpolates inf - inf into NaN; tracer keeps inf (see row_quantiles)
            want = np.quantile(kept, QS) if kept.size else np.full(len(QS), np.nan)
            np.testing.assert_allclose(got[r].numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(got[r].numpy(), formulas.masked_quantiles(values[r], mask[r], QS).numpy())
    assert got[2, -1] == float("inf") and torch.isnan(got[3]).all()


def _spy_batches(sizes: list[int]):
    real = summaries.compute_summaries

    def spy(steps):
        sizes.append(len(steps))
        return real(steps)
    return spy


def test_steps_recorded_close_together_are_summarised_as_one_batch(tmp_path):
    sizes: list[int] = []
    with mock.patch.object(summaries, "compute_summaries", _spy_batches(sizes)), \
            mock.patch("tracer.record.thread.LINGER_S", 3600.0):  # only the batch bound or a flush ends a wait
        with TraceWriter(tmp_path / "run", "grpo", max_queue_steps=64) as writer:
            for step in range(20):
                writer.record(step, _step(step))
            done = threading.Thread(target=writer.flush)
            done.start()
            done.join(60)
            assert not done.is_alive(), "flush() waited for the linger instead of writing at once"
            assert len(Trace(tmp_path / "run").steps()) == 20
    assert sum(sizes) == 20 and max(sizes) > 1
    trace = Trace(tmp_path / "run")
    for key in trace.steps():  # every header holds the summary its own tensors give
        data, meta = trace.load_step(key), trace.metadata(key)
        _close(summary_format.read_summary(meta), summaries.compute_summary(data, meta))


def test_the_default_queue_lets_the_writer_thread_fill_a_whole_batch(tmp_path):
    """Lingering stops at half the queue's bound, so the default bound is twice MAX_BATCH: steps that
    arrive while the writer thread lingers are handled MAX_BATCH at a time (a batch's cold start is
    most of a small step's cost: BENCHMARKS.md, "Writer throughput and CPU"), not half that."""
    from tracer.record.thread import MAX_BATCH

    sizes: list[int] = []
    with mock.patch.object(summaries, "compute_summaries", _spy_batches(sizes)), \
            mock.patch("tracer.record.thread.LINGER_S", 3600.0):  # only the batch bound or a flush ends a wait
        with TraceWriter(tmp_path / "run", "grpo") as writer:
            for step in range(MAX_BATCH):
                writer.record(step, _step(step))
                threading.Event().wait(0.01)  # time for the writer thread to take what is there
            for _ in range(600):  # at most a minute: a full batch is written without a flush
                if sizes:
                    break
                threading.Event().wait(0.1)
            assert sizes == [MAX_BATCH]


def test_lingering_stops_at_half_the_queue_so_it_never_makes_a_step_drop():
    written, drops = [], []
    bg = BackgroundWriter(lambda it, reason: written.append(it.step), lambda it: None, lambda it, e: None,
                          drops.append, max_steps=4, max_bytes=10_000, when_full="drop", linger_s=3600.0)
    for step in range(2):  # half the queue's 4 steps: the writer must start now, not linger
        assert bg.put(StagedStep(step, 0, 0, {"x": torch.zeros(1)}, {}, 10))
    stopper = threading.Thread(target=lambda: [bg.flush(), bg.stop()])
    for _ in range(600):  # at most a minute: the two steps are written without a flush
        if len(written) == 2:
            break
        threading.Event().wait(0.1)
    assert written == [0, 1] and not drops
    stopper.start()
    stopper.join(60)
    assert not stopper.is_alive()


def test_a_failing_summary_in_a_batch_costs_only_its_own_step(tmp_path):
    real = summaries.compute_summaries

    def fragile(steps):
        if any(meta.get("poison") for _, meta in steps):
            raise RuntimeError("boom")
        return real(steps)

    with mock.patch.object(summaries, "compute_summaries", fragile), mock.patch("tracer.record.thread.LINGER_S", 3600.0):
        with TraceWriter(tmp_path / "run", "grpo", max_queue_steps=64) as writer:
            for step in range(6):
                writer.record(step, _step(step), metadata={"poison": True} if step == 3 else None)
    trace = Trace(tmp_path / "run")
    has = {key.step: "summary" in trace.metadata(key) for key in trace.steps()}
    assert has == {0: True, 1: True, 2: True, 3: False, 4: True, 5: True}


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32, torch.float16, torch.bfloat16])
def test_tensor_bytes_are_the_tensor_memory(dtype):
    t = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    assert bytes(tensor_bytes(t)) == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert bytes(tensor_bytes(torch.zeros(0, 4, dtype=dtype))) == b""
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        tensor_bytes(torch.zeros(4, 4, dtype=dtype).t())


def test_content_checksum_is_unchanged_by_the_buffer_path():
    tensors = {"b": torch.randn(3, 2), "a": torch.tensor([True, False]), "c": torch.tensor(5)}
    digest = hashlib.sha256()  # the scheme of tracer.format.names, computed here through numpy
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    assert content_sha256(tensors) == digest.hexdigest()


def test_nonfinite_fields_numpy_and_torch_paths():
    tensors = {"ok": torch.zeros(3), "nan": torch.tensor([0.0, float("nan")]), "ids": torch.tensor([1, 2]),
               "neg_inf": torch.tensor([float("-inf")], dtype=torch.float64),
               "bf16_inf": torch.tensor([1.0, float("inf")], dtype=torch.bfloat16),
               "half_ok": torch.ones(2, dtype=torch.float16), "empty": torch.zeros(0)}
    assert nonfinite_fields(tensors) == ["nan", "neg_inf", "bf16_inf"]
    assert nonfinite_fields({"a": torch.ones(4, 4)}) == []


def test_encoded_metadata_fast_path_equals_the_general_one():
    values = {"beta": 0.04, "n": 8, "flag": True, "summary": {"version": 1, "mean_ratio": float("nan"), "kept": 3},
              "nested": {"a": [1, 2]}, "tuple": (1, 2), "np": np.float32(0.5), "text": "x"}
    got = encode_metadata(values)
    want = {k: v if isinstance(v, str) else json.dumps(jsonable(v), allow_nan=True) for k, v in values.items()}
    assert got == want


def test_writer_reuses_the_hyperparameter_encoding_unless_a_step_overrides_it(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters={"beta": 0.04, "num_generations": 2}) as writer:
        writer.record(0, _step(0))
        writer.record(1, _step(1), metadata={"beta": 0.1})
    trace = Trace(tmp_path / "run")
    assert [trace.metadata(k)["beta"] for k in trace.steps()] == [0.04, 0.1]
    assert all(trace.metadata(k)["num_generations"] == 2 for k in trace.steps())


def _capture(memo, mask):
    """read_frame on this frame, whose locals are a GRPO loop's (the mask given)."""
    policy_logprobs = torch.full((2, 3), -1.0)
    old_logprobs = torch.full((2, 3), -1.1)
    completion_mask = mask
    advantages = torch.tensor([0.5, -0.5])
    capture = frames.read_frame(sys._getframe(), load_name_map(None, "grpo"), "grpo", memo)
    assert capture.fields["policy_logprobs"] is policy_logprobs  # the frame's own variables are read
    assert capture.sources["old_logprobs"] == "old_logprobs" and advantages is not None and completion_mask is not None
    return capture


def test_remembered_schema_checks_still_check_float_mask_values_every_time():
    memo: dict = {}
    good = _capture(memo, torch.ones(2, 3))
    assert "completion_mask" in good.fields and memo
    bad = _capture(memo, torch.full((2, 3), 0.5))  # same signature, values a mask cannot hold
    assert "completion_mask" not in bad.fields
    assert any("0 and 1" in why for why in bad.rejected.values())
    wrong_shape = _capture(memo, torch.ones(2, 4, dtype=torch.bool))  # T = 4 against the logprobs' 3
    again = _capture(memo, torch.ones(2, 4, dtype=torch.bool))  # remembered: refused the same way
    assert "completion_mask" not in wrong_shape.fields and "completion_mask" not in again.fields
    assert wrong_shape.rejected == again.rejected
    assert "completion_mask" in _capture(memo, torch.ones(2, 3, dtype=torch.bool)).fields


def test_a_paused_watcher_leaves_backward_alone_and_resumes_into_the_same_trace(tmp_path):
    weight = torch.nn.Parameter(torch.zeros(3))

    def train_step(step):
        policy_logprobs = torch.log_softmax(weight.expand(2, 3), dim=-1)
        completion_mask = torch.ones(2, 3, dtype=torch.bool)
        loss = -(policy_logprobs * completion_mask).mean()
        loss.backward()
        return completion_mask

    original = torch.Tensor.backward
    with tracer.watch(algo="grpo", out=tmp_path / "run", nothing_traced="ignore") as w:
        train_step(0)
        with w.paused():
            assert torch.Tensor.backward is original
            train_step(1)
        assert torch.Tensor.backward is not original
        train_step(2)
    assert w.backward_calls == 2 and w.steps_recorded == 2
    assert [k.step for k in Trace(tmp_path / "run").steps()] == [0, 2]  # the loop's own step counter
    with pytest.raises(TraceError, match="only for an active watcher"):
        with w.paused():
            pass


def test_owned_tensors_are_staged_without_a_copy_and_others_are_copied():
    from tracer.record.capture import stage

    fresh = torch.arange(6.0).reshape(2, 3)[torch.tensor([1, 0])]  # indexed rows: a new tensor
    view = torch.arange(6.0).reshape(2, 3)[:1]  # a view of someone's tensor
    grad = torch.ones(2, requires_grad=True) * 2
    loop_owned = torch.zeros(2)
    staged, _, _, nbytes = stage({"fresh": fresh, "view": view, "grad": grad, "loop": loop_owned},
                                 owned={"fresh", "view", "grad"})
    assert staged["fresh"] is fresh  # made for this record alone: kept as it is
    assert staged["view"] is not view and staged["view"]._base is None  # a view is copied even when named
    assert staged["grad"] is not grad and not staged["grad"].requires_grad
    assert staged["loop"] is not loop_owned  # not named: copied, the loop may mutate its own tensor
    loop_owned += 1
    assert staged["loop"].tolist() == [0.0, 0.0]
    assert nbytes == sum(t.nbytes for t in (fresh, view, grad, loop_owned))


def test_an_unexpected_error_in_the_writer_thread_drops_the_batch_and_the_thread_goes_on():
    written, drops, errors = [], [], []
    calls = {"n": 0}

    def write(item, reason):
        calls["n"] += 1
        if item.step == 1:
            raise RuntimeError("a bug in the write path")
        written.append(item.step)

    bg = BackgroundWriter(write, lambda it: None, lambda it, e: errors.append((it.step, repr(e))), drops.append,
                          max_steps=8, max_bytes=10_000, linger_s=0.0)
    for step in range(3):
        bg.put(StagedStep(step, 0, 0, {"x": torch.zeros(1)}, {}, 10))
        bg.flush()  # one step per batch
    stopper = threading.Thread(target=bg.stop)
    stopper.start()
    stopper.join(60)
    assert not stopper.is_alive(), "the writer thread died and stop() waits forever"
    # the lost step goes to on_error (the writer counts it, and strict mode raises it); nothing else is lost
    assert written == [0, 2] and errors == [(1, "RuntimeError('a bug in the write path')")] and not drops


def test_staging_buffers_are_reused_once_written_and_never_shared_while_queued(tmp_path):
    from tracer.record.capture import BufferPool, stage

    pool = BufferPool(per_key=8, max_idle_bytes=10_000)
    a = {"x": torch.arange(4.0), "y": torch.ones(2, 2)}
    staged1, _, buffers1, _ = stage(a, pool, reuse=True)
    staged2, _, buffers2, _ = stage(a, pool, reuse=True)  # the first step is not written yet
    assert staged1["x"].data_ptr() != staged2["x"].data_ptr()
    pool.give(buffers1)
    staged3, _, _, _ = stage({"x": torch.full((4,), 7.0), "y": torch.zeros(2, 2)}, pool, reuse=True)
    assert staged3["x"].data_ptr() == staged1["x"].data_ptr()  # warm memory, reused
    assert staged3["x"].tolist() == [7.0] * 4 and staged2["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    big = BufferPool(per_key=8, max_idle_bytes=8)  # idle plain buffers are bounded in bytes
    _, _, held, _ = stage({"x": torch.zeros(4)}, big, reuse=True)
    big.give(held)
    assert big.take(torch.Size([4]), torch.float32, pinned=False).data_ptr() != held[0][0].data_ptr()
    # end to end: every step's file holds its own values although buffers were reused
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        for step in range(40):
            writer.record(step, {**_step(0), "rewards": torch.full((4,), float(step))})
    trace = Trace(tmp_path / "run")
    assert [trace.load_step(k)["rewards"][0].item() for k in trace.steps()] == [float(s) for s in range(40)]


@pytest.mark.parametrize("seed", range(6))
def test_step_bytes_equal_the_reference_checksum_and_nonfinite_scan(seed):
    from tracer.record import step_bytes

    g = torch.Generator().manual_seed(seed)
    tensors = {"policy_logprobs": -torch.rand(3, 5, generator=g), "ids": torch.randint(0, 9, (3, 5), generator=g),
               "mask": torch.rand(3, 5, generator=g) > 0.5, "half": torch.randn(4, generator=g).half(),
               "bf": torch.randn(2, generator=g).bfloat16(), "wide": torch.randn(2, generator=g).double(),
               "scalar": torch.tensor(0.5), "empty": torch.zeros(0, 3)}
    if seed % 2:
        tensors["policy_logprobs"][1, 2] = float("nan")
        tensors["bf"][0] = float("inf")
        tensors["wide"][1] = float("-inf")
    plan = step_bytes.make_plan(tensors)
    got = step_bytes.describe(tensors, plan)
    assert got.content_sha256 == content_sha256(tensors)
    assert got.nonfinite == nonfinite_fields(tensors)
    assert got.specs is None  # an empty tensor: written by save_file
    del tensors["empty"]
    got = step_bytes.describe(tensors, step_bytes.make_plan(tensors))
    assert sorted(got.specs) == sorted(tensors)  # pointer specs of every field
    assert got.content_sha256 == content_sha256(tensors)
    big = {**tensors, "big": torch.zeros(step_bytes.CONCAT_BYTES // 4 + 1)}  # beyond a joined copy: per piece
    got = step_bytes.describe(big, step_bytes.make_plan(big))
    assert set(got.specs) == set(big) and got.content_sha256 == content_sha256(big)
    assert got.nonfinite == nonfinite_fields(big)


def test_a_known_cpu_signature_is_staged_into_one_reused_buffer_group(tmp_path):
    from tracer.record.capture import BufferGroup, BufferPool, stage

    pool = BufferPool(per_key=8)
    grad = torch.randn(3, 4, requires_grad=True)
    base = torch.arange(12.0).reshape(3, 4)
    step = {"ratio": grad * 1, "policy_logprobs": base.t(), "completion_mask": torch.ones(3, 4, dtype=torch.bool),
            "empty": torch.zeros(0, 4)}
    key = tuple((n, t.shape, t.dtype, t.device) for n, t in step.items())
    want = {n: t.detach().clone() for n, t in step.items()}
    staged, event, buffers, nbytes = stage(step, pool, reuse=True, group_key=key)
    assert event is None and len(buffers) == 1 and isinstance(buffers[0][0], BufferGroup)
    assert nbytes == sum(t.nbytes for t in step.values())
    assert torch.is_grad_enabled()  # the grad mode the copy turned off is on again
    for name, t in staged.items():  # the values at record time, contiguous, no graph, each its own memory
        assert torch.equal(t, want[name]) and t.is_contiguous() and not t.requires_grad and t._base is None
    base += 100  # the loop mutates its tensors right after recording: the staged copy keeps the old values
    assert torch.equal(staged["policy_logprobs"], want["policy_logprobs"])
    again, _, buffers2, _ = stage(step, pool, reuse=True, group_key=key)  # step 1 is not written yet
    assert again["ratio"].data_ptr() != staged["ratio"].data_ptr()
    pool.give(buffers)  # step 1 written: its group may be reused
    base += 100
    third, _, _, _ = stage(step, pool, reuse=True, group_key=key)
    assert third["ratio"].data_ptr() == staged["ratio"].data_ptr()  # the written step's group, reused warm
    assert torch.equal(third["policy_logprobs"], base.t())
    assert torch.equal(again["policy_logprobs"], base.t() - 100)  # the queued step 2 keeps its own values
    # through the writer: every step's file holds its own values though the groups are reused
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        for s in range(40):
            writer.record(s, {**_step(0), "rewards": torch.full((4,), float(s))})
    trace = Trace(tmp_path / "run")
    assert [trace.load_step(k)["rewards"][0].item() for k in trace.steps()] == [float(s) for s in range(40)]


class _CountingCondition(threading.Condition):
    """Counts the notifications made by the thread that created it (the training thread's put())."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.owner, self.notified = threading.get_ident(), 0  # get_ident: no Thread object made while patched

    def notify_all(self) -> None:
        if threading.get_ident() == self.owner:
            self.notified += 1
        super().notify_all()


def test_a_lingering_writer_thread_is_woken_only_by_a_first_step_or_a_full_batch():
    """Every wake-up of the writer thread is a hand-off of the interpreter lock in the middle of the
    training thread's record(): put() wakes it for the first step of a batch and when the batch is
    full, not for each step in between (the lingering wait ends by itself)."""
    written: list[int] = []
    with mock.patch("tracer.record.thread.threading.Condition", _CountingCondition):
        bg = BackgroundWriter(lambda it, reason: written.append(it.step), lambda it: None, lambda it, e: None,
                              lambda r: None, max_steps=64, max_bytes=10**6, linger_s=3600.0, max_batch=4)
    for step in range(4):
        bg.put(StagedStep(step, 0, 0, {"x": torch.zeros(1)}, {}, 10))
    for _ in range(600):  # the full batch is written without a flush
        if len(written) == 4:
            break
        threading.Event().wait(0.1)
    assert written == [0, 1, 2, 3]
    assert bg._cond.notified == 2, "put() woke the lingering writer thread for steps in the middle of a batch"
    bg.stop()


def test_a_step_dropped_for_want_of_room_ends_the_lingering_so_the_next_finds_room():
    """A step of more than half the bytes bound, arriving while the thread lingers over a small one,
    cannot fit and is dropped (``drop`` never waits); the thread then writes what it holds instead of
    lingering on, so the steps after it find the queue empty and are kept."""
    written, drops = [], []
    bg = BackgroundWriter(lambda it, reason: written.append(it.step), lambda it: None, lambda it, e: None,
                          drops.append, max_steps=64, max_bytes=1_000, when_full="drop", linger_s=3600.0)
    assert bg.put(StagedStep(0, 0, 0, {"x": torch.zeros(1)}, {}, 100))  # lingered over (a tenth of the bytes)
    assert not bg.put(StagedStep(1, 0, 0, {"x": torch.zeros(1)}, {}, 950))  # 100 + 950 > 1000: dropped
    for _ in range(600):  # at most a minute (the linger is an hour): step 0 written without a flush
        if written:
            break
        threading.Event().wait(0.1)
    assert written == [0] and len(drops) == 1
    with bg._cond:  # the writer thread is done with its batch before the next step comes
        while bg._busy:
            bg._cond.wait()
    assert bg.put(StagedStep(2, 0, 0, {"x": torch.zeros(1)}, {}, 950))  # an empty queue always fits
    stopper = threading.Thread(target=lambda: [bg.flush(), bg.stop()])
    stopper.start()
    stopper.join(60)
    assert not stopper.is_alive() and written == [0, 2] and len(drops) == 1


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
