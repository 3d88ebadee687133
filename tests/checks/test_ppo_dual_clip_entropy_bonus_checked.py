"""A hand-written PPO loop with dual clip (``clip_ratio_c``) and a verl-style entropy bonus
(tests/scripts/ppo_dual_clip_entropy.py, tiny model, explicit API): the healthy run is checked, not
skipped (recompute.loss and recompute.ratio run on every step file; `tracer check` and
``--strict-coverage`` exit 0), the loss with the bonus's sign flipped and the loss without the dual clip
each exit 1 naming the term at fault first, and a loop that does not record ``entropy`` opens the
report with "not checked: entropy bonus" (``--strict-coverage`` exits 1).

The recorded loss is worked out here by hand from the recorded tensors (plain torch, not tracer.formulas):
``max(-A r, -A clip(r, 0.8, 1.2))`` capped at ``-c A`` where ``A < 0``, ``+ 0.02 k3``, token mean over kept
tokens, ``- 0.01 ×`` the token mean of the entropy.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.fixtures.paths import REPO, SCRIPTS
from tracer import Trace
from tracer.checks import ERROR, WARNING, CheckOptions, run_checks
from tracer.checks.context import StepContext
from tracer.checks.coverage import NOT_CHECKED
from tracer.checks.finding import CHECKS
from tracer.checks.runner import check_step
from tracer.cli import main

C, EPS, KL_COEF, ENTROPY_COEF = 1.2, 0.2, 0.02, 0.01  # the script's defaults
LOSS_CHECKS = ("recompute.loss", "recompute.ratio")


def run_loop(out, model_dir, *argv: str):
    env = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(SCRIPTS / "ppo_dual_clip_entropy.py"), "--model_dir", str(model_dir),
                           "--out", str(out), *argv], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_objectives")
    return {name: run_loop(root / name, model_dir, *argv) for name, argv in (
        ("healthy", ()), ("entropy_sign", ("--bug", "entropy_sign")), ("no_dual_clip", ("--bug", "no_dual_clip")),
        ("no_entropy", ("--leave_out", "entropy", "per_token_loss")),
        ("no_dual_clip_per_token", ("--bug", "no_dual_clip", "--leave_out")))}


def by_hand(d: dict, dual_clip: bool = True, entropy_sign: float = -1.0) -> float:
    pi, old, ref = d["policy_logprobs"].double(), d["old_logprobs"].double(), d["ref_logprobs"].double()
    a, m = d["advantages"].double(), d["completion_mask"].double()
    r = torch.exp(pi - old)
    l = torch.max(-a * r, -a * r.clamp(1 - EPS, 1 + EPS))
    if dual_clip:
        l = torch.where(a < 0, torch.min(l, -a * C), l)
    l = l + KL_COEF * (torch.exp(ref - pi) - (ref - pi) - 1)
    entropy = (d["entropy"].double() * m).sum() / m.sum()
    return float((l * m).sum() / m.sum() + entropy_sign * ENTROPY_COEF * entropy)


def binds(d: dict) -> int:
    """Kept tokens where the dual clip caps the loss: A < 0 and ratio > c."""
    r = torch.exp(d["policy_logprobs"] - d["old_logprobs"])
    return int((d["completion_mask"].bool() & (d["advantages"] < 0) & (r > C)).sum())


def test_healthy_loop_runs_the_loss_and_ratio_checks_and_passes(runs, capsys):
    trace = Trace(runs["healthy"])
    capped = 0
    for key in trace.steps():
        d = trace.load_step(key)
        assert float(d["loss"]) == pytest.approx(by_hand(d), abs=1e-5)
        capped += binds(d)
        result = check_step(StepContext(trace, key, CheckOptions()), list(CHECKS.values()))
        assert set(LOSS_CHECKS) <= set(result.ran), result.skipped
    assert capped > 0  # the dual clip binds somewhere: the run tells dual clip from none
    findings = run_checks(runs["healthy"])
    assert [f.message for f in findings if f.severity in (ERROR, WARNING)] == []
    capsys.readouterr()
    assert main(["check", str(runs["healthy"]), "--strict-coverage"]) == 0
    capsys.readouterr()
    assert main(["check", str(runs["healthy"]), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert not [f for f in shown if f["check"] in LOSS_CHECKS and f["severity"] == "skipped"]


def test_entropy_bonus_with_its_sign_flipped_is_named_first_on_every_step_file(runs, capsys):
    trace = Trace(runs["entropy_sign"])
    for key in trace.steps():  # the loop's loss is the policy loss + entropy_coef * H
        d = trace.load_step(key)
        assert float(d["loss"]) == pytest.approx(by_hand(d, entropy_sign=+1.0), abs=1e-5)
    errors = [f for f in run_checks(runs["entropy_sign"]) if f.severity == ERROR]
    assert {f.check for f in errors} == {"recompute.loss"}
    assert len(errors) == len(trace.steps())
    for f in errors:
        assert f.message.startswith("entropy bonus sign flipped: recorded loss"), f.message
        assert "+ entropy_coef × H" in f.message and f.details["cause"] == "entropy_sign_flipped"
        assert f.details["entropy_coef"] == ENTROPY_COEF
    capsys.readouterr()
    assert main(["check", str(runs["entropy_sign"])]) == 1


def test_loss_without_its_dual_clip_is_named_where_the_clip_binds(runs, capsys):
    trace = Trace(runs["no_dual_clip"])
    expected = set()
    for key in trace.steps():
        d = trace.load_step(key)
        assert float(d["loss"]) == pytest.approx(by_hand(d, dual_clip=False), abs=1e-5)
        if binds(d):
            expected.add((key.step, key.inner_step, key.micro_batch))
    assert expected  # else the case tests nothing
    errors = [f for f in run_checks(runs["no_dual_clip"]) if f.severity == ERROR]
    assert {(f.step, f.inner_step, f.micro_batch) for f in errors} == expected
    for f in errors:
        assert f.check == "recompute.loss"
        assert f.message.startswith("dual clip missing: the policy loss"), f.message
        assert "clip_ratio_c = 1.2 is recorded" in f.message and f.details["cause"] == "dual_clip_missing"
    capsys.readouterr()
    assert main(["check", str(runs["no_dual_clip"])]) == 1


def test_recorded_per_token_loss_without_the_dual_clip_is_named_on_the_tokens_it_caps(runs):
    trace = Trace(runs["no_dual_clip_per_token"])
    expected = {(k.step, k.inner_step, k.micro_batch) for k in trace.steps() if binds(trace.load_step(k))}
    assert expected
    errors = [f for f in run_checks(runs["no_dual_clip_per_token"]) if f.check == "recompute.per_token_loss"
              and f.severity == ERROR]
    assert {(f.step, f.inner_step, f.micro_batch) for f in errors} == expected
    for f in errors:
        d = trace.load_step(trace.step_key(f.step, f.inner_step, f.micro_batch, f.rank))
        assert f.message.startswith(f"dual clip missing: the recorded per_token_loss is the clipped surrogate without "
                                    f"the dual clip, while clip_ratio_c = 1.2 is recorded: on {binds(d)} kept tokens")


def test_an_entropy_bonus_whose_entropy_is_not_recorded_is_said_not_checked(runs, capsys):
    (note,) = [f for f in run_checks(runs["no_entropy"]) if f.check == NOT_CHECKED]
    assert note.message.startswith("not checked: entropy bonus (entropy_coef 0.01) — the loss subtracts entropy_coef "
                                   "× the mean token entropy, and entropy is not recorded; record entropy [B, T]")
    assert note.details["checks"] == ["recompute.loss"]
    capsys.readouterr()
    assert main(["check", str(runs["no_entropy"])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("not checked: entropy bonus (entropy_coef 0.01)")
    assert main(["check", str(runs["no_entropy"]), "--strict-coverage"]) == 1
