"""A check whose subject does not exist in the run is "not applicable", not "not checked": on a
healthy TRL GRPOTrainer run that samples with the policy itself (``use_vllm = False``), the sampler
checks (``sampler.mismatch``, ``sampler.probs_diff``, ``alignment.logprob_shift``) have no sampler to
compare with, and on the hand-written PPO sample whose KL penalty is in the loss,
``recompute.token_rewards`` has no KL penalty in the rewards to recompute. ``tracer check`` used to
open its report on every such healthy run with "not checked: 3 checks could not run", which teaches
users to skip the block that names real gaps. Now those checks are said once, dimmed, above the
summary, and the same run declaring an inference engine (``use_vllm = True``) without recording
``sampler_logprobs`` is a gap again, named at the top."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tracer.checks import SKIPPED, run_checks
from tracer.checks.coverage import NOT_CHECKED
from tracer.checks.finding import is_not_applicable
from tracer.cli import main

from tests.fixtures.paths import REPO

os.environ["HF_HUB_OFFLINE"] = "1"
SAMPLER_CHECKS = {"sampler.mismatch", "sampler.probs_diff", "alignment.logprob_shift"}


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory, model_dir):
    """A real TRL GRPOTrainer run (tracer.demo.grpo_trl: num_iterations = 2, use_vllm = False)."""
    pytest.importorskip("trl")
    from tracer.demo import grpo_trl

    out = tmp_path_factory.mktemp("na") / "grpo"
    grpo_trl.run_grpo_demo(out, steps=2, seed=0, progress=False, model_dir=model_dir)
    return out


def test_sampler_checks_do_not_apply_to_a_trl_run_that_samples_with_its_policy(trl_run, capsys):
    manifest = json.loads((trl_run / "manifest.json").read_text())
    steps = list((trl_run / "steps").glob("*.safetensors"))
    from safetensors import safe_open

    for path in steps:  # what the run recorded: no sampler, and TRL's use_vllm off
        with safe_open(str(path), "np") as f:
            assert "sampler_logprobs" not in f.keys()
            assert f.metadata().get("use_vllm", json.dumps(manifest.get("hyperparameters", {}).get("use_vllm"))) in (
                "false", "False", "0", "null", None)
    findings = run_checks(trl_run)
    inapplicable = [f for f in findings if is_not_applicable(f)]
    assert {f.check for f in inapplicable} == SAMPLER_CHECKS
    for f in inapplicable:
        assert f.severity == SKIPPED and f.message.startswith("not applicable on ")
        assert "no inference engine sampled this run" in f.details["reason"]
    assert not [f for f in findings if f.severity == SKIPPED and f.check in SAMPLER_CHECKS
                and not is_not_applicable(f)]
    assert [f for f in findings if f.check == NOT_CHECKED] == []
    capsys.readouterr()
    assert main(["check", str(trl_run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("not checked") for line in lines), lines
    (head,) = [i for i, line in enumerate(lines) if line.startswith("not applicable to this run")]
    assert head == len(lines) - 3  # the block sits just above the summary, one line per reason
    assert lines[head] == "not applicable to this run: 3 checks (nothing of what they test exists here)"
    assert lines[head + 1].startswith("  alignment.logprob_shift, sampler.mismatch, sampler.probs_diff: no inference "
                                      "engine sampled this run")
    assert lines[-1].startswith("PASS") and lines[-1].endswith(", 0 skipped, 3 not applicable")


def test_the_same_run_declaring_an_engine_without_sampler_logprobs_is_a_gap_again(trl_run, tmp_path, capsys):
    declared = tmp_path / "declared"
    shutil.copytree(trl_run, declared)
    manifest = json.loads((declared / "manifest.json").read_text())
    manifest.setdefault("hyperparameters", {})["rollout_engine"] = "vllm"
    (declared / "manifest.json").write_text(json.dumps(manifest))
    findings = run_checks(declared)
    assert not [f for f in findings if is_not_applicable(f) and f.check in SAMPLER_CHECKS]
    skipped = {f.check: f for f in findings if f.severity == SKIPPED and f.check in SAMPLER_CHECKS}
    assert set(skipped) == SAMPLER_CHECKS
    assert all("needs field sampler_logprobs" in f.message for f in skipped.values())
    (gap,) = [f for f in findings if f.check == NOT_CHECKED]
    assert gap.details["class"] == "sampler mismatch" and "sampler_logprobs" in gap.details["fields"]
    capsys.readouterr()
    assert main(["check", str(declared)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("not checked: sampler mismatch — record sampler_logprobs")
    assert main(["check", str(declared), "--strict-coverage"]) == 1


def test_token_rewards_do_not_apply_where_the_kl_penalty_is_in_the_loss():
    # the hand-written PPO sample: kl_in_reward not set, token_rewards hold the sequence reward alone
    findings = run_checks(REPO / "sample_traces" / "ppo-tiny")
    (token_rewards,) = [f for f in findings if f.check == "recompute.token_rewards"]
    assert is_not_applicable(token_rewards)
    assert token_rewards.details["reason"].startswith("the KL penalty is in the loss")
    assert token_rewards.message.startswith("not applicable on 17 of 17 step files: the KL penalty is in the loss")
