"""The step-wide lens: the Step page's frame, table order, heatmap and histograms, the coloured
completion text, and the selection in the URL (every page reopens from its link). Real traces
written by ``TraceWriter`` in tmp_path; the pages through ``AppTest``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from app.components import urls
from app.components.coloured_text import REASON_STYLE, colour_of, coloured_html
from app.components.navigation import RUN_FREE_PAGES, pages_for
from app.components.step_view import FARTHEST, LARGEST, filter_sort, heatmap_matrix, histograms_figure
from tracer import formulas
from tracer.views.step import step_token_frame
from tracer.record.writer import TraceWriter

from tests.fixtures.toy_traces import (
    BOLD, HYPERPARAMETERS, SAMPLES, SCRIPT, TOKENS_PAGE, ToyTokenizer, assert_no_raw_markup, frame_with, healthy_step_tensors, start)


B, T = 4, 6


def step_tensors(seed: int, micro_batch: int) -> dict[str, torch.Tensor]:
    """:func:`healthy_step_tensors` at inner step 1, with a per-token loss; micro-batch 1's row 2
    has one policy logprob 2 nats off old at position 1 (the step's worst token)."""
    tensors = healthy_step_tensors(seed, 1)
    if micro_batch == 1:
        tensors["policy_logprobs"][2, 1] = tensors["old_logprobs"][2, 1] + 2.0
    policy, old, ref = tensors["policy_logprobs"], tensors["old_logprobs"], tensors["ref_logprobs"]
    tensors.update(ratio=formulas.ratio(policy, old), ref_kl_k3=formulas.ref_kl_k3(policy, ref),
                   approx_kl_k2=formulas.approx_kl_k2(policy, old))
    advantages = tensors["advantages"].unsqueeze(1).expand(B, T)  # [B] -> [B, T]
    tensors["per_token_loss"] = formulas.grpo_per_token_loss(policy, old, advantages, 0.2, 0.2, 0.04, ref)
    return tensors


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """``run``: steps 0 and 1, inner step 1, two micro-batches each (B = 4 rows per file);
    ``other``: the same run written again (a second run to overlay)."""
    root = tmp_path_factory.mktemp("steproot")
    for name in ("run", "other"):
        hyper = {**HYPERPARAMETERS, "loss_reduction": "sequence_mean"}
        with TraceWriter(root / name, "grpo", tokenizer=ToyTokenizer(), hyperparameters=hyper,
                         async_write=False) as writer:
            for step in range(2):
                for mb in range(2):
                    writer.record(step, step_tensors(10 * step + mb, mb), inner_step=1, micro_batch=mb)
    return root


def test_step_frame_merges_the_files_and_computes_each_quantity(root):
    from tracer.read import Trace

    trace = Trace(root / "run")
    frame = step_token_frame(trace, 1, 1)
    assert len(frame) == 2 * B * T and set(frame["micro_batch"]) == {0, 1}
    for mb in (0, 1):
        tensors = step_tensors(10 + mb, mb)
        rows = frame[frame["micro_batch"] == mb]
        expected = (tensors["policy_logprobs"].double() - tensors["old_logprobs"].double()).abs().reshape(-1)
        assert rows["abs_policy_old"].to_numpy() == pytest.approx(expected.numpy(), abs=1e-6)
        sampler = (tensors["old_logprobs"].double() - tensors["sampler_logprobs"].double()).abs().reshape(-1)
        assert rows["abs_old_sampler"].to_numpy() == pytest.approx(sampler.numpy(), abs=1e-6)
        assert rows["advantages"].tolist()[:T] == pytest.approx([float(tensors["advantages"][0])] * T)
        # shares of a sequence-mean loss sum to that loss
        loss = formulas.sequence_mean_loss(tensors["per_token_loss"].double(), tensors["completion_mask"])
        assert rows["loss_share"].sum() == pytest.approx(float(loss), rel=1e-5)
    assert frame.attrs["derived"] == []


def test_table_order_puts_the_worst_token_first(root):
    from tracer.read import Trace

    frame = step_token_frame(Trace(root / "run"), 1, 1)
    top = filter_sort(frame, "abs_policy_old", FARTHEST).iloc[0]
    assert (top["micro_batch"], top["sequence"], top["position"]) == (1, 2, 1)
    assert top["abs_policy_old"] == pytest.approx(2.0, abs=1e-5)
    ratio_rows = filter_sort(frame, "ratio", FARTHEST)
    assert ratio_rows.iloc[0]["ratio"] == pytest.approx(math.exp(2.0), rel=1e-5)  # farthest from 1
    assert ratio_rows["kept"].all() and len(ratio_rows) == int(frame["kept"].sum())
    kept_ratio = frame.loc[frame["kept"], "ratio"]
    assert filter_sort(frame, "ratio", LARGEST)["ratio"].tolist() == sorted(kept_ratio, reverse=True)
    assert len(filter_sort(frame, "ratio", FARTHEST, threshold=1.0)) == int(((kept_ratio - 1).abs() >= 1).sum())


def test_heatmap_blanks_masked_cells_and_bins_keep_the_extreme():
    frame = pd.DataFrame({"rank": 0, "micro_batch": 0, "sequence": [0] * 4 + [1] * 4, "position": [0, 1, 2, 3] * 2,
                          "kept": [True, True, False, True, True, True, True, False],
                          "ratio": [1.0, 1.5, 9.0, 0.9, 1.1, 0.2, 1.0, 7.0]})
    z, names, starts, col_w, _ = heatmap_matrix(frame, "ratio")
    assert names == ["seq 0", "seq 1"] and col_w == 1 and list(starts) == [0, 1, 2, 3]
    assert np.isnan(z[0, 2]) and np.isnan(z[1, 3])  # masked: blank, never the recorded 9.0 / 7.0
    z, _, starts, col_w, _ = heatmap_matrix(frame, "ratio", max_cols=2)
    assert col_w == 2 and list(starts) == [0, 2]
    # bins of 2 positions keep the value farthest from 1: row 0 -> 1.5, 0.9; row 1 -> 0.2, 1.0
    assert z.tolist() == [[1.5, 0.9], [0.2, 1.0]]


def test_histograms_count_kept_tokens_and_shade_the_clip_band():
    frame = pd.DataFrame({"kept": [True, True, True, False], "ratio": [0.9, 1.0, 1.3, 50.0],
                          "advantages": [1.0, 1.0, -1.0, 5.0]})
    fig = histograms_figure(frame, clip=(0.8, 1.2))
    bars = {t.name: t for t in fig.data}
    assert sum(bars["ratio"].y) == 3 and max(bars["ratio"].x) < 2  # the masked 50 is not counted
    assert sum(bars["advantages"].y) == 3
    band = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(band) == 1 and (band[0].x0, band[0].x1) == (0.8, 1.2)


def test_coloured_text_escapes_tokens_and_marks_masked_reasons():
    table = pd.DataFrame({
        "section": "completion", "position": range(5), "token_id": [4, 8, 1, 0, 0],
        "token_text": [SCRIPT, BOLD, "<eos>", "<pad>", "<pad>"], "kept": [True, True, True, False, False],
        "mask_reason": ["kept", "kept", "kept", "after_eos", "after_eos"], "ratio": [1.5, 1.0, 0.5, 3.0, 3.0]})
    out = coloured_html(table, "ratio", ["ratio"])
    assert SCRIPT not in out and BOLD not in out and "<eos>" not in out
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in out and "&lt;b&gt;" in out
    assert colour_of(1.5, 1.0, 0.5) in out and colour_of(0.5, 1.0, 0.5) in out  # span = max |r - 1| = 0.5
    assert colour_of(1.0, 1.0, 0.5) == colour_of(1.0, 1.0, 7.0)  # the neutral value is the scale's centre
    assert out.count(REASON_STYLE["after_eos"]) == 1 and "⟪2 × after_eos⟫" in out  # one marker per run
    assert "ratio = 1.5" in out  # hover lists the values


# -- pages ----------------------------------------------------------------------------------------


def test_step_page_lists_the_worst_token_first_with_a_link(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "run", "step": "1", "inner": "1"})
    at.switch_page("app_pages/step.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Step"
    table = frame_with(at, {"open", "token_text", "abs_policy_old"}).value
    first = table.iloc[0]
    assert (first["micro_batch"], first["sequence"], first["position"]) == (1, 2, 1)
    assert first["open"] == urls.link("tokens", {"run": "run", "step": 1, "inner": 1, "mb": 1, "rank": 0, "seq": 2,
                                                 "token": 1})
    assert len(at.get("plotly_chart")) == 2  # heatmap and histograms
    heatmap = json.loads(at.get("plotly_chart")[0].proto.spec)["data"][0]
    assert heatmap["type"] == "heatmap" and heatmap["zmin"] == 0 < heatmap["zmax"]  # |policy − old| >= 0
    assert_no_raw_markup(at)
    # the link reopens that sequence with the token marked
    at = start(monkeypatch, root, query={k: v[0] for k, v in _query(first["open"]).items()}, page=TOKENS_PAGE)
    assert at.title[0].value == "Tokens"
    assert at.selectbox(key="step_file").value == "step 1 · inner 1 · mb 1 · rank 0"
    assert at.selectbox(key="sequence").value == 2
    # one table, the marked token (position 1) and its neighbours: positions 0..4
    assert "Position 1 (marked) with 3 neighbours each side." in [c.value for c in at.caption]
    tables = [d for d in at.dataframe if {"position", "token_text"} <= set(d.value.columns)]
    assert len(tables) == 1 and tables[0].value["position"].tolist() == [0, 1, 2, 3, 4]


def _query(link: str) -> dict:
    from urllib.parse import parse_qs, urlsplit

    return parse_qs(urlsplit(link).query)


# the pages it offers that have step choosers (Diff: tests/app/test_url_state.py; Rollouts, which lists
# every step and hides them: test_rollouts_step_choosers_hidden.py and test_rollouts_page.py)
@pytest.mark.parametrize("page", [p.path for p in pages_for("grpo", step_tensors(0, 0))
                                  if p.url_path not in RUN_FREE_PAGES and p.url_path != "rollouts"])
def test_every_page_reopens_from_its_url(monkeypatch, root, page):
    """Open a page, choose step 1 · mb 1 · sequence 3: the URL says so; a new session started on
    that URL shows the same selection on the same page."""
    at = start(monkeypatch, root, query={"run": "run"})
    at.switch_page(page).run()
    at.selectbox(key="step_file").select("step 1 · inner 1 · mb 1 · rank 0").run()
    at.selectbox(key="sequence").select(3).run()
    assert not at.exception, [e.value for e in at.exception]
    params = dict(at.query_params)
    assert {k: params[k] for k in urls.SELECTION_PARAMS} == {
        "run": "run", "step": "1", "inner": "1", "mb": "1", "rank": "0", "seq": "3"}
    again = start(monkeypatch, root, query={k: str(v) for k, v in params.items()})
    again.switch_page(page).run()
    assert not again.exception, [e.value for e in again.exception]
    assert again.selectbox(key="step_file").value == "step 1 · inner 1 · mb 1 · rank 0"
    assert again.selectbox(key="sequence").value == 3
    assert again.title[0].value == at.title[0].value


def test_url_naming_a_missing_step_says_so(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "run", "step": "99", "seq": "x"}, page=TOKENS_PAGE)
    assert not at.exception
    assert any("step 99" in w.value for w in at.sidebar.warning)
    assert at.selectbox(key="step_file").value == "step 0 · inner 1 · mb 0 · rank 0"


