"""Zero-edit capture per backward with call-site plans on and off, side by side .

Runs ``tests/scripts/minimind_ppo.py`` (MiniMind's PPO in the seed's names, 12 backwards a step, 19
fields a capture) on the tiny local model under one ``tracer.watch``, in blocks that alternate
``watcher.plans.enabled`` (off: every frame read in full, as before plans). For every backward it
takes the training thread's CPU time (``time.thread_time``, which the machine's load moves less than
wall time) of the frame read alone (``SitePlans.read``: lookups, mapping, rows by ``inds``, checks,
indices, metadata, derived fields) and of the whole capture (``Watcher.on_backward``, the writer's
``record()`` included), and prints the medians, plans off and on, with their ratio.

    python -m bench.capture_plan [--rounds 5] [--steps 2]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time

import torch

from bench.common import machine, median

_TIMER = """
def timed(*args):
    t0 = thread_time()
    try:
        return real(*args)
    finally:
        out.append(thread_time() - t0)
"""


def _timed(real, out: list, module: str):
    """``real`` timed into ``out``; the wrapper's module is ``module`` (a ``tracer.`` name, so the
    capture's walk out to the calling frame skips it as it skips tracer's own frames)."""
    scope = {"__name__": module, "thread_time": time.thread_time, "real": real, "out": out}
    exec(compile(_TIMER, "<bench timer>", "exec"), scope)  # noqa: S102  (a fixed string)
    return scope["timed"]


def measure(rounds: int, steps: int) -> dict:
    from bench.loops import ppo_setup
    from tracer.zero_edit import watch

    with tempfile.TemporaryDirectory() as tmp:
        epoch, _ = ppo_setup(tmp, steps)
        times = {(part, on): [] for part in ("read", "capture") for on in (False, True)}
        with contextlib.redirect_stdout(io.StringIO()), watch(algo="ppo", out=f"{tmp}/ppo") as w:
            reads: list[float] = []
            captures: list[float] = []
            w.plans.read = _timed(w.plans.read, reads, "tracer._bench_timer")
            w.on_backward = _timed(w.on_backward, captures, "tracer._bench_timer")
            epoch()  # warm-up, opens the writer
            for r in range(rounds):
                for on in ((True, False) if r % 2 else (False, True)):
                    w.plans.enabled = on
                    del reads[:], captures[:]
                    epoch()
                    w.writer.flush()
                    times["read", on] += reads[1:]  # the block's first backward may build a plan
                    times["capture", on] += captures[1:]
            assert not w.failures, w.failures
            hits, built = w.plans.hits, w.plans.built
    return {"us": {k: 1e6 * median(v) for k, v in times.items()}, "n": len(times["read", True]),
            "hits": hits, "built": built}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="PPO steps per block (12 backwards each)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine())
    r = measure(args.rounds, args.steps)
    us = r["us"]
    for part, what in (("read", "frame read (SitePlans.read)"), ("capture", "whole capture (on_backward, record included)")):
        print(f"{what}: plans off {us[part, False]:.0f} us, plans on {us[part, True]:.0f} us per backward "
              f"({us[part, True] / us[part, False]:.2f}x; thread CPU, medians of {r['n']} backwards each)")
    print(f"plans: {r['hits']} backwards read by a plan, {r['built']} plan(s) made")


if __name__ == "__main__":
    main()
