"""The manifest says how a run ended, as ``tracer info --json`` and the Runs page show it: a hand-written
GRPO loop (a real TraceWriter with its defaults, in its own Python process) that raises without calling
``close()`` is ``crashed`` with the exception and the last step it recorded, not ``finished``; Ctrl-C
(SIGINT) is ``interrupted``; a normal exit without ``close()``, ``close()`` itself and a handled exception
stay ``finished``; a SIGTERM, which runs no Python code, leaves ``running`` (unfinished). The program's own
excepthook still runs and its exit status is unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tracer import TraceWriter, formulas
from tracer.cli import main
from tracer.record.writer import note_uncaught

from tests.fixtures.paths import REPO
from tests.fixtures.toy_traces import frame_with, start

# The loop records steps 0..3 (one GRPO step each: 2 prompts x 2 completions, policy = old on fresh
# rollouts), then ends as END says. It prints "ready" once step 3 is on disk, for the signal cases.
_LOOP = textwrap.dedent('''
    import os, signal, sys, threading, time
    import torch
    from tracer import TraceWriter, formulas

    # Ctrl-C as in a terminal: a test run started in the background by a non-interactive shell ignores
    # SIGINT, and this script would inherit that
    signal.signal(signal.SIGINT, signal.default_int_handler)

    out, end = sys.argv[1], sys.argv[2]

    def user_hook(kind, value, tb):  # the program's own hook: it must still run
        print(f"user hook saw {kind.__name__}", file=sys.stderr, flush=True)
        sys.__excepthook__(kind, value, tb)

    if end != "raise_hook_after":
        sys.excepthook = user_hook

    def step(seed):
        gen = torch.Generator().manual_seed(seed)
        old = -torch.rand(4, 6, generator=gen) * 3 - 0.05  # (B, T) nats
        rewards = torch.rand(4, generator=gen)
        return {"completion_ids": torch.randint(2, 9, (4, 6), generator=gen),
                "completion_mask": torch.ones(4, 6, dtype=torch.bool),
                "old_logprobs": old, "policy_logprobs": old.clone(), "rewards": rewards,
                "advantages": formulas.group_advantages(rewards, 2), "group_ids": torch.tensor([0, 0, 1, 1])}

    def train(writer):
        for s in range(4):
            writer.record(s, step(s))
        writer.flush()  # on disk before a signal that runs no Python code (SIGTERM)
        print("ready", flush=True)

    hp = {"num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "beta": 0.0}
    if end == "with_raises":
        with TraceWriter(out, "grpo", hyperparameters=hp) as writer:
            train(writer)
            raise RuntimeError("CUDA out of memory in step 4")
    writer = TraceWriter(out, "grpo", hyperparameters=hp)
    if end == "thread_raises":
        def worker():
            train(writer)
            raise RuntimeError("reward server went away")
        thread = threading.Thread(target=worker, name="trainer")
        thread.start()
        thread.join()
        sys.exit(0)  # the main thread ends normally: the run still crashed in its trainer thread
    train(writer)
    if end == "raise_hook_after":
        sys.excepthook = user_hook  # a hook set after the writer's, not calling it
        raise ValueError("loss is nan at step 4")
    if end == "raise":
        raise ValueError("loss is nan at step 4")
    if end == "finally_close":
        try:
            raise ValueError("loss is nan at step 4")
        finally:
            writer.close()
    if end == "handled":
        try:
            raise StopIteration  # the data loader is exhausted: handled, the run ends normally
        except StopIteration:
            writer.close()
    if end == "close":
        writer.close()
    if end in ("sigint", "sigterm"):
        time.sleep(60)  # the test sends the signal
''')
WAIT_FOR_SIGNAL = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM}
ENDS = ("raise", "raise_hook_after", "with_raises", "finally_close", "thread_raises", "sigint", "sigterm",
        "exit", "close", "handled")
NAN = "ValueError: loss is nan at step 4"


@pytest.fixture(scope="module")
def ended(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """Every ``END`` of the loop run once, side by side, under one root: ``(root, {end: process})``."""
    root = tmp_path_factory.mktemp("ends")
    script = root.parent / "loop.py"
    script.write_text(_LOOP)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRACER_GUARD": "off"}
    procs = {end: subprocess.Popen([sys.executable, str(script), str(root / end), end], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env) for end in ENDS}
    for end, sig in WAIT_FOR_SIGNAL.items():
        assert procs[end].stdout.readline() == "ready\n"  # steps 0..3 recorded
        procs[end].send_signal(sig)
    done = {}
    for end, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        done[end] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return root, done


def info(path: Path, capsys) -> dict:
    """``tracer info --json PATH``, parsed."""
    assert main(["info", "--json", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


def crash(exception: str, message: str, closed_by: str, thread: str = "MainThread") -> dict:
    return {"closed_by": closed_by, "last_step": 3, "exception": exception, "message": message, "thread": thread}


# status, ended, status_text: what each end must leave, written out by hand
EXPECTED = {
    "raise": ("crashed", crash("ValueError", "loss is nan at step 4", "exit"),
              f"crashed after recording step 3: {NAN}"),
    "raise_hook_after": ("crashed", crash("ValueError", "loss is nan at step 4", "exit"),
                         f"crashed after recording step 3: {NAN}"),
    "with_raises": ("crashed", crash("RuntimeError", "CUDA out of memory in step 4", "with"),
                    "crashed after recording step 3: RuntimeError: CUDA out of memory in step 4"),
    "finally_close": ("crashed", crash("ValueError", "loss is nan at step 4", "close"),
                      f"crashed after recording step 3: {NAN}"),
    "thread_raises": ("crashed", crash("RuntimeError", "reward server went away", "exit", thread="trainer"),
                      "crashed after recording step 3: RuntimeError: reward server went away (in thread trainer)"),
    "sigint": ("interrupted", crash("KeyboardInterrupt", "", "exit"),
               "interrupted after recording step 3: KeyboardInterrupt"),
    "sigterm": ("running", None, "unfinished (the writer did not close: crashed or still running)"),
    "exit": ("finished", {"closed_by": "exit", "last_step": 3}, "finished"),
    "close": ("finished", {"closed_by": "close", "last_step": 3}, "finished"),
    "handled": ("finished", {"closed_by": "close", "last_step": 3}, "finished"),
}


@pytest.mark.parametrize("end", ENDS)
def test_tracer_info_says_how_the_run_ended(ended, end, capsys):
    root, _ = ended
    got = info(root / end, capsys)
    assert (got["status"], got["ended"], got["status_text"]) == EXPECTED[end]
    assert got["steps"] == [0, 1, 2, 3]  # every recorded step is on disk, whatever the end


def test_the_program_exits_as_it_would_without_tracer_and_its_own_hook_runs(ended):
    _, procs = ended
    for end in ("raise", "finally_close"):
        assert procs[end].returncode == 1, procs[end].stderr
        # the user's hook ran (it prints the traceback through sys.__excepthook__), and once
        assert procs[end].stderr.count("user hook saw ValueError") == 1, procs[end].stderr
        assert procs[end].stderr.rstrip().endswith(NAN), procs[end].stderr
    assert procs["raise_hook_after"].stderr.count("user hook saw ValueError") == 1
    assert procs["with_raises"].stderr.count("user hook saw RuntimeError") == 1
    # Python ends an uncaught KeyboardInterrupt by SIGINT, as without tracer; SIGTERM's default action kills
    assert (procs["sigint"].returncode, procs["sigterm"].returncode) == (-signal.SIGINT, -signal.SIGTERM)
    assert "KeyboardInterrupt" in procs["sigint"].stderr
    for end in ("exit", "close", "handled", "thread_raises"):
        assert procs[end].returncode == 0, procs[end].stderr
    assert "RuntimeError: reward server went away" in procs["thread_raises"].stderr  # threading's own hook printed it
    assert all("tracer:" not in proc.stderr for proc in procs.values())  # no warning of tracer's own


def test_the_runs_page_shows_each_run_as_it_ended(ended, monkeypatch):
    root, _ = ended
    at = start(monkeypatch, root)
    assert not at.exception
    table = frame_with(at, {"run", "status"}).value.set_index("run")
    assert table["status"].to_dict() == {end: text for end, (_, _, text) in EXPECTED.items()}


def test_a_runner_that_catches_the_scripts_exception_can_say_it_ended_the_run(tmp_path):
    """``note_uncaught``: what a runner calls when it catches the script's exception itself (the hooks never
    hear of it); the writer then closes as ``crashed``, with that exception and the last step recorded."""
    writer = TraceWriter(tmp_path / "run", "grpo", async_write=False, guard="off")
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    for step in range(3):
        old = torch.full((4, 2), -1.0)
        writer.record(step, {"old_logprobs": old, "policy_logprobs": old.clone(), "rewards": rewards,
                             "advantages": formulas.group_advantages(rewards, 2),
                             "group_ids": torch.tensor([0, 0, 1, 1]), "completion_mask": torch.ones(4, 2, dtype=torch.bool)})
    try:
        raise KeyError("reward_fn")
    except KeyError as err:
        note_uncaught(err)
    writer.close()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    # str(KeyError("reward_fn")) is the key's repr, quotes included
    assert (manifest["status"], manifest["ended"]) == ("crashed", crash("KeyError", "'reward_fn'", "close") | {"last_step": 2})
