"""The sidebar's Step number on a run of many step files: above
``sidebar.MAX_STEP_OPTIONS`` files the Step file chooser offers only the files of the step picked
in a number input (no 10,000-option list), and the URL's step, a number without a file and a
page switch still land on the right step file. The bound is lowered here so that a small real
trace (written by ``TraceWriter``) crosses it; the labels are worked out from the coordinates."""

from __future__ import annotations

import pytest

from app.components import sidebar, trace_cache
from tracer.format.names import step_file_name
from tracer.record.writer import TraceWriter

from tests.fixtures.toy_traces import TOKENS_PAGE, healthy_step_tensors, start, write_trace


def label(step: int, inner: int) -> str:
    return f"step {step} · inner {inner} · mb 0 · rank 0"


@pytest.fixture(autouse=True)
def few_options(monkeypatch):
    monkeypatch.setattr(sidebar, "MAX_STEP_OPTIONS", 3)
    trace_cache.clear_caches()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    write_trace(root / "run", steps=4)  # steps 0-3, inner steps 0 and 1: 8 files, more than 3
    return root


def test_the_step_number_offers_only_that_steps_files(monkeypatch, root):
    # no step in the URL: a healthy run opens at its last step
    at = start(monkeypatch, root, {"run": "run"}, page=TOKENS_PAGE)
    assert not at.exception
    assert at.sidebar.number_input(key=sidebar.STEP_NUMBER).value == 3
    assert at.sidebar.selectbox(key="step_file").options == [label(3, 0), label(3, 1)]
    assert at.sidebar.selectbox(key="step_file").value == label(3, 1)  # its last inner step
    at.sidebar.number_input(key=sidebar.STEP_NUMBER).set_value(2).run()
    assert not at.exception
    assert at.sidebar.selectbox(key="step_file").options == [label(2, 0), label(2, 1)]
    assert at.sidebar.selectbox(key="step_file").value == label(2, 0)  # a new step: its first file
    assert (at.query_params["step"], at.query_params["inner"]) == ("2", "0")
    at.sidebar.selectbox(key="step_file").select(label(2, 1)).run()
    assert (at.query_params["step"], at.query_params["inner"]) == ("2", "1")


def test_the_urls_step_moves_the_number(monkeypatch, root):
    at = start(monkeypatch, root, {"run": "run", "step": "3", "inner": "1"}, page=TOKENS_PAGE)
    assert not at.exception
    assert at.sidebar.number_input(key=sidebar.STEP_NUMBER).value == 3
    assert at.sidebar.selectbox(key="step_file").value == label(3, 1)
    assert (at.query_params["step"], at.query_params["inner"]) == ("3", "1")


def test_a_number_without_a_step_file_shows_the_next_step(monkeypatch, tmp_path):
    with TraceWriter(tmp_path / "gaps", "grpo", hyperparameters={"num_generations": 2}, async_write=False) as w:
        for step in (0, 5, 10, 15):
            w.record(step, healthy_step_tensors(step, 0))
    at = start(monkeypatch, tmp_path, {"run": "gaps"}, page=TOKENS_PAGE)
    at.sidebar.number_input(key=sidebar.STEP_NUMBER).set_value(6).run()
    assert not at.exception
    assert "No step file at step 6: showing step 10." in [c.value for c in at.sidebar.caption]
    assert at.sidebar.selectbox(key="step_file").options == [label(10, 0)]
    assert at.query_params["step"] == "10"


def test_the_steps_page_draws_every_step_with_the_number_input(monkeypatch, root):
    at = start(monkeypatch, root, {"run": "run"})
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception
    assert len(at.get("plotly_chart")) == 1
    assert at.sidebar.number_input(key=sidebar.STEP_NUMBER).value == 3  # the run's last step (no step in the URL)


def _with_a_copy_of_step_2(tmp_path, name: str):
    run = write_trace(tmp_path / "run", steps=4)
    (run / "steps" / name).write_bytes((run / "steps" / step_file_name(2)).read_bytes())
    return run


def _shows_every_file_once(monkeypatch, tmp_path, expected: list[str], pick: str, step: int) -> None:
    at = start(monkeypatch, tmp_path, {"run": "run"}, page=TOKENS_PAGE)
    assert not at.exception
    assert at.sidebar.selectbox(key="step_file").options == expected
    assert not at.sidebar.number_input  # no Step number: the one list holds every file once
    at.sidebar.selectbox(key="step_file").select(pick).run()
    assert not at.exception
    assert at.query_params["step"] == str(step)
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception
    assert len(at.get("plotly_chart")) == 1


@pytest.mark.parametrize("options", [3, 2_000], ids=["number-input", "one-list"])
def test_a_step_number_beyond_what_a_number_input_holds_gets_the_one_list(monkeypatch, tmp_path, options):
    """A step file named ``step_<2**60>`` (a copy of step 2's, by a user): a Streamlit number input
    holds no number beyond 2**53 - 1, so above MAX_STEP_OPTIONS files the one Step file list is
    offered (every file once), and the Steps page's step axis still gets its ticks."""
    monkeypatch.setattr(sidebar, "MAX_STEP_OPTIONS", options)
    _with_a_copy_of_step_2(tmp_path, f"step_{2**60}.inner_0.mb_0.rank_0.safetensors")
    expected = [label(s, i) for s in range(4) for i in (0, 1)] + [label(2**60, 0)]
    _shows_every_file_once(monkeypatch, tmp_path, expected, label(2**60, 0), 2**60)


def test_a_file_named_with_a_number_beyond_int64_is_listed_by_its_header(monkeypatch, tmp_path):
    """``step_<2**70>...`` (a copy of step 2's): no int64 holds the number its name gives, so it is
    listed as a user-named file is, at the coordinates its header gives (step 2, inner 0), and the
    two files claiming step 2 · inner 0 name their files in every label; with the Step number
    (more than MAX_STEP_OPTIONS files), step 2 offers its three files."""
    run = _with_a_copy_of_step_2(tmp_path, f"step_{2**70}.inner_0.mb_0.rank_0.safetensors")
    coords = sorted([(s, i, step_file_name(s, i)) for s in range(4) for i in (0, 1)]
                    + [(2, 0, f"step_{2**70}.inner_0.mb_0.rank_0.safetensors")])
    expected = [f"{label(s, i)} · {name}" for s, i, name in coords]
    assert (run / "steps" / coords[5][2]).name.startswith("step_1180591620717411303424")
    at = start(monkeypatch, tmp_path, {"run": "run"}, page=TOKENS_PAGE)
    assert not at.exception
    at.sidebar.number_input(key=sidebar.STEP_NUMBER).set_value(2).run()
    assert not at.exception
    assert at.sidebar.selectbox(key="step_file").options == expected[4:7]
    monkeypatch.setattr(sidebar, "MAX_STEP_OPTIONS", 2_000)
    _shows_every_file_once(monkeypatch, tmp_path, expected, expected[5], 2)
