"""guard=callable: the callable gets each error and warning as a Finding, in the order the findings
file holds them, from the checker process forked beside the writer thread or (writer="process") from
the writer process, whose checks ran there (the findings file's guard line names that process)."""

from __future__ import annotations

import json
import os

import pytest

from tests.guard.grpo_loops import run_loop
from tracer.checks.finding import Finding
from tracer.format.findings_log import findings_paths, read_lines


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_the_callable_gets_every_reported_finding(model_dir, tmp_path, monkeypatch, writer):
    monkeypatch.setenv("TRACER_GUARD_SHARE", "1")
    got: list[Finding] = []
    out = tmp_path / writer
    run_loop(out, model_dir, got.append, bug="flip_kl", steps=2, writer=writer)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["capture"]["writer"] == writer and manifest["guard"] == {"mode": "callable"}
    (path,) = findings_paths(out)
    lines = list(read_lines(path))
    guards = [line for line in lines if line["kind"] == "guard"]
    assert len(guards) == 1 and guards[0]["mode"] == "callable"
    # the checks ran off the training process: in the checker process forked beside the writer thread, or in
    # the writer process
    assert guards[0]["pid"] != os.getpid()
    assert guards[0]["where"] == {"thread": "checker process", "process": "writer process"}[writer]
    reported = [line for line in lines if line["kind"] == "finding" and line["severity"] in ("error", "warning")]
    assert all(type(f) is Finding for f in got)
    assert [f.to_dict() for f in got] == [{k: v for k, v in line.items() if k not in ("kind", "scope", "file")}
                                          for line in reported]
    assert [(f.check, f.step, f.inner_step) for f in got][:1] == [("recompute.per_token_loss", 0, 1)]
