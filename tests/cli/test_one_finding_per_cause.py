"""`tracer check` shows one cause once: the same bug found at every step file, whose message carries
that step's numbers, is one entry with the steps it occurs on, while --json keeps every finding. Run
on a real MiniMind-style GRPO loop whose KL term has the wrong sign at every step (--bug flip_kl)."""

from __future__ import annotations

import contextlib
import io
import json
import os

from rich.console import Console

from tracer.checks.finding import Finding
from tracer.checks.report import cause_key, render_findings, same_cause
from tracer.cli import main
from tracer.demo.tiny_model import torch_threads

from tests.fixtures.paths import SCRIPTS

os.environ["HF_HUB_OFFLINE"] = "1"


def _cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_the_same_bug_at_every_step_is_one_entry_with_its_steps(tmp_path, model_dir):
    out = tmp_path / "trace"
    with torch_threads(1):
        assert main(["run", "--algo", "grpo", "--out", str(out), "--meta", "loss_reduction=sequence_mean", "--",
                     str(SCRIPTS / "minimind_grpo.py"), "--model_dir", str(model_dir), "--bug", "flip_kl",
                     "--steps", "3"]) == 0
    code, text = _cli("check", str(out), "--json")
    flipped = [f for f in json.loads(text) if f["check"] == "recompute.per_token_loss" and f["severity"] == "error"]
    # every step file (3 steps x 2 inner steps, but for step 0's first pass where ref == policy) says it
    assert code == 1 and len(flipped) >= 3 and len({f["message"] for f in flipped}) == len(flipped)
    assert all("KL term's sign flipped" in f["message"] for f in flipped)
    first, others = flipped[0], flipped[1:]
    steps = sorted({f["step"] for f in others} - {first["step"]})
    code, text = _cli("check", str(out))
    assert code == 1
    assert text.count("KL term's sign flipped") == 1  # was once per step file
    assert f"ERROR   recompute.per_token_loss  {len(flipped)} findings" in text
    listed = ", ".join(map(str, steps)) if len(steps) < 3 else f"{steps[0]}..{steps[-1]}"
    assert (f"(the same with other numbers at steps {listed}: {len(others)} more findings, --json lists each)"
            in " ".join(text.split()))


def test_numbers_are_masked_but_names_are_not_and_a_declared_cause_groups():
    assert cause_key(Finding("x.y", "error", "k3 is 0.25 at step 3, token 7 (79%)")) == "k3 is # at step #, token # (#)"
    assert cause_key(Finding("x.y", "error", "fp16 1e-05 -2.5")) == "fp16 # #"
    a = Finding("x.y", "warning", "ref KL 3.4 nats", step=1, details={"cause": "drift"})
    b = Finding("x.y", "warning", "an other wording 9", step=2, details={"cause": "drift"})
    c = Finding("x.y", "warning", "ref KL 3.5 nats", step=5)
    d = Finding("x.y", "warning", "ref KL 2.5 nats", step=7)
    assert [(f, rest) for f, rest in same_cause([a, c, b, d])] == [(a, [b]), (c, [d])]
    console = Console(width=400, record=True)
    console.print(render_findings([a, b, c, d]))
    shown = console.export_text()
    assert "ref KL 3.4 nats" in shown and "an other wording" not in shown and "ref KL 2.5" not in shown
    assert "step 5 (the same with other numbers at step 7: 1 more finding, --json lists each)" in shown
