"""A writer process that dies loses no step it was handed, whichever call meets its
death: the real child killed with SIGKILL at different moments, real files; each file holds its
own step's values, the manifest's counts are exact, the summary index lists each file once and
``tracer check`` passes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from tracer.record.capture import SamplingPolicy
from tracer.cli import main
from tracer.errors import TraceError
from tracer.read import Trace
from tracer.record.writer import TraceWriter

from tests.fixtures.writer_process import break_steps_dir, child_of, read_manifest, stopped_with_steps_in_flight
from tests.fixtures.writer_process import healthy_grpo_step as grpo_step


def _assert_whole(root: Path, steps: list[int]) -> None:
    trace = Trace(root)
    assert [k.step for k in trace.steps()] == steps
    for key in trace.steps():
        torch.testing.assert_close(trace.load_step(key)["policy_logprobs"], grpo_step(key.step)["policy_logprobs"])
    summary = trace.step_summary()
    assert summary["step"].tolist() == steps  # one row per file
    # the index lists each file once: the child's lines (flushed at step 0's flush), then the thread's
    lines = (root / "summary_index.rank_0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines[1:]] == steps
    assert (root / "summary_index.rank_0.columns").exists()  # compacted at close, the child's lines too
    manifest = json.loads((root / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (len(steps), 0, "finished")
    assert manifest["capture"]["writer"] == "process, then thread"
    assert "killed by signal 9" in manifest["capture"]["writer_process_exit"]
    assert main(["check", str(root)]) == 0


@pytest.mark.parametrize("call", ["close", "flush"])
def test_a_child_killed_unnoticed_before_close_or_flush_loses_no_step(tmp_path, call):
    """The child dies (SIGKILL) with 3 steps in flight and no record comes after: close() (or
    flush()) meets its death; the 3 steps are still written, by the thread that takes over."""
    writer, pid = stopped_with_steps_in_flight(tmp_path / "k", range(1, 4))
    os.kill(pid, signal.SIGKILL)
    with pytest.warns(RuntimeWarning, match=r"killed by signal 9 \(SIGKILL\); the 3 step\(s\) it had not written"):
        getattr(writer, call)()
    writer.close()
    _assert_whole(tmp_path / "k", [0, 1, 2, 3])


def test_a_child_killed_while_close_waits_for_it_loses_no_step(tmp_path):
    """close() waits for the stopped child to write what it holds; it is killed meanwhile."""
    writer, pid = stopped_with_steps_in_flight(tmp_path / "k", range(1, 5))
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.warns(RuntimeWarning, match=r"the 4 step\(s\) it had not written"):
            writer.close()
    finally:
        killer.join()
    _assert_whole(tmp_path / "k", [0, 1, 2, 3, 4])


def test_steps_of_two_layouts_in_flight_are_each_rescued_with_their_own_shapes(tmp_path):
    """Steps of two field signatures (4 rows, then 2) in the ring when the child dies."""
    writer, pid = stopped_with_steps_in_flight(tmp_path / "k", range(1, 3))
    small = {name: t[:2] for name, t in grpo_step(3).items()}
    writer.record(3, small)
    writer.record(4, grpo_step(4))
    os.kill(pid, signal.SIGKILL)
    with pytest.warns(RuntimeWarning, match=r"the 4 step\(s\) it had not written"):
        writer.close()
    trace = Trace(tmp_path / "k")
    assert [k.step for k in trace.steps()] == [0, 1, 2, 3, 4]
    for key in trace.steps():
        expected = small if key.step == 3 else grpo_step(key.step)
        data = trace.load_step(key)
        for name in ("policy_logprobs", "advantages", "completion_ids"):
            torch.testing.assert_close(data[name], expected[name], rtol=0, atol=0)
    assert trace.step_summary()["step"].tolist() == [0, 1, 2, 3, 4]
    assert (read_manifest(tmp_path / "k")["steps_written"], read_manifest(tmp_path / "k")["dropped_steps"]) == (5, 0)


def test_drops_of_a_full_queue_stay_counted_once_and_the_rest_is_rescued(tmp_path):
    """when_full="drop", 2 steps in flight at most: of steps 1-4 handed to the stopped child, 3 and 4
    are dropped (queue full); the child dies; 1 and 2 are rescued; the counts are exact."""
    writer, pid = stopped_with_steps_in_flight(tmp_path / "k", range(1, 3), max_queue_steps=2, when_full="drop")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in (3, 4):
            assert writer.record(step, grpo_step(step)) is None
    os.kill(pid, signal.SIGKILL)
    with pytest.warns(RuntimeWarning, match=r"the 2 step\(s\) it had not written"):
        writer.close()
    assert [k.step for k in Trace(tmp_path / "k").steps()] == [0, 1, 2]
    manifest = read_manifest(tmp_path / "k")
    assert (manifest["steps_written"], manifest["dropped_steps"]) == (3, 2)
    assert all("queue full" in reason for reason in manifest["drop_reasons"])


def test_a_step_larger_than_the_ring_in_flight_is_counted_as_dropped_once(tmp_path):
    """A step larger than the ring travels through the pipe; the child dies before writing it: it is
    the one step counted as dropped (its reason names the signal); later steps are written."""
    writer = TraceWriter(tmp_path / "k", "grpo", writer="process", max_queue_bytes=256)
    writer.record(0, grpo_step(0))
    writer.flush()
    child = child_of(writer)
    os.kill(child.pid, signal.SIGSTOP)
    writer.record(1, grpo_step(1))  # ~0.5 KiB: through the pipe
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    with pytest.warns(RuntimeWarning):
        writer.record(2, grpo_step(2))
    writer.close()
    assert [k.step for k in Trace(tmp_path / "k").steps()] == [0, 2]
    manifest = read_manifest(tmp_path / "k")
    assert (manifest["steps_written"], manifest["dropped_steps"]) == (2, 1)
    assert ["killed by signal 9" in reason for reason in manifest["drop_reasons"]] == [True]


@pytest.mark.parametrize("noticed_by", ["results", "hand-over"])
def test_unsampled_steps_in_flight_still_precede_a_later_anomaly(tmp_path, noticed_by):
    """The anomaly ring on, only step 0 sampled: steps 1-3 (unsampled, waiting in the stopped
    child's queue for an anomaly) are in the ring when the child dies; step 4 holds a NaN (and is
    itself handed to the dead child when the hand-over is what notices): the thread that took over
    writes 1-3 as the steps before the anomaly, and 4, as the child would have."""
    policy = SamplingPolicy(every_n_steps=100, anomaly_ring=4)
    writer, pid = stopped_with_steps_in_flight(tmp_path / "k", range(1, 4), sampling=policy)
    os.kill(pid, signal.SIGKILL)
    writer._process._child.wait(timeout=30)  # gone: the next hand-over meets the command pipe's end
    if noticed_by == "results":
        writer._process._polled_at = 0.0  # the next record reads the result pipe first: its end
    bad = grpo_step(4)
    bad["policy_logprobs"][0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="killed by signal 9"):
        writer.record(4, bad)
    writer.close()
    trace = Trace(tmp_path / "k")
    assert [k.step for k in trace.steps()] == [0, 1, 2, 3, 4]
    assert [trace.metadata(k).get("anomaly", "").startswith("before anomaly at step 4") for k in trace.steps()] == \
        [False, True, True, True, False]
    manifest = read_manifest(tmp_path / "k")
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["skipped_steps"]) == (5, 0, 0)


def test_a_child_failure_is_raised_by_the_next_flush_even_when_no_poll_came_due(tmp_path):
    """Strict mode: the child fails to write step 1 (its steps folder replaced by a file); step 2 is
    recorded before any poll of the results is due (RESULTS_EVERY_S), so record does not raise yet;
    the flush right after reads every result and raises the failure, naming the file."""
    writer = TraceWriter(tmp_path / "s", "grpo", writer="process", strict=True)
    writer.record(0, grpo_step(0))
    writer.flush()
    break_steps_dir(tmp_path / "s")
    writer.record(1, grpo_step(1))
    time.sleep(0.5)  # the child (writing each step as it arrives) has tried step 1 and sent its failure
    writer._process._polled_at = time.monotonic() + 3600  # no poll due for the next record
    writer.record(2, grpo_step(2))
    with pytest.raises(TraceError, match=r"step_00000001\.inner_0\.mb_0\.rank_0\.safetensors.*2 writes failed"):
        writer.flush()  # steps 1 and 2 both failed by then: one raise tells of both
    writer.close()
    manifest = read_manifest(tmp_path / "s")
    assert (manifest["steps_written"], manifest["dropped_steps"]) == (1, 2)


def test_a_resumed_index_ends_a_torn_last_line_and_keeps_every_whole_one(tmp_path):
    """The index a dead writer left ends in a torn line (it died appending step 1's): the writer
    that resumes it ends that line (readers skip it) and appends its own after; the file keeps its
    writer token, and step 0's line and the new one are read."""
    from safetensors import safe_open

    from tracer.format import summary_store
    from tracer.format.run_index import IndexWriter, index_paths, read_index

    root = tmp_path / "t"
    with TraceWriter(root, "grpo") as writer:
        for step in (0, 1):
            writer.record(step, grpo_step(step))
    index = root / "summary_index.rank_0.jsonl"
    head, line0, line1 = index.read_bytes().splitlines(keepends=True)
    index.write_bytes(head + line0 + line1[: len(line1) // 2])
    resumed = IndexWriter(root, 0, resume=True)
    assert resumed.token == json.loads(head)["writer"]
    path = root / "steps" / json.loads(line1)["file"]
    with safe_open(str(path), "pt") as fh:
        resumed.add(path, list(fh.keys()), fh.metadata())
    resumed.flush()  # appended, not yet compacted
    lines = index.read_bytes().splitlines(keepends=True)
    assert lines[:2] == [head, line0] and lines[2] == line1[: len(line1) // 2] + b"\n"
    assert sorted(entry["step"] for entry in read_index(index_paths(root)).values()) == [0, 1]  # the lines
    resumed.close()
    columns = summary_store.read_store(root / "summary_index.rank_0.columns")  # compacted at close, of the same token
    assert (columns.writer, len(columns)) == (resumed.token, 2)
    assert Trace(root).step_summary()["step"].tolist() == [0, 1]
