"""Review 7: the writer process's child that lingers for more steps (tracer.writer_child), is hurried
by a record waiting for room, and keeps its ring views per (layout, offset). Real child processes,
real shared memory, real files: the steps written (exact lists, exact values) when the child is
killed, stopped or orphaned while it lingers, under tight bounds, through the anomaly ring, with
layouts sharing an offset, and against the writer thread's bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from tracer.capture import SamplingPolicy
from tracer.reader import Trace
from tracer.writer import TraceWriter
from tracer.writer_process import ALIGN, _Layout

from test_writer_process import _alive, _lingering_child, _wait_gone, grpo_step

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("completion_ids", "completion_mask", "policy_logprobs", "old_logprobs", "rewards", "advantages", "group_ids")


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def _assert_steps(root: Path, expected: dict[int, dict[str, torch.Tensor]]) -> None:
    """The trace holds exactly the steps of ``expected``, each with exactly its values."""
    trace = Trace(root)
    assert [k.step for k in trace.steps()] == sorted(expected)
    for key in trace.steps():
        got = trace.load_step(key, derive=False)
        for name, want in expected[key.step].items():
            torch.testing.assert_close(got[name].to(want.dtype), want, rtol=0, atol=0, equal_nan=True,
                                       msg=f"step {key.step}, {name}")


def _until(condition, process, timeout: float = 10.0) -> bool:
    """Poll the child's results until ``condition()`` holds (False when ``timeout`` passed first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()
        if condition():
            return True
        time.sleep(0.005)
    return False


def _tiny(step: int) -> dict[str, torch.Tensor]:
    """A step of 7 fields of a few bytes each (B=2, T=2: 100 bytes): each takes 64 in the ring."""
    return grpo_step(step, B=2, T=2)


# -- the linger never holds ring room a record needs -------------------------------------------------


def test_a_lingering_child_leaves_room_for_small_padded_steps_under_drop(tmp_path, monkeypatch):
    """Steps of many small fields take far more ring room (each field on a 64-byte boundary) than
    their bytes: a ring of 4 such steps holds 4 x 100 bytes. A child that lingers until half the
    ring's bytes are its steps' own bytes would hold all 4 and make the 5th drop (when_full="drop"),
    although it writes in a moment whatever it is given; it must stop lingering once half the
    ring's room is held, so that every step finds room once the child has written."""
    _lingering_child(monkeypatch)  # only the bounds end a linger
    size = _Layout(0, _tiny(0), "float32").size
    assert size == 7 * ALIGN
    ring = 4 * size
    expected = {}
    with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_bytes=ring, when_full="drop") as writer:
        writer.record(0, _tiny(0))
        writer.flush()
        expected[0] = _tiny(0)
        process = writer._process
        for step in range(1, 13):
            assert writer.record(step, _tiny(step)) is not None, step
            expected[step] = _tiny(step)
            # the next step finds room once the child has done what it does without being told
            assert _until(lambda: process._place(size) is not None, process, 5.0), step
        assert writer.dropped_steps == 0
    _assert_steps(tmp_path / "p", expected)
    assert (_manifest(tmp_path / "p")["steps_written"], _manifest(tmp_path / "p")["dropped_steps"]) == (13, 0)


def test_a_step_dropped_for_want_of_room_ends_the_linger_so_the_next_finds_room(tmp_path, monkeypatch):
    """when_full="drop" never waits: a large step finding the ring held by a lingering child's small
    one is dropped. The child is told to hurry all the same, so that the steps after it are not
    dropped too for as long as the linger lasts: once the child has written, the next large step
    finds room (before 94be6fc the child wrote each step at once)."""
    _lingering_child(monkeypatch)
    big = {step: grpo_step(step, B=16, T=64) for step in (2, 3)}
    size = _Layout(0, big[2], "float32").size
    ring = size + ALIGN  # the big step fits only in an empty ring
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the drop's warning
        with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_bytes=ring, when_full="drop") as writer:
            writer.record(0, grpo_step(0))
            writer.flush()
            process = writer._process
            writer.record(1, grpo_step(1))  # the child lingers over it
            assert writer.record(2, big[2]) is None and writer.dropped_steps == 1
            assert _until(lambda: process._place(size) is not None, process, 5.0)
            assert writer.record(3, big[3]) is not None
    _assert_steps(tmp_path / "p", {0: grpo_step(0), 1: grpo_step(1), 3: big[3]})
    manifest = _manifest(tmp_path / "p")
    assert (manifest["steps_written"], manifest["dropped_steps"]) == (3, 1)
    assert [reason.startswith("step 2: queue full") for reason in manifest["drop_reasons"]] == [True]


