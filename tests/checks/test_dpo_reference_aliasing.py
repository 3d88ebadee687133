"""dpo.reference_aliasing on real DPO runs: a reference that is the policy (MiniMind-style loop with
``ref_model = model``; TRL's DPOTrainer given a shallow copy that shares the policy's parameters) is
one error naming the aliasing with the pairs, steps and the loss at log 2; the same loops with a
frozen reference, and an aliased reference whose optimizer ran at learning rate 0, give no error."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from tracer import Trace  # noqa: E402
from tracer.checks import ERROR, run_checks  # noqa: E402
from tracer.cli import main as cli_main  # noqa: E402
from tracer.demo.tiny_model import torch_threads  # noqa: E402

from tests.fixtures.paths import SCRIPTS  # noqa: E402

STEPS, PAIRS = 4, 4  # minimind_dpo.py --steps 4, its default --batch_size 4


def _minimind_dpo(out, model_dir, *argv):
    with torch_threads(1):
        code = cli_main(["run", "--algo", "dpo", "--out", str(out), "--meta", "loss_reduction=sequence_mean", "--",
                         str(SCRIPTS / "minimind_dpo.py"), "--model_dir", str(model_dir), "--steps", str(STEPS),
                         *argv])
    assert code == 0
    return out


def _aliasing(findings):
    return [f for f in findings if f.check == "dpo.reference_aliasing"]


def test_minimind_dpo_with_the_reference_being_the_policy_is_one_error(tmp_path, model_dir, capsys):
    out = _minimind_dpo(tmp_path / "alias", model_dir, "--bug", "ref_is_policy")
    trace = Trace(out)
    # the data show the bug: after step 0 every side's ref equals its policy, and the recorded loss is log 2
    for key in trace.steps():
        data = trace.load_step(key)
        for side in ("chosen", "rejected"):
            keep = data[f"{side}_mask"].bool()
            assert torch.equal(data[f"{side}_ref_logprobs"][keep], data[f"{side}_policy_logprobs"][keep])
        assert abs(float(data["loss"]) - math.log(2)) < 1e-6
    capsys.readouterr()
    findings = run_checks(out)
    (finding,) = _aliasing(findings)
    assert finding.severity == ERROR and finding.step == 1
    # steps 1, 2, 3 are after an optimizer step (step 0 is a fresh copy): 3 steps x 4 pairs
    assert finding.details["steps"] == [1, 2, 3] and finding.details["pairs"] == 3 * PAIRS
    assert finding.details["max_abs_gap"] == 0.0
    assert finding.message.startswith(
        "reference aliases the policy: chosen and rejected ref logprobs equal the policy's on all 12 pairs "
        "(4 per step) at steps 1..3 (max |ref − policy| 0 nats, compared per token over ")
    assert "after optimizer steps with learning rate 0.001" in finding.message
    assert f"the loss is log 2 = {math.log(2):.4f} on every step (recorded loss 0.6931 at steps 1..3)" in finding.message
    assert cli_main(["check", str(out)]) == 1
    assert "ERROR   dpo.reference_aliasing  1 finding" in capsys.readouterr().out


def test_minimind_dpo_with_a_frozen_copy_or_learning_rate_0_has_no_aliasing_error(tmp_path, model_dir):
    healthy = _minimind_dpo(tmp_path / "healthy", model_dir)
    assert _aliasing(run_checks(healthy)) == []
    # ref is the policy, but the optimizer never moves it: ref == policy is the truth at every step
    frozen = _minimind_dpo(tmp_path / "lr0", model_dir, "--bug", "ref_is_policy", "--learning_rate", "0")
    assert {Trace(frozen).metadata(k).get("learning_rate") for k in Trace(frozen).steps()} == {0.0}
    assert _aliasing(run_checks(frozen)) == []


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_trl_dpo_trainer_with_a_shallow_copy_of_the_policy_as_reference_is_one_error(tmp_path, model_dir):
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM
    from transformers.trainer_callback import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    import tracer
    from tracer.demo import dpo_trl
    from tracer.demo.trl_demo import cpu_config

    with torch_threads(1):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        args = cpu_config(DPOConfig, tmp_path / "trl", 3, 0, False, per_device_train_batch_size=dpo_trl.PAIRS_PER_STEP,
                          beta=dpo_trl.BETA, loss_type=["sigmoid"], learning_rate=dpo_trl.LEARNING_RATE,
                          logging_strategy="steps", logging_steps=1)
        # TRL refuses ref_model=model (the same object); a shallow copy shares every parameter with the policy
        trainer = DPOTrainer(model=model, ref_model=copy.copy(model), args=args,
                             train_dataset=dpo_trl.make_dataset(0))
        trainer.remove_callback(PrinterCallback)
        tracer.attach(trainer, tmp_path / "trace")
        trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3 and all(abs(v - math.log(2)) < 1e-4 for v in logged)  # TRL's own log says it
    (finding,) = _aliasing(run_checks(tmp_path / "trace"))
    assert finding.severity == ERROR and finding.details["steps"] == [1, 2]
    assert finding.details["pairs"] == 2 * dpo_trl.PAIRS_PER_STEP
    assert finding.message.startswith("reference aliases the policy: chosen and rejected ref logprobs equal the "
                                      f"policy's on all {2 * dpo_trl.PAIRS_PER_STEP} pairs")


def test_minimind_dpo_under_gradient_accumulation_is_judged_from_its_first_optimizer_step(tmp_path, model_dir):
    """MiniMind's train_dpo.py divides the loss by accumulation_steps and steps the optimizer every N
    batches, numbering batches as steps: before batch N nothing has moved, so ref == policy is healthy
    there, and the recorded loss / N is the loss it means (recompute.dpo takes the 1 / N scale)."""
    healthy = _minimind_dpo(tmp_path / "accum", model_dir, "--accumulation_steps", "2")
    trace = Trace(healthy)
    assert {trace.metadata(k).get("gradient_accumulation_steps") for k in trace.steps()} == {2}
    findings = run_checks(healthy)
    assert [f"{f.check}: {f.message}" for f in findings if f.severity in (ERROR, "warning")] == []
    aliased = _minimind_dpo(tmp_path / "accum_alias", model_dir, "--accumulation_steps", "2", "--bug", "ref_is_policy")
    for key in Trace(aliased).steps():  # the recorded loss is log 2 / 2 at every step: logits 0
        assert abs(float(Trace(aliased).load_step(key)["loss"]) - math.log(2) / 2) < 1e-6
    (finding,) = _aliasing(run_checks(aliased))
    # batches 0 and 1 precede the first optimizer step; batches 2 and 3 follow one
    assert finding.severity == ERROR and finding.details["steps"] == [2, 3]
    assert f"the loss is log 2 = {math.log(2):.4f} on every step (recorded loss 0.6931 at steps 2, 3)" in finding.message
