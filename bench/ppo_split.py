"""Where the zero-edit PPO loop's traced cost goes .

``python -m bench.ppo_split [--rounds N] [--part split,corun,linger] [--long-linger S]``, on the MiniMind-style PPO loop of
``bench.loops`` (tests/scripts/minimind_ppo.py, tiny local model, one torch thread), blocks of
``bench.loops.PPO_STEPS`` steps, the order rotating each round, each ratio paired with that round's
plain block (95% bootstrap interval):

* ``split``: the loop traced for real (``tracer.watch``, writer ``auto``: the writer process), the
  same capture with ``TraceWriter._record`` a no-op (the frame read and checks, no copy into the ring,
  no hand-over, nothing for the writer process), and the capture replaced by a busy-wait of the real
  capture's training-thread CPU (measured in a warm-up block). If the real loop costs more than the
  busy-wait, the rest is paid outside the capture: the flush closing each traced block, and the
  writer process's work on the other core.
* ``corun``: the plain loop alone, beside a process spinning in pure Python, and beside a process
  copying 16 MB buffers (torch, one thread): what work on the other core costs this one.
* ``linger``: the loop traced through two writer processes, one whose child lingers
  :data:`tracer.record.process.child.CHILD_LINGER_S` (0.25 s) for more steps to batch with and one lingering
  ``--long-linger`` seconds (default 1), one watcher whose writer is swapped between them block by
  block; besides each one's ratio to plain, the paired ratio of the two traced blocks of a round
  (long / short) and each child's CPU per backward (no difference
  established, so the shipped linger stayed).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

from bench.common import machine, median
from bench.loops import PPO_STEPS, _rotate, _timed, child_cpu_s, paired_ratio, ppo_setup


def _line(kind: str, r: dict, extra: str = "") -> str:
    lo, mid, hi = r["paired"][1], r["paired"][0], r["paired"][2]
    return (f"{kind:<13} plain {1e3 * r['off_s'] / PPO_STEPS:.1f} ms/step, traced/plain {mid:.3f} ({lo:.3f}-{hi:.3f}), "
            f"CPU {r['cpu_paired'][0]:.3f} ({r['cpu_paired'][1]:.3f}-{r['cpu_paired'][2]:.3f}){extra}")


def split(rounds: int, tmp: str) -> None:
    from tracer.zero_edit import watch

    epoch, args = ppo_setup(tmp, PPO_STEPS)
    backwards = PPO_STEPS * args.ppo_update_iters * (args.batch_size // args.mini_batch_size)
    inside: dict[str, list[float]] = {"real": [], "no hand-over": [], "busy": []}  # the hook's thread CPU
    busy_s = [0.0]
    with contextlib.redirect_stdout(io.StringIO()), watch(algo="ppo", out=f"{tmp}/ppo", writer="auto") as w:
        real_on = w.on_backward

        def timed(kind, fn):
            return _timed(fn, [], inside[kind])

        def spin(_loss):
            end = time.thread_time() + busy_s[0]
            while time.thread_time() < end:
                pass

        def plain():
            with w.paused():
                epoch()

        def real(_r):
            w.on_backward = timed("real", real_on)
            epoch()
            w.writer.flush()

        def no_handover(_r):
            w.on_backward = timed("no hand-over", real_on)
            w.writer._record = lambda *a, **k: None  # an instance attribute over the method, for this block
            try:
                epoch()
            finally:
                del w.writer._record

        def busy(_r):
            w.on_backward = timed("busy", spin)
            epoch()

        real(-1)
        real(-1)  # warm-up: opens the writer, then the capture's CPU for the busy-wait
        busy_s[0] = median(inside["real"][backwards:])
        inside["real"].clear()
        res = _rotate(plain, {"real": real, "no hand-over": no_handover, "busy": busy}, rounds,
                      {"real": lambda: child_cpu_s(w.writer)})
        w.on_backward = real_on
    print(f"busy-wait per backward: {1e6 * busy_s[0]:.0f} us of thread CPU (the real capture's, warm-up median)")
    for kind, r in res.items():
        child = f", writer process {1e6 * r['child_cpu_s'] / backwards:.0f} us/backward" if kind == "real" else ""
        print(_line(kind, r, f"; in the backward hook {1e6 * median(inside[kind]):.0f} us of thread CPU{child}"))


def corun(rounds: int, tmp: str) -> None:
    epoch, _ = ppo_setup(tmp, PPO_STEPS)
    py = sys.executable
    helpers = {
        "spin": subprocess.Popen([py, "-c", "while True: pass"]),
        "copy": subprocess.Popen([py, "-c", "import torch\ntorch.set_num_threads(1)\n"
                                  "a = torch.empty(16 << 20, dtype=torch.uint8); b = torch.empty_like(a)\n"
                                  "while True: b.copy_(a)"]),
    }
    try:
        time.sleep(5)  # imports done
        for p in helpers.values():
            os.kill(p.pid, signal.SIGSTOP)

        def beside(p):
            def run(_r):
                os.kill(p.pid, signal.SIGCONT)
                try:
                    epoch()
                finally:
                    os.kill(p.pid, signal.SIGSTOP)
            return run

        with contextlib.redirect_stdout(io.StringIO()):
            epoch()
            res = _rotate(lambda: epoch(), {k: beside(p) for k, p in helpers.items()}, rounds)
    finally:
        for p in helpers.values():
            p.kill()
    for kind, r in res.items():
        print(_line(f"beside {kind}", r))


def linger(rounds: int, tmp: str, long_linger: float = 1.0) -> None:
    from tracer.zero_edit import watch
    from tracer.record.writer import TraceWriter
    from tracer.record.process.child import CHILD_LINGER_S

    epoch, args = ppo_setup(tmp, PPO_STEPS)
    backwards = PPO_STEPS * args.ppo_update_iters * (args.batch_size // args.mini_batch_size)
    waits = {f"linger {CHILD_LINGER_S:g} s": CHILD_LINGER_S, f"linger {long_linger:g} s": long_linger}
    writers: dict[str, TraceWriter] = {}
    with contextlib.redirect_stdout(io.StringIO()), watch(algo="ppo", out=f"{tmp}/ppo", writer="process") as w:
        epoch()  # opens the watcher's own writer (its hyperparameters are the loop's), idle from here on
        own = w.writer
        for i, (kind, wait) in enumerate(waits.items()):
            writer = TraceWriter(f"{tmp}/ppo_{i}", "ppo", hyperparameters=own.hyperparameters, writer="process")
            writer._child_config = lambda writer=writer, wait=wait: {**TraceWriter._child_config(writer), "linger_s": wait}
            writers[kind] = writer

        def traced(kind):
            def run(_r):
                w.writer = writers[kind]
                epoch()
                writers[kind].flush()
            return run

        def plain():
            with w.paused():
                epoch()

        for kind in writers:  # each child started and warm
            traced(kind)(-1)
        res = _rotate(plain, {kind: traced(kind) for kind in writers}, rounds,
                      {kind: (lambda kind=kind: child_cpu_s(writers[kind])) for kind in writers})
        for writer in writers.values():
            writer.close()
        w.writer = own  # closed with the watcher
    for kind, r in res.items():
        print(_line(kind, r, f"; writer process {1e6 * r['child_cpu_s'] / backwards:.0f} us/backward"))
    short, long = (res[kind]["raw"]["traced_s"] for kind in waits)
    mid, lo, hi = paired_ratio([a / b for a, b in zip(long, short)])
    print(f"linger {long_linger:g} s / linger {CHILD_LINGER_S:g} s, traced blocks of one round: {mid:.4f} ({lo:.4f}-{hi:.4f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--part", default="split,corun", help="split, corun, linger (comma-separated)")
    parser.add_argument("--long-linger", type=float, default=1.0, help="the linger part's longer wait, seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.part.split(","):
            print(f"-- {part}")
            parts = {"split": split, "corun": corun, "linger": lambda r, t: linger(r, t, args.long_linger)}
            parts[part](args.rounds, tmp)


if __name__ == "__main__":
    main()
