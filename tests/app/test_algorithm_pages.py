"""The per-algorithm views of the web UI: pure builders on hand-built frames, and the PPO, group and
DPO pages through ``streamlit.testing.v1.AppTest`` on the committed sample traces (expected values
read independently from the step files with safetensors) and on a small RLOO trace in tmp_path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors import safe_open
from streamlit.testing.v1 import AppTest

from app.components.dpo import (
    MASKED_CELL, dpo_curves_figure, pair_logprobs_figure, side_text, style_pair_table)
from app.components.groups import (
    ZERO_VARIANCE_BACKGROUND, group_label, group_rewards_figure, style_group_table, zero_variance_figure)
from app.components.navigation import PAGES, hidden_pages_note, not_offered_reason, pages_for
from app.components.ppo import (
    STATUS_BACKGROUND, STATUS_COLOUR, early_stop_figure, early_stop_grid, gae_figure, gae_token_frame,
    style_minibatch_table)
from app.components.token_table import visible_token
from tracer.record.writer import TraceWriter

from tests.fixtures.paths import SAMPLES
from tests.fixtures.toy_traces import APP, SCRIPT, TOKENS_PAGE, markup_values

needs_samples = pytest.mark.skipif(
    not all((SAMPLES / n).is_dir() for n in ("ppo-tiny", "grpo-tiny", "cispo-tiny", "grpo-trl-tiny", "dpo-tiny")),
    reason="the sample traces are not in this checkout")


def read_step(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and raw header metadata of one step file, read without tracer."""
    with safe_open(str(path), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()


def token_strings(run: Path) -> list[str]:
    return json.loads((run / "tokens.json").read_text(encoding="utf-8"))["tokens"]


def open_page(monkeypatch, root: Path, run: Path, page: str, step_label: str | None = None,
              sequence: int | None = None) -> AppTest:
    monkeypatch.setenv("TRACER_ROOT", str(root))
    # the choosers are on a run's pages (the Runs page at / has none): Tokens, which every run has
    at = AppTest.from_file(str(APP), default_timeout=60).switch_page(TOKENS_PAGE).run()
    at.selectbox(key="run").select(run).run()
    if step_label is not None:
        at.selectbox(key="step_file").select(step_label).run()
    if sequence is not None:
        at.selectbox(key="sequence").select(sequence).run()
    at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def frame_with(at: AppTest, columns: set[str]) -> pd.DataFrame:
    for df in at.dataframe:
        if columns <= set(df.value.columns):
            return df.value
    raise AssertionError(f"no table with {columns} among {[list(d.value.columns) for d in at.dataframe]}")


# -- navigation -------------------------------------------------------------------------------------


def test_pages_follow_the_algorithm():
    def titles(algorithm):
        return [p.title for p in pages_for(algorithm)]

    common = ["Steps", "Health", "Diff", "Overview"]
    assert titles("ppo") == ["Tokens", "Rollouts", "Conversation", "Step", "PPO: GAE and early stop", "Mismatch",
                             *common]
    for algorithm in ("grpo", "cispo", "rloo"):
        assert titles(algorithm) == ["Tokens", "Rollouts", "Conversation", "Step", "Groups", "Mismatch", *common]
    assert titles("dpo") == ["Tokens", "DPO pairs", *common]  # no completion tokens: no Step page
    assert len({p.url_path for p in PAGES}) == len(PAGES) and all(p.url_path for p in PAGES)
    assert titles(None) == [p.title for p in PAGES]  # unknown algorithm: every page, each explains itself
    assert hidden_pages_note("dpo") == ("Hidden for a dpo run: Rollouts, Conversation, Step, PPO: GAE and early stop, "
                                        "Groups, Mismatch.")
    assert hidden_pages_note(None) is None


def test_a_page_not_offered_says_why():
    """The reason the page behind a link to a hidden page gives (its algorithms; a field not recorded)."""
    by_url = {p.url_path: p for p in PAGES}
    assert not_offered_reason(by_url["groups"], "ppo") == (
        "The Groups page is for grpo, cispo, rloo runs; this run's algorithm is ppo.")
    assert not_offered_reason(by_url["step"], "dpo") == (
        "The Step page is for ppo, grpo, cispo, rloo runs; this run's algorithm is dpo.")
    assert not_offered_reason(by_url["mismatch"], "grpo", {"policy_logprobs", "old_logprobs"}) == (
        "The Mismatch page shows sampler_logprobs, which this run does not record (no sampler_logprobs in the "
        "first or the selected step file).")


# -- PPO builders -------------------------------------------------------------------------------------


def ppo_table() -> pd.DataFrame:
    """One PPO sequence, T = 4, position 3 masked; reward 1 on the last kept token (2)."""
    return pd.DataFrame({
        "section": ["prompt"] + ["completion"] * 4, "position": [0, 0, 1, 2, 3],
        "token_text": ["Q", "a", SCRIPT, "<eos>", "<pad>"], "kept": [False, True, True, True, False],
        "mask_reason": ["prompt", "kept", "kept", "kept", "after_eos"],
        "token_rewards": [None, 0.0, 0.0, 1.0, 0.0], "values": [None, 0.5, 0.6, 0.7, 0.0],
        "returns": [None, 0.9, 0.95, 1.0, 0.0], "advantages": [None, 0.4, 0.35, 0.3, 0.0],
        "ratio": [None, 1.0, 1.0, 1.0, 1.0],
    })


def test_gae_figure_bars_for_rewards_lines_for_the_rest_and_shaded_mask():
    fig = gae_figure(ppo_table())
    kinds = {t.name: (t.type, t.yaxis) for t in fig.data}
    assert kinds == {"token_rewards": ("bar", "y"), "values": ("scatter", "y"), "returns": ("scatter", "y"),
                     "advantages": ("scatter", "y2")}
    assert list(fig.data[0].x) == [0, 1, 2, 3] and list(fig.data[0].y) == [0.0, 0.0, 1.0, None]  # masked: a gap
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    assert {(s.x0, s.x1) for s in rects} == {(2.5, 3.5)} and len(rects) == 2  # both panels
    assert "&lt;script&gt;" in str(fig.data[0].customdata[1])  # hover shows the token as text
    assert list(gae_token_frame(ppo_table()).columns) == [
        "position", "token_text", "mask_reason", "token_rewards", "values", "returns", "advantages"]
    assert not gae_figure(ppo_table()[["section", "position", "kept"]]).data


def test_gae_figure_labels_its_axis_with_the_completion_tokens():
    # the x axis names each token over its position (escaped: a token is text, never markup)
    fig = gae_figure(ppo_table())
    assert list(fig.layout.xaxis2.tickvals) == [0, 1, 2, 3]
    assert [t.split("<br>") for t in fig.layout.xaxis2.ticktext] == [
        ["a", "0"], ["&lt;script&gt;a…", "1"], ["&lt;eos&gt;", "2"], ["&lt;pad&gt;", "3"]]


def minibatch_table() -> pd.DataFrame:
    """Two epochs x two minibatches; epoch 1 minibatch 0 stopped early, minibatch 1 never ran."""
    return pd.DataFrame({
        "step": 0, "epoch": [0, 0, 1, 1], "minibatch": [0, 1, 0, 1], "rank": 0,
        "status": ["ran", "ran", "early stop", "not run"], "early_stop": [False, False, True, False],
        "mean_approx_kl_k2": [0.01, 0.02, 0.15, math.nan], "target_kl": [0.1, 0.1, 0.1, math.nan],
        "above_target_kl": [False, False, True, False], "rows": [4, 4, 4, 0], "row_ids": ["", "", "", ""],
    })


def test_early_stop_grid_epochs_by_minibatches():
    grid = early_stop_grid(minibatch_table())
    assert list(grid.columns) == ["epoch", "mb 0", "mb 1"]
    assert grid.values.tolist() == [[0, "ran · k2 0.01", "ran · k2 0.02"],
                                    [1, "EARLY STOP · k2 0.15 > target 0.1", "not run"]]


def test_early_stop_table_and_figure_mark_the_stop():
    ctx = style_minibatch_table(minibatch_table())._compute().ctx
    styled = {row: css for (row, _), css in ctx.items() if css}
    assert STATUS_BACKGROUND["early stop"] in str(styled[2]) and STATUS_BACKGROUND["not run"] in str(styled[3])
    assert set(styled) == {2, 3}
    fig = early_stop_figure(minibatch_table())
    bars = fig.data[0]
    assert list(bars.x) == ["e0 · mb0", "e0 · mb1", "e1 · mb0", "e1 · mb1"]
    assert list(bars.marker.color) == [STATUS_COLOUR[s] for s in ("ran", "ran", "early stop", "not run")]
    assert [s.y0 for s in fig.layout.shapes if s.type == "line"] == [0.1]  # target_kl


# -- group builders -----------------------------------------------------------------------------------


def completions() -> pd.DataFrame:
    return pd.DataFrame({"sequence": [4, 5], "completion_text": [SCRIPT, "b"], "reward": [1.0, 3.0],
                         "advantage": [-1.0, 1.0], "group_mean": [2.0, 2.0], "group_std": [1.0, 1.0],
                         "zero_variance": [False, False]})


def test_group_rewards_figure_and_labels():
    fig = group_rewards_figure(completions())
    # the bars, the dash on top of each bar (one legend entry with the bars), the advantages
    assert [t.name for t in fig.data] == ["reward", "reward", "advantage"]
    assert [t.name for t in fig.data if t.showlegend is not False] == ["reward", "advantage"]
    assert list(fig.data[0].x) == ["seq 4", "seq 5"] and list(fig.data[2].y) == [-1.0, 1.0]
    assert fig.data[2].yaxis == "y2"
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert [s.y0 for s in lines] == [2.0]  # group mean
    assert [(s.y0, s.y1) for s in fig.layout.shapes if s.type == "rect"] == [(1.0, 3.0)]  # ± std
    row = {"group": 1, "size": 4, "reward_mean": 1.0, "zero_variance": True}
    assert group_label(pd.Series(row)) == "group 1 · 4 rows · mean 1 · zero variance"


def test_style_group_table_marks_zero_variance_rows():
    frame = pd.DataFrame({"group": [0, 1, 2], "reward_std": [0.5, 0.0, 0.0], "zero_variance": [False, True, True]})
    ctx = style_group_table(frame)._compute().ctx
    assert {row for (row, _), css in ctx.items() if css} == {1, 2}
    assert ZERO_VARIANCE_BACKGROUND in str(ctx[(1, 0)])


def test_zero_variance_figure_one_line_per_inner_step():
    shares = pd.DataFrame({"step": [0, 0, 1, 1], "inner_step": [0, 1, 0, 1], "groups": 4,
                           "zero_variance_groups": [1, 1, 2, 2], "zero_variance_share": [0.25, 0.25, 0.5, 0.5]})
    fig = zero_variance_figure(shares)
    assert [t.name for t in fig.data] == ["inner step 0", "inner step 1"]
    assert list(fig.data[0].y) == [0.25, 0.5]
    assert not zero_variance_figure(shares.iloc[:0]).data


# -- DPO builders -------------------------------------------------------------------------------------


def pair_tokens() -> pd.DataFrame:
    return pd.DataFrame({
        "position": [0, 1, 2], "chosen_token_text": ["Q", SCRIPT, "<pad>"], "chosen_kept": [False, True, False],
        "chosen_policy_logprobs": [-1.0, -2.0, -3.0], "chosen_ref_logprobs": [-1.0, -2.5, -3.0],
        "rejected_token_text": ["Q", "b", "c"], "rejected_kept": [False, True, True],
        "rejected_policy_logprobs": [-1.0, -1.0, -1.0], "rejected_ref_logprobs": [-1.0, -1.0, -1.0],
    })


def test_style_pair_table_greys_each_side_on_its_own_mask():
    frame = pair_tokens()
    ctx = style_pair_table(frame)._compute().ctx
    grey = {(row, frame.columns[col]) for (row, col), css in ctx.items() if css}
    chosen_cols = [c for c in frame.columns if c.startswith("chosen_")]
    rejected_cols = [c for c in frame.columns if c.startswith("rejected_")]
    assert grey == {(r, c) for r in (0, 2) for c in chosen_cols} | {(0, c) for c in rejected_cols}
    assert ("background-color", MASKED_CELL.split(";")[0].split(": ")[1]) in ctx[(0, 1)]


def test_side_text_and_pair_figure():
    assert side_text(pair_tokens(), "chosen") == SCRIPT
    assert side_text(pair_tokens(), "rejected") == "bc"
    fig = pair_logprobs_figure(pair_tokens())
    assert [t.name for t in fig.data] == ["chosen_policy_logprobs", "chosen_ref_logprobs",
                                          "rejected_policy_logprobs", "rejected_ref_logprobs"]
    rects = sorted((s.yref, s.x0, s.x1) for s in fig.layout.shapes if s.type == "rect")
    # chosen masked at 0 and 2 (panel 1), rejected at 0 (panel 2)
    assert rects == [("y domain", -0.5, 0.5), ("y domain", 1.5, 2.5), ("y2 domain", -0.5, 0.5)]


def test_dpo_curves_figure_panels():
    summary = pd.DataFrame({"step": [0, 1], "inner_step": 0, "pairs": 4, "margin": [0.0, 0.1],
                            "preference_accuracy": [0.0, 0.75], "mean_dpo_loss": [0.69, 0.68]})
    fig = dpo_curves_figure(summary)
    assert len(fig.data) == 3 and list(fig.data[1].y) == [0.0, 0.75]
    assert "preference accuracy" in [a.text for a in fig.layout.annotations]
    assert not dpo_curves_figure(pd.DataFrame()).data


# -- pages on the sample traces -----------------------------------------------------------------------


@needs_samples
def test_ppo_page_marks_the_early_stop_read_from_metadata(monkeypatch):
    run = SAMPLES / "ppo-tiny"
    at = open_page(monkeypatch, SAMPLES, run, "ppo", step_label="step 2 · inner 0 · mb 0 · rank 0")
    # which minibatches of step 2 say early_stop, read from the headers without tracer
    stops = set()
    for path in sorted((run / "steps").glob("step_00000002.*.safetensors")):
        _, meta = read_step(path)
        if json.loads(meta["early_stop"]):
            stops.add((int(json.loads(meta["inner_step"])), int(json.loads(meta["micro_batch"]))))
    assert stops == {(2, 0)}
    table = frame_with(at, {"epoch", "minibatch", "status", "early_stop"})
    assert set(zip(table.loc[table["early_stop"], "epoch"], table.loc[table["early_stop"], "minibatch"])) == stops
    assert table.loc[(table["epoch"] == 2) & (table["minibatch"] == 1), "status"].tolist() == ["not run"]
    grid = frame_with(at, {"epoch", "mb 0", "mb 1"}).set_index("epoch")
    assert grid.loc[2, "mb 0"].startswith("EARLY STOP") and "> target 0.1" in grid.loc[2, "mb 0"]
    assert grid.loc[2, "mb 1"] == "not run" and grid.loc[0, "mb 1"].startswith("ran")
    assert len(at.get("plotly_chart")) == 2


@needs_samples
def test_ppo_page_shows_the_chosen_rollout_row_from_its_minibatch_file(monkeypatch):
    run = SAMPLES / "ppo-tiny"
    at = open_page(monkeypatch, SAMPLES, run, "ppo", step_label="step 1 · inner 1 · mb 0 · rank 0")
    box = at.selectbox(key="rollout_row")
    label = next(opt for opt in box.options if opt.startswith("row 5 "))
    box.select(box.options.index(label) if isinstance(box.value, int) else label).run()
    assert not at.exception
    # find row 5 of epoch 1 independently: the file of step 1, inner 1 whose row_ids hold 5
    for path in sorted((run / "steps").glob("step_00000001.inner_1.*.safetensors")):
        data, _ = read_step(path)
        if 5 in data["row_ids"].tolist():
            index = data["row_ids"].tolist().index(5)
            break
    assert f"{path.name}, row {index}" in " ".join(t.value for t in at.text)
    shown = frame_with(at, {"token_rewards", "values", "returns", "advantages"})
    for name in ("token_rewards", "values", "returns", "advantages"):
        assert shown[name].tolist() == pytest.approx(data[name][index].tolist())
    tokens = token_strings(run)
    # as drawn: a whitespace-only token shows its marker (visible_token, pinned in test_first_use.py)
    assert shown["token_text"].tolist() == [visible_token(tokens[i]) for i in data["completion_ids"][index].tolist()]


@needs_samples
@pytest.mark.parametrize("run_name", ["grpo-tiny", "cispo-tiny"])
def test_group_page_shows_g_completions_with_the_files_rewards(monkeypatch, run_name):
    run = SAMPLES / run_name
    at = open_page(monkeypatch, SAMPLES, run, "groups")  # step 0 · inner 0: group 1 has zero variance
    data, meta = read_step(run / "steps" / "step_00000000.inner_0.mb_0.rank_0.safetensors")
    G = int(json.loads(meta["num_generations"]))
    names = json.loads(meta["reward_component_names"])
    for group in (0, 1):
        at.selectbox(key="group").select(group).run()
        assert not at.exception
        rows = frame_with(at, {"sequence", "completion_text", "reward", "advantage", "group_mean", "group_std"})
        in_group = (data["group_ids"] == group).nonzero().flatten().tolist()
        assert len(rows) == G and rows["sequence"].tolist() == in_group
        rewards = data["rewards"][in_group]
        assert rows["reward"].tolist() == pytest.approx(rewards.tolist())
        assert rows["advantage"].tolist() == pytest.approx(data["advantages"][in_group].tolist())
        components = data["reward_components"][in_group]  # (G, F)
        assert rows[names].values.ravel().tolist() == pytest.approx(components.ravel().tolist())
        assert rows["group_mean"].iloc[0] == pytest.approx(float(rewards.double().mean()))
        assert rows["group_std"].iloc[0] == pytest.approx(float(rewards.double().std(unbiased=False)))
        zero = bool((rewards == rewards[0]).all())
        assert rows["zero_variance"].tolist() == [zero] * G
        warned = any("Zero-variance group" in w.value for w in at.warning)
        assert warned == zero
    assert zero  # group 1 of step 0 is the zero-variance one in these samples
    shares = frame_with(at, {"step", "zero_variance_share"})
    assert shares["zero_variance_share"].iloc[0] == pytest.approx(0.5)
    assert len(at.get("plotly_chart")) == 2


@needs_samples
def test_group_page_uses_the_unbiased_std_of_a_trl_trace(monkeypatch):
    run = SAMPLES / "grpo-trl-tiny"
    at = open_page(monkeypatch, SAMPLES, run, "groups")
    data, meta = read_step(run / "steps" / "step_00000000.inner_0.mb_0.rank_0.safetensors")
    assert meta["advantage_std"] == "unbiased"
    rows = frame_with(at, {"sequence", "reward", "group_std"})
    rewards = data["rewards"][(data["group_ids"] == 0)]
    assert rows["group_std"].iloc[0] == pytest.approx(float(rewards.double().std(unbiased=True)))
    assert any("group std: unbiased" in t.value for t in at.text)


@needs_samples
def test_dpo_page_shows_the_files_logits_and_the_pair(monkeypatch):
    run = SAMPLES / "dpo-tiny"
    at = open_page(monkeypatch, SAMPLES, run, "dpo", step_label="step 1 · inner 0 · mb 0 · rank 0", sequence=2)
    data, _ = read_step(run / "steps" / "step_00000001.inner_0.mb_0.rank_0.safetensors")
    terms = frame_with(at, {"quantity", "recorded", "recomputed"}).set_index("quantity")
    assert terms.loc["dpo_logits", "recorded"] == float(data["dpo_logits"][2])
    assert terms.loc["dpo_loss", "recorded"] == float(data["dpo_loss"][2])
    assert terms.loc["dpo_logits", "recomputed"] == pytest.approx(float(data["dpo_logits"][2]), abs=1e-5)
    assert at.selectbox(key="sequence").options[2] == "pair 2"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["dpo_logits"] == f"{float(data['dpo_logits'][2]):.4g}"
    assert metrics["chosen_rewards"] == f"{float(data['chosen_rewards'][2]):.4g}"
    pair = frame_with(at, {"chosen_token_text", "rejected_token_text", "chosen_kept"})
    tokens = token_strings(run)
    assert pair["chosen_token_text"].tolist() == [visible_token(tokens[i]) for i in data["chosen_ids"][2].tolist()]
    assert pair["rejected_kept"].tolist() == data["rejected_mask"][2].tolist()
    assert pair["chosen_policy_logprobs"].tolist() == pytest.approx(data["chosen_policy_logprobs"][2].tolist())
    summary = frame_with(at, {"step", "margin", "preference_accuracy"})
    for step in (0, 1, 2):
        d, _ = read_step(run / "steps" / f"step_{step:08d}.inner_0.mb_0.rank_0.safetensors")
        accuracy = (d["chosen_rewards"] > d["rejected_rewards"]).double().mean()
        margin = (d["chosen_rewards"] - d["rejected_rewards"]).double().mean()
        assert summary["preference_accuracy"].iloc[step] == pytest.approx(float(accuracy))
        assert summary["margin"].iloc[step] == pytest.approx(float(margin))
    assert len(at.get("plotly_chart")) == 2


@needs_samples
def test_tokens_page_of_a_dpo_run_points_to_the_pair_view(monkeypatch):
    at = open_page(monkeypatch, SAMPLES, SAMPLES / "dpo-tiny", "tokens")
    assert "pair view" in at.info[0].value
    assert "Hidden for a dpo run" in " ".join(t.value for t in at.sidebar.text)


# -- an RLOO trace with a token that looks like markup ------------------------------------------------


class ToyTokenizer:
    name_or_path = "toy"
    eos_token_id = 1
    pad_token_id = 0
    padding_side = "left"
    vocab = ["<pad>", "<eos>", "Q", SCRIPT, " ok"]

    def __len__(self) -> int:
        return len(self.vocab)

    def batch_decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return ["".join(self.vocab[i] for i in row) for row in ids]


def test_group_page_renders_an_rloo_run_and_keeps_token_text_literal(monkeypatch, tmp_path):
    run = tmp_path / "rloo"
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])  # G = 2: group 0 varies, group 1 has zero variance
    with TraceWriter(run, "rloo", tokenizer=ToyTokenizer(), hyperparameters={"num_generations": 2},
                     async_write=False) as w:
        w.record(0, {
            "prompt_ids": torch.tensor([[2]] * 4), "completion_ids": torch.tensor([[3, 1], [4, 1], [3, 1], [3, 1]]),
            "completion_mask": torch.ones(4, 2, dtype=torch.bool), "policy_logprobs": torch.full((4, 2), -1.0),
            "rewards": rewards, "advantages": torch.tensor([1.0, -1.0, 0.0, 0.0]),
            "group_ids": torch.tensor([0, 0, 1, 1]),
        })
    at = open_page(monkeypatch, tmp_path, run, "groups")
    rows = frame_with(at, {"sequence", "completion_text", "reward"})
    assert rows["completion_text"].tolist() == [SCRIPT + "<eos>", " ok<eos>"]
    assert rows["reward"].tolist() == [1.0, 0.0]
    assert not any("<script>" in text for text in markup_values(at))
    assert "1 with zero variance" in " ".join(t.value for t in at.text)


