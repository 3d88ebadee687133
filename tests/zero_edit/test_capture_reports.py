"""Zero-edit tracing on two ranks (torchrun's RANK / WORLD_SIZE, one trace): every rank's capture
report is kept and ``tracer info`` shows each, not only rank 0's (the manifest is rank 0's)."""

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import tracer
from tracer import Trace, TraceError
from tracer.cli import main as cli_main
from tracer.read.trace_info import trace_info
from tracer.demo.tiny_model import build_tiny_model
from tracer.format.names import capture_report_name

from tests.fixtures.loops import tiny_loop
from tests.fixtures.paths import REPO, SCRIPTS


@pytest.fixture(scope="module")
def two_rank_trace(tmp_path_factory):
    """``tracer run`` of the unmodified MiniMind-style GRPO script as rank 0 and rank 1 of a world
    of 2, into one trace: rank 0 runs 2 steps, rank 1 one step with a map entry that cannot be used
    (a bool mask offered as entropy), so the two reports differ."""
    root = tmp_path_factory.mktemp("ranks")
    model_dir = build_tiny_model(root / "model", seed=0)
    bad_map = root / "map.toml"
    bad_map.write_text('[fields]\nentropy = ["completion_mask"]\n')
    out = root / "trace"
    with pytest.MonkeyPatch.context() as env:
        for rank, steps, extra in ((0, 2, []), (1, 1, ["--map", str(bad_map)])):
            env.setenv("RANK", str(rank))
            env.setenv("LOCAL_RANK", str(rank))
            env.setenv("WORLD_SIZE", "2")
            code = cli_main(["run", "--algo", "grpo", "--out", str(out), *extra, "--meta",
                             "loss_reduction=sequence_mean", "--", str(SCRIPTS / "minimind_grpo.py"),
                             "--model_dir", str(model_dir), "--steps", str(steps)])
            assert code == 0
    return out


def test_under_torchrun_both_ranks_leave_their_report(two_rank_trace, tmp_path):
    """The real launcher: two processes at once, RANK 0 and 1, one trace (1 step x 2 iterations each)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "trace"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), "-m", "tracer", "run", "--algo", "grpo", "--out", str(out), "--",
         str(SCRIPTS / "minimind_grpo.py"), "--model_dir", str(two_rank_trace.parent / "model"), "--steps", "1"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = trace_info(out)["capture_reports"]
    assert {rank: r["steps_recorded"] for rank, r in reports.items()} == {"0": 2, "1": 2}
    text = info_text(out)
    assert "capture, rank 0: 2 step file(s)" in text and "capture, rank 1: 2 step file(s)" in text


def info_text(path) -> str:
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli_main(["info", str(path)]) == 0
    return printed.getvalue()


def test_info_shows_the_capture_report_of_every_rank(two_rank_trace):
    # the script makes num_iterations = 2 backward passes per step, each one step file:
    # rank 0: 2 steps x 2 = 4, rank 1: 1 step x 2 = 2
    info = trace_info(two_rank_trace)
    assert info["ranks"] == [0, 1]
    reports = info["capture_reports"]
    assert sorted(reports) == ["0", "1"]
    assert (reports["0"]["steps_recorded"], reports["0"]["backward_calls"]) == (4, 4)
    assert (reports["1"]["steps_recorded"], reports["1"]["backward_calls"]) == (2, 2)
    assert reports["0"]["map_entries_unused"] == []
    assert [e.split(":")[0] for e in reports["1"]["map_entries_unused"]] == ["entropy <- `completion_mask`"]
    # the manifest's capture_report is still rank 0's, as readers before per-rank reports expect
    assert info["capture_report"] == reports["0"]
    text = info_text(two_rank_trace)
    assert "capture, rank 0: 4 step file(s) from 4 backward call(s), 0 without policy logprobs, 0 failed" in text
    assert "capture, rank 1: 2 step file(s) from 2 backward call(s), 0 without policy logprobs, 0 failed" in text
    rank_1 = text[text.index("capture, rank 1"):]
    assert "not recorded: entropy <- `completion_mask`" in rank_1
    assert "not recorded" not in text[text.index("capture, rank 0"):text.index("capture, rank 1")]


def test_each_rank_keeps_its_report_in_its_own_file(two_rank_trace):
    for rank, recorded in ((0, 4), (1, 2)):
        report = json.loads((two_rank_trace / capture_report_name(rank)).read_text())
        assert report["steps_recorded"] == recorded
    manifest = json.loads((two_rank_trace / "manifest.json").read_text())
    assert manifest["capture_report"]["steps_recorded"] == 4  # rank 0 writes the manifest


def test_a_trace_from_before_per_rank_reports_and_an_unreadable_report(two_rank_trace, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(two_rank_trace, old)
    for rank in (0, 1):
        (old / capture_report_name(rank)).unlink()
    # only the manifest's report (rank 0's): shown, and rank 1 is named as having none
    assert trace_info(old)["capture_reports"] == {"0": trace_info(two_rank_trace)["capture_reports"]["0"]}
    text = info_text(old)
    assert "capture, rank 0: 4 step file(s) from 4 backward call(s)" in text
    assert "capture, rank 1: no capture report" in text
    (old / capture_report_name(1)).write_text("[1, 2")  # torn or hostile: named, the rest still shown
    text = info_text(old)
    assert "capture, rank 1: report unreadable: " in text and "could not read the capture report" in text
    assert "capture, rank 0: 4 step file(s)" in text


def test_a_report_that_cannot_be_written_never_stops_training_unless_strict(tmp_path):
    out = tmp_path / "w"
    (out / (capture_report_name(0) + ".partial")).mkdir(parents=True)  # the atomic write's temporary name is taken
    with pytest.warns(RuntimeWarning, match=r"could not write the capture report .*capture_report\.rank_0\.json"):
        with tracer.watch(algo="grpo", out=out) as w:
            tiny_loop(steps=2)
    assert w.steps_recorded == 2 and len(Trace(out).steps()) == 2
    assert trace_info(out)["capture_reports"]["0"]["steps_recorded"] == 2  # the manifest's copy
    strict_out = tmp_path / "s"
    (strict_out / (capture_report_name(0) + ".partial")).mkdir(parents=True)
    with pytest.raises(TraceError, match=r"could not write the capture report .*capture_report\.rank_0\.json"):
        with tracer.watch(algo="grpo", out=strict_out, strict=True):
            tiny_loop(steps=1)
    assert Trace(strict_out).status == "finished"  # the writer was closed first
