"""The Mismatch page (sampler vs trainer): the views it shows on a hand-made step whose values are
worked out here, and the page through AppTest on real vLLM-sampled runs (the committed healthy
sample and the two broken runs of tests/data/vllm_bugs/, made by ``make sample-trace-vllm``)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from tracer import Trace, TraceWriter
from tracer.views.mismatch import correction_settings, mismatch_steps, mismatch_tokens

from tests.fixtures.toy_traces import REPO, SAMPLES, TOKENS_PAGE, ToyTokenizer, assert_no_raw_markup, frame_with, start


BUGS = REPO / "tests" / "data" / "vllm_bugs"
HEALTHY = SAMPLES / "grpo-vllm-tiny"


def write_step(root: Path, is_mode: str, weights_name: str, weights: torch.Tensor) -> Trace:
    """B = 2, T = 3; row 1's last token masked. old - sampler = [[0.1, -0.2, 0.3], [1.5, 0.0, <masked>]]."""
    old = torch.log(torch.tensor([[0.5, 0.4, 0.2], [0.6, 0.3, 0.9]]))
    sampler = old - torch.tensor([[0.1, -0.2, 0.3], [1.5, 0.0, 9.0]])
    tensors = {"completion_ids": torch.tensor([[2, 3, 1], [4, 5, 0]]),
               "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool),
               "old_logprobs": old, "policy_logprobs": old.clone(), "sampler_logprobs": sampler,
               "entropy": torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]), weights_name: weights}
    hyper = {"is_mode": is_mode, "is_clip_max": 3.0, "sampler_engine": "vllm", "temperature": 0.7}
    with TraceWriter(root, "grpo", tokenizer=ToyTokenizer(), hyperparameters=hyper) as writer:
        writer.record(0, tensors)
    return Trace(root)


def test_tokens_table_holds_both_conventions_and_the_cut(tmp_path):
    # token_truncate, cap 3: exp(1.5) = 4.48 was truncated to 3.0; the others are exp(delta)
    delta = torch.tensor([[0.1, -0.2, 0.3], [1.5, 0.0, 0.0]])
    weights = torch.exp(delta).clamp(max=3.0)
    trace = write_step(tmp_path / "t", "token_truncate", "is_weights", weights)
    frame = mismatch_tokens(trace, trace.steps()[0])
    assert frame[["sequence", "token"]].values.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1]]  # masked left out
    assert frame["log_diff"].tolist() == pytest.approx([0.1, -0.2, 0.3, 1.5, 0.0], abs=1e-6)
    p_old = [0.5, 0.4, 0.2, 0.6, 0.3]
    p_sampler = [p / math.exp(d) for p, d in zip(p_old, [0.1, -0.2, 0.3, 1.5, 0.0])]
    assert frame["prob_diff"].tolist() == pytest.approx([abs(a - b) for a, b in zip(p_old, p_sampler)], abs=1e-6)
    assert frame["cut"].tolist() == [False, False, False, True, False]
    assert frame["entropy"].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert frame.attrs["trainer_field"] == "old_logprobs"
    (row,) = mismatch_steps(trace, trace.steps()).to_dict("records")
    assert row["tokens"] == 5 and row["cut"] == 1 and row["cut_unit"] == "tokens"
    assert row["mean_abs"] == pytest.approx(2.1 / 5, abs=1e-6) and row["max_abs"] == pytest.approx(1.5, abs=1e-6)
    assert correction_settings(trace.metadata(trace.steps()[0]))["is_mode"] == "token_truncate"


def test_sequence_mask_cuts_whole_sequences(tmp_path):
    # sequence_mask, cap 3: row 0 sums to 0.2 (kept, exp 1.22), row 1 to 1.5 (exp 4.48 > 3: masked to 0)
    weights = torch.tensor([math.exp(0.2), 0.0])
    trace = write_step(tmp_path / "s", "sequence_mask", "sequence_is_weights", weights)
    frame = mismatch_tokens(trace, trace.steps()[0])
    assert frame["cut"].tolist() == [False, False, False, True, True]
    assert frame["is_weight"].tolist() == pytest.approx([math.exp(0.2)] * 3 + [0.0, 0.0])
    (row,) = mismatch_steps(trace, trace.steps()).to_dict("records")
    assert row["cut"] == 1 and row["cut_unit"] == "sequences"


def test_no_sampler_logprobs_gives_an_empty_table(tmp_path):
    with TraceWriter(tmp_path / "n", "grpo", tokenizer=ToyTokenizer()) as writer:
        writer.record(0, {"completion_ids": torch.tensor([[2, 1]]), "completion_mask": torch.ones(1, 2, dtype=torch.bool),
                          "policy_logprobs": torch.tensor([[-0.1, -0.2]])})
    trace = Trace(tmp_path / "n")
    assert mismatch_tokens(trace, trace.steps()[0]).empty and mismatch_steps(trace, trace.steps()).empty


