"""The Health page: findings of tracer.checks per step, filters, and the jump from a finding to its
token on the Tokens page. Pure builders on hand-made findings; pages through AppTest on a trace with
a deliberate bug (a mask that keeps a token after EOS) and on the committed sample traces."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from app.components.health import (
    NO_PROBLEMS, FindingTarget, filter_findings, findings_frame, per_check_counts, per_step_counts,
    severity_counts, target_of, verdict)
from app.components.token_table import HIGHLIGHT_STYLE, MASK_BACKGROUND, style_token_table, token_display_frame
from tracer import TraceWriter
from tracer.checks import Finding

from tests.fixtures.toy_traces import (
    BOLD, HYPERPARAMETERS, SAMPLES, SCRIPT, ToyTokenizer, assert_no_raw_markup, frame_with, healthy_step_tensors,
    largest_frame_with, start, styled_rows, write_trace)


BUG_STEP, BUG_SEQUENCE, BUG_TOKEN = 1, 0, 3


def keep_bold_after_eos(step: int, inner_step: int, tensors) -> None:
    """Step 1, inner 0, row 0 is ``4 <script> <eos> | pad pad pad``: put ``<b>`` (id 8) right after the
    EOS and keep it in the mask, a token after EOS that enters the loss."""
    if (step, inner_step) == (BUG_STEP, 0):
        tensors["completion_ids"][BUG_SEQUENCE, BUG_TOKEN] = 8
        tensors["completion_mask"][BUG_SEQUENCE, BUG_TOKEN] = True


@pytest.fixture(scope="module")
def buggy_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("health")
    write_trace(root / "grpo_after_eos", tokenizer=ToyTokenizer(), edit=keep_bold_after_eos)
    return root


# -- pure builders ----------------------------------------------------------------------------------


def hand_findings() -> list[Finding]:
    return [
        Finding("masks.after_eos", "error", "keeps token 3", step=1, inner_step=0, micro_batch=0, rank=1,
                sequence=0, token=3, token_id=8, token_text=BOLD, path="/t/steps/s1.rank_1"),
        Finding("kl.k1_negative", "warning", "k1 < 0 in every file"),  # trace-level: no location
        Finding("sampler.mismatch", "info", "mean +0.001", step=0, inner_step=0, micro_batch=0, rank=0,
                sequence=2, token=None, path="/t/steps/s0.rank_0"),
        Finding("recompute.loss", "skipped", "no loss", step=0, inner_step=0, micro_batch=0, rank=0),
    ]


def test_findings_frame_counts_and_filters():
    frame = findings_frame(hand_findings())
    assert list(frame["check"]) == ["masks.after_eos", "kl.k1_negative", "sampler.mismatch", "recompute.loss"]
    assert severity_counts(frame) == {"error": 1, "warning": 1, "info": 1, "skipped": 1}
    assert verdict(frame) == "1 error, 1 warning"
    assert verdict(filter_findings(frame, ["info", "skipped"])) == NO_PROBLEMS
    # rank 1 keeps its own finding and the trace-level one, not rank 0's
    assert list(filter_findings(frame, rank=1)["check"]) == ["masks.after_eos", "kl.k1_negative"]
    assert list(filter_findings(frame, checks=["sampler.mismatch"])["severity"]) == ["info"]
    per_step = per_step_counts(frame)
    assert per_step[["step", "rank", "error", "info", "skipped"]].values.tolist() == [[0, 0, 0, 1, 1], [1, 1, 1, 0, 0]]
    per_check = per_check_counts(frame)
    assert per_check["check"].iloc[0] == "masks.after_eos"
    assert "EOS" in per_check["description"].iloc[0]  # the rule, from the checks registry


def test_target_of_needs_a_step_file_and_sequence():
    frame = findings_frame(hand_findings())
    target = target_of(frame, 0, "/t")
    assert target == FindingTarget("/t", "/t/steps/s1.rank_1", 0, 3, "masks.after_eos")
    assert target.caption() == "finding: masks.after_eos at token 3"
    assert target_of(frame, 1, "/t") is None  # trace-level
    assert target_of(frame, 2, "/t").caption() == "finding: sampler.mismatch in sequence 2"
    assert target_of(frame, 3, "/t") is None  # no sequence


def test_highlight_marks_only_the_completion_token():
    table = pd.DataFrame({
        "section": ["prompt", "prompt", "completion", "completion", "completion"],
        "position": [0, 1, 0, 1, 2], "token_id": [2, 3, 7, 1, 8],
        "token_text": ["Hi", "!", "4", "<eos>", BOLD], "kept": [False, False, True, True, True],
        "mask_reason": ["prompt", "prompt", "kept", "kept", "kept"]})
    frame = token_display_frame(table)
    ctx = style_token_table(frame, highlight=1)._compute().ctx
    marked = {row for (row, _), css in ctx.items() if ("font-weight", "bold") in css}
    assert marked == {1}  # completion position 1 (completion rows first), not prompt position 1 (row 4)
    assert frame.loc[1, "section"] == "completion" and frame.loc[4, "section"] == "prompt"
    assert any(("background-color", MASK_BACKGROUND["prompt"]) in css for (row, _), css in ctx.items() if row == 4)
    assert "#ffd54f" in HIGHLIGHT_STYLE


# -- pages ------------------------------------------------------------------------------------------


def test_finding_opens_its_token_highlighted(monkeypatch, buggy_root):
    at = start(monkeypatch, buggy_root)
    at.switch_page("app_pages/health.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert "1 error" in at.error[0].value
    findings = frame_with(at, {"check", "sequence", "token", "token_text"})
    table = findings.value
    bug = table[table["check"] == "masks.after_eos"]
    assert len(bug) == 1
    assert bug[["step", "inner_step", "sequence", "token"]].iloc[0].tolist() == [BUG_STEP, 0, BUG_SEQUENCE, BUG_TOKEN]
    assert bug["token_text"].iloc[0] == BOLD  # literal, in a table cell
    assert_no_raw_markup(at)

    # choose the finding: the sidebar moves to its step file and sequence, the Tokens page opens
    at.session_state[findings.key] = {"selection": {"rows": [int(bug.index[0])], "columns": [], "cells": []}}
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Tokens"
    assert at.selectbox(key="step_file").value == f"step {BUG_STEP} · inner 0 · mb 0 · rank 0"
    assert at.selectbox(key="sequence").value == BUG_SEQUENCE
    assert f"finding: masks.after_eos at token {BUG_TOKEN}" in [c.value for c in at.caption]
    tokens = largest_frame_with(at, {"section", "position", "token_text"})
    rows = tokens.value
    expected = rows.index[(rows["section"] == "completion") & (rows["position"] == BUG_TOKEN)].tolist()
    assert rows.loc[expected[0], "token_text"] == BOLD
    assert styled_rows(tokens.proto.arrow_data.styler.styles, "#ffd54f") == set(expected)
    assert_no_raw_markup(at)

    # another sequence of the same step: no highlight, no caption (AppTest reruns the page it was
    # last told to show, so tell it, as a browser would stay on the Tokens page)
    at.switch_page("app_pages/tokens.py")
    at.selectbox(key="sequence").select(1).run()
    assert not any(c.value.startswith("finding:") for c in at.caption)
    tokens = largest_frame_with(at, {"section", "position", "token_text"})
    assert styled_rows(tokens.proto.arrow_data.styler.styles, "#ffd54f") == set()


def test_severity_filter_hides_findings(monkeypatch, buggy_root):
    at = start(monkeypatch, buggy_root)
    at.switch_page("app_pages/health.py").run()
    at.multiselect[0].set_value(["info"]).run()
    assert not at.exception
    shown = frame_with(at, {"check", "sequence", "token"}).value
    assert set(shown["severity"]) == {"info"} and "masks.after_eos" not in set(shown["check"])


@pytest.mark.skipif(not SAMPLES.is_dir(), reason="sample_traces/ is not in this checkout")
def test_every_sample_trace_has_no_errors_or_warnings(monkeypatch):
    at = start(monkeypatch, SAMPLES)
    at.switch_page("app_pages/health.py").run()
    runs = at.selectbox(key="run").options
    assert len(runs) >= 5
    for run in runs:
        at.selectbox(key="run").select_index(runs.index(run)).run()
        assert not at.exception, (run, [e.value for e in at.exception])
        assert at.title[0].value == "Health", run
        assert not at.error, (run, [e.value for e in at.error])
        assert any(NO_PROBLEMS in s.value for s in at.success), run


def test_health_page_shows_script_tokens_literally(monkeypatch, buggy_root):
    at = start(monkeypatch, buggy_root)
    at.switch_page("app_pages/health.py").run()
    at.multiselect[0].set_value(["error", "info"]).run()
    texts = frame_with(at, {"check", "token_text"}).value["token_text"].dropna().tolist()
    assert BOLD in texts
    assert_no_raw_markup(at)
    assert SCRIPT not in " ".join(str(m.value) for m in at.markdown)


def test_a_healthy_trace_still_being_written_passes_with_an_unfinished_note(monkeypatch, tmp_path):
    writer = TraceWriter(tmp_path / "live", "grpo", tokenizer=ToyTokenizer(), hyperparameters=HYPERPARAMETERS)
    try:
        for step in range(2):
            writer.record(step, healthy_step_tensors(step, 0), inner_step=0)
        writer.flush()  # the steps are on disk; the writer is still open (manifest status "running")
        at = start(monkeypatch, tmp_path)
        at.switch_page("app_pages/health.py").run()
        assert not at.exception, [e.value for e in at.exception]
        assert not at.error, [e.value for e in at.error]
        assert any(NO_PROBLEMS in s.value for s in at.success)  # an info finding is not a problem
        by_check = frame_with(at, {"check", "description"}).value
        row = by_check[by_check["check"] == "trace.unfinished"]
        assert row[["info", "error", "warning"]].iloc[0].tolist() == [1, 0, 0]
        assert row["description"].iloc[0] == "the writer has not closed: the trace may grow or be cut short"
    finally:
        writer.close()
