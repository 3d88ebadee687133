"""What the writer costs per step file, in CPU time. The writer thread (``--writer
thread``, the default): its CPU time handling batches, the time it holds the interpreter lock beside
the training loop, so what a loop of small steps pays for tracing. The writer process (``--writer
process``): all the CPU time of the child process over the steps (read from
``/proc/<pid>/task/*/schedstat``: its waking for each message, reading the pipe and lingering included),
CPU that a training process using the other cores no longer has.

Each shape is recorded ``steps`` times, ``gap_ms`` apart (the rest of a training step), through a
real ``TraceWriter``; the writer thread's ``time.thread_time()`` is summed around its handling of
each batch of steps. CPU time, not wall time: it does not move with the load of other processes
the way a wall-clock ratio does. With ``--compare DIR`` the same measurement runs, alternating, on
the ``tracer`` package of another checkout (e.g. a ``git worktree`` of the commit before), and the
ratio is printed side by side.

With ``--gap-work`` the gap is spent multiplying a 256 x 1024 by a 1024 x 1024 matrix (4 MB of
weights streamed, like a training step) instead of sleeping, so that each batch starts with the
caches the loop left, as in a run; ``--linger S`` sets the writer process's wait for more steps to
batch with (:data:`tracer.record.process.child.CHILD_LINGER_S`, 0.25 s, otherwise).

    python -m bench.writer_cost [--steps 300] [--rounds 3] [--writer thread|process]
                                [--gap-ms 4] [--gap-work] [--linger S]
                                [--compare /path/to/old/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # name: (B, T, L, fields): the toy GRPO step of bench/loops.py and a MiniMind PPO minibatch
    "toy GRPO step, 14 fields, B=8 T=16": (8, 16, 16, "grpo"),
    "PPO minibatch, 19 fields, B=4 T=16": (4, 16, 16, "ppo"),
}


def _tensors(B: int, T: int, L: int, kind: str) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    policy = -3 * torch.rand(B, T, generator=g)
    old = policy + 0.05 * torch.randn(B, T, generator=g)
    ref = policy + 0.05 * torch.randn(B, T, generator=g)
    out = {"prompt_ids": torch.randint(0, 500, (B, L), generator=g), "prompt_mask": torch.ones(B, L, dtype=torch.bool),
           "completion_ids": torch.randint(0, 500, (B, T), generator=g),
           "completion_mask": torch.ones(B, T, dtype=torch.bool), "policy_logprobs": policy, "old_logprobs": old,
           "ref_logprobs": ref, "ratio": torch.exp(policy - old), "approx_kl_k2": 0.5 * (policy - old) ** 2,
           "ref_kl_k3": torch.exp(ref - policy) - (ref - policy) - 1, "per_token_loss": torch.randn(B, T, generator=g),
           "loss": torch.tensor(0.5), "rewards": torch.rand(B, generator=g)}
    if kind == "grpo":
        out.update(advantages=torch.randn(B, generator=g), group_ids=torch.arange(B) // 4)
    else:
        out.update(advantages=torch.randn(B, T, generator=g), returns=torch.randn(B, T, generator=g),
                   values=torch.randn(B, T, generator=g), token_rewards=torch.randn(B, T, generator=g),
                   row_ids=torch.arange(B), reward_components=torch.rand(B, 2, generator=g))
    return out


def _child_cpu_s(writer) -> float:
    """The writer process's CPU time so far (seconds, all its threads), from the kernel's schedstat."""
    total = 0
    for task in Path(f"/proc/{writer._process.pid}/task").iterdir():
        try:
            with open(task / "schedstat") as fh:
                total += int(fh.read().split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile (its time is lost with it)
            pass
    return total / 1e9


def _gap(gap_ms: float, work: bool):
    """What runs between two steps: a sleep, or (``work``) matrix products for as long."""
    import torch

    if not work:
        return lambda: time.sleep(gap_ms / 1e3)
    a, w = torch.randn(256, 1024), torch.randn(1024, 1024)

    def busy() -> None:
        end = time.perf_counter() + gap_ms / 1e3
        while time.perf_counter() < end:
            torch.mm(a, w)
    return busy


def child(steps: int, gap_ms: float, kind_of_writer: str = "thread", gap_work: bool = False,
          linger: float | None = None) -> dict:
    """Measure in this process (the ``tracer`` package first on sys.path)."""
    import torch

    from tracer.record.writer import TraceWriter

    torch.set_num_threads(1)
    from tracer.record.batches import BatchHandler as owner  # where the write side handles a batch
    name = "handle"
    real = getattr(owner, name)
    spent = {"cpu": 0.0}

    def timed(self, work):
        t0 = time.thread_time()
        try:
            return real(self, work)
        finally:
            spent["cpu"] += time.thread_time() - t0

    setattr(owner, name, timed)
    if linger is not None:
        own_config = TraceWriter._child_config
        TraceWriter._child_config = lambda self: {**own_config(self), "linger_s": linger}
    gap = _gap(gap_ms, gap_work)
    out = {}
    hyper = {"num_generations": 4, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28, "beta": 0.04}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TRACER_BENCH_TMP")) as tmp:
        for label, (B, T, L, kind) in SHAPES.items():
            tensors = _tensors(B, T, L, kind)
            spent["cpu"] = 0.0
            with TraceWriter(f"{tmp}/{kind}", kind, hyperparameters=hyper, writer=kind_of_writer) as writer:
                if kind_of_writer == "process":  # its start (importing torch) and first file left out
                    writer.record(steps, tensors)
                    writer.flush()
                    before = _child_cpu_s(writer)
                for step in range(steps):
                    writer.record(step, tensors)
                    gap()
                if kind_of_writer == "process":
                    writer.flush()
                    spent["cpu"] = _child_cpu_s(writer) - before
            out[label] = 1e6 * spent["cpu"] / steps
    return out


def _run(root: Path, steps: int, gap_ms: float, writer: str = "thread", gap_work: bool = False,
         linger: float | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    extra = (["--gap-work"] if gap_work else []) + (["--linger", str(linger)] if linger is not None else [])
    done = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps), "--gap-ms", str(gap_ms),
                           "--writer", writer, *extra],
                          env=env, capture_output=True, text=True, check=True, cwd=str(root))
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(steps: int = 300, rounds: int = 3, gap_ms: float = 4.0, compare: str | None = None,
            writer: str = "thread", gap_work: bool = False, linger: float | None = None) -> dict:
    roots = {"this": REPO} | ({"compare": Path(compare).resolve()} if compare else {})
    runs: dict[str, list[dict]] = {k: [] for k in roots}
    for r in range(rounds):
        for key in (list(roots) if r % 2 == 0 else list(roots)[::-1]):
            runs[key].append(_run(roots[key], steps, gap_ms, writer, gap_work, linger))
    med = {k: {label: sorted(run[label] for run in v)[len(v) // 2] for label in SHAPES} for k, v in runs.items()}
    return {"median_us": med, "runs": runs, "steps": steps, "rounds": rounds, "gap_ms": gap_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=4.0)
    parser.add_argument("--compare", help="another checkout whose tracer/ to measure beside this one")
    parser.add_argument("--writer", choices=("thread", "process"), default="thread")
    parser.add_argument("--gap-work", action="store_true", help="fill the gap with matrix products, not a sleep")
    parser.add_argument("--linger", type=float, help="the writer process's linger in seconds (process writer only)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.linger is not None and args.writer != "process":
        parser.error("--linger sets the writer process's wait: use it with --writer process")
    if args.child:
        print(json.dumps(child(args.steps, args.gap_ms, args.writer, args.gap_work, args.linger)))
        return
    sys.path.insert(0, str(REPO))
    from bench.common import machine

    print(machine())
    res = measure(args.steps, args.rounds, args.gap_ms, args.compare, args.writer, args.gap_work, args.linger)
    for label in SHAPES:
        this = res["median_us"]["this"][label]
        what = "writer thread CPU" if args.writer == "thread" else "writer process CPU (all of the child)"
        line = f"{what} per step file, {label}: {this:.0f} us"
        if args.compare:
            other = res["median_us"]["compare"][label]
            line += f" vs {other:.0f} us in {args.compare} ({this / other:.2f}x)"
        gap = f"{args.gap_ms:g} ms apart" + (" (matrix products between)" if args.gap_work else "")
        linger = f", linger {args.linger:g} s" if args.linger is not None else ""
        print(line + f"  (median of {args.rounds} runs x {args.steps} steps, {gap}{linger})")


if __name__ == "__main__":
    main()
