"""``tracer.attach(trainer, out, guard="stop")`` on a real TRL GRPOTrainer (CPU, tiny local model): a bug
that shows from the first step ends ``trainer.train()`` before its last step, through the trainer's own
control (``control.should_training_stop``), with every step it trained recorded, and the trace readable
by ``tracer check``; a healthy run under ``guard="stop"`` trains every step. How many steps after the bad
one the stop comes is a time (the checks run beside training), measured by bench/guard_cost.py, not
asserted here. The steps are written by the writer thread (``writer="thread"``): the writer process takes
seconds to start on a busy host, and the guard checks what has been written.

The injected bug: a trainer subclass negates the advantages ``_generate_and_score_completions``
returns (a sign slip in a custom advantage estimator), so every completion is pushed the wrong way
from step 0 on; ``recompute.advantages`` finds it in the first step file. No mocks: real trainer,
real files, the finding compared with a fresh ``tracer check`` of the finished trace.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
trl = pytest.importorskip("trl")

import tracer
from tracer import Trace
from tracer.checks import ERROR, run_checks
from tracer.cli import main as cli_main
from tracer.demo import grpo_trl

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
MAX_STEPS = 20  # what the trainer would run without the guard
G = grpo_trl.NUM_GENERATIONS


class NegatedAdvantagesGRPOTrainer(trl.GRPOTrainer):
    """GRPOTrainer with one sign slip: the advantages it trains on are the negated group z-scores."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        output["advantages"] = -output["advantages"]
        return output


def _trainer(trainer_class, model_dir, tmp_path, steps: int):
    return grpo_trl.make_group_trainer(trl.GRPOConfig, trainer_class, model_dir, tmp_path / "scratch", steps, 0, False,
                                       num_iterations=2, beta=grpo_trl.BETA, loss_type="grpo")


def _group_zscores(rewards: torch.Tensor) -> torch.Tensor:
    """TRL's GRPO advantages by hand: (r - group mean) / (group std, unbiased, + 1e-4), groups of G rows."""
    r = rewards.double().view(-1, G)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).view(-1)


def test_negated_advantages_stop_the_trainer_before_its_last_step(tmp_path, model_dir):
    out = tmp_path / "trace"
    trainer = _trainer(NegatedAdvantagesGRPOTrainer, model_dir, tmp_path, MAX_STEPS)
    hook = tracer.attach(trainer, out, guard="stop", writer="thread")
    trainer.train()  # returns: the stop goes through the trainer's control, not an exception

    stop = hook.guard_stop
    assert stop is not None and stop.check == "recompute.advantages" and stop.severity == ERROR
    assert stop.step == 0  # the bug shows from the first step
    assert 1 <= trainer.state.global_step < MAX_STEPS
    trace = Trace(out)
    steps = sorted(k.step for k in trace.steps())
    assert steps == list(range(trainer.state.global_step))  # every step trained was written, none dropped
    assert trace.manifest["dropped_steps"] == 0 and hook.capture_failures == 0
    assert trace.manifest["guard"]["mode"] == "stop"
    assert trace.manifest["guard"]["finding"]["check"] == "recompute.advantages"

    # the bug is real: the recorded advantages are minus TRL's group z-scores of the recorded rewards
    first = trace.load_step(next(k for k in trace.steps() if k.step == 0))
    torch.testing.assert_close(first["advantages"].double(), -_group_zscores(first["rewards"]), atol=1e-5, rtol=1e-5)

    # the finished trace reads as any other: checked afresh (the guard's file not reused), the same finding at step 0
    fresh = [f for f in run_checks(out, select=["recompute.advantages"], reuse_guard=False)
             if f.step == 0 and f.severity == ERROR]
    assert [f.message for f in fresh] == [stop.message]
    assert cli_main(["check", str(out)]) == 1


def test_a_healthy_trainer_under_guard_stop_trains_every_step(tmp_path, model_dir):
    out = tmp_path / "trace"
    trainer = _trainer(trl.GRPOTrainer, model_dir, tmp_path, 3)
    hook = tracer.attach(trainer, out, guard="stop", writer="thread")
    trainer.train()

    assert hook.guard_stop is None
    assert trainer.state.global_step == 3
    trace = Trace(out)
    assert sorted(k.step for k in trace.steps()) == [0, 1, 2]
    assert trace.status == "finished" and trace.manifest["guard"] == {"mode": "stop"}
    assert [f for f in run_checks(out) if f.severity == ERROR] == []