def test_steps_page_overlays_another_run(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "run", "overlay": "other"})
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    names = {t["name"] for t in spec["data"]}
    assert names == {"run · inner step 1", "other · inner step 1"}
    colours = {t["name"]: t["line"]["color"] for t in spec["data"]}
    assert colours["run · inner step 1"] != colours["other · inner step 1"]
    assert spec["layout"]["xaxis"]["dtick"] == 1 and spec["layout"]["xaxis"]["tickformat"] == "d"
    # each line carries its inner step and run: what a click opens (figures.clicked_step)
    assert {t["name"]: tuple(t["meta"]) for t in spec["data"]} == {"run · inner step 1": (1, 0),
                                                                    "other · inner step 1": (1, 1)}


@pytest.mark.skipif(not (SAMPLES / "ppo-tiny").is_dir() or not (SAMPLES / "dpo-tiny").is_dir(),
                    reason="sample_traces/ppo-tiny, dpo-tiny are not in this checkout")
@pytest.mark.parametrize("run, page, query, step_file", [
    ("ppo-tiny", "ppo", {"step": "1", "inner": "1", "mb": "1", "seq": "0"}, "step 1 · inner 1 · mb 1 · rank 0"),
    ("dpo-tiny", "dpo", {"step": "2", "seq": "1"}, "step 2 · inner 0 · mb 0 · rank 0"),
])
def test_algorithm_pages_open_from_a_url_on_the_samples(monkeypatch, run, page, query, step_file):
    at = start(monkeypatch, SAMPLES, query={"run": run, **query})
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="step_file").value == step_file
    assert at.selectbox(key="sequence").value == int(query["seq"])
    assert dict(at.query_params)["run"] == run
    if page == "dpo":  # the DPO Steps page: margin, accuracy, loss, chosen and rejected logps over steps
        at.switch_page("app_pages/steps.py").run()
        spec = at.get("plotly_chart")[0].proto.spec
        for title in ("margin", "preference accuracy", "DPO loss", "chosen logp", "rejected logp"):
            assert title in spec, title


