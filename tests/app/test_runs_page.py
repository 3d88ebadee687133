"""The Runs page (the app's root URL): one row per run under the root, whose numbers are worked out
here from the step files themselves and whose check status is what ``tracer check --json`` says of
the same run; choosing a run (a row, or a URL naming ``run=`` without ``step=``) opens it at its
most informative step: the first step file with an error, else the last step. Runs are toy GRPO
traces (one with a deliberate bug at a known step) and copies of the bundled sample runs."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from app.components import runs, trace_cache
from tracer import TraceWriter

from tests.fixtures.toy_traces import (
    BOLD, HYPERPARAMETERS, REPO, SAMPLES, TOKENS_PAGE, ToyTokenizer, assert_no_raw_markup, frame_with,
    healthy_step_tensors, start, write_trace)

BUG_STEP, BUG_SEQUENCE, BUG_TOKEN = 1, 0, 3
SAMPLE_RUNS = ("dpo-tiny", "grpo-tiny", "ppo-tiny")  # DPO pairs; GRPO inner steps; PPO micro-batches
_NAME = re.compile(r"step_(\d+)\.inner_(\d+)\.mb_(\d+)\.rank_(\d+)\.safetensors")


def keep_bold_after_eos(step: int, inner_step: int, tensors) -> None:
    """Step 1, inner 0, row 0 is ``4 <script> <eos> | pad pad pad``: put ``<b>`` (id 8) right after the
    EOS and keep it in the mask, a token after EOS that enters the loss (``masks.after_eos``, an error)."""
    if (step, inner_step) == (BUG_STEP, 0):
        tensors["completion_ids"][BUG_SEQUENCE, BUG_TOKEN] = 8
        tensors["completion_mask"][BUG_SEQUENCE, BUG_TOKEN] = True


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    write_trace(root / "buggy", tokenizer=ToyTokenizer(), edit=keep_bold_after_eos)  # steps 0-2
    write_trace(root / "healthy", tokenizer=ToyTokenizer(), steps=4)  # steps 0-3
    for name in SAMPLE_RUNS:
        if (SAMPLES / name).is_dir():
            shutil.copytree(SAMPLES / name, root / name)
    return root


@pytest.fixture(autouse=True)
def fresh_caches():
    trace_cache.clear_caches()
    runs.run_status.clear()


def expected_row(path: Path) -> dict:
    """Steps, step files, rows and last mean reward of a run, from its step files: file names give
    the coordinates; the last step's files at its first inner step give the rows (first dim of
    completion_ids, DPO: chosen_ids) and the rewards, whose plain mean is the last mean reward."""
    coordinates = {f: tuple(int(n) for n in _NAME.fullmatch(f.name).groups())
                   for f in (path / "steps").glob("*.safetensors")}
    last = max(c[0] for c in coordinates.values())
    first_inner = min(c[1] for c in coordinates.values() if c[0] == last)
    tensors = [load_file(str(f)) for f, c in coordinates.items() if c[:2] == (last, first_inner)]
    rows = sum(t["completion_ids" if "completion_ids" in t else "chosen_ids"].shape[0] for t in tensors)
    rewards = [t["rewards"] for t in tensors if "rewards" in t]
    reward = torch.cat(rewards).double().mean().item() if rewards else math.nan
    return {"steps": len({c[0] for c in coordinates.values()}), "step files": len(coordinates), "rows": rows,
            "last mean reward": reward}


def cli_check(path: Path) -> str:
    """What ``tracer check --json`` finds in the run, as the page words it: ``pass`` or the counts."""
    done = subprocess.run([sys.executable, "-m", "tracer", "check", str(path), "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)  # exit 1: errors found
    findings = json.loads(done.stdout)
    counts = [(sum(f["severity"] == s for f in findings), s) for s in ("error", "warning")]
    return ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for n, s in counts if n) or "pass"


def runs_table(at):
    return frame_with(at, {"run", "check", "last mean reward"})


def test_every_run_is_listed_with_the_numbers_of_its_step_files_and_tracer_checks_verdict(monkeypatch, root):
    at = start(monkeypatch, root)
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Runs"
    table = runs_table(at).value.set_index("run")
    names = sorted(p.name for p in root.iterdir())
    assert sorted(table.index) == names
    for name in names:
        row, expected = table.loc[name], expected_row(root / name)
        for column in ("steps", "step files", "rows"):
            assert row[column] == expected[column], (name, column)
        if math.isnan(expected["last mean reward"]):
            assert math.isnan(row["last mean reward"]), name
        else:
            assert row["last mean reward"] == pytest.approx(expected["last mean reward"], rel=1e-5), name
        assert row["check"] == cli_check(root / name), name
        assert row["open"] == (f"dpo?run={name}" if name == "dpo-tiny" else f"tokens?run={name}")
    assert table.loc["buggy", "check"].startswith("1 error")  # the one token kept after EOS
    assert table.loc["buggy", "algorithm"] == "grpo" and table.loc["healthy", "check"] == "pass"
    assert table.loc["healthy", "status"] == "finished"


def _choose(at, run: str):
    table = runs_table(at)
    at.session_state[table.key] = {"selection": {"rows": [table.value["run"].tolist().index(run)], "columns": [],
                                                 "cells": []}}
    return at.run()


def test_a_chosen_run_opens_at_its_first_error_else_its_last_step(monkeypatch, root):
    at = _choose(start(monkeypatch, root), "buggy")
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Tokens"
    assert at.selectbox(key="run").value == root / "buggy"
    assert at.selectbox(key="step_file").value == f"step {BUG_STEP} · inner 0 · mb 0 · rank 0"
    assert at.selectbox(key="sequence").value == BUG_SEQUENCE  # the row the error names
    assert (at.query_params["run"], at.query_params["step"], at.query_params["seq"]) == ("buggy", "1", "0")

    at.switch_page("app_pages/runs.py").run()
    at = _choose(at, "healthy")  # no error: steps 0-3 with inner steps 0 and 1, the last is step 3 · inner 1
    assert at.title[0].value == "Tokens"
    assert at.selectbox(key="step_file").value == "step 3 · inner 1 · mb 0 · rank 0"


@pytest.mark.skipif(not (SAMPLES / "dpo-tiny").is_dir(), reason="sample_traces/ is not in this checkout")
def test_a_dpo_run_opens_on_its_pairs_page(monkeypatch, root):
    at = _choose(start(monkeypatch, root), "dpo-tiny")
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value.startswith("DPO")
    assert at.selectbox(key="step_file").value == "step 2 · inner 0 · mb 0 · rank 0"  # the last step


def test_a_url_naming_only_the_run_opens_its_most_informative_step(monkeypatch, root):
    at = start(monkeypatch, root, {"run": "buggy"}, page=TOKENS_PAGE)
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="step_file").value == f"step {BUG_STEP} · inner 0 · mb 0 · rank 0"
    assert at.selectbox(key="sequence").value == BUG_SEQUENCE
    # a URL naming the step is obeyed as it is
    at = start(monkeypatch, root, {"run": "buggy", "step": "0", "inner": "1"}, page=TOKENS_PAGE)
    assert at.selectbox(key="step_file").value == "step 0 · inner 1 · mb 0 · rank 0"


def charged_bytes(run: Path) -> int:
    """The bytes a run is charged against the automatic check's budget, from its files on disk:
    each step file's size plus the fixed per-file charge."""
    files = list((run / "steps").glob("*.safetensors"))
    return sum(p.stat().st_size for p in files) + len(files) * runs.FILE_OVERHEAD_BYTES


