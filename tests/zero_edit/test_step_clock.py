"""Step numbers when the frame's ``step`` and the watcher's own count mix in one run
(tracer/zero_edit/step_clock.py): keys never repeat and steps never decrease, whether a backward's step
comes from the frame, from the watcher's count, or from both (a warm-up before the loop's ``step``
exists, a second call site that sees no ``step``). The two-run tests use tests/fixtures/site_plans.py's
``assert_same_runs`` (call-site plans on, compared with a full read, and off)."""

from __future__ import annotations

import pytest
import torch

from tracer import Trace
from tracer.zero_edit.step_clock import StepClock

from tests.fixtures.site_plans import assert_same_runs, run_in


def test_step_clock_mixing_frame_steps_and_its_own_count():
    # counted first, then the frame's step 0 and 1: after the counted steps 0 and 1, as steps 2 and 3
    clock = StepClock()
    keys = [clock.key(i) for i in [{}, {}, {"step": 0}, {"step": 1}, {"step": 1}]]
    assert keys == [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0), (3, 0, 1)] and clock.offset == 2
    # a frame step, then a backward without one: the count goes on from the frame's step (before: 0 again,
    # and back in time); the frame's next step 6 is the counted one's, so it moves up one
    clock = StepClock()
    keys = [clock.key(i) for i in [{"step": 5}, {}, {"step": 6}, {"step": 7}]]
    assert keys == [(5, 0, 0), (6, 0, 0), (7, 0, 0), (8, 0, 0)] and clock.offset == 1
    # without a step, a later inner step of the last key's step stays in it
    clock = StepClock()
    assert [clock.key(i) for i in [{"step": 3}, {"inner_step": 1}, {"inner_step": 1}]] == [
        (3, 0, 0), (3, 1, 0), (4, 1, 0)]
    # before: {"step": 1}, then {"inner_step": 0} gave step -1, which the writer refuses (a failed capture)
    clock = StepClock()
    assert [clock.key(i) for i in [{"step": 1}, {"inner_step": 0}]] == [(1, 0, 0), (2, 0, 0)]
    clock = StepClock()  # a negative frame step starts at 0
    assert [clock.key(i) for i in [{"step": -1}, {"step": 0}]] == [(0, 0, 0), (1, 0, 0)] and clock.offset == 1


def test_step_clock_keys_never_repeat_and_steps_never_decrease():
    """Every sequence of found indices over small ranges (3 backwards, each index absent or 0..1)."""
    import itertools

    choices = [{k: v for k, v in zip(("step", "inner_step", "micro_batch"), values) if v is not None}
               for values in itertools.product((None, 0, 1), repeat=3)]
    for sequence in itertools.product(choices, repeat=3):
        clock = StepClock()
        keys = [clock.key(i) for i in sequence]
        assert len(set(keys)) == 3 and all(a[0] <= b[0] for a, b in zip(keys, keys[1:])), (sequence, keys)
        assert min(k[0] for k in keys) >= 0
        for indices, key in zip(sequence, keys):  # the frame's inner step and micro-batch as found
            assert key[1] == indices.get("inner_step", 0)


def warm_up_then_loop(weight) -> None:
    """A backward before the loop's ``step`` exists, then steps 0..2 (before: the loop's step 0 was
    recorded as micro-batch 1 of the warm-up's step)."""
    per_token_logps = weight.log_softmax(-1)[..., 0]
    per_token_logps.sum().backward()
    for step in range(3):
        per_token_logps = weight.log_softmax(-1)[..., 1]
        per_token_logps.sum().backward()


def policy_phase(weight, steps) -> None:
    for step in steps:
        per_token_logps = weight.log_softmax(-1)[..., 3]
        per_token_logps.sum().backward()


def critic_step(weight) -> None:
    """A second call site, which sees no ``step`` (neither it nor its caller has one)."""
    per_token_logps = weight.log_softmax(-1)[..., 2]
    per_token_logps.sum().backward()


def loop_then_other_site(weight) -> None:
    policy_phase(weight, range(2))
    for _ in range(2):
        critic_step(weight)  # before: steps 0 and 1 again (as their micro-batches 1), back in time
    policy_phase(weight, range(2, 4))


@pytest.mark.parametrize("loop,expected,source_steps", [
    (warm_up_then_loop, [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)], [None, 0, 1, 2]),
    (loop_then_other_site, [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0), (4, 0, 0), (5, 0, 0)],
     [None, None, None, None, 2, 3]),
])
def test_backwards_numbered_by_the_frame_and_by_the_watcher_get_increasing_steps(loop, expected, source_steps,
                                                                                tmp_path):
    weight = torch.nn.Parameter(torch.zeros(2, 3, 5))
    planned = assert_same_runs(lambda w: run_in(w, lambda: loop(weight)), tmp_path, algo="grpo")
    assert planned.failures == 0 and planned.writer.dropped_steps == 0
    trace = Trace(tmp_path / "planned")
    keys = trace.steps()
    assert [(k.step, k.inner_step, k.micro_batch) for k in keys] == expected
    assert [trace.metadata(k).get("source_step") for k in keys] == source_steps
