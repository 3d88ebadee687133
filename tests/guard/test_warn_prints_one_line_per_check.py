"""guard="warn" on the flipped-KL loop: the run goes on to its end; the first error or
warning of each check prints one line (the same bug found again at later steps prints nothing more),
while the findings file keeps every finding."""

from __future__ import annotations

import logging

from tests.guard.grpo_loops import run_loop
from tracer.format.findings_log import findings_paths, read_lines


def test_each_check_prints_its_first_finding_once_and_the_run_ends(model_dir, tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("TRACER_GUARD_SHARE", "1")  # check every file: the bug is in the file at every step
    out = tmp_path / "warn"
    progress: list[int] = []
    with caplog.at_level(logging.WARNING, logger="tracer.guard"):
        run_loop(out, model_dir, "warn", bug="flip_kl", steps=3, progress=progress)
    assert progress == [0, 1, 2, 3]
    printed = [r.getMessage() for r in caplog.records if r.name == "tracer.guard"
               and r.getMessage().startswith(("tracer guard: ERROR", "tracer guard: WARNING"))]
    (path,) = findings_paths(out)
    found = [line for line in read_lines(path) if line["kind"] == "finding" and line["severity"] in ("error", "warning")]
    loss_errors = [f for f in found if f["check"] == "recompute.per_token_loss"]
    assert len(loss_errors) >= 2  # found at several steps ...
    checks = list(dict.fromkeys(f["check"] for f in found))
    assert [line.split()[3] for line in printed] == checks  # ... printed once per check, in the order found
    first = loss_errors[0]
    assert (first["step"], first["inner_step"]) == (0, 1)
    line = printed[checks.index("recompute.per_token_loss")]
    assert line.startswith(f"tracer guard: ERROR recompute.per_token_loss at step 0 · inner 1 · mb 0 · rank 0 · "
                           f"seq {first['sequence']} · token {first['token']}: ")
    assert " | open: tracer view " in line and "\n" not in line