def test_a_child_stopped_under_drop_is_told_to_hurry_once_not_at_every_drop(tmp_path, monkeypatch):
    """A stopped child (SIGSTOP) under when_full="drop": every record drops; the hurry the first
    drop sends is not repeated by each later one (a message per drop would fill the command pipe,
    and a full pipe makes every step drop until the child reads it)."""
    from tracer.writer_pipe import frame

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        writer = TraceWriter(tmp_path / "d", "grpo", writer="process", max_queue_steps=1, when_full="drop")
        writer.record(0, grpo_step(0))
        writer.flush()
        process, pid = writer._process, writer._process.pid
        sent = []
        real_send = process._send
        process._send = lambda data, *args, **kwargs: (sent.append(bytes(data)), real_send(data, *args, **kwargs))[1]
        os.kill(pid, signal.SIGSTOP)
        try:
            returned = [writer.record(step, grpo_step(step)) for step in range(1, 30)]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert returned[0] is not None and returned[1:] == [None] * 28
        assert sent.count(frame({"k": "hurry"})) <= 1
        writer.close()
    assert [k.step for k in Trace(tmp_path / "d").steps()] == [0, 1]
    assert (_manifest(tmp_path / "d")["steps_written"], _manifest(tmp_path / "d")["dropped_steps"]) == (2, 28)


def test_a_padded_step_carried_by_the_pipe_is_never_lingered_over(tmp_path, monkeypatch):
    """A step larger than the ring travels through the pipe and cannot be rescued from the ring if
    the child dies: the child writes it at once, even one whose own bytes (100) are far fewer than
    half the ring (256): its room, padding included (448), is more than the ring."""
    batches = _lingering_child(monkeypatch)
    with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_bytes=256) as writer:
        writer.record(0, grpo_step(0))  # larger than the ring too
        writer.flush()
        writer.record(1, _tiny(1))
        assert _until(lambda: writer.steps_written == 2, writer._process, 5.0)
        assert batches == [1, 1]
    _assert_steps(tmp_path / "p", {0: grpo_step(0), 1: _tiny(1)})


# -- the child killed, stopped or orphaned while it lingers --------------------------------------------


