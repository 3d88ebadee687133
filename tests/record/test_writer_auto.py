"""``writer="auto"``, TraceWriter's default: at the first step written, the writer process for CPU
tensors on Linux with a core to spare per training process, else the writer thread
(:func:`tracer.record.modes.auto_writer`); a trace closed while that process is still starting has
its steps written by a thread. Real children, real files; the suite's other tests pin the thread
(tests/conftest.py), these unset it."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from tracer.read import Trace
from tracer.record.writer import TraceWriter
from tracer.record.modes import auto_writer
from tracer.record import writer as writer_module

from tests.fixtures.writer_process import grpo_step, process_alive, wait_gone


@pytest.fixture(autouse=True)
def _default_writer(monkeypatch):
    monkeypatch.delenv("TRACER_WRITER", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@pytest.mark.parametrize("cpu_only, platform, cores, local_ranks, picked, why", [
    (True, "linux", 2, 1, "process", "auto: CPU tensors, 2 usable cores for 1 training process(es)"),
    (True, "linux", 16, 8, "process", "auto: CPU tensors, 16 usable cores for 8 training process(es)"),
    (True, "linux", 15, 8, "thread", "auto: 15 usable core(s) for 8 training process(es), none to spare"),
    (True, "linux", 1, 1, "thread", "auto: 1 usable core(s) for 1 training process(es), none to spare"),
    (True, "darwin", 8, 1, "thread", "auto: the writer process runs on Linux only (this is darwin)"),
    (False, "linux", 64, 1, "thread", "auto: a tensor of the first step is not on the CPU"),
])
def test_the_choice_by_device_platform_and_cores(cpu_only, platform, cores, local_ranks, picked, why):
    assert auto_writer(cpu_only, platform, cores, local_ranks) == (picked, why)


def test_the_local_ranks_come_from_torchrun(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert auto_writer(True, "linux", 7)[0] == "thread"  # 7 cores < 2 x 4 ranks
    assert auto_writer(True, "linux", 8)[0] == "process"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")  # unreadable: one rank
    assert auto_writer(True, "linux", 2)[0] == "process"


def _capture(root) -> dict:
    return json.loads((root / "manifest.json").read_text())["capture"]


def test_nothing_is_started_before_the_first_step(tmp_path):
    writer = TraceWriter(tmp_path / "t", "grpo")
    assert writer.writer == "auto" and writer._process is None and writer._background is None
    writer.flush()  # nothing to wait for
    writer.close()
    capture = _capture(tmp_path / "t")
    assert capture["writer"] == "auto" and "writer_choice" not in capture  # no step, so no choice
    assert json.loads((tmp_path / "t" / "manifest.json").read_text())["status"] == "finished"


@pytest.mark.skipif(auto_writer(True)[0] != "process", reason="auto picks the thread on this machine")
def test_cpu_tensors_get_the_writer_process_and_the_same_files_as_the_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_module, "wall_clock", lambda: 1.8e9)  # the same wall_time in both traces
    steps = {step: grpo_step(step) for step in range(12)}
    with TraceWriter(tmp_path / "thread", "grpo", writer="thread") as writer:
        for step, tensors in steps.items():
            writer.record(step, tensors)
    writer = TraceWriter(tmp_path / "auto", "grpo")
    for step, tensors in steps.items():
        writer.record(step, tensors)
        if step == 0:
            assert writer.writer == "process"
    writer.flush()  # waits for the child's start-up: it has written these steps itself
    child = writer._process._child
    writer.close()
    assert child.returncode == 0  # it left through tracer.record.process.child.leave with main's code
    capture = _capture(tmp_path / "auto")
    assert capture["writer"] == "process"
    assert capture["writer_choice"].startswith("auto: CPU tensors, ")
    thread, auto = Trace(tmp_path / "thread"), Trace(tmp_path / "auto")
    assert [k.step for k in auto.steps()] == list(steps)
    for a, b in zip(thread.steps(), auto.steps()):
        assert auto.metadata(b)["content_sha256"] == thread.metadata(a)["content_sha256"]
    assert auto.step_summary().equals(thread.step_summary())


@pytest.mark.skipif(auto_writer(True)[0] != "process", reason="auto picks the thread on this machine")
def test_a_trace_closed_while_the_process_starts_is_written_by_a_thread(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the user did not ask for the process
        writer = TraceWriter(tmp_path / "t", "grpo")
        for step in range(3):
            writer.record(step, grpo_step(step))
        pid = writer._process.pid
        assert writer._process._ready is False  # a fresh interpreter takes > 0.3 s
        writer.close()
    assert writer.writer == "thread"
    assert wait_gone(pid) and not process_alive(pid)
    capture = _capture(tmp_path / "t")
    assert capture["writer"] == "thread"
    assert capture["writer_choice"].endswith("the trace closed while the writer process was starting, so a thread "
                                             "wrote its steps")
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (3, 0, "finished")
    trace = Trace(tmp_path / "t")
    assert [k.step for k in trace.steps()] == [0, 1, 2]
    first = trace.load_step(trace.steps()[0])
    assert torch.equal(first["policy_logprobs"], grpo_step(0)["policy_logprobs"])


def test_a_ready_process_is_closed_as_usual(tmp_path):
    if auto_writer(True)[0] != "process":
        pytest.skip("auto picks the thread on this machine")
    writer = TraceWriter(tmp_path / "t", "grpo")
    writer.record(0, grpo_step(0))
    writer.flush()  # the child is ready and has written step 0
    writer.record(1, grpo_step(1))
    writer.close()
    assert _capture(tmp_path / "t")["writer"] == "process"
    assert [k.step for k in Trace(tmp_path / "t").steps()] == [0, 1]


def test_an_explicit_writer_is_not_second_guessed(tmp_path, monkeypatch):
    with TraceWriter(tmp_path / "t", "grpo", writer="thread") as writer:
        writer.record(0, grpo_step(0))
        assert writer.writer == "thread"
    assert "writer_choice" not in _capture(tmp_path / "t")
    monkeypatch.setenv("TRACER_WRITER", "thread")
    with TraceWriter(tmp_path / "env", "grpo") as writer:
        writer.record(0, grpo_step(0))
        assert writer.writer == "thread"


def test_a_real_trl_grpo_run_writes_the_same_trace_whichever_writer(tmp_path, monkeypatch):
    """TRL's GRPOTrainer on the tiny local model, traced by ``tracer.attach`` with no writer named
    (auto), then with the process and the thread named: every step file holds the same tensors and
    header (checksums equal), so the checks read the same run. This two-step run usually closes while
    auto's process is still starting (a TRL step here takes a fraction of a second; the child 1-3 s),
    so a thread wrote it: the short-run path, with a real trainer."""
    pytest.importorskip("trl")
    if auto_writer(True)[0] != "process":
        pytest.skip("auto picks the thread on this machine")
    from tracer.demo import grpo_trl
    from tracer.demo.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    for writer in ("auto", "process", "thread"):
        monkeypatch.setenv("TRACER_WRITER", writer)
        grpo_trl.run_grpo_demo(tmp_path / writer, steps=2, seed=0, progress=False, model_dir=model_dir)
    auto = _capture(tmp_path / "auto")
    assert auto["writer_choice"].startswith("auto: CPU tensors, ")
    assert _capture(tmp_path / "process")["writer"] == "process"
    if auto["writer"] == "thread":  # the usual case here; a machine that starts the child faster keeps it
        assert auto["writer_choice"].endswith("the trace closed while the writer process was starting, so a "
                                              "thread wrote its steps"), auto
    else:
        assert auto["writer"] == "process", auto
    traces = {writer: Trace(tmp_path / writer) for writer in ("auto", "process", "thread")}
    for writer, trace in traces.items():
        assert [k.step for k in trace.steps()] == [0, 1], writer
        assert (trace.manifest["steps_written"], trace.manifest["dropped_steps"]) == (2, 0), writer
    for step in range(2):
        sums = {w: t.metadata(t.steps()[step])["content_sha256"] for w, t in traces.items()}
        assert len(set(sums.values())) == 1, sums


def test_a_child_killed_before_it_starts_the_index_leaves_no_older_run_in_it(tmp_path):
    """An older run's index, its step files deleted (the user traces again into the directory); a
    writer process killed while it is still importing (before it starts the index): the thread that
    takes over resumes the index the parent started, which lists this run's step alone."""
    import signal

    from tracer.format.names import step_file_name, summary_index_name

    with TraceWriter(tmp_path / "run", "grpo", writer="thread") as writer:
        for step in range(4):
            writer.record(step, grpo_step(step))
    for path in (tmp_path / "run" / "steps").iterdir():
        path.unlink()
    writer = TraceWriter(tmp_path / "run", "grpo", writer="process")
    os.kill(writer._process.pid, signal.SIGKILL)  # a fresh interpreter: still importing
    with pytest.warns(RuntimeWarning, match="killed by signal 9"):
        writer.record(7, grpo_step(7))
        writer.close()
    lines = [json.loads(line) for line in (tmp_path / "run" / summary_index_name(0)).read_text().splitlines()]
    assert [line["file"] for line in lines[1:]] == [step_file_name(7)]
    assert [k.step for k in Trace(tmp_path / "run").steps()] == [7]