# -- the page on real vLLM runs ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_root(tmp_path_factory) -> Path:
    if not (HEALTHY.is_dir() and BUGS.is_dir()):
        pytest.fail("sample_traces/grpo-vllm-tiny and tests/data/vllm_bugs/ are committed: make sample-trace-vllm")
    root = tmp_path_factory.mktemp("vllm-runs")
    shutil.copytree(HEALTHY, root / "healthy", ignore=shutil.ignore_patterns("model"))
    for bug in ("raw-logprobs", "top-p"):
        shutil.copytree(BUGS / bug, root / bug)
    return root


def open_mismatch(monkeypatch, root: Path, run: str):
    at = start(monkeypatch, root, query={"run": run})
    at.switch_page("app_pages/mismatch.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Sampler vs trainer"
    return at


@pytest.mark.parametrize("run, severity, cause", [
    ("healthy", "success", "noise-level differences"),
    ("raw-logprobs", "error", "temperature applied on one side only"),
    ("top-p", "error", "renormalised over a truncated distribution"),
])
def test_page_shows_the_verdict_and_the_cause(monkeypatch, vllm_root, run, severity, cause):
    at = open_mismatch(monkeypatch, vllm_root, run)
    banners = [e.value for e in getattr(at, severity)]
    assert any(b.startswith("sampler.mismatch") for b in banners), banners
    assert any(cause in t.value for t in at.text) or any(cause in b for b in banners)
    assert any("sampler_engine = vllm" in t.value for t in at.text)
    worst = frame_with(at, {"sequence", "token", "token_text", "log_diff"})
    diffs = worst.value["log_diff"].abs().tolist()
    assert diffs == sorted(diffs, reverse=True) and len(diffs) > 0
    assert_no_raw_markup(at)


def test_worst_token_opens_on_the_tokens_page(monkeypatch, vllm_root):
    at = open_mismatch(monkeypatch, vllm_root, "top-p")
    worst = frame_with(at, {"sequence", "token", "token_text", "log_diff"})
    first = worst.value.iloc[0]
    at.session_state[worst.key] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Tokens"
    assert at.selectbox(key="sequence").value == int(first["sequence"])
    assert f"finding: sampler.mismatch at token {int(first['token'])}" in [c.value for c in at.caption]


def test_a_run_without_sampler_logprobs_has_no_mismatch_page_and_the_sidebar_says_why(monkeypatch, tmp_path):
    # the bundled GRPO demo trace (hand-written loop, no inference engine) next to a vLLM-sampled run
    shutil.copytree(SAMPLES / "grpo-tiny", tmp_path / "plain", ignore=shutil.ignore_patterns("model"))
    shutil.copytree(HEALTHY, tmp_path / "vllm", ignore=shutil.ignore_patterns("model"))
    assert all("sampler_logprobs" not in Trace(tmp_path / "plain").fields(k) for k in Trace(tmp_path / "plain").steps())
    at = start(monkeypatch, tmp_path, query={"run": "plain"}, page=TOKENS_PAGE)
    assert not at.exception, [e.value for e in at.exception]
    note = " ".join(t.value for t in at.sidebar.text)
    assert "Hidden for this run: Mismatch (no sampler_logprobs in the first or the selected step file)." in note
    with pytest.raises(ValueError, match="Could not find a navigation page"):  # not in the navigation
        at.switch_page("app_pages/mismatch.py")
    at = open_mismatch(monkeypatch, tmp_path, "vllm")  # a run that records them keeps the page
    assert "Mismatch" not in " ".join(t.value for t in at.sidebar.text)


def test_a_step_file_without_sampler_logprobs_in_a_run_with_them_says_so(monkeypatch, tmp_path):
    step = {"completion_ids": torch.tensor([[2, 1]]), "completion_mask": torch.ones(1, 2, dtype=torch.bool),
            "old_logprobs": torch.tensor([[-0.1, -0.2]]), "policy_logprobs": torch.tensor([[-0.1, -0.2]])}
    with TraceWriter(tmp_path / "runs" / "mixed", "grpo", tokenizer=ToyTokenizer()) as writer:
        writer.record(0, {**step, "sampler_logprobs": torch.tensor([[-0.15, -0.2]])})  # step 0 sampled by an engine
        writer.record(1, step)  # step 1 not
    at = start(monkeypatch, tmp_path / "runs", query={"run": "mixed", "step": "1"})
    at.switch_page("app_pages/mismatch.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("This step file has no sampler_logprobs" in i.value for i in at.info)
