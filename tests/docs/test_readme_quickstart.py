"""The README's quick start works as written: its TRL example, saved as a file and run in a new
directory, writes a trace that ``tracer info`` and ``tracer check`` read (and a second run is
refused, as the README says); the commands of its "Check" block, run from the checkout, find the
example's bug. Each command is taken from README.md itself, so the test follows the README."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.fixtures.paths import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def block_after(marker: str, language: str) -> str:
    """The first ```language block after ``marker`` in the README."""
    start = README.index(marker)
    match = re.compile(rf"^```{language}\n(.*?)^```", re.M | re.S).search(README, start)
    assert match, f"no {language} block after {marker!r} in README.md"
    return match.group(1)


def python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def test_the_trl_example_runs_as_written_in_a_new_directory(tmp_path):
    example = block_after("**TRL** (`GRPOTrainer`", "python")
    assert 'tracer.attach(trainer, "runs/my-grpo")' in example and "max_steps=2" in example
    (tmp_path / "example.py").write_text(example)
    run = python(["example.py"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    info = python(["-m", "tracer", "info", "runs/my-grpo", "--json"], tmp_path)
    assert info.returncode == 0, info.stderr
    facts = json.loads(info.stdout)
    # max_steps=2, one pass per rollout (TRL's default num_iterations = 1): steps 0 and 1, one file each
    assert (facts["algorithm"], facts["steps"], facts["num_step_files"], facts["status"]) == ("grpo", [0, 1], 2,
                                                                                              "finished")
    check = python(["-m", "tracer", "check", "runs/my-grpo"], tmp_path)
    assert check.returncode == 0 and "PASS  0 error" in check.stdout, check.stdout + check.stderr
    again = python(["example.py"], tmp_path)  # "run the example twice and the second attach says so"
    assert again.returncode != 0 and "runs/my-grpo already holds a trace" in again.stderr


def test_the_check_block_finds_the_examples_bug_from_the_checkout(tmp_path):
    block = block_after("records one GRPO step whose `completion_mask` is all ones", "bash")
    commands = [shlex.split(line.replace("/tmp/buggy", str(tmp_path / "buggy"))) for line in block.splitlines()]
    assert [c[:2] for c in commands] == [["python", "docs/examples/buggy_grpo_step.py"], ["python", "-m"]]
    write, check = (python(c[1:], REPO) for c in commands)
    assert write.returncode == 0, write.stderr
    assert check.returncode == 1, check.stdout + check.stderr  # exit 1: an error finding
    assert "ERROR   masks.after_eos  1 finding" in check.stdout and "ERROR   masks.padding  1 finding" in check.stdout
    assert "FAIL  2 error, 0 warning" in check.stdout


def test_the_explicit_api_skeleton_with_a_loss_over_padding_exits_1(tmp_path, model_dir, capsys):
    """The skeleton as written records loss and per_token_loss; its loss (the prelude's) is a mean over
    all B x T positions, padding after EOS included, while it declares sequence_mean: an error."""
    from tracer.cli import main

    from tests.fixtures.readme_skeleton import run_skeleton, skeleton

    assert '"per_token_loss": per_token_loss' in skeleton() and '"loss": loss' in skeleton()
    trace = run_skeleton(tmp_path, model_dir)
    capsys.readouterr()
    assert main(["check", str(trace)]) == 1
    out = capsys.readouterr().out
    assert "ERROR   recompute.loss" in out and "not checked: loss reduction" not in out
    # the cause, named first: the recorded loss is per_token_loss.mean() over all 4 x 6 positions
    assert "    loss over padding: recorded loss " in out and "over all 4 × 6 positions, padding included" in out