# -- the listed faults ------------------------------------------------------------------------------


def test_group_finding_opens_the_groups_page_on_its_group(monkeypatch, tmp_path):
    """A group-level finding (advantages that do not sum to 0 in group 1 of step 1) opens the
    Groups page with that group chosen, not the Tokens page."""
    from tests.fixtures.toy_traces import write_trace

    def unbalanced(step, inner, tensors):
        if (step, inner) == (1, 0):
            tensors["advantages"][2:] = torch.tensor([1.0, 1.0])  # rows 2, 3 = group 1

    write_trace(tmp_path / "run", tokenizer=ToyTokenizer(), steps=2, edit=unbalanced)
    at = start(monkeypatch, tmp_path)
    at.switch_page("app_pages/health.py").run()
    findings = frame_with(at, {"check", "sequence", "message"})
    table = findings.value
    rows = table.index[(table["check"] == "advantages.group_sum") & (table["severity"] == "error")].tolist()
    assert rows, table[["check", "severity"]]
    at.session_state[findings.key] = {"selection": {"rows": [rows[0]], "columns": [], "cells": []}}
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Groups"
    assert at.selectbox(key="step_file").value == "step 1 · inner 0 · mb 0 · rank 0"
    assert at.selectbox(key="group").value == 1


def test_rloo_groups_say_leave_one_out_not_population_std():
    from app.components.groups import advantage_rule_text

    rloo = advantage_rule_text("rloo", {"advantage_rule": "rloo_kl"}, "population")
    assert "leave-one-out" in rloo and "no std" in rloo and "population (unbiased=False" not in rloo
    assert "group std: unbiased" in advantage_rule_text("grpo", {"advantage_std": "unbiased"}, "unbiased")
    assert "group std: population" in advantage_rule_text("grpo", {}, "population")


