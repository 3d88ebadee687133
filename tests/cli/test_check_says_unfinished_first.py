"""`tracer check` on a run whose writer has not closed (manifest status ``running``: still going, or
killed) says so before anything else, whether or not a step file is on disk yet."""

from __future__ import annotations

import json
import sys

from tracer import TraceWriter
from tracer.checks import run_checks
from tracer.cli import main

from tests.fixtures.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from crash_loop import step_tensors  # noqa: E402
sys.path.remove(str(SCRIPTS))


def _open_writer(root):
    return TraceWriter(root, "grpo", hyperparameters={"num_generations": 2}, writer="thread")


def test_check_of_an_unfinished_run_without_step_files_says_unfinished_before_no_step_file(tmp_path, capsys):
    root = tmp_path / "run"
    writer = _open_writer(root)
    try:
        assert main(["check", str(root)]) == 2
    finally:
        writer.close()
    err = capsys.readouterr().err
    assert err.startswith(f"tracer check: error: {root}: this trace is unfinished (its manifest says status "
                          "'running': the writer has not closed; the run is still going, or it crashed or was "
                          "killed before close()), and it holds no step file: nothing to check")


def test_check_of_an_unfinished_run_with_step_files_says_unfinished_first(tmp_path, capsys):
    root = tmp_path / "run"
    writer = _open_writer(root)
    try:
        writer.record(0, step_tensors(0))
        writer.record(1, {k: v for k, v in step_tensors(1).items() if k != "old_logprobs"})  # something to skip
        writer.flush()
        code = main(["check", str(root)])
        text = capsys.readouterr().out
        assert main(["check", "--json", str(root)]) == code
        findings = json.loads(capsys.readouterr().out)
        assert run_checks(root)[0].check == "trace.unfinished"
    finally:
        writer.close()
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[0] == str(root) and lines[1].startswith("INFO    trace.unfinished"), lines[:3]
    assert lines[3].strip().startswith("this trace is unfinished: its manifest says status 'running'")
    assert findings[0]["check"] == "trace.unfinished"


def test_check_of_a_closed_run_says_nothing_about_unfinished(tmp_path, capsys):
    root = tmp_path / "run"
    with _open_writer(root) as writer:
        writer.record(0, step_tensors(0))
    main(["check", str(root)])
    assert "unfinished" not in capsys.readouterr().out
