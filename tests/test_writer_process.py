"""The writer process (``TraceWriter(writer="process")``, ``TRACER_WRITER=process``): the real child,
real shared memory, real files; each guarantee of the thread writer checked against it, and the
failures (child killed, parent killed, Ctrl-C) that only a process has."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import tracer
from tracer import summaries
from tracer.capture import SamplingPolicy
from tracer.errors import TraceError
from tracer.integrity import verify_step_file
from tracer.reader import Trace
from tracer.writer import TraceWriter
from tracer.writer_process import RESULTS_EVERY_S

from test_writer_review import _as_stored, _random_step

ROOT = Path(__file__).resolve().parents[1]
WRITERS = ["thread", "process"]


def grpo_step(step: int, B: int = 4, T: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    policy = -3 * torch.rand(B, T, generator=g)
    old = policy + 0.05 * torch.randn(B, T, generator=g)
    return {"completion_ids": torch.randint(0, 100, (B, T), generator=g),
            "completion_mask": torch.ones(B, T, dtype=torch.bool), "policy_logprobs": policy,
            "old_logprobs": old, "rewards": torch.rand(B, generator=g), "advantages": torch.randn(B, generator=g),
            "group_ids": torch.arange(B) // 2}


def _child_of(writer: TraceWriter) -> subprocess.Popen:
    assert writer.writer == "process"
    return writer._process._child


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _index_lines(root: Path) -> list[dict]:
    lines = (root / "summary_index.rank_0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[1:]]


def _header(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as fh:
        return fh.metadata()


def test_the_process_writes_what_the_thread_writes(tmp_path):
    """Same steps through both writers: the same step files (tensors, header values, checksum that
    verifies, summary equal to compute_summary of the file), the same summary index lines and
    manifest counts; the manifest names the writer."""
    hyper = {"num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28, "beta": 0.04}
    for kind in WRITERS:
        with TraceWriter(tmp_path / kind, "grpo", hyperparameters=hyper, writer=kind) as writer:
            for step in range(12):
                tensors = grpo_step(step)
                metadata = {"note": f"step {step}", "lr": 1e-4 * step} if step % 3 == 0 else None
                writer.record(step, tensors, metadata=metadata)
                for t in tensors.values():  # the loop reuses its tensors at once
                    t.zero_() if t.dtype != torch.bool else t.logical_not_()
            if kind == "process":
                writer.flush()
                assert writer.steps_written == 12 and writer.dropped_steps == 0
    thread, process = Trace(tmp_path / "thread"), Trace(tmp_path / "process")
    assert [k.step for k in process.steps()] == [k.step for k in thread.steps()] == list(range(12))
    for a, b in zip(thread.steps(), process.steps()):
        assert a.path.name == b.path.name
        data_a, data_b = thread.load_step(a, derive=False), process.load_step(b, derive=False)
        assert data_a.keys() == data_b.keys()
        for name in data_a:
            assert torch.equal(data_a[name], data_b[name]), name
        assert _header(a.path) == _header(b.path)
        meta = process.metadata(b)
        assert verify_step_file(b.path) == meta["content_sha256"]
        stored, own = summaries.read_summary(meta), summaries.compute_summary(process.load_step(b), meta)
        assert stored == own
    assert _index_lines(tmp_path / "thread") == _index_lines(tmp_path / "process")
    manifests = {kind: json.loads((tmp_path / kind / "manifest.json").read_text()) for kind in WRITERS}
    for kind, manifest in manifests.items():
        assert manifest["capture"]["writer"] == kind
        assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (12, 0, "finished")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_written_tensor_equals_a_copy_taken_at_record_time(tmp_path, seed):
    """The property test of the thread writer (test_writer_review), through the writer process:
    random dtypes, layouts, empty dims, NaNs, first_k_sequences, the anomaly ring, both policies."""
    rng = random.Random(seed)
    algorithm = rng.choice(["ppo", "grpo", "rloo"])
    keep, k, ring = rng.random() < 0.4, rng.choice([None, 1, 2]), rng.choice([0, 3])
    sampling = SamplingPolicy(every_n_steps=rng.choice([1, 2]), first_k_sequences=k, anomaly_ring=ring)
    g = torch.Generator().manual_seed(seed)
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with TraceWriter(tmp_path / "t", algorithm, keep_source_dtype=keep, sampling=sampling, writer="process",
                         when_full=rng.choice(["block", "drop"]), max_queue_steps=rng.choice([1, 4, 16]),
                         hyperparameters={"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28}) as writer:
            for step in range(16):
                tensors = _random_step(rng, algorithm, g)
                expected[step] = {n: _as_stored(n, t, keep, algorithm, k) for n, t in tensors.items()}
                writer.record(step, tensors)
                for t in tensors.values():
                    t.fill_(7) if t.dtype != torch.bool else t.logical_not_()
    trace = Trace(tmp_path / "t")
    assert trace.steps()
    for key in trace.steps():
        data, meta = trace.load_step(key, derive=False), trace.metadata(key)
        for name, tensor in expected[key.step].items():
            assert data[name].dtype == tensor.dtype and data[name].shape == tensor.shape, name
            torch.testing.assert_close(data[name], tensor, rtol=0, atol=0, equal_nan=True, msg=name)
        assert verify_step_file(key.path) == meta["content_sha256"]
        stored, own = summaries.read_summary(meta), summaries.compute_summary(trace.load_step(key), meta)
        assert all(stored[n] == own[n] or (stored[n] != stored[n] and own[n] != own[n]) for n in own)
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["steps_written"] == len(trace.steps())
    assert manifest["steps_written"] + manifest["dropped_steps"] + manifest["skipped_steps"] == 16


@pytest.mark.parametrize("kind", WRITERS)
def test_the_anomaly_ring_writes_the_steps_before_a_blow_up(tmp_path, kind):
    """Only step 0 is sampled; step 7 holds a NaN: the ring (3) brings out steps 4-6 with it."""
    sampling = SamplingPolicy(every_n_steps=1000, anomaly_ring=3)
    with TraceWriter(tmp_path / "r", "grpo", sampling=sampling, writer=kind) as writer:
        for step in range(10):
            tensors = grpo_step(step)
            if step == 7:
                tensors["policy_logprobs"][1, 2] = float("nan")
            writer.record(step, tensors)
        writer.flush()
        assert (writer.steps_written, writer.skipped_steps) == (5, 5)
    trace = Trace(tmp_path / "r")
    assert [k.step for k in trace.steps()] == [0, 4, 5, 6, 7]
    assert trace.metadata(trace.steps()[1])["anomaly"].startswith("before anomaly at step 7: non-finite")
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["skipped_steps"], manifest["dropped_steps"]) == (5, 5, 0)


def test_when_full_drop_counts_what_it_drops(tmp_path):
    """One step in flight at most; a child kept from reading (SIGSTOP) makes the rest drop, counted
    in the writer and in the manifest right after flush() and close()."""
    writer = TraceWriter(tmp_path / "d", "grpo", writer="process", max_queue_steps=1, when_full="drop")
    writer.record(0, grpo_step(0))
    writer.flush()  # the child is up: the steps bound applies from now on
    child = _child_of(writer)
    os.kill(child.pid, signal.SIGSTOP)
    try:
        with pytest.warns(RuntimeWarning, match=r"dropped a step \(\d+ so far\): step \d+: queue full \(1 steps"):
            returned = [writer.record(step, grpo_step(step)) for step in range(1, 6)]
    finally:
        os.kill(child.pid, signal.SIGCONT)
    assert returned[0] is not None and returned[1:] == [None] * 4
    writer.flush()
    assert (writer.steps_written, writer.dropped_steps) == (2, 4)
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"], len(manifest["drop_reasons"])) == (2, 4, 4)
    writer.close()
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["dropped_steps"], manifest["status"]) == (2, 4, "finished")
    assert [k.step for k in Trace(tmp_path / "d").steps()] == [0, 1]


def _break_steps_dir(root: Path) -> None:
    """The steps folder becomes a file: every later write fails (a real OSError in the child)."""
    steps = root / "steps"
    for f in steps.iterdir():
        f.unlink()
    steps.rmdir()
    steps.write_text("not a folder")


def test_strict_mode_raises_the_childs_write_failure(tmp_path):
    writer = TraceWriter(tmp_path / "s", "grpo", writer="process", strict=True)
    writer.record(0, grpo_step(0))
    writer.flush()
    _break_steps_dir(tmp_path / "s")
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
    _break_steps_dir(tmp_path / "w")
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
    child = _child_of(writer)
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
sys.path.insert(0, {tests!r})
from test_writer_process import grpo_step
from tracer.writer import TraceWriter
from tracer.writer_process import RESULTS_EVERY_S
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
    script.write_text(_SCRIPT.format(tests=str(ROOT / "tests"), root=str(tmp_path / "run"), end=end))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True, **popen)
    child = int(proc.stdout.readline())
    return proc, child


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_a_killed_parent_leaves_the_steps_it_handed_over_and_no_process_or_shared_memory(tmp_path):
    before = _shm()
    proc, child = _run_script(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.wait(timeout=120) == -signal.SIGKILL
    assert _wait_gone(child), "the writer process outlived its parent"
    assert [k.step for k in Trace(tmp_path / "run").steps()] == list(range(10))
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["status"]) == (10, "running")  # nobody closed it
    assert _shm() <= before


def test_ctrl_c_closes_the_trace_and_the_child_writes_everything(tmp_path):
    """SIGINT to the whole process group (a Ctrl-C in the terminal): the training script dies of
    KeyboardInterrupt, its atexit closes the writer; the child ignored the signal and wrote all."""
    proc, child = _run_script(tmp_path, "time.sleep(60)", start_new_session=True)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) != 0
    assert _wait_gone(child)
    assert [k.step for k in Trace(tmp_path / "run").steps()] == list(range(10))
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert (manifest["steps_written"], manifest["status"]) == (10, "finished")


def test_the_environment_variable_chooses_the_writer(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACER_WRITER", "process")
    with TraceWriter(tmp_path / "env", "grpo") as writer:
        assert writer.writer == "process"
        writer.record(0, grpo_step(0))
    assert json.loads((tmp_path / "env" / "manifest.json").read_text())["capture"]["writer"] == "process"
    with TraceWriter(tmp_path / "sync", "grpo", async_write=False) as writer:  # writes inside record
        assert writer.writer == "inline"
    monkeypatch.setenv("TRACER_WRITER", "fork")
    with pytest.raises(TraceError, match=r"TRACER_WRITER='fork' is not one of \['thread', 'process'\]"):
        TraceWriter(tmp_path / "bad", "grpo")
    with pytest.raises(TraceError, match=r"writer='proc' is not one of"):
        TraceWriter(tmp_path / "bad2", "grpo", writer="proc")


def test_a_step_larger_than_the_ring_goes_through_the_pipe(tmp_path):
    with TraceWriter(tmp_path / "big", "grpo", writer="process", max_queue_bytes=256) as writer:
        for step in range(3):
            writer.record(step, grpo_step(step, B=8, T=64))  # ~6 KB per step
    trace = Trace(tmp_path / "big")
    for key in trace.steps():
        want = grpo_step(key.step, B=8, T=64)
        assert torch.equal(trace.load_step(key, derive=False)["policy_logprobs"], want["policy_logprobs"])
        assert verify_step_file(key.path) == trace.metadata(key)["content_sha256"]


def test_zero_edit_capture_and_paused_with_the_writer_process(tmp_path):
    """tracer.watch with writer="process": each backward outside paused() is one step."""
    from test_watch import tiny_loop

    with tracer.watch(algo="grpo", out=tmp_path / "w", writer="process") as w:
        tiny_loop(steps=2)
        with w.paused():
            tiny_loop(steps=3)
        tiny_loop(steps=1)
    assert w.writer.writer == "process" and w.steps_recorded == 3
    trace = Trace(tmp_path / "w")
    assert [k.step for k in trace.steps()] == [0, 1, 2]
    manifest = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert manifest["capture"]["writer"] == "process" and manifest["capture_report"]["steps_recorded"] == 3


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


def test_record_reads_the_childs_results_only_when_due_yet_the_bounds_hold(tmp_path, monkeypatch):
    """A record reads the result pipe (a syscall) at most every RESULTS_EVERY_S, not at each step;
    a step that finds the ring's step bound reached reads it at once, so the bound holds."""
    from tracer import writer_process

    polls = []
    real = writer_process.ProcessWriter.poll
    monkeypatch.setattr(writer_process.ProcessWriter, "poll", lambda self: (polls.append(1), real(self))[1])
    with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_steps=4) as writer:
        writer.record(0, grpo_step(0))
        writer.flush()
        process = writer._process
        process._polled_at = time.monotonic() + 3600  # no poll is due for the rest of the test
        polls.clear()
        for step in range(1, 4):
            writer.record(step, grpo_step(step))
        assert polls == []  # three records, no read of the result pipe
        for step in range(4, 12):  # the bound of 4 steps in flight is reached: each waits for results
            writer.record(step, grpo_step(step))
            assert len(process._inflight) <= 4
        assert polls
    assert [k.step for k in Trace(tmp_path / "p").steps()] == list(range(12))


