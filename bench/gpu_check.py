"""GPU check (run when a GPU is lent): tracing overhead on a GPU loop, and values identical to a
synchronous copy even when the loop overwrites its tensors right after record().

    python -m bench.gpu_check            # prints the ratio and the value check; exit 1 on a mismatch

Targets: overhead <= 1.01; every recorded tensor equal to a synchronous .cpu() copy.
"""

from __future__ import annotations

import sys
import tempfile

import torch

from bench.common import grpo_step_tensors, machine, median, timed
from tracer import Trace
from tracer.writer import TraceWriter


def values_identical(steps: int = 20) -> bool:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        expected = []
        with TraceWriter(tmp + "/run", "grpo", max_queue_steps=4) as w:
            for step in range(steps):
                t = grpo_step_tensors(64, 1024, device="cuda", seed=step)
                expected.append({k: v.cpu() for k, v in t.items()})  # synchronous copy
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


def overhead(rounds: int = 7, steps: int = 20) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(512, 2048, device="cuda")

    def loop(writer):
        for step in range(steps):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if writer is not None:
                writer.record(step, grpo_step_tensors(64, 1024, device="cuda", seed=step))
        torch.cuda.synchronize()

    loop(None)
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            off.append(timed(loop, None))

            def traced(i=r):
                with TraceWriter(f"{tmp}/r{i}", "grpo") as w:
                    loop(w)
            on.append(timed(traced))
    return median(on) / median(off)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a GPU machine")
    print(machine())
    same = values_identical()
    ratio = overhead()
    print(f"gpu values identical to a synchronous copy: {same}")
    print(f"gpu overhead ratio: {ratio:.4f} (target <= 1.01)")
    sys.exit(0 if same else 1)
