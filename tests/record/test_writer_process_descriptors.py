"""The writer process's file descriptors: every one a writer process takes (the ring's memfd, the
command, result and wake pipes) is closed again, after a clean run, a child killed while it lingered,
a writer dropped without close(), and a start that fails at the wake pipe. (The wake pipe's wakes:
test_writer_wake.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tracer.record.process import lifecycle as writer_lifecycle
from tracer.read import Trace
from tracer.record.writer import TraceWriter

from tests.fixtures.writer_process import grpo_step, lingering_child

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")


def _fds() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


def test_a_start_that_fails_at_the_wake_pipe_leaves_no_descriptor_open(tmp_path, monkeypatch):
    """The third pipe (the wake pipe) failing (EMFILE: the process is out of descriptors) falls back
    to the writer thread; the two pipe ends made for the child before it, the command pipe's read
    end and the result pipe's write end, are closed too (a leak of two descriptors per try, at the
    moment descriptors run out)."""
    real_pipe, calls = os.pipe, []

    def pipe():
        calls.append(1)
        if len(calls) == 3:
            raise OSError(24, "Too many open files")
        return real_pipe()

    TraceWriter(tmp_path / "warm", "grpo", writer="thread").close()
    before = _fds()
    for attempt in range(3):
        calls.clear()
        monkeypatch.setattr(writer_lifecycle.os, "pipe", pipe)
        with pytest.warns(RuntimeWarning, match="could not start the writer process"):
            # guard off: the live guard's checker process makes its own two pipes when the writer falls back
            # to a thread (tests/guard/test_checker_process_leaves_no_descriptor_or_child.py)
            writer = TraceWriter(tmp_path / f"r{attempt}", "grpo", writer="process", guard="off")
        monkeypatch.setattr(writer_lifecycle.os, "pipe", real_pipe)
        writer.record(0, grpo_step(0))
        writer.close()
        assert len(calls) == 3
    assert _fds() == before


def _pipes_and_rings() -> int:
    """The descriptors of pipes and memfds this process holds (the writer process's kinds)."""
    kinds = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            kinds.append(os.readlink(fd))
        except OSError:  # the listing's own descriptor, gone
            pass
    return sum(kind.startswith(("pipe:", "/memfd:")) for kind in kinds)


def test_process_writers_opened_and_closed_leave_no_descriptor_open(tmp_path, monkeypatch):
    """Every descriptor a writer process takes (the ring's memfd, the command, result and wake
    pipes) is closed again: by close() after a clean run, after a child killed while it lingered
    (its steps rescued by a thread), and after a writer dropped without close() (its finaliser, which
    before closed only the command and wake pipes: the result pipe and the ring's memfd leaked)."""
    import gc
    import signal

    lingering_child(monkeypatch)
    TraceWriter(tmp_path / "warm", "grpo", writer="process").close()
    before = _pipes_and_rings()
    for run in range(4):
        writer = TraceWriter(tmp_path / f"r{run}", "grpo", writer="process")
        writer.record(0, grpo_step(0))
        writer.flush()
        writer.record(1, grpo_step(1))
        child = writer._process._child
        if run == 1:
            time.sleep(0.3)
            os.kill(child.pid, signal.SIGKILL)
            with pytest.warns(RuntimeWarning, match="killed by signal 9"):
                writer.close()
        elif run == 2:
            del writer
            gc.collect()
            assert child.wait(timeout=30) == 0
        else:
            writer.close()
        assert [k.step for k in Trace(tmp_path / f"r{run}").steps()] == [0, 1]
    gc.collect()
    assert _pipes_and_rings() == before
