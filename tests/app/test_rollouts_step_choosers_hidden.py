"""On the Rollouts page, which lists every completion of every step file, the sidebar's Step file
and Sequence choosers would do nothing: they are off the sidebar there, the Run chooser stays, and
the step and row chosen before come back on the next page (as the Diff page does with every chooser)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.toy_traces import TOKENS_PAGE, ToyTokenizer, start, write_trace

ROLLOUTS_PAGE = "app_pages/rollouts.py"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    write_trace(root / "a_run", tokenizer=ToyTokenizer(), steps=3)
    write_trace(root / "b_run", tokenizer=ToyTokenizer(), steps=2)
    return root


def test_rollouts_hides_the_step_choosers_and_keeps_their_values(monkeypatch, root):
    at = start(monkeypatch, root, {"run": "a_run", "step": "1", "inner": "1", "seq": "2"}, page=TOKENS_PAGE)
    assert [s.key for s in at.sidebar.selectbox] == ["run", "step_file", "sequence"]
    at.switch_page(ROLLOUTS_PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Rollouts"
    assert [s.key for s in at.sidebar.selectbox] == ["run"]  # Run stays: it picks the run listed
    at.text_input(key="ro_search").input("a").run()  # a rerun on Rollouts
    assert not at.exception, [e.value for e in at.exception]
    assert [s.key for s in at.sidebar.selectbox] == ["run"]
    at.query_params.clear()  # the navigation menu opens a page without the query string
    at.switch_page(TOKENS_PAGE).run()  # back: the step file and row chosen before Rollouts
    assert not at.exception, [e.value for e in at.exception]
    assert at.sidebar.selectbox(key="run").value == root / "a_run"
    assert at.selectbox(key="step_file").value == "step 1 · inner 1 · mb 0 · rank 0"
    assert at.selectbox(key="sequence").value == 2


def test_the_run_chooser_on_rollouts_lists_the_other_run(monkeypatch, root):
    at = start(monkeypatch, root, {"run": "a_run"}, page=ROLLOUTS_PAGE)
    assert not at.exception, [e.value for e in at.exception]

    def rows():  # the rollouts table: the page's largest
        return max((f.value for f in at.dataframe), key=len)

    assert len(rows()) == 3 * 2 * 4  # a_run: 3 steps x 2 inner steps x 4 rows
    at.sidebar.selectbox(key="run").select(root / "b_run").run()
    assert not at.exception, [e.value for e in at.exception]
    assert [s.key for s in at.sidebar.selectbox] == ["run"]
    assert len(rows()) == 2 * 2 * 4
