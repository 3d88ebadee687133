"""The Rollouts page's "First pass only" filter: a run that trains on one batch of rollouts for
several inner steps (PPO epochs, GRPO ``num_iterations``) records every completion once per inner
step; the filter lists each once. Pinned on a hand-built frame, on the toy GRPO trace through
``AppTest`` (and the URL), and on the bundled traces of two trainers that number inner steps
differently: TRL's GRPOTrainer (``num_iterations=2``: step 0 inner 0, step 1 inner 1, the same
completions under consecutive step numbers) and a hand-written PPO loop (inner steps 0-2 of each
step). Expected rows are read from the step files with ``safetensors.safe_open``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from safetensors import safe_open

from app.components.rollouts import RolloutQuery, first_pass_rows, pass_count, select_rollouts
from tests.app.test_rollouts_page import file_rows, open_rollouts, table, where
from tests.fixtures.toy_traces import ToyTokenizer, write_trace

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


def test_first_pass_keeps_the_lowest_inner_step_of_the_run():
    frame = pd.DataFrame({"step": [0, 0, 0, 0, 1, 1, 2], "inner_step": [0, 0, 1, 1, 1, 2, 0],
                          "seq": [0, 1, 0, 1, 0, 0, 0]})
    assert first_pass_rows(frame).tolist() == [True, True, False, False, False, False, True]
    assert list(zip(*[select_rollouts(frame, RolloutQuery(first_pass=True))[c] for c in ("step", "seq")])) == [
        (0, 0), (0, 1), (2, 0)]
    assert pass_count(frame) == 3
    assert pass_count(frame[frame["inner_step"] == 0]) == 1
    later = frame[frame["inner_step"] > 0]  # a run traced from its second pass on: inner step 1 is its first
    assert first_pass_rows(later).tolist() == [True, True, True, False]


def test_first_pass_round_trips_through_the_url():
    assert RolloutQuery(first_pass=True).to_params()["first_pass"] == "1"
    assert RolloutQuery().to_params()["first_pass"] is None
    assert RolloutQuery.from_params({"first_pass": "1"}).first_pass is True
    assert RolloutQuery.from_params({"first_pass": "yes"}).first_pass is False
    assert RolloutQuery(first_pass=True).filters().first_pass is True  # a change of it goes back to page 1


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("first_pass")
    write_trace(root / "run", tokenizer=ToyTokenizer(), steps=9)  # 9 steps x inner 0, 1 x 4 rows
    return root


def test_the_toggle_lists_each_completion_once_and_writes_the_url(monkeypatch, root):
    at = open_rollouts(monkeypatch, root, {"run": "run"})
    assert any("once per inner step (2 inner steps)" in c.value for c in at.caption)
    at.toggle(key="ro_first_pass").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    expected = [(r["step"], r["inner_step"], r["seq"]) for r in file_rows(root / "run") if r["inner_step"] == 0]
    assert len(expected) == 36
    assert where(table(at)) == expected
    assert at.query_params["first_pass"] == "1"
    assert not any("once per inner step" in c.value for c in at.caption)
    # the copied link opens the same rows with the toggle on
    again = open_rollouts(monkeypatch, root, {"run": "run", "first_pass": "1"})
    assert again.toggle(key="ro_first_pass").value is True
    assert where(table(again)) == expected


def file_ids(path: Path) -> np.ndarray:
    with safe_open(str(path), "np") as f:
        return f.get_tensor("completion_ids")


@pytest.mark.parametrize("sample", ["grpo-trl-tiny", "ppo-tiny"])
def test_on_real_trainers_the_first_pass_is_inner_step_0(monkeypatch, sample):
    steps = sorted((SAMPLES / sample / "steps").glob("*.safetensors"))
    firsts = [p for p in steps if ".inner_0." in p.name]
    assert firsts and len(firsts) < len(steps)
    if sample == "grpo-trl-tiny":  # TRL: step 1 (inner 1) trains on step 0's completions again
        assert np.array_equal(file_ids(steps[0]), file_ids(steps[1]))
    expected = sum(file_ids(p).shape[0] for p in firsts)
    at = open_rollouts(monkeypatch, SAMPLES, {"run": sample, "first_pass": "1"})
    shown = table(at)
    assert not at.toggle(key="ro_first_pass").disabled
    assert set(shown["inner_step"]) == {0}
    # rows of the first page (50 at most) of the expected count, and the page's summary names the count
    assert len(shown) == min(expected, 50)
    assert any(f"of {expected:,} shown" in t.value for t in at.text)
