"""The Runs page's check column agrees with ``tracer check`` on runs whose step files cannot be read:
an unreadable step file is a ``trace.unreadable`` error there (the run does not "pass"), the step
files column counts the files on disk, and a run none of whose step files can be read says so,
where ``tracer check`` exits 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.components import runs, trace_cache
from tests.fixtures.toy_traces import REPO, SAMPLES, frame_with, start
from tests.fixtures.unreadable_runs import unreadable_runs

pytestmark = pytest.mark.skipif(not (SAMPLES / "grpo-tiny").is_dir(), reason="sample_traces/ is not in this checkout")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return unreadable_runs(tmp_path_factory.mktemp("unreadable"))


@pytest.fixture(autouse=True)
def fresh_caches():
    trace_cache.clear_caches()
    runs.run_status.clear()


def cli_check(path: Path) -> tuple[int, list[dict] | None]:
    done = subprocess.run([sys.executable, "-m", "tracer", "check", str(path), "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    return done.returncode, (json.loads(done.stdout) if done.returncode in (0, 1) else None)


def test_unreadable_step_files_are_errors_as_tracer_check_says(monkeypatch, root):
    at = start(monkeypatch, root)
    assert not at.exception, [e.value for e in at.exception]
    table = frame_with(at, {"run", "check"}).value.set_index("run")
    code, findings = cli_check(root / "onebad")
    assert code == 1
    errors = sum(f["severity"] == "error" for f in findings)
    assert sum(f["check"] == "trace.unreadable" for f in findings) == 1
    assert table.loc["onebad", "check"].startswith(f"{errors} error")
    assert table.loc["onebad", "step files"] == 6  # the files on disk, the unreadable one too
    assert table.loc["grpo-tiny", "check"] == "pass"


def test_a_run_with_no_readable_step_file_says_it_cannot_be_read(monkeypatch, root):
    at = start(monkeypatch, root)
    table = frame_with(at, {"run", "check"}).value.set_index("run")
    code, _ = cli_check(root / "allbad")
    assert code == 2
    assert table.loc["allbad", "check"] == "cannot read any of its 6 step files"
    assert table.loc["allbad", "step files"] == 6