def _lingering_child(monkeypatch, linger_s: float = 3600.0) -> list[int]:
    """Children started from now on linger ``linger_s`` for more steps (tracer.writer_child); the
    list receives the steps written by each batch the child reports."""
    from tracer import writer_process

    real_config, real_apply, batches = TraceWriter._child_config, writer_process.ProcessWriter._apply, []
    monkeypatch.setattr(TraceWriter, "_child_config", lambda self: {**real_config(self), "linger_s": linger_s})

    def apply(self, message):
        if message.get("k") == "done":
            batches.append(message.get("w", 0) + message.get("u", 0))
        return real_apply(self, message)

    monkeypatch.setattr(writer_process.ProcessWriter, "_apply", apply)
    return batches


def test_the_child_batches_the_steps_it_is_handed_and_a_flush_writes_them_at_once(tmp_path, monkeypatch):
    """Steps arriving one by one are written together (a batch's cold start is most of a small
    step's cost): none is written while the child lingers, and a flush ends the linger."""
    batches = _lingering_child(monkeypatch)
    with TraceWriter(tmp_path / "p", "grpo", writer="process") as writer:
        writer.record(0, grpo_step(0))
        writer.flush()  # the child is up and has written its first batch
        assert batches == [1]
        for step in range(1, 17):
            writer.record(step, grpo_step(step))
            writer._process.poll()
        time.sleep(0.5)  # the child has read them all by now, and lingers
        writer._process.poll()
        assert batches == [1] and len(list((tmp_path / "p").rglob("*.safetensors"))) == 1
        writer.flush()
        assert batches == [1, 16]
    assert [k.step for k in Trace(tmp_path / "p").steps()] == list(range(17))