# -- runs that are not (yet) what a view needs --------------------------------------------------------


@pytest.mark.parametrize("algorithm, page", [("ppo", "ppo"), ("grpo", "groups"), ("rloo", "groups"), ("dpo", "dpo")])
def test_algorithm_pages_wait_for_the_first_step(monkeypatch, tmp_path, algorithm, page):
    run = tmp_path / "starting"
    TraceWriter(run, algorithm, async_write=False)  # the trainer has not written a step yet
    at = open_page(monkeypatch, run, run, page)
    assert "no step files" in at.info[0].value


def test_bare_step_file_gets_every_page_and_each_says_what_it_lacks(monkeypatch, tmp_path):
    from safetensors.torch import save_file

    step_file = tmp_path / "step.safetensors"  # no metadata: algorithm unknown, no group_ids, no G
    save_file({"completion_ids": torch.tensor([[2, 1], [3, 1]]), "completion_mask": torch.ones(2, 2, dtype=torch.bool),
               "rewards": torch.tensor([1.0, 0.0])}, str(step_file))
    at = open_page(monkeypatch, step_file, step_file, "groups")
    assert "cannot be told apart" in at.info[0].value
    assert any("record group_ids" in t.value for t in at.text)
    at.switch_page("app_pages/dpo.py").run()
    assert not at.exception and "no chosen_ids" in at.info[0].value
    at.switch_page("app_pages/ppo.py").run()
    assert not at.exception
    assert frame_with(at, {"epoch", "mb 0"}).loc[0, "mb 0"] == "ran"
