"""The fixed cost of ``record()`` on the training thread: 14 small fields (B = 8, T = 16, the 4 ms
toy step), beside a plain ``clone()`` of the same tensors.

Each round records ``steps`` steps with a pause of ``gap_ms`` between them (the rest of a training
step: the writer drains meanwhile, as in a loop), alternating which of record() and the plain copy
comes first after the pause. Reported: the median over rounds of each round's median, with the
spread (min-max of the round medians), and record() minus the copy (the fixed cost).
Target: <= 100 us inside record() for 14 small fields.

    python -m bench.record_cost [--rounds 5] [--steps 200] [--gap-ms 4] [--writer thread,process]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from bench.common import grpo_step_tensors, machine, median
from tracer.record.writer import TraceWriter

HYPER = {"num_generations": 8, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28, "beta": 0.04}


def one_round(tensors, steps: int, gap_s: float, root: str, index: int, writer: str = "thread") -> tuple[float, float]:
    inside, copy = [], []
    with TraceWriter(f"{root}/run{index}_{writer}", "grpo", hyperparameters=HYPER, writer=writer) as writer:
        writer.record(0, tensors)  # the first record of a signature runs the full schema check
        writer.flush()  # (the writer process is up)
        for step in range(1, steps + 1):
            for first in ((True, False) if step % 2 else (False, True)):
                time.sleep(gap_s / 2)
                t0 = time.perf_counter()
                if first:
                    writer.record(step, tensors)
                    inside.append(time.perf_counter() - t0)
                else:
                    _ = {k: v.clone() for k, v in tensors.items()}
                    copy.append(time.perf_counter() - t0)
    return median(inside), median(copy)


def measure(rounds: int = 5, steps: int = 200, gap_ms: float = 4.0, B: int = 8, T: int = 16,
            writer: str = "thread") -> dict:
    tensors = grpo_step_tensors(B, T, L=16)
    assert len(tensors) == 14
    rec, cp = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            a, b = one_round(tensors, steps, gap_ms / 1e3, tmp, r, writer)
            rec.append(a)
            cp.append(b)
    return {"record_us": 1e6 * median(rec), "copy_us": 1e6 * median(cp),
            "record_spread": (1e6 * min(rec), 1e6 * max(rec)), "copy_spread": (1e6 * min(cp), 1e6 * max(cp)),
            "fixed_us": 1e6 * (median(rec) - median(cp)), "fields": len(tensors), "rounds": rounds, "steps": steps,
            "gap_ms": gap_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=4.0)
    parser.add_argument("--writer", default="thread", help="comma-separated: thread, process (default thread)")
    args = parser.parse_args()
    print(machine())
    for kind in args.writer.split(","):
        r = measure(args.rounds, args.steps, args.gap_ms, writer=kind)
        print(f"writer {kind}: record() of {r['fields']} fields (B=8, T=16), steps {r['gap_ms']:g} ms apart: "
              f"{r['record_us']:.0f} us ({r['record_spread'][0]:.0f}-{r['record_spread'][1]:.0f}) vs plain copy "
              f"{r['copy_us']:.0f} us ({r['copy_spread'][0]:.0f}-{r['copy_spread'][1]:.0f}); fixed cost "
              f"{r['fixed_us']:.0f} us (target: record() <= 100 us); median of {r['rounds']} rounds x {r['steps']} steps")


if __name__ == "__main__":
    main()
