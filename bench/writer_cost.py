"""What the writer thread costs per step file, in CPU time on that thread (issue 16): the time it
holds the interpreter lock beside the training loop, so what a loop of small steps pays for tracing.

Each shape is recorded ``steps`` times, ``gap_ms`` apart (the rest of a training step), through a
real ``TraceWriter``; the writer thread's ``time.thread_time()`` is summed around its handling of
each batch of steps. CPU time, not wall time: it does not move with the load of other processes
the way a wall-clock ratio does. With ``--compare DIR`` the same measurement runs, alternating, on
the ``tracer`` package of another checkout (e.g. a ``git worktree`` of the commit before), and the
ratio is printed side by side.

    python -m bench.writer_cost [--steps 300] [--rounds 3] [--compare /path/to/old/checkout]
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


def child(steps: int, gap_ms: float) -> dict:
    """Measure in this process (the ``tracer`` package first on sys.path)."""
    import torch

    import tracer.capture as capture
    from tracer.writer import TraceWriter

    torch.set_num_threads(1)
    try:  # where a batch is handled: tracer.batches.BatchHandler since the writer process; before, the writer
        from tracer.batches import BatchHandler as owner
        name = "handle"
    except ImportError:
        owner = capture.BackgroundWriter
        name = "_handle_batch" if hasattr(owner, "_handle_batch") else "_handle"
    real = getattr(owner, name)
    spent = {"cpu": 0.0}

    def timed(self, work):
        t0 = time.thread_time()
        try:
            return real(self, work)
        finally:
            spent["cpu"] += time.thread_time() - t0

    setattr(owner, name, timed)
    out = {}
    hyper = {"num_generations": 4, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28, "beta": 0.04}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TRACER_BENCH_TMP")) as tmp:
        for label, (B, T, L, kind) in SHAPES.items():
            tensors = _tensors(B, T, L, kind)
            spent["cpu"] = 0.0
            with TraceWriter(f"{tmp}/{kind}", kind, hyperparameters=hyper) as writer:
                for step in range(steps):
                    writer.record(step, tensors)
                    time.sleep(gap_ms / 1e3)
            out[label] = 1e6 * spent["cpu"] / steps
    return out


def _run(root: Path, steps: int, gap_ms: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, __file__, "--child", "--steps", str(steps), "--gap-ms", str(gap_ms)],
                          env=env, capture_output=True, text=True, check=True, cwd=str(root))
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(steps: int = 300, rounds: int = 3, gap_ms: float = 4.0, compare: str | None = None) -> dict:
    roots = {"this": REPO} | ({"compare": Path(compare).resolve()} if compare else {})
    runs: dict[str, list[dict]] = {k: [] for k in roots}
    for r in range(rounds):
        for key in (list(roots) if r % 2 == 0 else list(roots)[::-1]):
            runs[key].append(_run(roots[key], steps, gap_ms))
    med = {k: {label: sorted(run[label] for run in v)[len(v) // 2] for label in SHAPES} for k, v in runs.items()}
    return {"median_us": med, "runs": runs, "steps": steps, "rounds": rounds, "gap_ms": gap_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-ms", type=float, default=4.0)
    parser.add_argument("--compare", help="another checkout whose tracer/ to measure beside this one")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.steps, args.gap_ms)))
        return
    sys.path.insert(0, str(REPO))
    from bench.common import machine

    print(machine())
    res = measure(args.steps, args.rounds, args.gap_ms, args.compare)
    for label in SHAPES:
        this = res["median_us"]["this"][label]
        line = f"writer thread CPU per step file, {label}: {this:.0f} us"
        if args.compare:
            other = res["median_us"]["compare"][label]
            line += f" vs {other:.0f} us in {args.compare} ({this / other:.2f}x)"
        print(line + f"  (median of {args.rounds} runs x {args.steps} steps, {args.gap_ms:g} ms apart)")


if __name__ == "__main__":
    main()
