"""A run that declares an importance-sampling correction or a policy lag, but does not record what
their checks need, is never a silent PASS: the hand-written asynchronous GRPO loop
(tracer.demo.async_grpo) recorded without ``sampler_logprobs`` opens `tracer check` with "not checked:
importance-sampling correction — record sampler_logprobs", and without ``policy_version`` (its
``max_policy_lag`` declared) with "not checked: policy lag — record policy_version"; both exit 1 under
--strict-coverage. The same loop recorded in full has neither line, and both checks run."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracer.checks import run_checks
from tracer.checks.coverage import NOT_CHECKED
from tracer.cli import main
from tracer.demo.async_grpo import AsyncGRPOConfig, hyperparameters, train
from tracer.record.writer import Tracer


class _Dropping:
    """The loop's tracer, less the fields in ``drop`` (a capture that does not record them)."""

    def __init__(self, tr: Tracer, drop: tuple[str, ...]):
        self.tr, self.drop = tr, drop

    def record(self, **fields):
        return self.tr.record(**{k: v for k, v in fields.items() if k not in self.drop})


def _run(out, model_dir, drop: tuple[str, ...]):
    cfg = AsyncGRPOConfig(steps=3)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with Tracer(out, algorithm="grpo", tokenizer=tokenizer, config={**asdict(cfg), "trainer": "tracer.demo.async_grpo"},
                hyperparameters=hyperparameters(cfg), guard="off") as tr:
        train(model, tokenizer, cfg, _Dropping(tr, drop))
    return out


@pytest.mark.parametrize("drop,opening", [
    (("sampler_logprobs",), ("not checked: importance-sampling correction — record sampler_logprobs (on 3 of 3 "
                             "step files none of sampler.is_weights could run: an importance-sampling correction")),
    (("policy_version",), ("not checked: policy lag — record policy_version (on 3 of 3 step files none of "
                           "sampler.policy_lag could run: metadata max_policy_lag is declared")),
])
def test_declared_but_unrecorded_opens_with_not_checked(tmp_path, model_dir, capsys, drop, opening):
    trace = _run(tmp_path / "run", model_dir, drop)
    notes = [f for f in run_checks(trace) if f.check == NOT_CHECKED]
    assert [n.message[:len(opening)] for n in notes] == [opening]
    capsys.readouterr()
    # without policy_version the lagged rows' gap cannot be told from the engine's: sampler.mismatch names the
    # stale sampler (an error); with it recorded, the lag explains the gap (test_async_grpo_corrections_checked)
    assert main(["check", str(trace)]) == (1 if drop == ("policy_version",) else 0)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].startswith(opening[:60]), lines[:3]
    if drop == ("policy_version",):
        assert "the engine samples with a stale policy" in out
    assert main(["check", str(trace), "--strict-coverage"]) == 1


def test_recorded_in_full_has_no_not_checked_line(tmp_path, model_dir):
    trace = _run(tmp_path / "run", model_dir, ())
    findings = run_checks(trace)
    assert [f.message for f in findings if f.check == NOT_CHECKED] == []
    ran = {f.check for f in findings if f.severity == "info"}
    assert {"sampler.is_weights", "sampler.policy_lag"} <= ran
