"""``/rollouts?run=nope`` (no such trace under the root) says the URL's run is not a trace and lists
no rows: not the rows of the run the sidebar falls back on while the URL still names ``nope``.
A button lists the run the sidebar shows instead, and puts it in the URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.toy_traces import ToyTokenizer, start, write_trace

PAGE = "app_pages/rollouts.py"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    write_trace(root / "a_run", tokenizer=ToyTokenizer(), steps=2)
    return root


def test_an_unknown_run_in_the_url_lists_no_other_runs_rows(monkeypatch, root):
    at = start(monkeypatch, root, {"run": "nope"}, page=PAGE)
    assert not at.exception, [e.value for e in at.exception]
    assert at.query_params["run"] == ["nope"] or at.query_params["run"] == "nope"
    assert any("not a trace under the root" in e.value for e in at.error)
    assert len(at.dataframe) == 0  # no rows of a_run under a URL naming nope
    at.button(key="ro_open_shown_run").click().run()  # the run the sidebar shows: the URL now names it
    assert at.query_params["run"] in ("a_run", ["a_run"])
    assert not at.error
    assert not at.exception, [e.value for e in at.exception]
    assert max(len(f.value) for f in at.dataframe) == 2 * 2 * 4  # a_run: 2 steps x 2 inner steps x 4 rows
