"""Faults while writing: the disk fills part way through a run (tests/scripts/fault_loop.py, in its
own process: ``RLIMIT_FSIZE`` makes writes fail with EFBIG). Training goes on, the drops are
counted in the manifest and shown by ``info``, the files written before are intact and no
half-written file is left; in strict mode the first failure raises TraceError with its cause.
(A steps directory replaced by a file mid-run: tests/record/test_writer_reader.py.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracer import Trace
from tracer.cli import main
from tracer.read.trace_info import trace_info

from tests.fixtures.paths import SCRIPTS

_spec = importlib.util.spec_from_file_location("fault_loop", SCRIPTS / "fault_loop.py")
fault_loop = importlib.util.module_from_spec(_spec)
sys.path.insert(0, str(SCRIPTS))
_spec.loader.exec_module(fault_loop)
sys.path.remove(str(SCRIPTS))

FULL_AT, STEPS = fault_loop.FULL_AT, fault_loop.STEPS
DROPPED = STEPS - FULL_AT
EFBIG_TEXT = "OSError: [Errno 27] File too large"  # a small step file is written by tracer.format.files.write_new


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults")
    proc = subprocess.run([sys.executable, str(SCRIPTS / "fault_loop.py"), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout)


def assert_intact(root: Path, steps: range) -> None:
    """The step files of ``steps`` hold the values derived from their step number; nothing else
    is in the steps directory (no .partial, no safetensors temporary file)."""
    trace = Trace(root)
    assert [k.step for k in trace.steps()] == list(steps)
    assert sorted(p.name for p in (root / "steps").iterdir()) == [k.path.name for k in trace.steps()]
    for key in trace.steps():
        got = trace.load_step(key)
        for name, want in fault_loop.step_tensors(key.step).items():
            assert torch.equal(got[name], want.to(got[name].dtype)), (key.step, name)


@pytest.mark.parametrize("scenario", ["non_strict", "non_strict_sync"])
def test_disk_full_drops_steps_counts_them_and_training_goes_on(runs, scenario):
    out, report = runs
    seen = report[scenario]
    assert seen["ran"] == STEPS  # every step of the loop ran
    assert len(seen["warnings"]) == DROPPED
    assert f"dropped a step ({DROPPED} so far): step_{STEPS - 1:08d}" in seen["warnings"][-1]
    assert_intact(out / scenario, range(FULL_AT))
    manifest = json.loads((out / scenario / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["dropped_steps"] == DROPPED
    assert manifest["steps_written"] == FULL_AT
    assert all(EFBIG_TEXT in reason for reason in manifest["drop_reasons"])
    info = trace_info(out / scenario)
    assert info["dropped_steps"] == DROPPED and len(info["drop_reasons"]) == DROPPED


def test_info_shows_the_drops_and_why(runs, capsys):
    out, _ = runs
    assert main(["info", str(out / "non_strict")]) == 0
    text = capsys.readouterr().out
    assert f"dropped: {DROPPED}" in text
    assert f"drop reasons (of all {DROPPED}): {EFBIG_TEXT} x{DROPPED}" in text  # one kind, each drop counted
    assert f"first: step_{FULL_AT:08d}.inner_0.mb_0.rank_0.safetensors: {EFBIG_TEXT}" in text
    assert f"last kept: step_{STEPS - 1:08d}.inner_0.mb_0.rank_0.safetensors: {EFBIG_TEXT}" in text


def test_when_nothing_fits_the_old_manifest_is_kept_intact(runs):
    """Not even the manifest (nor its reserved counts, tracer/format/counts.py) can be rewritten: the
    drops reach the trainer as warnings, the manifest on disk is the last complete one (status
    running, so info says unfinished and that later drops are unknown)."""
    out, report = runs
    assert report["nothing_fits"]["ran"] == STEPS and len(report["nothing_fits"]["warnings"]) == DROPPED
    assert_intact(out / "nothing_fits", range(FULL_AT))
    info = trace_info(out / "nothing_fits")
    assert info["status_text"].startswith("unfinished") and info["unreadable"] == {}
    # findings.rank_0.jsonl: the live guard's (on by default), whose checker writes apart from the writer
    assert sorted(p.name for p in (out / "nothing_fits").iterdir()) == ["findings.rank_0.jsonl", "manifest.counts",
                                                                         "manifest.json", "rollouts.rank_0.jsonl",
                                                                         "steps", "summary_index.rank_0.jsonl"]
    # RLIMIT_FSIZE 0 refuses even the in-place write of the counts reserved at the start: info says
    # the count stops at the manifest's last update, never that nothing was dropped
    assert info["drops_note"].startswith("counted until the manifest's last update: the writer did not close")
    # the summary index holds the lines flushed before the disk filled up; the rest failed quietly
    assert Trace(out / "nothing_fits").step_summary().attrs["from_index"] == FULL_AT


@pytest.mark.parametrize("scenario", ["strict_sync", "strict_async"])
def test_strict_mode_raises_the_first_failure_with_its_cause(runs, scenario):
    out, report = runs
    seen = report[scenario]
    if scenario == "strict_sync":  # record(FULL_AT) itself raises
        assert seen["ran"] == FULL_AT
    else:  # the write fails on the writer thread; the next record (or the final flush) raises
        assert FULL_AT + 1 <= seen["ran"] <= STEPS
    assert seen["error"].startswith(f"tracer: writing {out / scenario} failed: step_{FULL_AT:08d}.inner_0")
    assert seen["cause"] == "OSError" and seen["cause_text"] == "[Errno 27] File too large"
    trace = Trace(out / scenario)
    assert FULL_AT not in [k.step for k in trace.steps()]
    assert trace.scan() == {}


def test_step_files_are_readable_by_others_like_the_manifest(runs):
    """safetensors' save_file makes 0600 files; the writer gives step files the mode open() gives
    the manifest (0666 less the umask), so a shared trace can be read by its audience."""
    out, _ = runs
    manifest_mode = stat.S_IMODE(os.stat(out / "non_strict" / "manifest.json").st_mode)
    for path in (out / "non_strict" / "steps").iterdir():
        assert stat.S_IMODE(os.stat(path).st_mode) == manifest_mode
