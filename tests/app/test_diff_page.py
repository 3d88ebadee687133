"""The Diff page: two traces written by TraceWriter in tmp_path that differ at one known (step,
sequence, token); the same trace copied (equal); traces of different algorithms (a clear message).
Pure builders on a hand-made token_diff_table frame."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from app.components.diff_view import (
    DIFF_STYLE, common_steps, differing_names, side_by_side_frame, style_side_by_side)
from app.components.token_table import MASK_BACKGROUND
from tracer.read import StepKey
from tracer.record.writer import TraceWriter

from tests.fixtures.toy_traces import (
    BOLD, ToyTokenizer, assert_no_raw_markup, frame_with, healthy_step_tensors, start, styled_rows, write_trace)


# The change: policy_logprobs of step 1, inner step 1, sequence 2, completion token 1 ("4") + 0.5 nats.
STEP, INNER, SEQUENCE, TOKEN, DELTA = 1, 1, 2, 1, 0.5
RED = DIFF_STYLE.split(";")[0]


def shift_one_logprob(step: int, inner_step: int, tensors) -> None:
    if (step, inner_step) == (STEP, INNER):
        tensors["policy_logprobs"][SEQUENCE, TOKEN] += DELTA


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("diff")
    write_trace(root / "a_base", tokenizer=ToyTokenizer(), steps=2)
    write_trace(root / "b_changed", tokenizer=ToyTokenizer(), steps=2, edit=shift_one_logprob)
    shutil.copytree(root / "a_base", root / "c_copy")
    with TraceWriter(root / "d_cispo", "cispo", hyperparameters={"num_generations": 2}, async_write=False) as w:
        w.record(0, healthy_step_tensors(0, 0))
    return root


# -- pure builders ----------------------------------------------------------------------------------


def key(step, inner=0, mb=0, rank=0) -> StepKey:
    return StepKey(step, inner, mb, rank, Path(f"s{step}.{inner}.{mb}.{rank}"))


def test_common_steps_pairs_by_step_inner_micro_batch_and_rank():
    keys_a = [key(0), key(1), key(1, rank=1), key(2)]
    keys_b = [key(1), key(1, rank=1), key(2), key(3)]
    assert common_steps(keys_a, keys_b) == [(1, 0, 0, 0), (1, 0, 0, 1), (2, 0, 0, 0)]
    assert common_steps(keys_a, keys_b, rank=1) == [(1, 0, 0, 1)]
    assert common_steps([key(4)], [key(9)], single_files=True) == [(4, 0, 0, 0)]


def hand_token_diff() -> pd.DataFrame:
    """Three positions: 0 equal, 1 ratio differs, 2 masked on b (not compared) with another id."""
    return pd.DataFrame({
        "sequence": 0, "position": [0, 1, 2],
        "token_id_a": [7, 4, 1], "token_id_b": [7, 4, 8],
        "token_text_a": ["4", "<script>alert(1)</script>", "<eos>"], "token_text_b": ["4", "<script>alert(1)</script>", BOLD],
        "kept_a": [True, True, True], "kept_b": [True, True, False],
        "mask_reason_a": ["kept"] * 3, "mask_reason_b": ["kept", "kept", "masked"],
        "mask_differs": [False, False, True], "id_differs": [False, False, True],
        "ratio_a": [1.0, 1.0, 1.0], "ratio_b": [1.0, 1.5, 9.0], "ratio_differs": [False, True, False],
    })


def test_side_by_side_marks_differing_cells_and_greys_uncompared_rows():
    table = hand_token_diff()
    assert differing_names(table).tolist() == ["", "ratio", "token, mask"]
    frame = side_by_side_frame(table)
    assert list(frame.columns) == ["position", "token_text_a", "token_text_b", "mask_reason_a", "mask_reason_b",
                                   "differs", "ratio_a", "ratio_b"]
    ctx = style_side_by_side(frame, table)._compute().ctx
    red = {(r, frame.columns[c]) for (r, c), css in ctx.items() if ("font-weight", "bold") in css}
    assert red == {(1, "ratio_a"), (1, "ratio_b"), (1, "differs"), (2, "token_text_a"), (2, "token_text_b"),
                   (2, "mask_reason_a"), (2, "mask_reason_b"), (2, "differs")}
    grey = {r for (r, _), css in ctx.items() if ("background-color", MASK_BACKGROUND["masked"]) in css}
    assert grey == {2}  # the ratio 9.0 there is not compared (b drops the position): grey, not red


# -- pages ------------------------------------------------------------------------------------------


def open_diff(monkeypatch, root: Path, b: str):
    at = start(monkeypatch, root)
    at.switch_page("app_pages/diff.py").run()
    at.selectbox(key="diff_a").select(root / "a_base").run()
    at.selectbox(key="diff_b").select(root / b).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_diff_marks_the_changed_token_with_both_values(monkeypatch, root):
    at = open_diff(monkeypatch, root, "b_changed")
    assert at.error[0].value.startswith("different: 1 finding")
    a_value = float(healthy_step_tensors(100 + STEP, INNER)["policy_logprobs"][SEQUENCE, TOKEN])
    b_value = float(torch.tensor(a_value) + DELTA)
    first = next(t.value for t in at.text if t.value.startswith("first divergence"))
    assert f"policy_logprobs at step {STEP}, inner {INNER}, seq {SEQUENCE}, tok {TOKEN} '4'" in first
    fields = frame_with(at, {"field", "passed", "differing", "max_abs_diff"}).value.set_index("field")
    assert not fields.loc["policy_logprobs", "passed"] and fields.loc["policy_logprobs", "differing"] == 1
    assert fields.loc["policy_logprobs", "max_abs_diff"] == pytest.approx(DELTA, abs=1e-6)
    assert fields.drop(index="policy_logprobs")["passed"].all()

    # the token view opens on the first divergence: that step and sequence
    assert at.selectbox(key="diff_step").value == (STEP, INNER, 0, 0)
    assert at.selectbox(key="diff_sequence").value == SEQUENCE
    tokens = frame_with(at, {"token_text_a", "token_text_b", "differs"})
    view = tokens.value
    row = view.index[view["position"] == TOKEN][0]
    assert view.loc[row, "differs"] == "policy_logprobs"
    assert view.loc[row, "policy_logprobs_a"] == pytest.approx(a_value)
    assert view.loc[row, "policy_logprobs_b"] == pytest.approx(b_value)
    assert (view.drop(index=row)["differs"] == "").all()
    styles = tokens.proto.arrow_data.styler.styles
    assert styled_rows(styles, RED) == {row}
    # row 2 of the toy step: " yes" "4" "<b>" "<eos>" then two positions after EOS, greyed
    masked = set(view.index[view["mask_reason_a"] != "kept"])
    assert masked == {4, 5} and styled_rows(styles, MASK_BACKGROUND["masked"]) == masked
    assert BOLD in set(view["token_text_a"])
    assert_no_raw_markup(at)


def test_identical_traces_are_equal(monkeypatch, root):
    at = open_diff(monkeypatch, root, "c_copy")
    assert not at.error
    assert at.success[0].value.startswith("equal within tolerance")
    assert frame_with(at, {"field", "passed"}).value["passed"].all()
    view = frame_with(at, {"token_text_a", "differs"}).value
    assert (view["differs"] == "").all()


def test_different_algorithms_give_a_clear_message(monkeypatch, root):
    at = open_diff(monkeypatch, root, "d_cispo")
    assert at.error[0].value == "These traces cannot be compared; nothing was diffed."
    assert any("cannot diff a grpo trace" in t.value and "cispo" in t.value for t in at.text)


def test_step_choice_changes_the_token_view(monkeypatch, root):
    at = open_diff(monkeypatch, root, "b_changed")
    at.selectbox(key="diff_step").select((0, 0, 0, 0)).run()
    assert not at.exception
    view = frame_with(at, {"token_text_a", "differs"}).value
    assert (view["differs"] == "").all()


# -- the bundled pair ---------------------------------------------------------------------------------


def test_the_page_opens_on_the_bundled_pair_and_takes_fields_and_tolerances(monkeypatch):
    from tests.fixtures.toy_traces import SAMPLES

    from tracer import Trace
    from tracer.demo.diff_pair import BASELINE, VARIANT

    a, b = Trace(SAMPLES / BASELINE), Trace(SAMPLES / VARIANT)
    step0 = a.load_step(a.steps()[0])
    seq = int((step0["reward_components"][:, 2] > 2).nonzero()[0])  # the first reward the new clip lowers
    # independently: the largest reward change over all step pairs
    max_reward_change = max(float((b.load_step(kb)["rewards"] - a.load_step(ka)["rewards"]).abs().max())
                            for ka, kb in zip(a.steps(), b.steps()))

    at = start(monkeypatch, SAMPLES)
    at.switch_page("app_pages/diff.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert (at.selectbox(key="diff_a").value, at.selectbox(key="diff_b").value) == (SAMPLES / BASELINE,
                                                                                     SAMPLES / VARIANT)
    assert at.error[0].value.startswith("different: ")
    texts = [t.value for t in at.text]
    assert f"{VARIANT} is a variant of {BASELINE}: scorer_clip 3.0 -> 2.0 (the reward function)" in texts
    assert any(t.startswith(f"first divergence: rewards at step 0, seq {seq} (") for t in texts), texts
    assert any(t.startswith("follows from rewards: reward_components, advantages") for t in texts), texts
    table = frame_with(at, {"field", "role", "passed"}).value
    assert table.iloc[0]["field"] == "rewards" and table.iloc[0]["role"] == "cause"
    assert set(table.loc[table["role"] == "follows", "field"]) >= {"advantages", "per_token_loss"}
    # the token view opens on the cause's step and sequence
    assert at.selectbox(key="diff_step").value == (0, 0, 0, 0) and at.selectbox(key="diff_sequence").value == seq

    # only the rewards, within a tolerance of their largest change: equal; just under it: different
    at.multiselect(key="diff_fields_pick").select("rewards").run()
    at.text_input(key="diff_atol").input(f"rewards={max_reward_change}").run()
    assert not at.exception and at.success[0].value.startswith("equal within tolerance")
    assert frame_with(at, {"field", "role"}).value["field"].tolist() == ["rewards"]
    command = next(c.value for c in at.code if "tracer diff" in c.value)
    assert command.endswith(f"--fields rewards --atol rewards={max_reward_change}")
    at.text_input(key="diff_atol").input(f"rewards={max_reward_change * 0.99}").run()
    assert at.error[0].value.startswith("different: 1 finding")
    at.text_input(key="diff_atol").input("rewards=loose").run()
    assert at.error[0].value == "A tolerance cannot be read; nothing was diffed."
    assert any("atol 'rewards=loose': expected FIELD=NUMBER or NUMBER" in t.value for t in at.text)


def test_default_pair_prefers_a_declared_baseline_then_a_comparable_pair(tmp_path):
    from app.components.diff_view import cli_command, declared_baseline, default_pair, split_tolerances

    t = [tmp_path / n for n in ("a_dpo", "b_dpo", "c_base", "d_variant", "e_other")]
    manifest = {"config": {"diff_baseline": "../c_base"}}
    assert declared_baseline(t[3], manifest, t) == t[2]
    assert declared_baseline(t[3], {"config": {"diff_baseline": "../nowhere"}}, t) is None
    assert declared_baseline(t[3], {"config": "not a dict"}, t) is None
    assert declared_baseline(t[3], {"config": {"diff_baseline": "."}}, t) is None  # itself
    baselines = {t[3]: t[2]}
    same_algo = lambda x, y: {x.name[2:], y.name[2:]} <= {"dpo"} or {x.name, y.name} <= {"c_base", "e_other"}  # noqa: E731
    assert default_pair(t, t[0], baselines, same_algo) == (2, 3)  # the declared pair, wherever the selection is
    assert default_pair(t, t[3], baselines, same_algo) == (2, 3)
    assert default_pair(t, t[4], {}, same_algo) == (4, 2)  # the selection and a trace it can be compared with
    assert default_pair(t, t[3], {}, same_algo) == (0, 1)  # else the first comparable pair
    assert default_pair(t, t[3], {}, lambda x, y: False) == (3, 4)  # else the selection and the next one
    assert split_tolerances(" 1e-4, ratio=1e-3  rewards=0.5,") == ["1e-4", "ratio=1e-3", "rewards=0.5"]
    assert cli_command(Path("a b"), Path("c"), ["rewards", "ratio"], ["1e-4"], ["ratio=0.1"]) == (
        "python -m tracer diff 'a b' c --fields rewards,ratio --atol 1e-4 --rtol ratio=0.1")