def test_a_record_waiting_for_room_makes_a_lingering_child_write(tmp_path, monkeypatch):
    """A step that finds no room in the ring while the child lingers over a small one (less than
    half the bounds in hand, so it would linger on) tells the child to hurry: it writes what it
    holds and frees the room, instead of the record waiting out the linger, or the stall limit
    that would kill the child and warn."""
    from tracer.writer_process import ALIGN, _Layout

    batches = _lingering_child(monkeypatch)
    big = grpo_step(2, B=16, T=64)
    ring = _Layout(0, big, "float32").size + ALIGN  # the big step fits only in an empty ring
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stall warning (the child taken for hung) fails the test
        with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_bytes=ring, writer_stall_s=5,
                         strict=True) as writer:
            writer.record(0, grpo_step(0))
            writer.flush()
            pid = writer._process.pid
            writer.record(1, grpo_step(1))  # the child lingers over it
            writer.record(2, big)  # no room behind step 1: waits for the child to write it
            assert batches[:2] == [1, 1] and writer._process.dead is None and _alive(pid)
    assert [k.step for k in Trace(tmp_path / "p").steps()] == [0, 1, 2]


def test_a_layout_id_given_again_never_reuses_the_views_of_the_layout_it_replaces(tmp_path, monkeypatch):
    """Past MAX_LAYOUTS the next id is given to each new layout in turn; the ring views cached for
    an id (in the parent and in the child) must not serve the next layout of that id."""
    from tracer import writer_process

    monkeypatch.setattr(writer_process, "MAX_LAYOUTS", 1)
    shapes = [(4, 6), (2, 6), (3, 5), (2, 6), (4, 3), (3, 5)]
    recorded = {}
    with TraceWriter(tmp_path / "p", "grpo", writer="process", strict=True) as writer:
        for step, (B, T) in enumerate(shapes):
            recorded[step] = grpo_step(step, B, T)
            writer.record(step, recorded[step])
            writer.flush()  # each step at the ring's start: the same (id, offset) every time
    trace = Trace(tmp_path / "p")
    assert [k.step for k in trace.steps()] == list(range(len(shapes)))
    for key in trace.steps():
        got = trace.load_step(key, derive=False)
        for name, t in recorded[key.step].items():
            assert torch.equal(got[name].to(t.dtype), t), (key.step, name)