def test_a_run_beyond_the_bound_is_checked_when_asked(monkeypatch, root):
    # buggy: 6 step files; healthy: 8 of the same shapes, so it weighs more: the budget takes buggy only
    assert charged_bytes(root / "buggy") < charged_bytes(root / "healthy")
    monkeypatch.setattr(runs, "MAX_CHECKED_BYTES", charged_bytes(root / "buggy"))
    at = start(monkeypatch, root)
    table = runs_table(at).value.set_index("run")
    assert table.loc["healthy", "check"] == runs.NOT_CHECKED and table.loc["buggy", "check"].startswith("1 error")
    assert [b.label for b in at.button if b.label.startswith("Check ")] == [
        f"Check {name}" for name in table.index if table.loc[name, "check"] == runs.NOT_CHECKED]
    # not checked: the run opens at its last step
    opened = start(monkeypatch, root, {"run": "healthy"}, page=TOKENS_PAGE)
    assert opened.selectbox(key="step_file").value == "step 3 · inner 1 · mb 0 · rank 0"
    at.button(key="check_healthy").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert runs_table(at).value.set_index("run").loc["healthy", "check"] == "pass"


def test_the_automatic_check_is_a_budget_on_the_step_files_bytes(monkeypatch, root):
    # a run of few but big step files (64 x 128 tokens weigh ~400 kB each, ~0.1 s of checks each)
    # waits as long as hundreds of tiny ones: the bound counts bytes, not files
    paths = sorted((root / "healthy" / "steps").glob("*.safetensors"))
    cost = runs.check_cost(str(root / "healthy"))
    assert (cost.files, cost.bytes) == (8, sum(p.stat().st_size for p in paths))
    assert cost.charged == cost.bytes + 8 * runs.FILE_OVERHEAD_BYTES
    monkeypatch.setattr(runs, "MAX_CHECKED_BYTES", cost.charged)
    assert runs.check_cost(str(root / "healthy")).automatic
    monkeypatch.setattr(runs, "MAX_CHECKED_BYTES", cost.charged - 1)
    assert not runs.check_cost(str(root / "healthy")).automatic
    table = runs_table(start(monkeypatch, root)).value.set_index("run")
    assert table.loc["healthy", "check"] == runs.NOT_CHECKED
    assert table.loc["buggy", "check"].startswith("1 error")  # 6 files: under the budget
    # the real budget keeps the automatic check near 5 s on the files measured in the module's notes:
    # 290 step files of 14 kB and 35 of 410 kB fit (~5 s, ~4 s), 37 of 410 kB do not
    monkeypatch.undo()
    assert runs.CheckCost(290, 290 * 14_000).automatic and runs.CheckCost(35, 35 * 410_000).automatic
    assert not runs.CheckCost(37, 37 * 410_000).automatic


