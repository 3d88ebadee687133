"""The Runs page (the root URL) lists every run, so the sidebar's Run, Step file and Sequence choosers and
the note on the pages a run is not offered, which are about one run, are not drawn there (as on the Diff
page); a run's own page draws them again, with the choice the URL made."""

from __future__ import annotations

from tests.fixtures.toy_traces import TOKENS_PAGE, frame_with, start, write_trace

CHOOSERS = {"run", "rank", "step_file", "sequence", "auto_refresh"}


def drop_sampler(step, inner, tensors):  # no sampler_logprobs: a run page would note Mismatch is hidden
    tensors.pop("sampler_logprobs")


def test_the_runs_page_draws_no_run_choosers_and_a_run_page_does(monkeypatch, tmp_path):
    for name in ("a_run", "b_run"):
        write_trace(tmp_path / name, steps=2, edit=drop_sampler)
    at = start(monkeypatch, tmp_path, {"run": "b_run"})
    assert not at.exception, [e.value for e in at.exception]
    assert list(frame_with(at, {"run", "status"}).value["run"]) == ["a_run", "b_run"]
    drawn = {w.key for kind in ("selectbox", "toggle", "number_input") for w in at.sidebar.get(kind)}
    assert not drawn & CHOOSERS, drawn
    assert not [e for e in at.sidebar.expander if "not offered" in e.label]
    assert not [t for t in at.sidebar.text if "step files" in t.value]  # the run's status line
    at.switch_page(TOKENS_PAGE).run()
    assert not at.exception
    assert at.sidebar.selectbox(key="run").value == tmp_path / "b_run"
    assert at.sidebar.selectbox(key="step_file").options == [f"step {s} · inner {i} · mb 0 · rank 0"
                                                              for s in (0, 1) for i in (0, 1)]
    [expander] = [e for e in at.sidebar.expander if "not offered" in e.label]
    assert expander.label == "3 page(s) not offered for this run"  # PPO, DPO pairs, Mismatch
