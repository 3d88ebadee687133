"""guard="stop" on a hand-written GRPO loop whose loss adds the reference-KL term instead of
subtracting it (MiniMind's ``--bug flip_kl``): the guard's step checks find it at the first update
that moved the policy away from the reference (step 0, inner step 1), and the next record raises
GuardStop, with every step recorded before it on disk, the manifest saying why, and the trace
readable by ``tracer check`` (exit 1, the same finding)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

import tracer
from tests.guard.grpo_loops import BETA, run_loop
from tracer import formulas
from tracer.checks.runner import run_checks
from tracer.read import Trace


@pytest.fixture(scope="module")
def stopped(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("guard") / "flip_kl"
    progress: list[int] = []
    handler = _Lines()
    logging.getLogger("tracer.guard").addHandler(handler)
    try:
        with pytest.raises(tracer.GuardStop) as raised:
            # a step of 64 completions of up to 48 tokens (~0.6-1 s here; a real one takes seconds). At 32 x 32
            # (0.2-0.3 s) the checker's latency on a loaded 2-core CI machine was a step long: the stop came at
            # step 3, once in three CI runs of each of the last two sessions
            run_loop(out, model_dir, "stop", bug="flip_kl", steps=6, progress=progress, num_prompts=16,
                     max_new_tokens=48)
    finally:
        logging.getLogger("tracer.guard").removeHandler(handler)
    return out, raised.value, progress, handler.lines


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_recorded_loss_holds_the_flipped_kl_term_from_step_0_inner_1(stopped):
    # the bug as the data shows it, worked out independently of the checks: the loop trained with
    # -(min(r A, clip(r) A) + beta k3) where the grpo loss is -(min(...) - beta k3), so recorded minus
    # recomputed is -2 beta k3 at every kept token; k3 = 0 at step 0 inner 0 (policy == ref, no update yet)
    out, _, _, _ = stopped
    trace = Trace(out)
    first, second = trace.steps()[:2]
    for key, moved in ((first, False), (second, True)):
        data = trace.load_step(key)
        keep = data["completion_mask"].bool()
        recomputed = formulas.grpo_per_token_loss(data["policy_logprobs"], data["old_logprobs"], data["advantages"],
                                                  0.2, 0.2, BETA, data["ref_logprobs"])
        gap = (data["per_token_loss"] - recomputed)[keep]
        torch.testing.assert_close(gap, -2 * BETA * data["ref_kl_k3"][keep], atol=1e-5, rtol=1e-4)
        assert (data["ref_kl_k3"][keep].abs().max() > 1e-4) == moved


def test_guard_stop_is_raised_by_step_2_with_the_first_error(stopped):
    out, stop, progress, _ = stopped
    assert (stop.finding.check, stop.finding.severity) == ("recompute.per_token_loss", "error")
    assert (stop.finding.step, stop.finding.inner_step) == (0, 1)
    assert stop.finding.details["kl_sign_flipped"] is True
    assert max(progress) <= 2  # the loop of 6 steps never started step 3
    manifest = json.loads((out / "manifest.json").read_text())
    guard = manifest["guard"]
    assert guard["mode"] == "stop" and guard["finding"] == stop.finding.to_dict()
    assert guard["stopped_at"]["step"] <= 2
    # every step recorded before the refused one is on disk
    stopped_at = (guard["stopped_at"]["step"], guard["stopped_at"]["inner_step"])
    written = [(k.step, k.inner_step) for k in Trace(out).steps()]
    assert written == [(s, i) for s in range(3) for i in range(2) if (s, i) < stopped_at]
    assert manifest["steps_written"] == len(written) and manifest["status"] == "finished"


def test_the_stopping_finding_is_printed_on_one_line_with_its_view_link(stopped):
    out, stop, _, lines = stopped
    stopping = [line for line in lines if line.startswith("tracer guard: stopping at ERROR recompute.per_token_loss")]
    assert len(stopping) == 1
    line = stopping[0]
    assert "\n" not in line
    f = stop.finding
    assert f"at step 0 · inner 1 · mb 0 · rank 0 · seq {f.sequence} · token {f.token}: " in line
    assert "KL term's sign flipped" in line
    assert line.endswith(f"| open: tracer view {out} → http://localhost:8501/tokens?run=."
                         f"&step=0&inner=1&mb=0&rank=0&seq={f.sequence}&token={f.token}&colour={f.field}")


def test_tracer_check_reads_the_stopped_trace_and_finds_the_same_error(stopped):
    out, stop, _, _ = stopped
    fresh = [f.to_dict() for f in run_checks(out, reuse_guard=False)]
    assert stop.finding.to_dict() in fresh
    cli = subprocess.run([sys.executable, "-m", "tracer", "check", str(out)], capture_output=True, text=True, check=False,
                         timeout=300)
    assert cli.returncode == 1, cli.stderr
    assert "recompute.per_token_loss" in cli.stdout and "KL term's sign flipped" in cli.stdout
