"""A traced synthetic training loop for crash tests, run as a zygote: it imports torch and tracer
once, then forks one loop per request so that each run starts in milliseconds.

    python tests/scripts/crash_loop.py        (driven by tests/reliability/test_crash.py)

Protocol (one line each, on stdin / stdout):
    <- RUN <out_dir> <seed> <steps>
    -> PID <pid>            the forked loop started (before its TraceWriter exists)
    -> DONE <pid> <step>    after ``flush()`` returned for that step: it is reported complete
    -> CLOSED <pid>         the loop ended and closed its writer (it was not killed in time)
    <- REAP                 the test has sent its SIGKILL (or will not): wait for the loop
    -> EXIT <pid> <status>  the loop is gone (killed by the test, or ended)

The loop is reaped only after REAP, so its pid stays taken (a zombie at worst) while the test may
still signal it.

The loop records steps whose values are derived from the step number (:func:`step_tensors`),
flushes every 1-3 steps, and sleeps a random 0-4 ms between steps.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tracer import TraceWriter  # noqa: E402

B, T = 8, 256


def step_tensors(step: int) -> dict[str, torch.Tensor]:
    """One GRPO step whose every value is a function of ``step`` (so a reader can verify it)."""
    flat = torch.arange(B * T)
    completion_mask = torch.arange(T).expand(B, T) <= ((step + torch.arange(B)) % T).unsqueeze(1)  # (B, T)
    policy = -(flat.float() / (B * T) + step).reshape(B, T)  # (B, T) nats
    return {
        "completion_ids": ((flat + step) % 1000).reshape(B, T),
        "completion_mask": completion_mask,
        "policy_logprobs": policy,
        "old_logprobs": policy - 0.5,
        "rewards": torch.arange(B, dtype=torch.float32) + step,
        "advantages": torch.full((B,), float(step)),
        "group_ids": torch.arange(B) // 2,
    }


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write per line: lines from parent and child never mix


def loop(out_dir: str, seed: int, steps: int) -> None:
    torch.set_num_threads(1)
    rng = random.Random(seed)
    say(f"PID {os.getpid()}")
    writer = TraceWriter(out_dir, "grpo", hyperparameters={"num_generations": 2}, max_queue_steps=4)
    pending: list[int] = []
    for step in range(steps):
        writer.record(step, step_tensors(step))
        pending.append(step)
        if len(pending) >= rng.randint(1, 3):
            writer.flush()
            for done in pending:
                say(f"DONE {os.getpid()} {done}")
            pending = []
        time.sleep(rng.uniform(0, 0.004))
    writer.close()
    for done in pending:
        say(f"DONE {os.getpid()} {done}")
    say(f"CLOSED {os.getpid()}")


def main() -> None:
    while line := sys.stdin.readline():
        _, out_dir, seed, steps = line.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                loop(out_dir, int(seed), int(steps))
            except BaseException as err:  # report, never fall back into the zygote's loop
                say(f"ERROR {os.getpid()} {type(err).__name__}: {err}")
                code = 1
            finally:
                os._exit(code)
        assert sys.stdin.readline().strip() == "REAP"
        _, status = os.waitpid(pid, 0)
        say(f"EXIT {pid} {status}")


if __name__ == "__main__":
    main()
