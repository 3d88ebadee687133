"""The live guard raises no alarm on a healthy PPO loop that puts its KL penalty in the rewards without
declaring it (OpenRLHF's and InstructGPT's way: tests/scripts/foreign/ppo_openrlhf.py, kl_coef recorded,
kl_in_reward not). On the first rollout old == ref, so its token rewards carry a zero penalty and
cannot show where the penalty is; the guard, checking step 0 before later step files exist, printed
"ERROR recompute.per_token_loss ... matches the loss without its KL term" on every such run (with
guard="stop", it would have stopped a healthy run). Now that step is undecided (a skip naming what to
record), and ``tracer check`` of the finished run, whose later files show the penalty in the rewards,
still says so (an info of recompute.token_rewards at every step)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tracer.checks import ERROR, INFO, run_checks

from tests.fixtures.paths import REPO

SCRIPT = REPO / "tests" / "scripts" / "foreign" / "ppo_openrlhf.py"


@pytest.fixture(scope="module")
def stopped_or_not(tmp_path_factory):
    root = tmp_path_factory.mktemp("openrlhf")
    env = {k: v for k, v in os.environ.items() if k not in ("BUG", "KLR", "OMIT_KLCOEF", "MB", "KL_EST", "KL_EST_META")}
    env.update(FOREIGN_CACHE=str(root / "cache"), HF_HUB_OFFLINE="1", TRACER_GUARD="stop")
    (root / "cache").mkdir()
    done = subprocess.run([sys.executable, str(SCRIPT), str(root / "run")], env=env, capture_output=True, text=True,
                          timeout=600)
    return root / "run", done


def test_the_guard_lets_the_healthy_run_finish(stopped_or_not):
    out, done = stopped_or_not
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tracer guard: stopping" not in done.stderr and "tracer guard: ERROR" not in done.stderr, done.stderr[-3000:]


def test_the_finished_run_says_where_the_penalty_is(stopped_or_not):
    out, _ = stopped_or_not
    findings = run_checks(out)
    assert [f for f in findings if f.severity == ERROR] == []
    placed = [f for f in findings if f.check == "recompute.token_rewards" and f.severity == INFO]
    assert {f.step for f in placed} == {0, 1, 2} and all(f.details["kl_in_reward"] for f in placed)
