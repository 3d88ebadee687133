"""guard="stop" on the healthy hand-written GRPO loop: no false alarm stops it; it runs all its steps,
the findings file holds no error or warning, and the manifest names the guard without a stop."""

from __future__ import annotations

import json

from tests.guard.grpo_loops import run_loop
from tracer.format.findings_log import findings_paths, read_lines
from tracer.read import Trace


def test_the_healthy_loop_runs_every_step_and_nothing_is_reported(model_dir, tmp_path):
    out = tmp_path / "healthy"
    progress: list[int] = []
    run_loop(out, model_dir, "stop", steps=3, progress=progress)
    assert progress == [0, 1, 2, 3]
    assert [(k.step, k.inner_step) for k in Trace(out).steps()] == [(s, i) for s in range(3) for i in range(2)]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["guard"] == {"mode": "stop"}
    (path,) = findings_paths(out)
    lines = list(read_lines(path))
    assert [line["kind"] for line in lines][:1] == ["guard"]
    assert sum(line["kind"] == "checked" for line in lines) >= 4  # the first 4 files are always checked
    reported = [line for line in lines if line["kind"] == "finding" and line["severity"] in ("error", "warning")]
    assert reported == []
