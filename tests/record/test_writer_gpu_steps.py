"""The writer thread and steps of CUDA tensors, whose copies to host run on the GPU after ``record``
returns (:mod:`tracer.record.capture`): such steps are not lingered for, a batch holds only the steps
whose copies have landed, and a CUDA error on one step's copies loses that step, not the writer
thread. The copy events are driven by the test (the real ones need a GPU: bench/gpu_check.py and
the CUDA tests of tests/reliability/test_bad_tensors.py run them where one is lent)."""

from __future__ import annotations

import threading

import torch

from tracer.record.capture import StagedStep
from tracer.record.thread import BackgroundWriter


class _Copies:
    """What :class:`tracer.record.capture.CopiesDone` is to the writer thread (``query`` without blocking,
    ``synchronize`` blocking), driven by the test instead of a GPU: ``land()`` is the copy completing."""

    def __init__(self, landed: bool = False) -> None:
        self._done = threading.Event()
        if landed:
            self._done.set()

    def land(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        assert self._done.wait(60), "a copy never landed"


def test_gpu_steps_are_not_lingered_for_and_a_batch_holds_only_steps_whose_copies_landed():
    """The loop runs ahead of the GPU: a batch that gathered steps whose copies are still in flight
    would write them all only after the last one lands (a tail at every flush and at the run's end,
    measured on an H200: BENCHMARKS.md, GPU). So a step with a copy event is not lingered for
    (linger_s is an hour here), and a batch takes the first step (waited for) and the steps behind
    it whose copies have landed, never one still in flight."""
    batches: list[list[int]] = []
    first, second, third = _Copies(), _Copies(landed=True), _Copies()
    bg = BackgroundWriter(lambda it, reason: None, lambda it: it.wait(), lambda it, e: None, lambda r: None,
                          max_steps=64, max_bytes=10**6, linger_s=3600.0,
                          prepare=lambda items: batches.append([it.step for it in items]))
    for step, copies in enumerate((first, second, third)):
        item = StagedStep(step, 0, 0, {"x": torch.zeros(1)}, {}, 10)
        item.event = copies
        bg.put(item)
    first.land()  # the writer thread, waiting on step 0, goes on; step 1 had landed, step 2 has not
    for _ in range(300):  # no flush: a lingering thread would wait an hour here
        if any(1 in b for b in batches):
            break
        threading.Event().wait(0.1)
    third.land()
    bg.flush()
    bg.stop()
    # [[0, 1], [2]], or [[0], [1], [2]] when the thread took step 0 before step 1 was queued
    assert batches in ([[0, 1], [2]], [[0], [1], [2]]), batches


def test_cpu_steps_are_still_lingered_for():
    """Steps without a copy event (CPU tensors) keep the batching of small steps: with an hour's
    linger, three steps put back to back are written as one batch at the flush."""
    batches: list[list[int]] = []
    bg = BackgroundWriter(lambda it, reason: None, lambda it: it.wait(), lambda it, e: None, lambda r: None,
                          max_steps=64, max_bytes=10**6, linger_s=3600.0,
                          prepare=lambda items: batches.append([it.step for it in items]))
    for step in range(3):
        bg.put(StagedStep(step, 0, 0, {"x": torch.zeros(1)}, {}, 10))
    bg.flush()
    bg.stop()
    assert batches == [[0, 1, 2]]


class _BrokenCopies:
    """A copy event after a CUDA error in the training loop: torch's Event.query() and synchronize()
    then raise (a device-side assert is sticky)."""

    def query(self) -> bool:
        raise RuntimeError("CUDA error: device-side assert triggered")

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")


def test_a_cuda_error_in_a_steps_copy_loses_that_step_and_the_writer_thread_goes_on():
    """A step whose copy event raises is counted lost (on_error), its buffers are not reused, and the
    writer thread lives on: the steps around it are written and flush() returns (a query raising in
    the batching itself once ended the thread, and a flush then waited forever)."""
    written, errors = [], []
    bg = BackgroundWriter(lambda it, reason: written.append(it.step), lambda it: None,
                          lambda it, e: errors.append((it.step, str(e))), lambda r: None,
                          max_steps=64, max_bytes=10**6, linger_s=3600.0)
    landed_first = StagedStep(0, 0, 0, {"x": torch.zeros(1)}, {}, 10)
    landed_first.event = _Copies(landed=True)
    broken = StagedStep(1, 0, 0, {"x": torch.zeros(1)}, {}, 10)
    broken.event = _BrokenCopies()
    broken.pinned = [(torch.zeros(1), True)]
    for item in (landed_first, broken, StagedStep(2, 0, 0, {"x": torch.zeros(1)}, {}, 10)):
        bg.put(item)
    done = threading.Thread(target=bg.flush, daemon=True)
    done.start()
    done.join(60)
    assert not done.is_alive(), "flush() hung: the writer thread died"
    assert 1 in [step for step, _ in errors] and "device-side assert" in dict(errors)[1]
    assert 1 not in written and {0, 2} <= set(written)
    assert broken.pinned == []  # not given back to the pool: the copy may still be writing them
    bg.put(StagedStep(3, 0, 0, {"x": torch.zeros(1)}, {}, 10))
    bg.flush()
    assert 3 in written
    bg.stop()
