"""A trace that lacks the fields a common bug class needs is never a silent PASS: the README's
explicit-API skeleton run without its ``loss`` and ``per_token_loss`` lines (the loss averages over
padding) opens `tracer check`'s report with "not checked: loss reduction and loss over padding —
record loss, per_token_loss", exits 0, and exits 1 with --strict-coverage. A trace that records the
fields of every class that applies to it has no such line and --strict-coverage leaves it at 0."""

from __future__ import annotations

import os

from tracer.checks import run_checks
from tracer.checks.coverage import NOT_CHECKED
from tracer.cli import main

from tests.fixtures.paths import REPO
from tests.fixtures.readme_skeleton import run_skeleton

os.environ["HF_HUB_OFFLINE"] = "1"


def test_a_skeleton_without_loss_fields_says_first_that_the_loss_was_not_checked(tmp_path, model_dir, capsys):
    trace = run_skeleton(tmp_path, model_dir, drop=("per_token_loss", "loss"))
    (note,) = [f for f in run_checks(trace) if f.check == NOT_CHECKED]
    assert note.severity == "skipped"
    assert note.details["class"] == "loss reduction and loss over padding"
    assert note.details["fields"] == ["loss", "per_token_loss"]
    assert note.message.startswith("not checked: loss reduction and loss over padding — record loss, per_token_loss "
                                   "(on 1 of 1 step files none of recompute.loss, recompute.per_token_loss could run")
    capsys.readouterr()
    assert main(["check", str(trace)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == str(trace) and lines[1].startswith("not checked: loss reduction and loss over padding — record "
                                                          "loss, per_token_loss")
    assert "PASS" in lines[-1] and "(not checked: 1 bug class, named at the top)" in lines[-1]
    assert main(["check", str(trace), "--strict-coverage"]) == 1
    assert main(["check", str(trace), "--strict-coverage", "--select", "masks"]) == 0  # the loss was not asked for


def test_a_trace_recording_every_class_it_needs_passes_strict_coverage(capsys):
    # the hand-written CISPO sample records loss, per_token_loss, ref, old, ids, rewards and groups; no engine
    root = REPO / "sample_traces" / "cispo-tiny"
    assert [f for f in run_checks(root) if f.check == NOT_CHECKED] == []
    assert main(["check", str(root), "--strict-coverage"]) == 0
    assert "not checked: loss reduction" not in capsys.readouterr().out
