"""Several ranks and the live view in the web UI: a trace whose
ranks 0 and 1 wrote their own step files (two TraceWriters on one directory, as under
torch.distributed), and a trace still being written while the app is open."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import tracer.record.writer as writer_module

from app.components.sidebar import live_signature
from tracer.format.names import step_file_name
from tracer.record.writer import TraceWriter

from tests.fixtures.toy_traces import (
    HYPERPARAMETERS, TOKENS_PAGE, ToyTokenizer, frame_with, healthy_step_tensors, largest_frame_with, start)


RANKS, STEPS = (0, 1), 2
BUG_RANK, BUG_STEP, BUG_SEQUENCE, BUG_TOKEN = 1, 1, 0, 3


def rank_tensors(rank: int, step: int):
    """Each rank holds its own rows: rank 1's rewards are 10 higher. Rank 1, step 1 keeps the token
    after the EOS of sequence 0 (a bug only that rank has)."""
    tensors = healthy_step_tensors(step, 0)
    tensors["rewards"] = tensors["rewards"] + 10 * rank
    if (rank, step) == (BUG_RANK, BUG_STEP):
        tensors["completion_mask"][BUG_SEQUENCE, BUG_TOKEN] = True
    return tensors


@pytest.fixture(scope="module")
def ranked_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ranks")
    run = root / "ddp"
    for rank in RANKS:  # each rank writes its own files into the same directory; rank 0 the manifest
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(writer_module, "distributed_rank", lambda rank=rank: (rank, len(RANKS)))
            with TraceWriter(run, "grpo", tokenizer=ToyTokenizer(), hyperparameters=HYPERPARAMETERS,
                             async_write=False) as writer:
                for step in range(STEPS):
                    writer.record(step, rank_tensors(rank, step))
    assert {p.name for p in (run / "steps").iterdir()} == {
        step_file_name(s, 0, 0, r) for s in range(STEPS) for r in RANKS}
    return root


# -- ranks ------------------------------------------------------------------------------------------


def test_rank_filter_in_the_sidebar(monkeypatch, ranked_root):
    at = start(monkeypatch, ranked_root, page=TOKENS_PAGE)
    assert not at.exception
    rank = at.selectbox(key="rank")
    assert rank.options == ["all ranks", "rank 0", "rank 1"] and rank.value is None
    assert len(at.selectbox(key="step_file").options) == STEPS * len(RANKS)
    rank.select(1).run()
    assert not at.exception
    options = at.selectbox(key="step_file").options
    assert options == [f"step {s} · inner 0 · mb 0 · rank 1" for s in range(STEPS)]
    table = largest_frame_with(at, {"token_text", "mask_reason"}).value
    assert table["mask_reason"].tolist()[:6] == ["kept"] * 3 + ["after_eos"] * 3  # rank 1, step 0, seq 0


def line_names(at) -> set[str]:
    return {trace["name"] for trace in json.loads(at.get("plotly_chart")[0].proto.spec)["data"]}


def test_steps_page_has_a_line_per_rank_and_a_rank_column(monkeypatch, ranked_root):
    at = start(monkeypatch, ranked_root)
    at.switch_page("app_pages/steps.py").run()
    assert not at.exception
    assert line_names(at) == {"inner step 0 · rank 0", "inner step 0 · rank 1"}
    summary = frame_with(at, {"step", "rank", "mean_reward"}).value
    assert sorted(summary["rank"]) == [0, 0, 1, 1]
    # rank 1's rewards are 10 higher than rank 0's at every step (reader's mean over the step's rows)
    by_rank = summary.pivot(index="step", columns="rank", values="mean_reward")
    assert (by_rank[1] - by_rank[0]).round(6).tolist() == [10.0] * STEPS

    at.selectbox(key="rank").select(0).run()
    summary = frame_with(at, {"step", "rank", "mean_reward"}).value
    assert set(summary["rank"]) == {0}
    assert line_names(at) == {"inner step 0"}


def test_health_findings_carry_the_rank_and_jump_to_it(monkeypatch, ranked_root):
    at = start(monkeypatch, ranked_root)
    at.switch_page("app_pages/health.py").run()
    findings = frame_with(at, {"check", "rank", "sequence", "token"})
    bug = findings.value[findings.value["check"] == "masks.after_eos"]
    assert bug[["rank", "step", "sequence", "token"]].values.tolist() == [[BUG_RANK, BUG_STEP, BUG_SEQUENCE, BUG_TOKEN]]
    at.session_state[findings.key] = {"selection": {"rows": [int(bug.index[0])], "columns": [], "cells": []}}
    at.run()
    assert at.title[0].value == "Tokens"
    assert at.selectbox(key="step_file").value == f"step {BUG_STEP} · inner 0 · mb 0 · rank {BUG_RANK}"

    at.switch_page("app_pages/health.py")
    at.selectbox(key="rank").select(0).run()  # rank 0 has no such finding
    shown = frame_with(at, {"check", "rank"}).value
    assert "masks.after_eos" not in set(shown["check"]) and set(shown["rank"].dropna()) <= {0}


# -- live view --------------------------------------------------------------------------------------


def status_line(at) -> str:
    return next(t.value for t in at.text if "step files" in t.value and "·" in t.value)


def test_new_steps_and_status_appear_without_reload(monkeypatch, tmp_path):
    run = tmp_path / "live"
    writer = TraceWriter(run, "grpo", tokenizer=ToyTokenizer(), hyperparameters=HYPERPARAMETERS, async_write=False)
    first = writer.record(0, healthy_step_tensors(0, 0))
    at = start(monkeypatch, run, page=TOKENS_PAGE)
    assert not at.exception
    assert "running" in status_line(at) and "1 step files" in status_line(at)
    assert any("still writing" in c.value for c in at.caption)
    signature = live_signature(str(run))

    writer.record(1, healthy_step_tensors(1, 0))
    # a half-written file of the next step, as the writer leaves it before the rename: never listed
    shutil.copy(first, first.parent / (step_file_name(2) + ".partial"))
    assert live_signature(str(run)) != signature  # what auto-refresh polls
    at.run()  # a rerun (auto-refresh or any interaction), no Reload
    assert not at.exception
    assert at.selectbox(key="step_file").options == [f"step {s} · inner 0 · mb 0 · rank 0" for s in (0, 1)]

    writer.close()
    at.run()
    assert "finished" in status_line(at) and "2 step files" in status_line(at)
    assert not any("still writing" in c.value for c in at.caption)


def test_auto_refresh_toggle_watches_the_run(monkeypatch, tmp_path):
    run = tmp_path / "live"
    with TraceWriter(run, "grpo", hyperparameters=HYPERPARAMETERS, async_write=False) as writer:
        writer.record(0, healthy_step_tensors(0, 0))
    at = start(monkeypatch, run, page=TOKENS_PAGE)
    assert not any("auto-refresh on" in c.value for c in at.caption)
    at.toggle(key="auto_refresh").set_value(True).run()
    assert not at.exception
    assert any("auto-refresh on" in c.value for c in at.caption)
    assert at.button[0].label == "Reload"  # the manual way stays