def test_snippet_trace_gets_curves_and_derived_marks(monkeypatch, tmp_path):
    """A trace as the README's loop records it (no ratio / KL tensors): the Steps page draws the
    mean ratio and clip fraction, the Tokens and Step pages mark ratio and k2 as derived."""
    from tests.fixtures.snippet_traces import snippet_step, write_snippet_trace

    write_snippet_trace(tmp_path / "snippet", snippet_step())
    at = start(monkeypatch, tmp_path, query={"run": "snippet", "step": "0", "inner": "1"}, page=TOKENS_PAGE)
    assert any("derived by the reader" in c.value for c in at.caption)
    assert "ratio (derived)" in at.selectbox(key="colour_by").format_func("ratio")
    at.switch_page("app_pages/steps.py").run()
    spec = at.get("plotly_chart")[0].proto.spec
    assert "mean ratio (derived)" in spec and "clip fraction (derived)" in spec
    at.switch_page("app_pages/step.py").run()
    assert not at.exception
    assert any(c.value.startswith("ratio, approx_kl_k2: derived by the reader") for c in at.caption)
    assert at.selectbox(key="step_quantity").format_func("ratio").endswith("(derived)")
    assert frame_with(at, {"open", "ratio", "approx_kl_k2"}).value["ratio"].notna().all()


