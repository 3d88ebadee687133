"""``tracer run --guard stop -- minimind_grpo.py ...``: MiniMind's unmodified GRPO loop (tests/scripts/) with
the KL penalty's sign flipped (``--bug flip_kl``, from step 0 on) is interrupted at a traced backward
before its end, with ``GuardStop`` raised into the script, the finding printed and the documented exit
code; the trace holds every step recorded before the stop and ``tracer check`` fails on it with the same
finding. The healthy loop under ``--guard stop`` runs to its end. How many steps after the bad one the
stop comes is a time, measured by bench/guard_cost.py, not asserted here. The steps are written by the
writer thread (``TRACER_WRITER=thread``): the writer process takes seconds to start on a busy host, and
the guard checks what it has written.

Why step 0, inner 1: the reference model is the initial policy, so at step 0, inner step 0 (policy ==
reference) every ref_kl_k3 is 0 and a flipped penalty changes no per-token loss; at inner step 1 the
policy has moved and the recorded per_token_loss is the GRPO loss minus, not plus, beta * ref_kl_k3.
No mocks: the real script, the tiny local model, real files.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.paths import SCRIPTS
from tracer import Trace
from tracer.checks import ERROR, run_checks
from tracer.cli import main as cli_main
from tracer.demo.tiny_model import torch_threads
from tracer.zero_edit.script_runner import GUARD_STOPPED_EXIT

STEPS = 10  # the script's steps without the guard (2 inner steps each: num_iterations 2)


def _run(out, model_dir, *script_args: str, guard: str = "stop") -> int:
    with torch_threads(1), pytest.MonkeyPatch.context() as env:
        env.setenv("TRACER_WRITER", "thread")
        return cli_main(["run", "--algo", "grpo", "--out", str(out), "--guard", guard, "--meta",
                         "loss_reduction=sequence_mean", "--", str(SCRIPTS / "minimind_grpo.py"),
                         "--model_dir", str(model_dir), "--steps", str(STEPS), *script_args])


def test_flipped_kl_sign_stops_the_script_before_its_end(tmp_path, model_dir, capsys):
    out = tmp_path / "trace"
    assert _run(out, model_dir, "--bug", "flip_kl") == GUARD_STOPPED_EXIT == 4
    captured = capsys.readouterr()
    stopped = [line for line in captured.err.splitlines() if line.startswith("tracer run: the guard stopped the script:")]
    assert len(stopped) == 1 and "recompute.per_token_loss" in stopped[0], captured.err[-2000:]
    assert "step 0" in stopped[0] and "inner 1" in stopped[0]
    assert "Traceback" not in captured.err
    assert f"step {STEPS - 1}: reward" not in captured.out

    trace = Trace(out)
    keys = sorted((k.step, k.inner_step) for k in trace.steps())
    done = [line for line in captured.out.splitlines() if line.startswith("step ")]  # steps the script finished
    # every backward that ran was recorded: the finished steps' two, and at most one of the step under way
    assert keys[:2 * len(done)] == [(s, i) for s in range(len(done)) for i in (0, 1)]
    assert len(keys) in (2 * len(done), 2 * len(done) + 1) and len(keys) < 2 * STEPS
    assert trace.manifest["guard"]["stopped_at"] == dict(zip(("step", "inner_step", "micro_batch"),
                                                             (*divmod(len(keys), 2), 0)))
    assert trace.manifest["dropped_steps"] == 0
    guard = trace.manifest["guard"]
    assert guard["mode"] == "stop" and guard["finding"]["check"] == "recompute.per_token_loss"
    assert (guard["finding"]["step"], guard["finding"]["inner_step"]) == (0, 1)

    # the bug is real: at (0, 1) the recorded loss is the clipped objective plus beta * ref_kl_k3, not minus
    key = next(k for k in trace.steps() if (k.step, k.inner_step) == (0, 1))
    d = trace.load_step(key)
    ratio, adv = d["ratio"].double(), d["advantages"].double().unsqueeze(1)  # (B, T), (B, 1)
    clipped = torch.minimum(ratio * adv, ratio.clamp(1 - 0.2, 1 + 0.2) * adv)  # the script's epsilon 0.2
    keep = d["completion_mask"].bool()
    flipped = -(clipped + 0.04 * d["ref_kl_k3"].double())  # the script's beta 0.04, the sign flipped
    torch.testing.assert_close(d["per_token_loss"].double()[keep], flipped[keep], atol=1e-5, rtol=1e-4)
    assert bool((d["ref_kl_k3"][keep] > 1e-6).any())  # so the flip shows

    # checked afresh (the guard's file not reused): the guard's finding among the errors; `tracer check` exits 1
    fresh = [f for f in run_checks(out, select=["recompute.per_token_loss"], reuse_guard=False)
             if f.severity == ERROR]
    assert guard["finding"]["message"] in [f.message for f in fresh if (f.step, f.inner_step) == (0, 1)]
    assert cli_main(["check", str(out)]) == 1


def test_healthy_script_under_guard_stop_runs_to_its_end(tmp_path, model_dir, capsys):
    out = tmp_path / "trace"
    assert _run(out, model_dir) == 0
    captured = capsys.readouterr()
    assert f"step {STEPS - 1}: reward" in captured.out
    assert "the guard stopped" not in captured.err
    trace = Trace(out)
    assert sorted((k.step, k.inner_step) for k in trace.steps()) == [(s, i) for s in range(STEPS) for i in (0, 1)]
    assert [f for f in run_checks(out) if f.severity == ERROR] == []
    assert "finding" not in json.loads((out / "manifest.json").read_text()).get("guard", {})