def test_a_child_killed_while_it_lingers_loses_no_step_and_writes_none_twice(tmp_path, monkeypatch):
    """Steps 1-5 read by the child, which lingers over them (nothing written); SIGKILL: they are
    still in the ring, rescued and written by the thread, each once, with its own values; the
    loop changed its tensors after each record."""
    batches = _lingering_child(monkeypatch)
    expected = {0: grpo_step(0)}
    writer = TraceWriter(tmp_path / "k", "grpo", writer="process")
    writer.record(0, grpo_step(0))
    writer.flush()
    for step in range(1, 6):
        tensors = grpo_step(step)
        expected[step] = {n: t.clone() for n, t in tensors.items()}
        writer.record(step, tensors)
        for t in tensors.values():
            t.zero_() if t.dtype != torch.bool else t.logical_not_()
    time.sleep(0.3)  # the child has read them (if not, they are in the ring all the same)
    writer._process.poll()
    assert batches == [1]
    pid = writer._process.pid
    os.kill(pid, signal.SIGKILL)
    with pytest.warns(RuntimeWarning, match=r"killed by signal 9 \(SIGKILL\); the 5 step\(s\) it had not written"):
        writer.flush()
    writer.record(6, grpo_step(6))
    expected[6] = grpo_step(6)
    writer.close()
    _assert_steps(tmp_path / "k", expected)
    lines = (tmp_path / "k" / "summary_index.rank_0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines[1:]] == list(range(7))
    manifest = _manifest(tmp_path / "k")
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (7, 0, "finished")
    assert manifest["capture"]["writer"] == "process, then thread"


def test_a_child_stopped_while_it_lingers_is_taken_for_stalled_and_its_steps_rescued(tmp_path, monkeypatch):
    """The child lingers over steps 1-3, then is stopped (SIGSTOP): flush() hurries it, hears nothing
    for the stall limit (1 s), kills it and the thread writes the 3 steps."""
    _lingering_child(monkeypatch)
    writer = TraceWriter(tmp_path / "s", "grpo", writer="process", writer_stall_s=1.0)
    writer.record(0, grpo_step(0))
    writer.flush()
    for step in range(1, 4):
        writer.record(step, grpo_step(step))
    time.sleep(0.3)
    pid = writer._process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.warns(RuntimeWarning, match=rf"pid {pid}\) made no progress for .* while flush\(\) waited .*"
                                                r"holding 3 step\(s\) not yet written \(steps 1 to 3"):
            writer.flush()
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    writer.close()
    _assert_steps(tmp_path / "s", {step: grpo_step(step) for step in range(4)})
    manifest = _manifest(tmp_path / "s")
    assert (manifest["steps_written"], manifest["dropped_steps"]) == (4, 0)


def test_waits_on_a_lingering_child_raise_no_stall_false_alarm(tmp_path, monkeypatch):
    """A child lingering (for an hour) is quiet, yet every wait hurries it: a flush, a record
    waiting for room, a step larger than the ring and close() all get their answer well within a
    stall limit of 1 s (a false alarm would warn; warnings are errors here)."""
    batches = _lingering_child(monkeypatch)
    big = grpo_step(2, B=16, T=64)
    ring = _Layout(0, big, "float32").size + ALIGN
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with TraceWriter(tmp_path / "q", "grpo", writer="process", max_queue_bytes=ring, writer_stall_s=1.0,
                         strict=True) as writer:
            for step in range(12):
                tensors = big if step % 4 == 2 else grpo_step(step, B=64, T=200) if step % 4 == 3 else grpo_step(step)
                expected[step] = tensors
                writer.record(step, tensors)  # steps 3, 7, 11 are larger than the ring
                if step % 5 == 0:
                    time.sleep(1.2)  # longer than the stall limit, lingering
                    writer.flush()
            pid = writer._process.pid
            assert writer.writer == "process"
    assert not _alive(pid) and sum(batches) == 12
    _assert_steps(tmp_path / "q", expected)
    assert _manifest(tmp_path / "q")["capture"]["writer"] == "process"


_ORPHAN = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from test_writer_process import grpo_step
from tracer.writer import TraceWriter
real = TraceWriter._child_config
TraceWriter._child_config = lambda self: {{**real(self), "linger_s": 3600.0}}  # only the bounds end a linger
writer = TraceWriter({root!r}, "grpo", writer="process")
writer.record(0, grpo_step(0))
writer.flush()
for step in range(1, 8):
    writer.record(step, grpo_step(step))
time.sleep(0.3)  # the child lingers over steps 1-7
print(writer._process.pid, flush=True)
{end}
"""


@pytest.mark.parametrize("end", ["os.kill(os.getpid(), signal.SIGKILL)", "os._exit(0)", "pass"])
def test_the_training_process_ending_while_the_child_lingers_leaves_every_step_written(tmp_path, end):
    """The training process is SIGKILLed, leaves with os._exit (no close, no atexit) or simply ends
    (the atexit hook closes the writer) while the child lingers over 7 steps: the child writes them
    all and exits; only a clean exit marks the trace finished."""
    script = tmp_path / "loop.py"
    script.write_text(_ORPHAN.format(tests=str(ROOT / "tests"), root=str(tmp_path / "run"), end=end))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = int(proc.stdout.readline())
    proc.wait(timeout=60)
    assert _wait_gone(child, 30), "the writer process outlived its parent"
    _assert_steps(tmp_path / "run", {step: grpo_step(step) for step in range(8)})
    lines = (tmp_path / "run" / "summary_index.rank_0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines[1:]] == list(range(8))
    manifest = _manifest(tmp_path / "run")
    assert manifest["steps_written"] == 8
    assert manifest["status"] == ("finished" if end == "pass" else "running")


# -- cached ring views: a step's tensors are its own ---------------------------------------------------


@pytest.mark.parametrize("linger", ["flush each step", "batched"])
def test_the_anomaly_ring_keeps_each_held_steps_own_values_at_a_reused_offset(tmp_path, monkeypatch, linger):
    """Only step 0 is sampled; the ring (3) holds unsampled steps that the child read through the
    same cached views (each step at the ring's start when flushed one by one); step 9 holds a NaN,
    step 5 a KL spike: each brings out the 3 steps before it, each with its own values (a held
    step aliasing the ring would hold the last step's values)."""
    if linger == "batched":
        _lingering_child(monkeypatch)
    sampling = SamplingPolicy(every_n_steps=1000, anomaly_ring=3, kl_spike=5.0)
    expected = {}
    with TraceWriter(tmp_path / "r", "grpo", sampling=sampling, writer="process") as writer:
        for step in range(12):
            tensors = grpo_step(step)
            if step == 9:
                tensors["policy_logprobs"][1, 2] = float("nan")
            if step == 5:
                tensors["policy_logprobs"] = tensors["old_logprobs"] + 12.0  # ref-free k2 from old: a spike
            expected[step] = {n: t.clone() for n, t in tensors.items()}
            writer.record(step, tensors)
            for t in tensors.values():
                t.fill_(3) if t.dtype != torch.bool else t.logical_not_()
            if linger == "flush each step" or step in (4, 8):
                writer.flush()
    written = [0, 2, 3, 4, 5, 6, 7, 8, 9]
    _assert_steps(tmp_path / "r", {step: expected[step] for step in written})
    trace = Trace(tmp_path / "r")
    anomalies = {k.step: trace.metadata(k).get("anomaly", "") for k in trace.steps()}
    assert [s for s in written if anomalies[s].startswith("before anomaly at step 5")] == [2, 3, 4]
    assert [s for s in written if anomalies[s].startswith("before anomaly at step 9")] == [6, 7, 8]
    assert anomalies[5].startswith("approx_kl_k2") and anomalies[9].startswith("non-finite")
    manifest = _manifest(tmp_path / "r")
    assert (manifest["steps_written"], manifest["skipped_steps"], manifest["dropped_steps"]) == (9, 3, 0)


def test_fields_derived_by_the_child_are_each_steps_own_through_cached_views(tmp_path):
    """Zero-edit capture leaves ratio and approx_kl_k2 to the writer (derive=...): the child adds
    them to the step's tensors; a cached view's tensors shared by the next step at that offset
    would keep the first step's derived fields (derive_recorded skips a field present)."""
    from tracer.formulas import approx_kl_k2, ratio

    with TraceWriter(tmp_path / "z", "grpo", writer="process") as writer:
        for step in range(5):
            writer._record(step, grpo_step(step), derive=("ratio", "approx_kl_k2"))
            writer.flush()  # each step at the ring's start: the same cached views
    trace = Trace(tmp_path / "z")
    assert [k.step for k in trace.steps()] == list(range(5))
    for key in trace.steps():
        got, want = trace.load_step(key, derive=False), grpo_step(key.step)
        assert torch.equal(got["ratio"], ratio(want["policy_logprobs"], want["old_logprobs"])), key.step
        assert torch.equal(got["approx_kl_k2"], approx_kl_k2(want["policy_logprobs"], want["old_logprobs"])), key.step


def test_steps_of_different_layouts_at_one_offset_keep_their_own_shapes_and_dtypes(tmp_path):
    """Layouts alternate at the ring's start (each step flushed): shapes (4x6, 2x6, 4x3), the dtype of
    a field (float32, bfloat16) and the set of fields (one without rewards' neighbours); each file
    holds its own step's fields, shapes, dtypes and values."""
    def variant(step: int) -> dict[str, torch.Tensor]:
        kind = step % 4
        tensors = grpo_step(step, *[(4, 6), (2, 6), (4, 3), (4, 6)][kind])
        if kind == 3:
            tensors["policy_logprobs"] = tensors["policy_logprobs"].to(torch.bfloat16)
            tensors["old_logprobs"] = tensors["old_logprobs"].to(torch.bfloat16)
        return tensors

    with TraceWriter(tmp_path / "l", "grpo", writer="process", keep_source_dtype=True) as writer:
        for step in range(12):
            writer.record(step, variant(step))
            if step % 3 != 1:
                writer.flush()
    trace = Trace(tmp_path / "l")
    assert [k.step for k in trace.steps()] == list(range(12))
    for key in trace.steps():
        got, want = trace.load_step(key, derive=False), variant(key.step)
        assert set(got) == set(want), key.step
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), (key.step, name)


def test_steps_larger_than_the_ring_between_lingered_small_ones(tmp_path, monkeypatch):
    """Small steps the child lingers over, steps larger than the ring (through the pipe, once the
    lingered ones are written) in between, in every order: all written, each with its values."""
    batches = _lingering_child(monkeypatch)
    big = lambda step: grpo_step(step, B=16, T=64)  # noqa: E731
    ring = 4 * _Layout(0, grpo_step(0), "float32").size
    kinds = ["small", "big", "small", "small", "big", "big", "small", "big"]
    expected = {}
    with TraceWriter(tmp_path / "b", "grpo", writer="process", max_queue_bytes=ring) as writer:
        for step, kind in enumerate(kinds):
            expected[step] = grpo_step(step) if kind == "small" else big(step)
            writer.record(step, expected[step])
        writer.flush()
        assert sum(batches) == len(kinds)
    _assert_steps(tmp_path / "b", expected)


# -- tight bounds, flush, close ----------------------------------------------------------------------


@pytest.mark.parametrize("max_steps", [1, 2, 3])
@pytest.mark.parametrize("when_full", ["block", "drop"])
def test_a_bound_of_one_to_three_steps_is_never_lingered_over(tmp_path, monkeypatch, max_steps, when_full):
    """With at most 1-3 steps in flight half the bound is at most one step: the child writes each
    step as it comes (never lingers for an hour), so a record neither waits for the linger nor,
    under drop, drops a step once the one before it is written."""
    batches = _lingering_child(monkeypatch)
    with TraceWriter(tmp_path / "t", "grpo", writer="process", max_queue_steps=max_steps,
                     when_full=when_full) as writer:
        writer.record(0, grpo_step(0))
        writer.flush()
        for step in range(1, 8):
            assert writer.record(step, grpo_step(step)) is not None
            assert _until(lambda: writer.steps_written == step + 1, writer._process, 5.0), step
        assert writer.dropped_steps == 0 and batches == [1] * 8
    _assert_steps(tmp_path / "t", {step: grpo_step(step) for step in range(8)})


def test_a_flush_right_after_each_record_and_a_close_with_steps_lingered_over(tmp_path, monkeypatch):
    """flush() right after a record returns with that step on disk; close() with 9 steps lingered
    over writes them all and marks the trace finished."""
    batches = _lingering_child(monkeypatch)
    root = tmp_path / "f"
    writer = TraceWriter(root, "grpo", writer="process")
    for step in range(3):
        writer.record(step, grpo_step(step))
        writer.flush()
        assert [k.step for k in Trace(root).steps()] == list(range(step + 1))
    for step in range(3, 12):
        writer.record(step, grpo_step(step))
    writer._process.poll()
    assert batches == [1, 1, 1]
    pid = writer._process.pid
    writer.close()
    assert not _alive(pid) and batches == [1, 1, 1, 9]
    _assert_steps(root, {step: grpo_step(step) for step in range(12)})
    manifest = _manifest(root)
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (12, 0, "finished")


# -- the same bytes as the writer thread ----------------------------------------------------------------


def test_batched_process_files_are_byte_identical_to_the_threads(tmp_path, monkeypatch):
    """Steps of two layouts, metadata on some, a step larger than the ring, the anomaly ring and a
    KL threshold on, in batches of uneven sizes (flushes between): every step file holds the same
    bytes as the writer thread's (the header's values are the same; their order is safetensors'
    hash order, which differs from one process to the next whichever writer), and the summary index
    and the counts are the same."""
    import struct

    _lingering_child(monkeypatch)
    hyper = {"num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28, "beta": 0.04}
    sampling = SamplingPolicy(every_n_steps=2, anomaly_ring=2, kl_spike=50.0)
    ring = 6 * _Layout(0, grpo_step(0), "float32").size

    def steps():
        for step in range(20):
            tensors = grpo_step(step, *((2, 6) if step % 3 == 1 else (16, 64) if step == 12 else (4, 6)))
            if step == 11:
                tensors["policy_logprobs"][0, 0] = float("inf")
            yield step, tensors, ({"note": f"s{step}", "lr": 1e-5 * step} if step % 4 == 0 else None)

    for kind in ("thread", "process"):
        with TraceWriter(tmp_path / kind, "grpo", hyperparameters=hyper, sampling=sampling, writer=kind,
                         max_queue_bytes=ring) as writer:
            for step, tensors, metadata in steps():
                writer.record(step, tensors, metadata=metadata)
                if step in (2, 9, 10, 17):
                    writer.flush()

    def parts(path: Path) -> tuple[dict, bytes]:
        data = path.read_bytes()
        (size,) = struct.unpack_from("<Q", data)
        return json.loads(data[8:8 + size]), data[8 + size:]

    thread, process = (sorted((tmp_path / kind / "steps").iterdir()) for kind in ("thread", "process"))
    # the 10 sampled (even) steps; 7 and 9, held by the ring (2) when 11 showed an infinity, and 11
    written = [0, 2, 4, 6, 7, 8, 9, 10, 11, 12, 14, 16, 18]
    assert [p.name for p in process] == [p.name for p in thread] == [
        f"step_{step:08d}.inner_0.mb_0.rank_0.safetensors" for step in written]
    for a, b in zip(thread, process):
        (header_a, bytes_a), (header_b, bytes_b) = parts(a), parts(b)
        assert header_a == header_b and bytes_a == bytes_b, a.name
        assert len(a.read_bytes()) == len(b.read_bytes())
    index = {kind: (tmp_path / kind / "summary_index.rank_0.jsonl").read_text().splitlines()[1:]
             for kind in ("thread", "process")}
    # in the order written: 7 and 9 come out of the anomaly ring with 11
    assert [json.loads(line)["step"] for line in index["process"]] == [0, 2, 4, 6, 8, 10, 7, 9, 11, 12, 14, 16, 18]
    assert [json.loads(line) for line in index["thread"]] == [json.loads(line) for line in index["process"]]
    counts = {kind: {k: _manifest(tmp_path / kind)[k] for k in ("steps_written", "dropped_steps", "skipped_steps")}
              for kind in ("thread", "process")}
    assert counts["thread"] == counts["process"] == {"steps_written": 13, "dropped_steps": 0, "skipped_steps": 7}


def test_a_writer_dropped_without_close_ends_the_linger_and_every_step_is_written(tmp_path, monkeypatch):
    """A TraceWriter the program drops without close(): its finaliser closes the command pipe; the
    child lingering over steps 1-5 sees the pipe's end, writes them and exits."""
    import gc

    _lingering_child(monkeypatch)
    writer = TraceWriter(tmp_path / "g", "grpo", writer="process")
    for step in range(6):
        writer.record(step, grpo_step(step))
        if step == 0:
            writer.flush()
    child = writer._process._child
    del writer
    gc.collect()
    assert child.wait(timeout=30) == 0
    _assert_steps(tmp_path / "g", {step: grpo_step(step) for step in range(6)})
    assert _manifest(tmp_path / "g")["steps_written"] == 6
