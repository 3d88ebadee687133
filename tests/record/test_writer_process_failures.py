"""The writer process's failures that only a process has (the real child, real signals): a write
failure in the child (strict and not), the child killed with steps in hand, the parent killed,
Ctrl-C to the process group, a child that cannot start. Stalls are in test_writer_process_stall.py,
the rescue of a dead child's steps in test_writer_process_rescue.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tracer.errors import TraceError
from tracer.read import Trace
from tracer.record.writer import TraceWriter
from tracer.record.process.parent import RESULTS_EVERY_S

from tests.fixtures.paths import REPO
from tests.fixtures.writer_process import break_steps_dir, child_of, grpo_step, wait_gone


def test_strict_mode_raises_the_childs_write_failure(tmp_path):
    writer = TraceWriter(tmp_path / "s", "grpo", writer="process", strict=True)
    writer.record(0, grpo_step(0))
    writer.flush()
    break_steps_dir(tmp_path / "s")
    writer.record(1, grpo_step(1))
    with pytest.raises(TraceError, match=r"writing .* failed: step_00000001\.inner_0\.mb_0\.rank_0\.safetensors: "
                                         r"NotADirectoryError: \[Errno 20\] Not a directory"):
        writer.flush()
    assert (writer.steps_written, writer.dropped_steps) == (1, 1)
    writer.record(2, grpo_step(2))  # training goes on
    with pytest.raises(TraceError, match="step_00000002"):
        writer.close()
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"]) == (1, 2)


def test_a_failed_write_warns_and_training_goes_on(tmp_path):
    writer = TraceWriter(tmp_path / "w", "grpo", writer="process")
    writer.record(0, grpo_step(0))
    writer.flush()
    break_steps_dir(tmp_path / "w")
    writer.record(1, grpo_step(1))
    with pytest.warns(RuntimeWarning, match=r"dropped a step \(1 so far\): step_00000001.*Not a directory"):
        writer.flush()
    writer.close()
    manifest = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"]) == (1, 1)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("noticed_by", ["results", "hand-over"])
def test_a_killed_child_loses_no_step_it_was_handed(tmp_path, strict, noticed_by):
    """kill -9 of the writer process with 3 steps handed over and not written (it was stopped): the
    writer notices (by the result pipe's end at a due poll, or by the command pipe's at the next
    hand-over), warns naming the signal, copies the 3 steps out of the shared ring and writes them
    on a thread, which also writes every later step: nothing is dropped (strict mode has nothing to
    raise), each file holds its own step's values."""
    writer = TraceWriter(tmp_path / "k", "grpo", writer="process", strict=strict)
    writer.record(0, grpo_step(0))
    writer.flush()
    child = child_of(writer)
    os.kill(child.pid, signal.SIGSTOP)
    for step in (1, 2, 3):
        writer.record(step, grpo_step(step))
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    if noticed_by == "results":
        time.sleep(RESULTS_EVERY_S)  # the next record reads the result pipe: its end says the child is gone
    else:
        writer._process._polled_at = time.monotonic() + 3600  # no poll due: the hand-over meets the pipe's end
    killed = rf"writer process \(pid {child.pid}\) was killed by signal 9 \(SIGKILL\)"
    with pytest.warns(RuntimeWarning, match=killed + r".*(3|4) step\(s\) it had not written"):
        writer.record(4, grpo_step(4))
    assert writer.writer == "thread"
    writer.record(5, grpo_step(5))
    writer.close()
    trace = Trace(tmp_path / "k")
    assert [k.step for k in trace.steps()] == [0, 1, 2, 3, 4, 5]
    for key in trace.steps():
        torch.testing.assert_close(trace.load_step(key)["policy_logprobs"], grpo_step(key.step)["policy_logprobs"])
    manifest = json.loads((tmp_path / "k" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (6, 0, "finished")
    assert manifest["capture"]["writer"] == "process, then thread"
    assert "killed by signal 9" in manifest["capture"]["writer_process_exit"]
    assert all("killed by signal 9" in reason for reason in manifest["drop_reasons"])


_SCRIPT = """
import os, signal, sys, time, torch
# Ctrl-C as in a terminal: a test run started in the background by a non-interactive shell ignores
# SIGINT, and this script would inherit that
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {repo!r})
from tests.fixtures.writer_process import grpo_step
from tracer.record.writer import TraceWriter
from tracer.record.process.parent import RESULTS_EVERY_S
writer = TraceWriter({root!r}, "grpo", writer="process")
for step in range(4):
    writer.record(step, grpo_step(step))
writer.flush()
for step in range(4, 10):  # handed over, not flushed
    writer.record(step, grpo_step(step))
print(writer._process.pid, flush=True)
{end}
"""


def _run_script(tmp_path: Path, end: str, **popen) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "loop.py"
    script.write_text(_SCRIPT.format(repo=str(REPO), root=str(tmp_path / "run"), end=end))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True, **popen)
    child = int(proc.stdout.readline())
    return proc, child


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_a_killed_parent_leaves_the_steps_it_handed_over_and_no_process_or_shared_memory(tmp_path):
    before = _shm()
    proc, child = _run_script(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.wait(timeout=120) == -signal.SIGKILL
    assert wait_gone(child), "the writer process outlived its parent"
    assert [k.step for k in Trace(tmp_path / "run").steps()] == list(range(10))
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["status"]) == (10, "running")  # nobody closed it
    assert _shm() <= before


def test_ctrl_c_closes_the_trace_and_the_child_writes_everything(tmp_path):
    """SIGINT to the whole process group (a Ctrl-C in the terminal): the training script dies of
    KeyboardInterrupt, its atexit closes the writer (status ``interrupted``, tracer.format.run_end); the
    child ignored the signal and wrote all."""
    proc, child = _run_script(tmp_path, "time.sleep(60)", start_new_session=True)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) != 0
    assert wait_gone(child)
    assert [k.step for k in Trace(tmp_path / "run").steps()] == list(range(10))
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["status"]) == (10, "interrupted")
    assert (manifest["ended"]["exception"], manifest["ended"]["last_step"]) == ("KeyboardInterrupt", 9)


def test_a_writer_process_that_cannot_start_leaves_a_thread_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python-here"))
    with pytest.warns(RuntimeWarning, match=r"could not start the writer process .*FileNotFoundError.*writing on a "
                                            r"thread instead"):
        writer = TraceWriter(tmp_path / "t", "grpo", writer="process")
    assert writer.writer == "thread"
    writer.record(0, grpo_step(0))
    writer.close()
    assert [k.step for k in Trace(tmp_path / "t").steps()] == [0]
    assert json.loads((tmp_path / "t" / "manifest.json").read_text())["capture"]["writer"] == "thread"
    with pytest.raises(TraceError, match="could not start the writer process"):
        TraceWriter(tmp_path / "strict", "grpo", writer="process", strict=True)
