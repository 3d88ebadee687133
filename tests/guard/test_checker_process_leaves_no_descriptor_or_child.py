"""The default guard ("warn") of a thread-written run forks a checker process (tracer.guard.process):
after the writer's close, its pipes are closed, the child has exited and been reaped (no zombie), and
the findings file holds the child's lines. A checker process that dies mid-run leaves the run going
on, unguarded, with a warning that says so."""

from __future__ import annotations

import logging
import os
import signal

from tests.fixtures.writer_process import grpo_step
from tests.record.test_writer_process_descriptors import _fds
from tracer.format.findings_log import findings_paths, read_lines
from tracer.record.writer import TraceWriter


def _children() -> list[int]:
    """Pids of this process's children that still exist (zombies included), from /proc."""
    me, out = str(os.getpid()), []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[1] == me:
                        out.append(int(pid))
            except OSError:
                pass
    return out


def test_close_reaps_the_checker_and_closes_its_pipes(tmp_path, monkeypatch):
    monkeypatch.delenv("TRACER_GUARD", raising=False)
    TraceWriter(tmp_path / "warm", "grpo", writer="thread").close()
    before, children = _fds(), set(_children())
    writer = TraceWriter(tmp_path / "run", "grpo", writer="thread")
    checker = writer._observer._checker
    assert writer._observer.where == "process" and checker.pid in _children()
    for step in range(3):
        writer.record(step, grpo_step(step))
    writer.close()
    assert set(_children()) == children  # exited and reaped
    assert _fds() == before
    (path,) = findings_paths(tmp_path / "run")
    lines = list(read_lines(path))
    assert lines[0]["kind"] == "guard" and lines[0]["where"] == "checker process" and lines[0]["pid"] == checker.pid
    assert sum(1 for line in lines if line["kind"] == "checked") == 3


def test_a_checker_that_dies_leaves_the_run_going_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("TRACER_GUARD", raising=False)
    writer = TraceWriter(tmp_path / "run", "grpo", writer="thread")
    checker = writer._observer._checker
    writer.record(0, grpo_step(0))
    with caplog.at_level(logging.WARNING, logger="tracer.guard"):
        os.kill(checker.pid, signal.SIGKILL)
        checker._closed.wait(10)
        for step in range(1, 4):
            writer.record(step, grpo_step(step))
        writer.close()
    assert writer.steps_written == 4
    assert any("the checker process ended" in r.getMessage() and "unguarded" in r.getMessage() for r in caplog.records)
    assert checker.pid not in _children()
