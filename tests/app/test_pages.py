"""The web UI: pure figure/table builders on hand-built frames, and the pages through
``streamlit.testing.v1.AppTest`` on small GRPO traces written by ``TraceWriter`` in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from app.components.figures import masked_runs, token_values_figure
from app.components.overview import fields_table, manifest_facts
from app.components.sidebar import DEFAULT_ROOT, resolve_root
from app.components.step_curves import DEFAULT_COLUMNS, Layout, step_curves_figure
from app.components.token_table import (
    MASK_BACKGROUND,
    filler_marker,
    section_text,
    style_token_table,
    token_display_frame,
)
from tests.fixtures.paths import REPO
from tests.fixtures.toy_traces import (  # noqa: F401
    APP,
    EOS,
    PAD,
    SCRIPT,
    TOKENS_PAGE,
    VOCAB,
    ToyTokenizer,
    grpo_step_tensors,
    markup_values,
    start,
)
from tracer.record.writer import TraceWriter


def write_trace(out: Path, tokenizer=None, steps: int = 3) -> Path:
    hyper = {"num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "beta": 0.04}
    with TraceWriter(out, "grpo", tokenizer=tokenizer, hyperparameters=hyper, config={"lr": 1e-6}) as writer:
        for step in range(steps):
            writer.record(step, grpo_step_tensors(step))
            writer.record(step, grpo_step_tensors(100 + step), inner_step=1)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    write_trace(root / "a_grpo_tokens", tokenizer=ToyTokenizer())
    write_trace(root / "b_grpo_no_tokenizer")
    return root


def token_dataframe(at: AppTest):
    """The token table element (the one with token_text and mask_reason columns)."""
    for df in at.dataframe:
        if {"token_text", "mask_reason", "position"} <= set(df.value.columns):
            return df
    raise AssertionError(f"no token table among {[list(d.value.columns) for d in at.dataframe]}")


# -- pure builders ------------------------------------------------------------------------------


def hand_table() -> pd.DataFrame:
    """Two prompt rows (one padding) and five completion rows, positions 2 and 4 masked."""
    return pd.DataFrame({
        "sequence": 0,
        "section": ["prompt", "prompt", "completion", "completion", "completion", "completion", "completion"],
        "position": [0, 1, 0, 1, 2, 3, 4],
        "token_id": [0, 2, 7, 4, 1, 0, 0],
        "token_text": ["<pad>", "Hi", "4", SCRIPT, "<eos>", "<pad>", "<pad>"],
        "kept": [False, False, True, True, True, False, False],
        "mask_reason": ["prompt_padding", "prompt", "kept", "kept", "kept", "after_eos", "after_eos"],
        "old_logprobs": [None, None, -1.0, -2.0, -0.5, -3.0, -3.0],
        "policy_logprobs": [None, None, -1.1, -2.0, -0.4, -3.0, -3.0],
        "ratio": [None, None, 0.9, 1.0, 1.1, 1.0, 1.0],
        "advantages": [None, None, 0.5, 0.5, 0.5, 0.5, 0.5],
    })


def test_masked_runs_merge_neighbours():
    assert masked_runs([0, 1, 2, 3, 4, 5], [False, False, True, False, True, False]) == [(0, 1), (3, 3), (5, 5)]
    assert masked_runs([0, 1], [True, True]) == []


def test_token_values_figure_one_line_per_value_and_shaded_mask():
    fig = token_values_figure(hand_table())
    # old + policy logprobs, ratio, advantages: 4 lines in 3 panels
    assert sorted(t.name for t in fig.data) == ["advantages", "old_logprobs", "policy_logprobs", "ratio"]
    assert all(len(t.x) == 5 for t in fig.data)  # completion rows only
    # one masked run (positions 3..4) shaded in each of the 3 panels
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(rects) == 3
    assert {(s.x0, s.x1) for s in rects} == {(2.5, 4.5)}
    # hover text carries the token escaped, so Plotly shows it as text
    assert "&lt;script&gt;" in str(fig.data[0].customdata[1][0])
    # masked positions 3 and 4 are gaps, not points (their -3.0 would stretch the axis)
    old = next(t for t in fig.data if t.name == "old_logprobs")
    assert list(old.y) == [-1.0, -2.0, -0.5, None, None]
    # a tick per position naming its token (escaped: Plotly renders tick text as HTML); the legend sits in
    # the figure's top margin (container coordinates), above the subplot titles and clear of the axis title
    assert list(fig.layout.xaxis.tickvals) == [0, 1, 2, 3, 4]
    # (SCRIPT, "<script>alert(1)</script>", cut to its first 9 characters and …)
    assert list(fig.layout.xaxis.ticktext) == ["4<br>0", "&lt;script&gt;a…<br>1", "&lt;eos&gt;<br>2",
                                               "&lt;pad&gt;<br>3", "&lt;pad&gt;<br>4"]
    assert (fig.layout.legend.yref, fig.layout.legend.yanchor, fig.layout.legend.y) == ("container", "top", 1.0)
    # lines of one panel differ by dash, so one equal to another (old = policy) stays visible
    assert old.line.dash != next(t for t in fig.data if t.name == "policy_logprobs").line.dash


def test_token_values_figure_without_values_says_so():
    fig = token_values_figure(hand_table()[["section", "position", "kept", "token_text", "mask_reason"]])
    assert not fig.data
    assert "no per-token values" in fig.layout.annotations[0].text


def test_step_curves_figure_one_line_per_inner_step_and_panel():
    summary = pd.DataFrame({
        "step": [0, 0, 1, 1, 1], "inner_step": [0, 1, 0, 1, 1], "micro_batch": [0, 0, 0, 0, 1],
        "rank": 0, "mean_ratio": [1.0, 1.01, 1.0, 0.99, 1.03], "mean_ref_kl_k3": [0.0, 0.01, 0.02, 0.03, 0.05],
        "mean_reward": [0.1, 0.1, 0.3, 0.3, 0.3], "clip_fraction": [0.0, 0.1, 0.0, 0.2, 0.0],
    })
    fig, _ = step_curves_figure({"run": summary}, Layout(list(DEFAULT_COLUMNS)))
    assert len(fig.data) == 2 * 4  # 2 inner steps x 4 panels
    inner1_ratio = [t for t in fig.data if t.name == "inner step 1"][0]
    # step 1 inner 1 has two micro-batches: plain mean of the file values (0.99 + 1.03) / 2
    assert list(inner1_ratio.x) == [0, 1] and inner1_ratio.y[1] == pytest.approx(1.01)
    assert sum(t.showlegend for t in fig.data) == 2


def test_step_curves_figure_skips_missing_columns_and_empty_summary():
    fig, _ = step_curves_figure({"run": pd.DataFrame({"step": [0, 1], "inner_step": 0, "mean_reward": [0.0, 1.0]})},
                                    Layout(list(DEFAULT_COLUMNS)))
    assert [t.name for t in fig.data] == ["inner step 0"]
    assert not step_curves_figure({"run": pd.DataFrame()}, Layout(list(DEFAULT_COLUMNS)))[0].data


def test_style_token_table_greys_masked_rows_only():
    frame = token_display_frame(hand_table())
    assert list(frame.columns[:5]) == ["section", "position", "token_id", "token_text", "mask_reason"]
    html = style_token_table(frame).to_html()
    assert MASK_BACKGROUND["after_eos"] in html and MASK_BACKGROUND["prompt"] in html
    # every cell of a row not in the loss is grey; kept rows carry no style
    ctx = style_token_table(frame)._compute().ctx
    grey_rows = {row for (row, _), css in ctx.items() if css}
    assert grey_rows == set(frame.index[frame["mask_reason"] != "kept"]) == {3, 4, 5, 6}
    # completion rows first (the loss runs over them), then the prompt rows in their order
    assert frame["section"].tolist() == ["completion"] * 5 + ["prompt"] * 2
    assert frame["token_text"].tolist()[5:] == ["<pad>", "Hi"]


def test_section_text_collapses_filler_and_keeps_tokens_literal():
    table = hand_table()
    assert section_text(table, "prompt") == filler_marker(1, "prompt_padding") + "Hi"
    assert section_text(table, "completion") == "4" + SCRIPT + "<eos>" + filler_marker(2, "after_eos")


def test_overview_tables():
    facts = manifest_facts({"algorithm": "grpo", "status": "finished"}, 3)
    assert dict(zip(facts["key"], facts["value"]))["algorithm"] == "grpo"
    fields = fields_table({"completion_ids": ([4, 6], "I64"), "extra": ([2], "F32")}, "grpo")
    assert fields.loc[0, "dims"] == "[B, T]" and fields.loc[1, "description"] == "(not in the schema)"


def test_resolve_root_prefers_argument_then_env_then_default():
    assert resolve_root(["--root", "/x"], {"TRACER_ROOT": "/y"}) == Path("/x")
    assert resolve_root(["--root=/x"], {}) == Path("/x")
    assert resolve_root(["-q", "tests"], {"TRACER_ROOT": "/y"}) == Path("/y")
    assert resolve_root([], {}) == DEFAULT_ROOT == REPO / "sample_traces"


# -- pages ----------------------------------------------------------------------------------------


def test_tokens_page_shows_table_with_masked_marking(monkeypatch, root):
    at = start(monkeypatch, root, page=TOKENS_PAGE)
    assert not at.exception
    at.selectbox(key="run").select(root / "a_grpo_tokens").run()
    assert not at.exception
    df = token_dataframe(at)
    table = df.value
    completion = table[table["section"] == "completion"]
    # sequence 0: <eos> at completion position 2 -> positions 3..5 after EOS; prompt rows collapsed
    assert table["section"].tolist() == ["completion"] * 6
    assert completion["mask_reason"].tolist() == ["kept"] * 3 + ["after_eos"] * 3
    assert completion["token_text"].tolist()[:3] == ["4", SCRIPT, "<eos>"]
    # masked rows carry the grey background in the styler sent to the browser
    assert MASK_BACKGROUND["after_eos"] in df.proto.arrow_data.styler.styles
    # completion and prompt shown as text, padding marked; no markup anywhere holds the raw token
    codes = [c.value for c in at.code]
    assert codes[0] == "4" + SCRIPT + "<eos>" + filler_marker(3, "after_eos")
    assert codes[1] == filler_marker(2, "prompt_padding") + "Hello world 2+2"
    assert not any("<script>" in text for text in markup_values(at))
    assert len(at.get("plotly_chart")) == 1
    at.toggle(key="show_prompt").set_value(True).run()  # "Show prompt rows": listed after the completion rows
    table = token_dataframe(at).value
    assert table["section"].tolist() == ["completion"] * 6 + ["prompt"] * 5
    assert table.query("section == 'prompt'")["mask_reason"].tolist() == ["prompt_padding"] * 2 + ["prompt"] * 3


def test_choosing_another_sequence_changes_the_table(monkeypatch, root):
    at = start(monkeypatch, root, page=TOKENS_PAGE)
    at.selectbox(key="run").select(root / "a_grpo_tokens").run()
    before = token_dataframe(at).value
    at.selectbox(key="sequence").select(1).run()
    assert not at.exception
    after = token_dataframe(at).value
    completion = after[after["section"] == "completion"]
    assert completion["mask_reason"].tolist() == ["kept"] * 2 + ["padding"] * 4
    assert completion["token_text"].tolist()[:2] == [" no", "="]
    assert not before.equals(after)
    at.selectbox(key="sequence").select(3).run()
    reasons = token_dataframe(at).value.query("section == 'completion'")["mask_reason"].tolist()
    assert reasons == ["kept", "masked", "kept", "kept", "after_eos", "after_eos"]


def test_tokenizer_free_trace_shows_ids(monkeypatch, root):
    at = start(monkeypatch, root, page=TOKENS_PAGE)
    at.selectbox(key="run").select(root / "b_grpo_no_tokenizer").run()
    assert not at.exception
    table = token_dataframe(at).value
    completion = table[table["section"] == "completion"]
    assert completion["token_text"].tolist()[0] == "<id 7>"
    # without EOS / pad ids the reader can only say "masked"
    assert completion["mask_reason"].tolist() == ["kept"] * 3 + ["masked"] * 3


def test_steps_page_renders_curves(monkeypatch, root):
    at = start(monkeypatch, root)
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception
    charts = at.get("plotly_chart")
    assert len(charts) == 1
    spec = charts[0].proto.spec
    assert "mean ratio" in spec and "clip fraction" in spec and "inner step 1" in spec


def test_overview_page_lists_manifest_and_fields(monkeypatch, root):
    at = start(monkeypatch, root)
    at.switch_page("app_pages/overview.py").run()
    assert not at.exception
    frames = [df.value for df in at.dataframe]
    fields = next(f for f in frames if "field" in f.columns)
    assert {"completion_ids", "completion_mask", "ratio"} <= set(fields["field"])
    keys = set().union(*(set(f["key"]) for f in frames if "key" in f.columns))
    assert {"algorithm", "status", "clip_epsilon_low", "torch"} <= keys


def test_reload_picks_up_new_steps(monkeypatch, tmp_path):
    run = tmp_path / "live"
    writer = TraceWriter(run, "grpo", hyperparameters={"num_generations": 2})
    writer.record(0, grpo_step_tensors(0))
    writer.flush()  # the writer thread may linger up to LINGER_S before writing: wait for the file
    at = start(monkeypatch, run, page=TOKENS_PAGE)  # the root is itself a trace
    assert not at.exception
    assert len(at.selectbox(key="step_file").options) == 1
    writer.record(1, grpo_step_tensors(1))
    writer.close()
    at.button[0].click().run()
    assert not at.exception
    assert len(at.selectbox(key="step_file").options) == 2


def test_trace_without_steps_yet_and_single_step_file(monkeypatch, tmp_path):
    run = tmp_path / "starting"
    writer = TraceWriter(run, "grpo")  # the trainer has not written a step yet
    at = start(monkeypatch, run, page=TOKENS_PAGE)
    assert not at.exception
    assert "no step files yet" in at.info[0].value
    for page in ("steps", "overview"):
        at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception
    step_file = writer.record(0, grpo_step_tensors(0))
    writer.flush()  # record() returns the path the file will have; flush() waits for it
    at = start(monkeypatch, step_file, page=TOKENS_PAGE)  # one .safetensors file is a trace too
    assert not at.exception
    assert token_dataframe(at).value["token_text"].iloc[0] == "<id 7>"  # the first completion token, listed first


@pytest.mark.parametrize("make", ["empty", "missing"])
def test_root_without_traces_explains_what_is_expected(monkeypatch, tmp_path, make):
    root = tmp_path / "nothing here"
    if make == "empty":
        (root / "unrelated").mkdir(parents=True)
    at = start(monkeypatch, root)
    assert not at.exception
    message = at.warning[0].value
    assert "manifest.json" in message and "steps/" in message
    assert ("does not exist" if make == "missing" else "holds no trace") in message


SAMPLE = REPO / "sample_traces" / "grpo-trl-tiny"


@pytest.mark.skipif(not SAMPLE.is_dir(), reason="sample_traces/grpo-trl-tiny is not in this checkout")
def test_sample_trace_loads_from_the_default_root(monkeypatch):
    monkeypatch.delenv("TRACER_ROOT", raising=False)
    at = AppTest.from_file(str(APP), default_timeout=60).switch_page(TOKENS_PAGE).run()
    assert not at.exception
    at.selectbox(key="run").select(SAMPLE).run()
    assert not at.exception
    at.toggle(key="show_prompt").set_value(True).run()
    df = token_dataframe(at)
    reasons = set(df.value["mask_reason"])
    masked = reasons - {"kept"}
    assert "kept" in reasons and masked
    # each masked kind present in this sequence is greyed in the styler sent to the browser
    assert all(MASK_BACKGROUND[r] in df.proto.arrow_data.styler.styles for r in masked)
    assert len(at.get("plotly_chart")) == 1
