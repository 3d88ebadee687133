"""A reward function that returns None for completions it does not apply to (TRL's GRPOTrainer and
RLOOTrainer document it: "can also return None when the reward is not applicable"). TRL records NaN
there and leaves it out (nansum over the functions, nanmean / nanstd over the group), so the advantages
and the loss stay finite: a healthy run. `nonfinite.values` gave an error for that NaN (found by a
false-alarm hunt, 2026-12-05); it is now an info, while a NaN reward that does reach the advantages,
and an Inf, stay errors. Real trainers on the tiny local model; the hand-written cases write real files."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

import tracer  # noqa: E402
from tracer import Trace  # noqa: E402
from tracer.checks import ERROR, INFO, WARNING, run_checks  # noqa: E402


def _brevity_or_none(completion_ids, answer, **kwargs):
    """The demo's brevity reward, None on every third completion (a reward that does not apply there)."""
    from tracer.demo.grpo_trl import brevity

    scores = brevity(completion_ids, answer, **kwargs)
    return [None if i % 3 == 1 else s for i, s in enumerate(scores)]


@pytest.mark.parametrize("trainer_name", ["grpo", "rloo"])
def test_trl_reward_function_returning_none_is_no_false_alarm(tmp_path, trainer_name):
    pytest.importorskip("trl")
    from tracer.demo import grpo_trl, rloo_trl
    from tracer.demo.tiny_model import build_tiny_model, torch_threads

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    make = grpo_trl.make_trainer if trainer_name == "grpo" else rloo_trl.make_trainer
    with torch_threads(1):
        trainer = make(model_dir, tmp_path / "scratch", steps=2, seed=0, progress=False)
        trainer.reward_funcs[1] = _brevity_or_none
        tracer.attach(trainer, tmp_path / "trace")
        trainer.train()
    trace = Trace(tmp_path / "trace")
    data = trace.load_step(trace.steps()[0])
    # the precondition: TRL recorded NaN for the None rewards, and kept the advantages finite
    assert bool(torch.isnan(data["reward_components"][:, 1]).any())
    assert bool(torch.isfinite(data["advantages"]).all())
    findings = run_checks(tmp_path / "trace")
    bad = [f"{f.severity} {f.check}: {f.message}" for f in findings if f.severity in (ERROR, WARNING)]
    assert bad == [], "\n".join(bad)
    infos = [f for f in findings if f.check == "nonfinite.values"]
    assert infos and all(f.severity == INFO and "reward function 1" in f.message for f in infos)
    assert all(f.token is None for f in infos)  # a column of reward_components is a function, not a token


def _record(root, rewards, advantages, components=None):
    tensors = {"completion_ids": torch.tensor([[5, 6], [7, 8], [5, 9], [6, 6]]),
               "completion_mask": torch.ones(4, 2, dtype=torch.bool),
               "policy_logprobs": torch.full((4, 2), -1.0), "rewards": rewards, "advantages": advantages,
               "group_ids": torch.tensor([0, 0, 1, 1])}
    if components is not None:
        tensors["reward_components"] = components
    with tracer.Tracer(root, algorithm="grpo", hyperparameters={"num_generations": 2, "beta": 0.0}) as w:
        w.record(0, tensors)
    return [f for f in run_checks(root) if f.check == "nonfinite.values"]


def test_nan_reward_with_finite_advantages_is_an_info(tmp_path):
    nan = float("nan")
    (f,) = _record(tmp_path / "t", torch.tensor([1.0, nan, 0.0, 1.0]), torch.tensor([0.0, 0.0, -0.7, 0.7]),
                   torch.tensor([[1.0, nan], [nan, nan], [0.0, 0.0], [1.0, 0.0]]))
    assert f.severity == INFO and f.sequence == 1 and f.field == "rewards"  # the first in dependency order
    assert "NaN values: rewards 1, reward_components 3; 2 rows" in f.message


def test_nan_reward_that_reaches_the_advantages_is_an_error(tmp_path):
    nan = float("nan")  # a hand-written z-score over a NaN reward: the group's advantages are NaN
    (f,) = _record(tmp_path / "t", torch.tensor([1.0, nan, 0.0, 1.0]), torch.tensor([nan, nan, -0.7, 0.7]))
    assert f.severity == ERROR and f.field == "rewards" and f.sequence == 1
    assert "advantages (2)" in f.message  # named downstream


def test_inf_reward_is_an_error_even_with_finite_advantages(tmp_path):
    found = _record(tmp_path / "t", torch.tensor([1.0, float("inf"), 0.0, 1.0]), torch.tensor([0.0, 0.0, -0.7, 0.7]))
    assert [(f.severity, f.field, f.sequence) for f in found] == [(ERROR, "rewards", 1)]
