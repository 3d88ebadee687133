"""A real TRL GRPOTrainer's trace keeps the settings each call ran with beside the declared GRPOConfig, and
``tracer check`` names a sampling setting that did not come from the config (``generation_kwargs``
overriding ``temperature``: generate() samples at one temperature, the logprobs are scored at another)."""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

import tracer  # noqa: E402
from tracer import Trace  # noqa: E402
from tracer.checks import run_checks  # noqa: E402
from tracer.demo import grpo_trl  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture
def run(tmp_path, model_dir):
    def start(**overrides):
        trainer = grpo_trl.make_trainer(model_dir, tmp_path / "trl", steps=1, progress=False, num_iterations=1,
                                        **overrides)
        hook = tracer.attach(trainer, tmp_path / "trace")
        trainer.train()
        assert hook.capture_failures == 0
        trace = Trace(tmp_path / "trace")
        return trainer, trace, trace.metadata(trace.steps()[0])

    return start


def test_each_step_records_the_trainer_settings_in_effect_and_the_declared_config(run):
    trainer, trace, meta = run(epsilon=0.2, epsilon_high=None, scale_rewards="batch")
    # read off the trainer object as _compute_loss reads it, and off GRPOConfig
    assert (meta["loss_type"], meta["declared_loss_type"]) == (trainer.loss_type, trainer.args.loss_type) == ("grpo", "grpo")
    # epsilon_high None: TRL resolves it to epsilon, on both sides
    assert meta["clip_epsilon_high"] == meta["declared_clip_epsilon_high"] == trainer.epsilon_high == 0.2
    assert (meta["scale_rewards"], meta["declared_scale_rewards"]) == ("batch", "batch")
    assert meta["generation_temperature"] == trainer.generation_config.temperature == meta["declared_temperature"] == 1.0
    assert meta["steps_per_generation"] == trainer.args.steps_per_generation
    assert not [f for f in run_checks(trace) if f.check == "recompute.declared_settings" and f.severity != "skipped"]


def test_generation_kwargs_overriding_the_temperature_is_named(run):
    trainer, trace, meta = run(generation_kwargs={"temperature": 0.5})
    assert trainer.generation_config.temperature == 0.5 and trainer.temperature == 1.0
    assert (meta["generation_temperature"], meta["temperature"], meta["declared_temperature"]) == (0.5, 1.0, 1.0)
    (f,) = [f for f in run_checks(trace) if f.check == "recompute.declared_settings"]
    assert f.severity == "error"
    assert f.message.splitlines()[0] == "generation_temperature in effect is 0.5, config declares temperature = 1.0."
    assert "TRL's generation_kwargs override the config's field" in f.message
