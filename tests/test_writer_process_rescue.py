"""A writer process that dies loses no step it was handed (issue 16), whichever call meets its
death: the real child killed with SIGKILL at different moments, real files; each file holds its
own step's values, the manifest's counts are exact, the summary index lists each file once and
``tracer check`` passes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from tracer.cli import main
from tracer.reader import Trace
from tracer.writer import TraceWriter

from test_writer_process import _child_of
from test_writer_process import grpo_step as _random_grpo_step


def grpo_step(step: int) -> dict[str, torch.Tensor]:
    """test_writer_process's step, made healthy for ``tracer check``: fresh rollouts (old == policy),
    advantages the z-scores of the rewards within each group of 2 (unbiased std)."""
    tensors = _random_grpo_step(step)
    tensors["old_logprobs"] = tensors["policy_logprobs"].clone()
    rewards = tensors["rewards"].view(-1, 2)
    tensors["advantages"] = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
    return tensors


def _stopped_with_steps_in_flight(root: Path, steps: range, **options) -> tuple[TraceWriter, int]:
    """A process writer that wrote step 0, whose child is then stopped (SIGSTOP) with ``steps``
    handed over, none of them written; no poll of its results comes due by itself."""
    writer = TraceWriter(root, "grpo", writer="process", **options)
    writer.record(0, grpo_step(0))
    writer.flush()
    child = _child_of(writer)
    os.kill(child.pid, signal.SIGSTOP)
    for step in steps:
        writer.record(step, grpo_step(step))
    writer._process._polled_at = time.monotonic() + 3600
    return writer, child.pid


def _assert_whole(root: Path, steps: list[int]) -> None:
    trace = Trace(root)
    assert [k.step for k in trace.steps()] == steps
    for key in trace.steps():
        torch.testing.assert_close(trace.load_step(key)["policy_logprobs"], grpo_step(key.step)["policy_logprobs"])
    summary = trace.step_summary()
    assert summary["step"].tolist() == steps  # one row per file
    manifest = json.loads((root / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (len(steps), 0, "finished")
    assert manifest["capture"]["writer"] == "process, then thread"
    assert "killed by signal 9" in manifest["capture"]["writer_process_exit"]
    assert main(["check", str(root)]) == 0


@pytest.mark.parametrize("call", ["close", "flush"])
def test_a_child_killed_unnoticed_before_close_or_flush_loses_no_step(tmp_path, call):
    """The child dies (SIGKILL) with 3 steps in flight and no record comes after: close() (or
    flush()) meets its death; the 3 steps are still written, by the thread that takes over."""
    writer, pid = _stopped_with_steps_in_flight(tmp_path / "k", range(1, 4))
    os.kill(pid, signal.SIGKILL)
    with pytest.warns(RuntimeWarning, match=r"killed by signal 9 \(SIGKILL\); the 3 step\(s\) it had not written"):
        getattr(writer, call)()
    writer.close()
    _assert_whole(tmp_path / "k", [0, 1, 2, 3])


def test_a_child_killed_while_close_waits_for_it_loses_no_step(tmp_path):
    """close() waits for the stopped child to write what it holds; it is killed meanwhile."""
    writer, pid = _stopped_with_steps_in_flight(tmp_path / "k", range(1, 5))
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.warns(RuntimeWarning, match=r"the 4 step\(s\) it had not written"):
            writer.close()
    finally:
        killer.join()
    _assert_whole(tmp_path / "k", [0, 1, 2, 3, 4])
