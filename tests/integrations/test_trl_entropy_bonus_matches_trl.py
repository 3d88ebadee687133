"""tracer.formulas' entropy bonus against TRL 1.16's own loss code: TRL's GRPOTrainer with ``entropy_coef`` (the
static bonus ``loss = policy loss - entropy_coef * masked mean entropy``) trains the tiny model on CPU; each value
its ``compute_loss`` returns is rebuilt from the step file tracer recorded for that call with
``grpo_per_token_loss`` -> ``sequence_mean_loss`` minus ``entropy_bonus``, times the recorded loss scale. The
capture records that loss (a static bonus: TRL divides it by the accumulation steps, as the policy loss of
``loss_type="grpo"``), and `tracer check`'s ``recompute.loss`` checks it with the bonus and passes.
"""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

import tracer  # noqa: E402
from tracer import Trace  # noqa: E402
from tracer.checks import CheckOptions, run_checks  # noqa: E402
from tracer.checks.context import StepContext  # noqa: E402
from tracer.checks.coverage import NOT_CHECKED  # noqa: E402
from tracer.checks.finding import CHECKS  # noqa: E402
from tracer.checks.runner import check_step  # noqa: E402
from tracer.demo import grpo_trl  # noqa: E402
from tracer.demo.tiny_model import torch_threads  # noqa: E402
from tracer.formulas.losses import (  # noqa: E402
    entropy_bonus,
    grpo_per_token_loss,
    sequence_mean_loss,
)

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
COEF = 0.05


def test_trl_loss_with_its_entropy_bonus_equals_tracer_formulas(tmp_path, model_dir):
    returned = []
    with torch_threads(1):
        trainer = grpo_trl.make_trainer(model_dir, tmp_path / "scratch", steps=2, seed=0, progress=False,
                                        entropy_coef=COEF)
        tracer.attach(trainer, tmp_path / "trace")
        traced_compute_loss = trainer.compute_loss

        def compute_loss(model, inputs, *args, **kwargs):
            loss = traced_compute_loss(model, inputs, *args, **kwargs)
            returned.append(float(loss.detach()))
            return loss

        trainer.compute_loss = compute_loss
        trainer.train()
    trace = Trace(tmp_path / "trace")
    keys = trace.steps()
    assert len(keys) == len(returned) > 0
    for key, loss in zip(keys, returned):
        d, meta = trace.load_step(key), trace.metadata(key)
        assert meta["entropy_coef"] == COEF and "loss_not_recorded" not in meta
        assert float(d["loss"]) == pytest.approx(loss, rel=1e-6, abs=1e-7)  # what compute_loss returned
        assert meta["entropy_loss_scale"] == 1.0 / meta["gradient_accumulation_steps"]
        keep = d["completion_mask"].bool()
        policy = d["policy_logprobs"].double()
        old = d["old_logprobs"].double() if "old_logprobs" in d else policy
        per_token = grpo_per_token_loss(policy, old, d["advantages"].double(), meta["clip_epsilon_low"],
                                        meta["clip_epsilon_high"], meta["beta"], d["ref_logprobs"].double(),
                                        kl_importance_weighted=meta["use_bias_correction_kl"])
        scale = 1.0 / meta["gradient_accumulation_steps"]  # TRL divides both terms by the accumulation steps
        expected = scale * (float(sequence_mean_loss(per_token, keep))
                            - float(entropy_bonus(d["entropy"].double(), keep, COEF)))
        assert loss == pytest.approx(expected, rel=1e-4, abs=1e-6)
        bonus = float(entropy_bonus(d["entropy"].double(), keep, COEF))
        assert bonus > 1e-3  # the bonus is there to be told: without it the loss would differ by this much
    for key in keys:
        result = check_step(StepContext(trace, key, CheckOptions()), [CHECKS["recompute.loss"]])
        assert result.ran == ["recompute.loss"] and result.findings == [], (result.skipped, result.findings)
    findings = run_checks(tmp_path / "trace")
    assert [f.message for f in findings if f.check == NOT_CHECKED and "objective" in f.details] == []
    checked = [f for f in findings if f.check == "recompute.loss"]
    assert [f.message[:200] for f in checked if f.severity != "info"] == []
    assert not [f for f in findings if f.check == "recompute.loss" and f.severity == "skipped"]
