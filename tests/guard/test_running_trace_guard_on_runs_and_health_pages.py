"""The app shows what the live guard found in a trace while its run goes on: the Runs page's ``guard``
column and the Health page's note (and, for a run the guard stopped, the finding that stopped it).

The runs are toy GRPO traces written by the real TraceWriter with ``guard="warn"`` / ``"stop"``, one
token kept after EOS at step 1, inner 0, row 0 (``masks.after_eos``, an error). The writer of the
"warn" run is left open (a running trace); the "stop" run ends with the GuardStop of its next record.
The counts the page shows are compared with a fresh ``tracer check`` of the same step files (the
guard's file not reused).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from app.components import runs, trace_cache
from app.components.guard import guard_report
from tests.fixtures.toy_traces import (
    HYPERPARAMETERS,
    ToyTokenizer,
    frame_with,
    healthy_step_tensors,
    start,
)
from tracer import TraceWriter
from tracer.checks import ERROR, WARNING, run_checks
from tracer.errors import GuardStop
from tracer.format.findings_log import findings_paths, read_lines

BUG_STEP, BUG_SEQUENCE, BUG_TOKEN = 1, 0, 3
HEALTH_PAGE = "app_pages/health.py"


def _record(writer: TraceWriter, step: int, inner: int) -> None:
    tensors = healthy_step_tensors(step if inner == 0 else 100 + step, inner)
    if (step, inner) == (BUG_STEP, 0):  # `4 <script> <eos> | pad ...`: <b> right after the EOS, kept
        tensors["completion_ids"][BUG_SEQUENCE, BUG_TOKEN] = 8
        tensors["completion_mask"][BUG_SEQUENCE, BUG_TOKEN] = True
    writer.record(step, tensors, inner_step=inner)


def _checked(root: Path) -> int:
    return sum(1 for p in findings_paths(root) for line in read_lines(p) if line.get("kind") == "checked")


def _wait(condition, what: str, limit_s: float = 120.0) -> None:
    """Poll ``condition()`` until true; fail naming ``what`` after ``limit_s`` (a hung guard, not a timing)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"the guard never {what}")
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def fresh_caches():
    trace_cache.clear_caches()
    runs.run_status.clear()
    guard_report.clear()


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "runs"
    live = TraceWriter(root / "live", "grpo", tokenizer=ToyTokenizer(), hyperparameters=HYPERPARAMETERS,
                       async_write=False, guard="warn")
    for step in range(2):  # 4 step files: the guard's first files, all checked
        for inner in (0, 1):
            _record(live, step, inner)
    _wait(lambda: _checked(root / "live") == 4, "checked the 4 step files of the running trace")

    stopped = TraceWriter(root / "stopped", "grpo", tokenizer=ToyTokenizer(), hyperparameters=HYPERPARAMETERS,
                          async_write=False, guard="stop")
    for step in range(2):
        for inner in (0, 1):
            _record(stopped, step, inner)
    _wait(lambda: stopped.guard_stop is not None, "stopped the run with the bug")
    with pytest.raises(GuardStop):
        _record(stopped, 2, 0)
    stopped.close()
    yield root
    live.close()


def _fresh_counts(path: Path) -> tuple[int, int]:
    findings = run_checks(path, reuse_guard=False)
    return sum(f.severity == ERROR for f in findings), sum(f.severity == WARNING for f in findings)


def test_the_runs_page_shows_what_the_guard_found_and_where_it_stopped(monkeypatch, root):
    errors, warnings = _fresh_counts(root / "live")
    assert errors >= 1  # the kept token after EOS
    at = start(monkeypatch, root)
    assert not at.exception, [e.value for e in at.exception]
    table = frame_with(at, {"run", "check", "guard"}).value.set_index("run")
    assert table.loc["live", "status"] != "finished"  # the writer is still open: a running trace
    found = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for n, s in ((errors, "error"), (warnings, "warning")) if n)
    assert table.loc["live", "guard"] == f"warn: {found} in 4 step files"
    assert table.loc["stopped", "guard"] == f"stop: stopped at step {BUG_STEP} (masks.after_eos)"


def test_the_health_page_says_the_guard_stopped_the_run_and_why(monkeypatch, root):
    at = start(monkeypatch, root, {"run": "stopped"}, page=HEALTH_PAGE)
    assert not at.exception, [e.value for e in at.exception]
    assert next(e.value for e in at.error) == (
        f"The live guard stopped this run at the first error: masks.after_eos at step {BUG_STEP} · inner_step 0 · "
        f"sequence {BUG_SEQUENCE} · token {BUG_TOKEN}.")
    caption = next(c.value for c in at.caption if c.value.startswith("Live guard"))
    assert caption.startswith("Live guard (stop): 4 step file(s) checked while the run went on")

    at = start(monkeypatch, root, {"run": "live"}, page=HEALTH_PAGE)
    caption = next(c.value for c in at.caption if c.value.startswith("Live guard"))
    assert caption.startswith("Live guard (warn): 4 step file(s) checked while the run went on")
    assert not [e.value for e in at.error if "live guard stopped" in e.value]
