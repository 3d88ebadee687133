"""The Mismatch page's importance-sampling and policy-lag parts: the view's raw ratio, weight applied,
cut marks and lag on a hand-made step whose values are worked out here (recorded and derived
weights), and the page through AppTest on the asynchronous GRPO demo (tracer.demo.async_grpo: rows
sampled by the policy of 2 updates earlier, IcePop correction)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tracer import Trace, TraceWriter
from tracer.demo.async_grpo import AsyncGRPOConfig, run
from tracer.views.mismatch import mismatch_steps, mismatch_tokens

from tests.fixtures.toy_traces import ToyTokenizer, assert_no_raw_markup, frame_with, start

# old - sampler per token: row 0 [0.1, -0.4, 0.3], row 1 [0.5, 0.0, <masked>]
DELTA = torch.tensor([[0.1, -0.4, 0.3], [0.5, 0.0, 9.0]])


def write_step(root: Path, hyper: dict, weights: dict) -> Trace:
    old = torch.log(torch.tensor([[0.5, 0.4, 0.2], [0.6, 0.3, 0.9]]))
    tensors = {"completion_ids": torch.tensor([[2, 3, 1], [4, 5, 0]]),
               "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool),
               "old_logprobs": old, "policy_logprobs": old.clone(), "sampler_logprobs": old - DELTA,
               "policy_version": torch.tensor([7, 5]), **weights}
    with TraceWriter(root, "grpo", tokenizer=ToyTokenizer(), hyperparameters=hyper) as writer:
        writer.record(0, tensors, metadata={"trainer_version": 7})
    return Trace(root)


def test_icepop_recorded_weights_raw_ratio_cut_and_lag(tmp_path):
    # token_mask caps [0.8, 1.25]: exp(-0.4) = 0.670 and exp(0.3) = 1.350 and exp(0.5) = 1.649 lie outside
    raw = torch.exp(DELTA)
    weights = torch.where((raw < 0.8) | (raw > 1.25), torch.zeros_like(raw), raw)
    trace = write_step(tmp_path / "icepop", {"is_correction": True, "is_mode": "token_mask", "is_clip_min": 0.8,
                                             "is_clip_max": 1.25}, {"is_weights": weights})
    frame = mismatch_tokens(trace, trace.steps()[0])
    assert frame["raw_ratio"].tolist() == pytest.approx([math.exp(d) for d in (0.1, -0.4, 0.3, 0.5, 0.0)], rel=1e-6)
    assert frame["is_weight"].tolist() == pytest.approx([math.exp(0.1), 0.0, 0.0, 0.0, 1.0], rel=1e-6)
    assert frame["cut"].tolist() == [False, True, True, True, False]
    assert frame["policy_lag"].tolist() == [0, 0, 0, 2, 2]
    assert frame.attrs["weights_source"] == "recorded"
    (row,) = mismatch_steps(trace, trace.steps()).to_dict("records")
    assert row["cut"] == 3 and row["cut_share"] == pytest.approx(3 / 5)
    assert row["mean_lag"] == pytest.approx(1.0) and row["max_lag"] == 2


def test_weights_derived_when_declared_but_not_recorded(tmp_path):
    # sequence_truncate by mean, cap 1.1: row 0 mean 0.0 -> 1.0; row 1 mean 0.25 -> exp(0.25) = 1.284 -> 1.1
    trace = write_step(tmp_path / "derived", {"is_correction": True, "is_mode": "sequence_truncate",
                                              "is_clip_max": 1.1, "is_sequence_aggregation": "mean"}, {})
    frame = mismatch_tokens(trace, trace.steps()[0])
    assert frame.attrs["weights_source"] == "derived"
    assert frame["raw_sequence_ratio"].tolist() == pytest.approx([1.0] * 3 + [math.exp(0.25)] * 2, rel=1e-6)
    assert frame["is_weight"].tolist() == pytest.approx([1.0] * 3 + [1.1] * 2, rel=1e-6)
    assert frame["cut"].tolist() == [False] * 3 + [True] * 2
    (row,) = mismatch_steps(trace, trace.steps()).to_dict("records")
    assert row["cut"] == 1 and row["cut_unit"] == "sequences" and row["cut_share"] == pytest.approx(0.5)


def test_nothing_declared_nothing_filled_in(tmp_path):
    trace = write_step(tmp_path / "none", {}, {})
    frame = mismatch_tokens(trace, trace.steps()[0])
    assert frame["is_weight"].isna().all() and not frame["cut"].any() and frame.attrs["weights_source"] is None
    assert mismatch_steps(trace, trace.steps())["cut_share"].isna().all()


@pytest.fixture(scope="module")
def async_root(model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("async-runs")
    run(root / "icepop", AsyncGRPOConfig(is_mode="token_mask", is_clip_min=0.8, is_clip_max=1.25), model_dir)
    return root


def test_page_shows_raw_and_applied_weights_and_the_lag(monkeypatch, async_root):
    trace = Trace(async_root / "icepop")
    last = max(k.step for k in trace.steps())
    at = start(monkeypatch, async_root, query={"run": "icepop", "step": str(last)})
    at.switch_page("app_pages/mismatch.py").run()
    assert not at.exception, [e.value for e in at.exception]
    banners = [e.value for e in at.success] + [e.value for e in at.error]
    assert "sampler.is_weights: info" in banners and "sampler.policy_lag: info" in banners
    metrics = {m.label: m.value for m in at.metric}
    data = trace.load_step(next(k for k in trace.steps() if k.step == last))
    keep = data["completion_mask"].bool()
    raw = torch.exp(data["old_logprobs"].double() - data["sampler_logprobs"].double())
    cut = int((((raw < 0.8) | (raw > 1.25)) & keep).sum())
    assert metrics["tokens cut by the IS correction"] == f"{cut} of {int(keep.sum())}"
    assert metrics["policy lag (mean over rows)"] == "2.00"
    rows = frame_with(at, {"sequence", "tokens", "policy_lag", "raw_sequence_ratio"}).value
    assert rows["policy_lag"].tolist() == [2] * int(keep.any(dim=1).sum())
    cut_tables = [d.value for d in at.dataframe if {"raw_ratio", "is_weight", "cut"} <= set(d.value.columns)
                  and len(d.value) and bool(d.value["cut"].all())]
    assert cut > 0, "two updates of lag push some tokens outside the IcePop caps"
    (table,) = cut_tables  # the cut tokens: weight 0 (masked) against a raw ratio outside [0.8, 1.25]
    assert len(table) == cut and (table["is_weight"] == 0).all()
    assert ((table["raw_ratio"] < 0.8) | (table["raw_ratio"] > 1.25)).all()
    assert any("as the trainer recorded them" in c.value for c in at.caption)
    assert_no_raw_markup(at)