def test_dpo_step_summary_has_the_logps_of_each_side(tmp_path):
    from tracer import views
    from tracer.read import Trace

    chosen = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    rejected = torch.tensor([[-3.0, -1.0, -1.0], [-2.0, -9.0, -9.0]])
    tensors = {"chosen_ids": torch.tensor([[3, 4, 0], [3, 3, 3]]), "rejected_ids": torch.tensor([[4, 4, 4], [5, 0, 0]]),
               "chosen_mask": torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool),
               "rejected_mask": torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool),
               "chosen_policy_logprobs": chosen, "rejected_policy_logprobs": rejected,
               "chosen_ref_logprobs": chosen - 0.1, "rejected_ref_logprobs": rejected + 0.1}
    with TraceWriter(tmp_path / "dpo", "dpo", hyperparameters={"beta": 0.1}) as writer:
        writer.record(0, tensors)
    summary = views.dpo_step_summary(Trace(tmp_path / "dpo"))
    # by hand: chosen sums -3 and -1.5 -> mean -2.25; rejected sums -5 and -2 -> mean -3.5
    assert summary.loc[0, "mean_chosen_logps"] == pytest.approx(-2.25)
    assert summary.loc[0, "mean_rejected_logps"] == pytest.approx(-3.5)


def test_clicking_a_point_on_the_steps_curves_opens_that_step(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "run"})
    at.switch_page("app_pages/steps.py").run()
    # what the browser sends for a click on step 1 of the only line (customdata: its number of files)
    point = {"x": 1, "y": 1.0, "customdata": 2, "curve_number": 0, "point_number": 1, "point_index": 1}
    at.session_state["step_curves"] = {"selection": {"points": [point], "point_indices": [1], "box": [], "lasso": []}}
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Step"
    assert at.selectbox(key="step_file").value == "step 1 · inner 1 · mb 0 · rank 0"


def test_a_page_keeps_only_its_own_parameters_in_the_url(monkeypatch, root):
    at = start(monkeypatch, root, query={"run": "run", "step": "1", "inner": "1"}, page=TOKENS_PAGE)
    assert at.query_params["colour"]  # the Tokens page's colour choice
    at.switch_page("app_pages/step.py").run()
    assert "q" in at.query_params and "colour" not in at.query_params
    at.switch_page("app_pages/groups.py").run()
    assert "group" in at.query_params and "q" not in at.query_params
    assert at.query_params["step"] == "1"  # the selection stays


def test_a_long_runs_per_step_table_is_sent_when_asked_for(monkeypatch, root):
    from app.components import figures

    def summaries(at):
        return [d.value for d in at.dataframe if "summary_source" in d.value.columns]

    at = start(monkeypatch, root, query={"run": "run"})
    at.switch_page("app_pages/steps.py").run()
    assert len(summaries(at)) == 1 and [t.key for t in at.toggle] == ["auto_refresh"]  # 4 step files: the table at once
    monkeypatch.setattr(figures, "STEP_TABLE_ROWS", 3)  # 4 rows are now a long run's table
    at.run()
    assert summaries(at) == [] and at.toggle(key="step_table").label == "Show all 4 rows"
    at.toggle(key="step_table").set_value(True).run()
    (table,) = summaries(at)
    assert len(table) == 4 and table["step"].tolist() == [0, 0, 1, 1]