def test_check_results_are_cached_per_run_and_listing(monkeypatch, tmp_path):
    calls = []
    real = trace_cache.run_checks
    monkeypatch.setattr(trace_cache, "run_checks", lambda trace, **kw: calls.append(trace.path.name) or real(trace, **kw))
    write_trace(tmp_path / "one", steps=1)
    writer = TraceWriter(tmp_path / "two", "grpo", hyperparameters=HYPERPARAMETERS, async_write=False)
    try:
        writer.record(0, healthy_step_tensors(0, 0))
        at = start(monkeypatch, tmp_path)
        assert sorted(calls) == ["one", "two"]
        at.run()
        at.run()
        assert len(calls) == 2  # reruns read the cache
        writer.record(1, healthy_step_tensors(1, 0))  # a new step file: the listing of "two" changed
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        assert calls[2:] == ["two"]  # only that run is checked again
        assert runs_table(at).value.set_index("run").loc["two", "steps"] == 2
        at.button[0].click().run()  # Reload (the sidebar's first button) forgets every cache
        assert sorted(calls[3:]) == ["one", "two"]
    finally:
        writer.close()


def test_run_names_are_shown_literally(monkeypatch, tmp_path):
    write_trace(tmp_path / BOLD, tokenizer=ToyTokenizer(), steps=1)
    at = start(monkeypatch, tmp_path)
    assert not at.exception
    assert runs_table(at).value["run"].tolist() == [BOLD]
    assert_no_raw_markup(at)


def test_a_run_that_cannot_be_opened_is_named_and_the_others_listed(monkeypatch, tmp_path):
    """``a_bad`` (listed first, so the sidebar's run) has a manifest that links out of its directory:
    it cannot be opened, yet ``/`` lists every run, saying why for that one, and opens the others."""
    root = tmp_path / "root"
    write_trace(root / "b_good", tokenizer=ToyTokenizer(), steps=1)
    write_trace(root / "a_bad", tokenizer=ToyTokenizer(), steps=1)
    outside = tmp_path / "elsewhere.json"
    (root / "a_bad" / "manifest.json").rename(outside)
    (root / "a_bad" / "manifest.json").symlink_to(outside)
    at = start(monkeypatch, root)
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Runs"
    table = runs_table(at).value.set_index("run")
    assert table.loc["a_bad", "check"].startswith("cannot open: ") and "outside the trace directory" in table.loc[
        "a_bad", "check"]
    assert table.loc["b_good", "check"] == "pass"
    at = _choose(start(monkeypatch, root), "b_good")  # the other run opens from the table
    assert at.title[0].value == "Tokens" and at.selectbox(key="run").value == root / "b_good"
