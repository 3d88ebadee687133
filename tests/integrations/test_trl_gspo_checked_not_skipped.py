"""GSPO on TRL's real GRPOTrainer (``importance_sampling_level="sequence"``, tiny local model, CPU) is
checked, not skipped: the ratio, clip-fraction and loss checks run on every step file (GSPO's sequence
ratio = exp of the masked mean log-ratio, clipped per sequence), `tracer check` exits 0 and
``--strict-coverage`` too. The wrong form, TRL's loss computed with the per-token ratio while the run
records ``importance_sampling_level="sequence"``, exits 1 with the term at fault ("ratio level") first.

The loss each step should have is worked out here by hand from the recorded tensors (torch ops, not
tracer.formulas), with TRL 1.16 ``_compute_loss``'s rule: ``s_i = exp(sum_t m (π - π_old) / sum_t m)``,
``l = -min(s A, clip(s, 1-ε, 1+ε) A) + β k3 s`` (TRL's ``use_bias_correction_kl``, on by default in 1.16,
weighs k3 by the ratio), the sequence mean, times the recorded loss scale.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

import tracer  # noqa: E402
from tracer import Trace  # noqa: E402
from tracer.checks import ERROR, WARNING, CheckOptions, run_checks  # noqa: E402
from tracer.checks.context import StepContext  # noqa: E402
from tracer.checks.finding import CHECKS  # noqa: E402
from tracer.checks.runner import check_step  # noqa: E402
from tracer.cli import main  # noqa: E402
from tracer.demo import grpo_trl  # noqa: E402
from tracer.demo.tiny_model import torch_threads  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
LOSS_CHECKS = ("recompute.ratio", "recompute.clip_fractions", "recompute.loss")


def train(tmp_path, model_dir, name: str, token_ratio_in_loss: bool = False, loss_type: str = "grpo"):
    """Two GSPO steps (2 inner steps each); ``token_ratio_in_loss``: TRL's own _compute_loss run with
    importance_sampling_level switched to 'token' for the loss only (the config still says 'sequence')."""
    with torch_threads(1):
        trainer = grpo_trl.make_trainer(model_dir, tmp_path / f"{name}-scratch", steps=2, seed=0, progress=False,
                                        importance_sampling_level="sequence", epsilon=0.05, loss_type=loss_type)
        if token_ratio_in_loss:
            compute = trainer._compute_loss

            def token_level_loss(model, inputs):
                trainer.importance_sampling_level = "token"
                try:
                    return compute(model, inputs)
                finally:
                    trainer.importance_sampling_level = "sequence"

            trainer._compute_loss = token_level_loss
        tracer.attach(trainer, tmp_path / name)
        trainer.train()
    return tmp_path / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("gspo")
    return {"healthy": train(root, model_dir, "healthy"), "token_ratio": train(root, model_dir, "token_ratio", True)}


def gspo_loss_by_hand(d: dict, meta: dict) -> float:
    pi, old, ref = d["policy_logprobs"].double(), d["old_logprobs"].double(), d["ref_logprobs"].double()
    m = d["completion_mask"].double()
    s = torch.exp(((pi - old) * m).sum(1) / m.sum(1).clamp(min=1)).unsqueeze(1)  # (B, 1)
    a = d["advantages"].double().unsqueeze(1)
    eps = meta["clip_epsilon_high"]
    k3 = torch.exp(ref - pi) - (ref - pi) - 1
    assert meta["use_bias_correction_kl"] is True
    k3 = k3 * s  # the bias-corrected KL: k3 times the (sequence) ratio
    per_token = -torch.min(s * a, s.clamp(1 - eps, 1 + eps) * a) + meta["beta"] * k3
    return float(((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()) * meta["loss_scale"]


def test_healthy_gspo_runs_the_ratio_clip_and_loss_checks_on_every_step_and_passes(runs, capsys):
    trace = Trace(runs["healthy"])
    assert trace.metadata(trace.steps()[0])["importance_sampling_level"] == "sequence"
    moved = False
    for key in trace.steps():
        d, meta = trace.load_step(key), trace.metadata(key)
        assert "old_logprobs" in d  # num_iterations 2: old is kept, the sequence ratio can leave 1
        moved |= bool(((d["policy_logprobs"] - d["old_logprobs"]).abs() > 1e-3).any())
        assert float(d["loss"]) == pytest.approx(gspo_loss_by_hand(d, meta), rel=1e-4, abs=1e-6)
        result = check_step(StepContext(trace, key, CheckOptions()), list(CHECKS.values()))
        assert set(LOSS_CHECKS) <= set(result.ran), result.skipped
    assert moved  # the second inner steps score an updated policy: the ratio is not 1 everywhere
    findings = run_checks(runs["healthy"])
    assert [f.message for f in findings if f.severity in (ERROR, WARNING)] == []
    assert [f.message for f in findings if f.check in LOSS_CHECKS and f.severity == "skipped"] == []
    capsys.readouterr()
    assert main(["check", str(runs["healthy"]), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert not [f for f in shown if f["check"] in LOSS_CHECKS and f["severity"] == "skipped"]
    assert not [f for f in shown if f["check"] == "trace.not_checked" and "objective" in f["details"]]


def test_gspo_config_with_a_token_ratio_loss_fails_naming_the_ratio_level_first(runs, capsys):
    errors = [f for f in run_checks(runs["token_ratio"]) if f.check == "recompute.loss" and f.severity == ERROR]
    assert errors  # on the steps whose policy moved away from old (the first inner step has ratio 1 exactly)
    for f in errors:
        assert f.message.startswith("ratio level: recorded loss"), f.message
        assert "per-token ratio exp(policy − old), while importance_sampling_level = 'sequence'" in f.message
        assert f.details["cause"] == "ratio_level"
    capsys.readouterr()
    assert main(["check", str(runs["token_ratio"])]) == 1
    lines = capsys.readouterr().out.splitlines()
    block = next(i for i, line in enumerate(lines) if line.startswith("ERROR"))  # the first error block
    assert lines[block].startswith("ERROR   recompute.loss")
    assert lines[block + 2].strip().startswith("ratio level: recorded loss")  # under the step's location line


@pytest.mark.parametrize("loss_type", ["luspo", "dapo"])
def test_gspo_with_trls_other_reductions_is_checked_and_passes(tmp_path, model_dir, loss_type):
    """luspo (masked sum / B, TRL's recommended GSPO setup) and dapo (sum / the generation batch's tokens)."""
    trace = Trace(train(tmp_path, model_dir, loss_type, loss_type=loss_type))
    for key in trace.steps():
        result = check_step(StepContext(trace, key, CheckOptions()), list(CHECKS.values()))
        assert set(LOSS_CHECKS) <= set(result.ran), result.skipped
    findings = run_checks(trace.root)
    assert [f.message for f in findings if f.severity in (ERROR, WARNING)] == []
