"""Crash safety: a traced loop (tests/scripts/crash_loop.py) killed with SIGKILL at seeded random
points. Afterwards every step reported complete (its ``flush()`` returned) is readable and holds
the values derived from its step number, every step file the reader lists is complete (a kill
during a write leaves at most an unlisted temporary file), and ``info`` says the trace is
unfinished and lists what it holds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tracer import Trace, TraceFormatError
from tracer.cli import main
from tracer.read.trace_info import trace_info

from tests.fixtures.paths import SCRIPTS

SCRIPT = SCRIPTS / "crash_loop.py"
_spec = importlib.util.spec_from_file_location("crash_loop", SCRIPT)
crash_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_loop)

RUNS = int(os.environ.get("TRACER_CRASH_RUNS", "30"))  # more for a longer campaign
STEPS = 40
LINE_TIMEOUT_S = 60


class Zygote:
    """The crash_loop.py process: send RUN lines, read reply lines with a timeout."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.buffer = b""
        self.history: list[str] = []  # every line sent and received, for failure messages

    def send(self, line: str) -> None:
        self.history.append(f"<- {line}")
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def line(self) -> str:
        deadline = time.monotonic() + LINE_TIMEOUT_S
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                raise AssertionError(f"crash_loop.py said nothing for {LINE_TIMEOUT_S} s")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"crash_loop.py ended (exit code {self.proc.wait()})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        self.history.append(f"-> {line.decode()}")
        return line.decode()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def run_and_kill(zygote: Zygote, out: Path, seed: int) -> tuple[list[int], bool]:
    """One loop, killed after a random number of reported steps plus a random delay; returns the
    steps reported complete and whether the loop closed before the kill landed."""
    rng = random.Random(seed)
    kill_after, delay = rng.randint(0, STEPS - 5), rng.uniform(0, 0.03)
    zygote.send(f"RUN {out} {seed} {STEPS}")
    first = zygote.line()
    assert first.startswith("PID "), "\n".join(zygote.history[-60:])
    pid = int(first.split()[1])
    done, closed = [], False
    while len(done) < kill_after and not closed:
        closed = read_line(zygote, pid, done) == "CLOSED"
    if not closed:
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)  # safe: the zygote reaps the pid only after REAP
    zygote.send("REAP")
    while (kind := read_line(zygote, pid, done)) != "EXIT":
        closed = closed or kind == "CLOSED"
    return done, closed


def read_line(zygote: Zygote, pid: int, done: list[int]) -> str:
    """Read one line of loop ``pid`` and return its kind; DONE steps are appended to ``done``."""
    kind, who, *rest = zygote.line().split()
    assert int(who) == pid, "a line from another process:\n" + "\n".join(zygote.history[-60:])
    if kind == "DONE":
        done.append(int(rest[0]))
    elif kind not in ("CLOSED", "EXIT"):
        raise AssertionError(f"crash_loop.py: {kind} {who} {' '.join(rest)}")
    return kind


def verify(out: Path, done: list[int], closed: bool) -> dict[str, int]:
    """Everything reported is there and right; what is listed is complete; info says unfinished."""
    partials = len([p for p in (out / "steps").glob("*") if not p.name.endswith(".safetensors")]) \
        if (out / "steps").is_dir() else 0
    try:
        trace = Trace(out)
    except TraceFormatError:
        assert not done, f"{out}: steps {done} were reported complete but the trace does not open"
        return {"listed": 0, "unreported": 0, "partials": partials}
    listed = [k.step for k in trace.steps()]
    assert set(done) <= set(listed), f"reported complete but missing: {sorted(set(done) - set(listed))}"
    assert trace.scan() == {}, trace.scan()
    for key in trace.steps():  # listed means complete, reported or not
        assert key.path.suffix == ".safetensors"
        got = trace.load_step(key)
        for name, want in crash_loop.step_tensors(key.step).items():
            assert torch.equal(got[name], want.to(got[name].dtype)), (key.step, name)
    info = trace_info(out)
    assert info["steps"] == sorted(listed) and info["num_step_files"] == len(listed)
    if not closed and trace.status == "finished":
        # the kill landed after close() had finished but before the loop said CLOSED: a finished trace,
        # which then holds every step the loop records and counts them all
        assert trace.manifest["steps_written"] == len(listed) and sorted(listed) == list(range(len(listed)))
    elif not closed:
        assert trace.status == "running"
        assert info["status_text"] == "unfinished (the writer did not close: crashed or still running)"
    return {"listed": len(listed), "unreported": len(listed) - len(done), "partials": partials}


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def test_sigkill_at_random_points_loses_nothing_reported(zygote, tmp_path, capsys):
    totals = {"kills": 0, "closed_first": 0, "reported": 0, "listed": 0, "unreported": 0, "partials": 0}
    for run in range(RUNS):
        out = tmp_path / f"run{run}"
        done, closed = run_and_kill(zygote, out, seed=1000 + run)
        stats = verify(out, done, closed)
        totals["kills"] += not closed
        totals["closed_first"] += closed
        totals["reported"] += len(done)
        for key in ("listed", "unreported", "partials"):
            totals[key] += stats[key]
    with capsys.disabled():
        print(f"\ncrash test: {totals}")
    assert totals["kills"] >= 20 and totals["closed_first"] < RUNS // 2


def test_info_of_a_killed_run_says_unfinished_and_lists_steps(zygote, tmp_path, capsys):
    out = tmp_path / "killed"
    done, closed = run_and_kill(zygote, out, seed=7)  # kills after 1+ reported steps
    assert done and not closed
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "status: unfinished (the writer did not close: crashed or still running)" in text
    assert f"steps: 0..{max(k.step for k in Trace(out).steps())}" in text


def test_check_of_a_killed_run_says_unfinished(zygote, tmp_path, capsys):
    out = tmp_path / "killed"
    done, closed = run_and_kill(zygote, out, seed=7)
    assert done and not closed
    main(["check", str(out), "--json"])  # the exit code is that of crash_loop's tensors, not asserted
    findings = json.loads(capsys.readouterr().out)
    assert [(f["severity"], f["path"]) for f in findings if f["check"] == "trace.unfinished"] \
        == [("info", str(out / "manifest.json"))]
