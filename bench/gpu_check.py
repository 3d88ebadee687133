"""GPU check (run when a GPU is lent): tracing overhead on a GPU loop, and values identical to a
synchronous copy even when the loop overwrites its tensors right after record().

    python -m bench.gpu_check            # prints the ratios and the value checks; exit 1 on a mismatch
    python -m bench.gpu_check --overhead-only --batch 8192,32768 --steps 60

Three parts: explicit ``record()`` of GRPO steps of 64 x 1024 whose tensors the loop overwrites at
once, while the GPU is still busy; a hand-written GRPO loop traced with zero edits
(``tracer.watch``) that overwrites its tensors after each backward; the overhead of recording a
step's 14 fields in a GPU training loop; beside it, ``stage()`` of those fields alone, the GPU idle.
Targets: every recorded tensor equal to a synchronous
``.cpu()`` copy taken at record time; overhead <= 1.01.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from bench.common import grpo_step_tensors, machine, median
from bench.loops import _alternate
from tracer import Trace
from tracer.record.writer import TraceWriter


def values_identical(steps: int = 20) -> bool:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        expected = []
        with TraceWriter(tmp + "/run", "grpo", max_queue_steps=4) as w:
            for step in range(steps):
                t = grpo_step_tensors(64, 1024, device="cuda", seed=step)
                expected.append({k: v.cpu() for k, v in t.items()})  # synchronous copy
                busy = torch.ones(4096, 4096, device="cuda")
                for _ in range(8):  # the GPU is still busy when record() queues its copies and the loop its overwrite
                    busy = busy @ busy / 4096
                w.record(step, t)
                for v in t.values():  # the loop reuses its buffers at once, on the default stream
                    v.zero_() if v.dtype != torch.bool else v.logical_not_()
        trace = Trace(tmp + "/run")
        for key in trace.steps():
            got = trace.load_step(key)
            for name, want in expected[key.step].items():
                if not torch.equal(got[name].to(want.dtype), want):
                    print(f"MISMATCH step {key.step} field {name}")
                    ok = False
    return ok


def zero_edit_identical(device: str = "cuda", steps: int = 3) -> bool:
    """A hand-written GRPO loop on ``device`` traced with zero edits (``tracer.watch``: every
    ``loss.backward()`` captured by name): each step's recorded tensors equal a synchronous copy
    taken just before the backward."""
    import contextlib
    import io

    from tracer.zero_edit import watch

    torch.manual_seed(0)
    B, T, V = 8, 16, 64
    policy = torch.nn.Sequential(torch.nn.Embedding(V, 32), torch.nn.Linear(32, V)).to(device)
    expected = []
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()), watch(algo="grpo", out=f"{tmp}/run"):
            for step in range(steps):
                completion_ids = torch.randint(0, V, (B, T), device=device)
                completion_mask = torch.rand(B, T, device=device) > 0.2
                logits = policy(completion_ids)
                policy_logprobs = torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
                old_logprobs = policy_logprobs.detach() + 0.01 * torch.randn(B, T, device=device)
                advantages = torch.randn(B, device=device)
                ratio = torch.exp(policy_logprobs - old_logprobs)
                per_token_loss = -ratio * advantages.unsqueeze(1)
                loss = (per_token_loss * completion_mask).sum() / completion_mask.sum()
                expected.append({name: t.detach().to("cpu", copy=True) for name, t in (
                    ("policy_logprobs", policy_logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages),
                    ("completion_mask", completion_mask), ("ratio", ratio))})
                loss.backward()
                for t in (old_logprobs, advantages):  # the loop reuses its buffers at once
                    t.zero_()
        trace = Trace(f"{tmp}/run")
        keys = trace.steps()
        ok = len(keys) == steps
        if not ok:
            print(f"MISMATCH zero-edit: {len(keys)} steps recorded, {steps} expected")
        for key, want in zip(keys, expected):
            got = trace.load_step(key)
            for name, value in want.items():
                if name not in got or not torch.equal(got[name].to(value.dtype), value):
                    print(f"MISMATCH zero-edit step {key.step} field {name}")
                    ok = False
    return ok


def overhead(batch: int, rounds: int = 7, steps: int = 20) -> dict:
    """Traced/plain wall time of a GPU training loop (8 linear layers of 2048, ``batch`` rows: the GPU
    work per step) that also produces a GRPO step's 14 fields of 64 x 1024 on the GPU (both loops
    produce them; only the traced one records them). One writer for the whole measurement, opened
    before the first timed block, as in a run; each traced block ends with its ``flush()`` (the
    writer's queued work, counted against tracing). Blocks alternate, the order rotating by round
    (:func:`bench.loops._alternate`); the ratio is median(traced) / median(plain), ``paired`` the
    geometric mean of the per-round ratios with its 95% bootstrap interval. Also: the plain step in ms, and the median time one
    ``record()`` holds the training thread, in microseconds, and the flush that closes each traced
    block (it waits for the GPU to reach the block's last step, as the plain block's synchronize
    does, and then for the writing still queued)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(batch, 2048, device="cuda")
    base = grpo_step_tensors(64, 1024, device="cuda", seed=0)
    held: list[float] = []
    drains: list[float] = []

    def loop(writer, first: int = 0):
        for step in range(first, first + steps):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            fields = {k: v.clone() for k, v in base.items()}  # the step's quantities, made on the GPU
            if writer is not None:
                t0 = time.perf_counter()
                writer.record(step, fields)
                held.append(time.perf_counter() - t0)
        if writer is not None:
            t0 = time.perf_counter()
            writer.flush()  # waits for the GPU to reach the last step, then for its writing
            drains.append(time.perf_counter() - t0)
        torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as tmp, TraceWriter(f"{tmp}/run", "grpo") as w:
        loop(None)
        loop(w, first=0)  # warm-up: the writer's first step, the pinned buffers
        held.clear()
        drains.clear()
        res = _alternate(lambda: loop(None), lambda r: loop(w, first=(r + 1) * steps), rounds)
    return {"ratio": res["ratio"], "paired": res["paired"], "step_ms": 1e3 * res["off_s"] / steps,
            "held_us": 1e6 * median(held), "block_ms": 1e3 * res["off_s"], "drain_ms": 1e3 * median(drains)}


def stage_alone(calls: int = 200) -> float:
    """Median microseconds of :func:`tracer.record.capture.stage` of the 14 fields of 64 x 1024 (one group of
    pinned buffers, its copies queued, one event) with the GPU idle, buffers handed back after each:
    the training thread's own cost of the copies, beside ``record()``'s time in the loop, which also
    waits wherever the loop's launches wait."""
    from tracer.record.capture import BufferPool, stage

    fields = grpo_step_tensors(64, 1024, device="cuda", seed=0)
    key = tuple((name, t.shape, t.dtype, t.device) for name, t in fields.items())
    pool, times = BufferPool(), []
    for _ in range(calls):
        t0 = time.perf_counter()
        _, event, buffers, _ = stage(fields, pool, group_key=key)
        times.append(time.perf_counter() - t0)
        event.synchronize()
        pool.give(buffers)
    return 1e6 * median(times[calls // 10:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="512,8192", help="rows of the training loop's input, comma-separated: "
                        "one overhead measurement each (512: a 3 ms step on an H200, 8192: 32 ms)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--overhead-only", action="store_true", help="skip the two value checks")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a GPU machine")
    print(machine())
    same = captured = True
    if not args.overhead_only:
        same = values_identical()
        captured = zero_edit_identical()
        print(f"gpu values identical to a synchronous copy: {same}")
        print(f"gpu zero-edit capture (tracer.watch) identical to a synchronous copy: {captured}")
    print(f"stage() of the 14 fields of 64 x 1024, GPU idle: {stage_alone():.0f} us")
    for batch in (int(b) for b in args.batch.split(",")):
        res = overhead(batch, rounds=args.rounds, steps=args.steps)
        print(f"gpu overhead ratio, {res['step_ms']:.1f} ms step (batch {batch}, {args.steps} steps a block): "
              f"{res['ratio']:.4f} (paired {res['paired'][0]:.4f}, 95% {res['paired'][1]:.4f}-{res['paired'][2]:.4f}; "
              f"target <= 1.01); record() holds the training thread {res['held_us']:.0f} us; "
              f"the flush closing a traced block {res['drain_ms']:.1f} ms (plain block {res['block_ms']:.0f} ms)")
    sys.exit(0 if same and captured else 1)


if __name__ == "__main__":
    main()
