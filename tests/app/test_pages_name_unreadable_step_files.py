"""Pages that list a run's step files say which cannot be read: the Rollouts page warns that the
rows of an unreadable step file are left out (and lists the others, read from their files), and the
Rollouts, Steps and Tokens pages of a run none of whose step files can be read name those files
instead of saying that the trace has no step file yet. Runs: copies of ``sample_traces/grpo-tiny``
with random bytes in one or all of their six step files (:mod:`tests.fixtures.unreadable_runs`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from app.components import trace_cache
from tests.fixtures.toy_traces import SAMPLES, start
from tests.fixtures.unreadable_runs import BAD_FILE, unreadable_runs

pytestmark = pytest.mark.skipif(not (SAMPLES / "grpo-tiny").is_dir(), reason="sample_traces/ is not in this checkout")
NO_STEP_FILES_YET = "This trace has no step files yet"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return unreadable_runs(tmp_path_factory.mktemp("unreadable"))


@pytest.fixture(autouse=True)
def fresh_caches():
    trace_cache.clear_caches()


def readable_rows(run: Path) -> int:
    """Completions in the run's step files that open (first dim of completion_ids)."""
    total = 0
    for path in (run / "steps").glob("*.safetensors"):
        if path.name == BAD_FILE:  # the scrambled file: no header to read
            continue
        with safe_open(str(path), "pt") as f:
            total += f.get_slice("completion_ids").get_shape()[0]
    return total


def texts(at) -> str:
    return "\n".join(str(el.value) for kind in ("warning", "info", "error", "text", "code")
                     for el in at.get(kind))


def test_rollouts_warns_that_the_rows_of_an_unreadable_step_file_are_left_out(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "onebad"}, page="app_pages/rollouts.py")
    assert not at.exception, [e.value for e in at.exception]
    rows = readable_rows(root / "onebad")
    assert rows == 40  # 5 readable files x 8 completions
    assert f"{rows} of {rows}" in texts(at) or f"{rows} row" in texts(at)
    warnings = [w.value for w in at.warning]
    assert any(w.startswith("1 step file(s) could not be read") for w in warnings), warnings
    assert BAD_FILE in texts(at)


@pytest.mark.parametrize("page", ["app_pages/rollouts.py", "app_pages/steps.py", "app_pages/tokens.py"])
def test_a_run_of_unreadable_step_files_names_them_instead_of_none_yet(monkeypatch, root, page):
    at = start(monkeypatch, root, query={"run": "allbad"}, page=page)
    assert not at.exception, [e.value for e in at.exception]
    shown = texts(at)
    assert NO_STEP_FILES_YET not in shown
    assert "None of the 6 step files of this run can be read" in shown
    for path in (root / "allbad" / "steps").glob("*.safetensors"):
        assert path.name in shown, path.name
