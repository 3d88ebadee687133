"""Zero-edit capture overlapped with the backward it precedes (tracer/watch.py, ``_CaptureThread``):
the capture runs on the helper thread while the backward runs, and the loop's next line runs only
once it is done, so a loop that overwrites its tensors right after ``backward()`` still has the
values it held at the backward recorded; warnings are raised on the training thread and point at
the loop's line; ``strict`` captures on the training thread, before the backward.

The loops are hand-written GRPO-style loops with MiniMind's names (no tracing code in them); the
values asserted are worked out by hand."""

from __future__ import annotations

import math
import sys
import threading
import time
import warnings

import pytest
import torch

import tracer
from tracer import Trace, TraceError

WATCH = sys.modules["tracer.watch"]  # (tracer.watch is also the function's name)
STEPS = 4
LOG_FIFTH = math.log(1 / 5)


def overwriting_loop() -> int:
    """Four GRPO steps whose tensors are overwritten in place right after each ``backward()``: the
    old logprobs, advantages and mask are reused buffers (filled with step-dependent values before
    the backward, zeroed after it), as a loop that preallocates its rollout buffers does. Returns
    the line of its ``backward()`` call."""
    weight = torch.nn.Parameter(torch.zeros(2, 3, 5))  # never stepped: every logprob is log(1/5)
    completion_ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    old_per_token_logps = torch.empty(2, 3)
    advantages = torch.empty(2)
    completion_mask = torch.empty(2, 3)
    for step in range(STEPS):
        old_per_token_logps.fill_(-1.0 - step)
        advantages.copy_(torch.tensor([step + 0.5, -step - 0.5]))
        completion_mask.copy_(torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
        per_token_logps = weight.log_softmax(-1).gather(2, completion_ids.unsqueeze(-1)).squeeze(-1)
        loss = -(per_token_logps * advantages[:, None] * completion_mask).sum()
        line = sys._getframe().f_lineno + 1
        loss.backward()
        old_per_token_logps.zero_()  # the loop reuses its buffers at once
        advantages.zero_()
        completion_mask.zero_()
    return line


@pytest.fixture
def slow_capture(monkeypatch):
    """Each capture sleeps 50 ms first (many times the backward of these loops) and notes its thread:
    without the wait after the backward, the loop's overwrite would run before the capture reads."""
    threads: list[str] = []
    real = WATCH.Watcher._capture

    def slow(self, frame, job=None):
        threads.append(threading.current_thread().name)
        time.sleep(0.05)
        return real(self, frame, job)

    monkeypatch.setattr(WATCH.Watcher, "_capture", slow)
    return threads


def test_overlapped_capture_records_what_the_loop_held_at_backward(tmp_path, slow_capture):
    with tracer.watch(algo="grpo", out=tmp_path / "t", overlap=True) as w:
        overwriting_loop()
    assert w.overlap and w.steps_recorded == STEPS and w.failures == 0
    # the first capture opens the writer on the training thread; the others run on the helper thread
    assert slow_capture == [threading.current_thread().name] + ["tracer-capture"] * (STEPS - 1)
    trace = Trace(tmp_path / "t")
    assert [k.step for k in trace.steps()] == list(range(STEPS))
    for step in range(STEPS):
        d = trace.load_step(trace.steps()[step])
        assert torch.equal(d["old_logprobs"], torch.full((2, 3), -1.0 - step))
        assert torch.equal(d["advantages"], torch.tensor([step + 0.5, -step - 0.5]))
        assert torch.equal(d["completion_mask"].float(), torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
        assert torch.allclose(d["policy_logprobs"], torch.full((2, 3), LOG_FIFTH))


def test_the_loop_waits_for_its_capture_after_the_backward(tmp_path, slow_capture):
    """The backward runs while the capture sleeps (its gradient is there before the capture ends), and
    ``backward()`` returns only after the capture (each of the later steps takes its 50 ms)."""
    ends: list[float] = []
    real_after = WATCH.Watcher.after_backward

    def after(self):
        ends.append(time.perf_counter())
        real_after(self)

    with tracer.watch(algo="grpo", out=tmp_path / "t", overlap=True) as w:
        w.after_backward = after.__get__(w)
        t0 = time.perf_counter()
        overwriting_loop()
        elapsed = time.perf_counter() - t0
    assert len(ends) == STEPS and w.steps_recorded == STEPS
    assert elapsed >= 0.05 * STEPS  # every capture waited for, the overlapped ones included


def test_a_failed_overlapped_capture_warns_at_the_loop_line_and_training_goes_on(tmp_path, monkeypatch):
    real = WATCH.Watcher._capture
    calls = []

    def failing(self, frame, job=None):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise RuntimeError("boom at the third backward")
        return real(self, frame, job)

    monkeypatch.setattr(WATCH.Watcher, "_capture", failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracer.watch(algo="grpo", out=tmp_path / "t", overlap=True) as w:
            line = overwriting_loop()
    assert calls[2] == "tracer-capture"
    assert w.failures == 1 and w.steps_recorded == STEPS - 1
    failed = [m for m in caught if "step not traced" in str(m.message)]
    assert len(failed) == 1
    assert "boom at the third backward" in str(failed[0].message)
    assert failed[0].filename == __file__ and failed[0].lineno == line  # the loop's backward() line
    assert [k.step for k in Trace(tmp_path / "t").steps()] == [0, 1, 3]


def test_a_rejection_found_by_the_helper_thread_warns_at_the_loop_line(tmp_path):
    """A variable that turns into a tensor no field takes at the third backward (captured on the
    helper thread): the rejection is warned about once, pointing at the loop's line."""
    weight = torch.nn.Parameter(torch.zeros(2, 3, 5))
    completion_ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracer.watch(algo="grpo", out=tmp_path / "t", overlap=True) as w:
            for step in range(STEPS):
                per_token_logps = weight.log_softmax(-1).gather(2, completion_ids.unsqueeze(-1)).squeeze(-1)
                advantages = torch.tensor([1.0, -1.0]) if step < 2 else torch.tensor([[1.0], [-1.0], [0.0]])
                loss = -(per_token_logps * advantages.flatten()[:2, None]).sum()
                line = sys._getframe().f_lineno + 1
                loss.backward()
    rejected = [m for m in caught if "`advantages` was not recorded" in str(m.message)]
    assert len(rejected) == 1, [str(m.message) for m in caught]
    assert rejected[0].filename == __file__ and rejected[0].lineno == line
    assert w.failures == 0 and w.steps_recorded == STEPS
    trace = Trace(tmp_path / "t")
    assert [("advantages" in trace.fields(k)) for k in trace.steps()] == [True, True, False, False]


def test_strict_captures_before_the_backward(tmp_path, monkeypatch):
    """Under strict a failed capture raises before the backward runs (no gradient), as without overlap."""
    def failing(self, frame, job=None):
        raise RuntimeError("boom")

    weight = torch.nn.Parameter(torch.zeros(2, 3, 5))
    completion_ids = torch.tensor([[1, 2, 3], [4, 0, 0]])
    with tracer.watch(algo="grpo", out=tmp_path / "t", strict=True, overlap=True, nothing_traced="ignore") as w:
        assert w.overlap is False
        monkeypatch.setattr(WATCH.Watcher, "_capture", failing)
        per_token_logps = weight.log_softmax(-1).gather(2, completion_ids.unsqueeze(-1)).squeeze(-1)
        loss = -per_token_logps.sum()
        with pytest.raises(TraceError, match="boom"):
            loss.backward()
    assert weight.grad is None


def test_overlap_defaults(tmp_path, monkeypatch):
    assert tracer.watch(algo="grpo", out=tmp_path / "a", overlap=False).overlap is False
    assert tracer.watch(algo="grpo", out=tmp_path / "b", overlap=True, strict=True).overlap is False
    monkeypatch.setattr(WATCH.os, "sched_getaffinity", lambda pid: {0, 1})
    assert tracer.watch(algo="grpo", out=tmp_path / "c").overlap is True
    assert tracer.watch(algo="grpo", out=tmp_path / "d", strict=True).overlap is False
    monkeypatch.setattr(WATCH.os, "sched_getaffinity", lambda pid: {0})  # one CPU: nothing to overlap on
    assert tracer.watch(algo="grpo", out=tmp_path / "e").overlap is False


def test_the_helper_thread_ends_with_the_watcher(tmp_path):
    with tracer.watch(algo="grpo", out=tmp_path / "t", overlap=True) as w:
        overwriting_loop()
        helper = w._helper
        assert helper is not None and helper._thread.is_alive()
    assert w._helper is None and not helper._thread.is_alive()
    assert not any(t.name == "tracer-capture" for t in threading.enumerate())


def test_no_overlap_once_cuda_is_in_use(tmp_path, monkeypatch, slow_capture):
    """With CUDA initialised, a capture stays on the training thread (its copies must go on that
    thread's current stream)."""
    monkeypatch.setattr(WATCH.torch.cuda, "is_initialized", lambda: True)
    with tracer.watch(algo="grpo", out=tmp_path / "t", overlap=True) as w:
        overwriting_loop()
    assert w.steps_recorded == STEPS and w._helper is None
    assert slow_capture == [threading.current_thread().name] * STEPS
