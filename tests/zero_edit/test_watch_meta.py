"""Zero-edit capture takes the run's own hyperparameters (``tracer run --meta``, ``tracer.watch(
hyperparameters=...)``) for what it derives: they win over the frame's values, as they do in the
step metadata (found by a new-user trial: ``--meta num_generations=4`` left ``group_ids`` out and
every group check skipped)."""

from __future__ import annotations

import torch

import tracer
from tracer import Trace


def _grpo_loop(steps: int, G: int) -> None:
    """A loop whose frame holds no ``num_generations`` and no ``group_ids``."""
    weight = torch.nn.Parameter(torch.zeros(5))
    for step in range(steps):
        policy_logprobs = torch.log_softmax(weight.expand(2 * G, 5), dim=-1)
        old_logprobs = policy_logprobs.detach()
        completion_mask = torch.ones(2 * G, 5, dtype=torch.bool)
        rewards = torch.arange(2 * G, dtype=torch.float32)
        loss = -(policy_logprobs * completion_mask).mean()
        loss.backward()
        assert old_logprobs.shape == rewards.shape + (5,)


def test_meta_num_generations_derives_group_ids(tmp_path):
    with tracer.watch(algo="grpo", out=tmp_path / "run", hyperparameters={"num_generations": 4}):
        _grpo_loop(steps=2, G=4)
    trace = Trace(tmp_path / "run")
    for key in trace.steps():
        assert trace.load_step(key)["group_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
        assert trace.metadata(key)["num_generations"] == 4


def test_without_num_generations_no_group_ids_are_made_up(tmp_path):
    with tracer.watch(algo="grpo", out=tmp_path / "run"):
        _grpo_loop(steps=1, G=4)
    trace = Trace(tmp_path / "run")
    assert "group_ids" not in trace.load_step(trace.steps()[0])
