"""The rows a zero-edit capture made and kept without a copy (written by the writer thread up to
LINGER_S later) are the values at backward, whatever the loop does to its own tensors (the indexed
tensor, the index) in place right after. (The capture caches themselves: test_capture_caches.py.)"""
from __future__ import annotations

import warnings

import torch

from tracer import Trace
from tracer.zero_edit.watch import Watcher


def _mutating_loop(steps: int) -> list[list[list[float]]]:
    """PPO-shaped; after each backward the loop scales ``advantages`` and shifts ``inds`` in place.
    Returns the rows ``advantages[inds]`` held at each backward (computed by hand here)."""
    weight = torch.nn.Parameter(torch.zeros(4, 3))
    advantages = torch.arange(12.0).reshape(4, 3)
    inds = torch.tensor([0, 1])
    seen = []
    for _step in range(steps):
        seen.append([[float(v) for v in advantages[int(i)]] for i in inds])
        mb_resp_logp = weight[inds].log_softmax(-1)
        loss = -(mb_resp_logp * advantages[inds]).mean()
        loss.backward()
        advantages.mul_(-2.0)  # the loop's own tensors changed in place after backward
        inds.add_(1).remainder_(4)
    return seen


def test_kept_rows_are_the_values_at_backward_not_after_in_place_changes(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Watcher("ppo", tmp_path / "t", nothing_traced="ignore") as watcher:
            watcher.plan_differences = []
            seen = _mutating_loop(6)
    assert watcher.plan_differences == [] and watcher.plans.hits >= 4
    assert torch.is_grad_enabled()
    trace = Trace(tmp_path / "t")
    keys = list(trace.steps())
    assert len(keys) == 6
    assert [trace.load_step(k)["advantages"].tolist() for k in keys] == seen
