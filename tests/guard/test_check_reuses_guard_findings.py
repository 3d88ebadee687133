"""``tracer check`` of a guarded trace reuses the guard's step-check results (the findings file) for
the step files the guard checked: the same findings as checking afresh; a record whose step file
changed since (its modification time) is not reused."""

from __future__ import annotations

import json
import os

import pytest

from tests.guard.grpo_loops import run_loop
from tracer.checks.guard_records import LAST_REUSE
from tracer.checks.runner import run_checks
from tracer.format.findings_log import findings_paths, read_lines
from tracer.read import Trace


@pytest.fixture(scope="module")
def guarded(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reuse") / "flip_kl"
    os.environ["TRACER_GUARD_SHARE"] = "1"  # every file checked (module scope: no monkeypatch)
    try:
        run_loop(out, model_dir, "warn", bug="flip_kl", steps=2)
    finally:
        del os.environ["TRACER_GUARD_SHARE"]
    return out


def test_reused_results_equal_a_fresh_check(guarded):
    fresh = [f.to_dict() for f in run_checks(guarded, reuse_guard=False)]
    reused = [f.to_dict() for f in run_checks(guarded)]
    assert LAST_REUSE["reused"] == LAST_REUSE["files"] == 4
    assert reused == fresh
    assert any(f["severity"] == "error" and f["check"] == "recompute.per_token_loss" for f in fresh)


def test_the_record_is_what_is_reused_until_its_file_changes(guarded):
    first = Trace(guarded).steps()[0]
    (path,) = findings_paths(guarded)
    checked = next(line for line in read_lines(path) if line["kind"] == "checked" and line["file"] == first.path.name)
    forged = {"kind": "finding", "scope": "step", "file": first.path.name, "check": "masks.padding",
              "severity": "error", "message": "forged to see the record reused", "step": 0, "inner_step": 0,
              "micro_batch": 0, "rank": 0, "path": str(first.path)}
    with open(path, "a", encoding="utf-8") as fh:  # a later record of the same file replaces the first
        fh.write(json.dumps(forged) + "\n" + json.dumps({**checked, "findings": 1}) + "\n")
    messages = [f.message for f in run_checks(guarded)]
    assert "forged to see the record reused" in messages
    stat = os.stat(first.path)
    os.utime(first.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    again = [f.to_dict() for f in run_checks(guarded)]
    assert LAST_REUSE["reused"] == 3
    assert again == [f.to_dict() for f in run_checks(guarded, reuse_guard=False)]


def test_the_command_line_says_what_it_reused_and_fresh_recomputes(guarded, capsys):
    from tracer.cli import main

    assert main(["check", str(guarded), "--json"]) == 1
    reused = capsys.readouterr()
    # 4 step files; the earlier tests of this module may have touched one (then not reused)
    assert LAST_REUSE["files"] == 4 and LAST_REUSE["reused"] >= 3
    assert (f"reused the live guard's step-check results for {LAST_REUSE['reused']} of 4 step files"
            in reused.err)
    assert main(["check", str(guarded), "--json", "--fresh"]) == 1
    fresh = capsys.readouterr()
    assert "reused" not in fresh.err and LAST_REUSE.get("reused", 0) == 0
    assert json.loads(fresh.out) == json.loads(reused.out)  # the same findings either way
