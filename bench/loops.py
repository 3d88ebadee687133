"""Traced vs plain on three independent loop shapes, in alternating blocks:

* ``toy``: the GRPO-shaped CPU loop of ``bench/overhead.py`` at B = 8, T = 16 (a step of a few ms:
  the fixed cost of ``record()`` shows), 13 fields recorded per step through the explicit API;
* ``realistic``: the same loop at B = 64, T = 128;
* ``ppo``: ``tests/scripts/minimind_ppo.py`` (MiniMind's ``train_ppo.py`` in the seed's names: a
  rollout, then 3 PPO epochs over minibatches drawn by ``inds``) on the tiny local model, traced
  with zero edits through ``tracer.watch`` (every ``loss.backward()`` captured by name), in blocks of
  :data:`PPO_STEPS` PPO steps (``--ppo-steps``); the flush that closes each traced block is printed.

Each round runs one plain block and one traced block per writer (``--writer thread,process``: the
writer thread and the writer process, ``TraceWriter(writer=...)``) of ``steps`` steps, the order
rotating from round to round (one writer per kind for the whole run, flushed at the end of each of
its traced blocks; its open + close is reported apart); the ratio is median(traced) / median(plain)
over rounds, with the spread of the per-round ratios, and the geometric mean of the per-round
ratios with its 95% bootstrap interval (:func:`paired_ratio`): a target is called met only when
the whole interval is under it, missed when it is all above, else undecided. Beside it, the same
paired ratio of CPU times (less moved by the host's other guests, no verdict): the training
process's, and that plus the writer process's over the round. The ppo shape
measures each writer in its own series of rounds (one zero-edit watcher at a time). Targets: toy <= 1.05, realistic <= 1.03,
ppo <= 1.05; zero-edit capture <= 0.5 ms per backward.

    python -m bench.loops [--rounds 7] [--only toy,realistic,ppo] [--threads 1] [--writer thread,process]
                          [--ppo-steps 6] [--flush block|end]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import tempfile
import time
from argparse import Namespace
from pathlib import Path

import numpy as np
import torch

from bench.common import machine, median, trace_dir_line
from bench.overhead import make_model, run_loop
from tracer.record.writer import TraceWriter

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "minimind_ppo.py"
TARGETS = {"toy": 1.05, "realistic": 1.03, "ppo": 1.05}
# PPO steps per timed block: 6 (about 0.5 s, as the toy loop's 0.7 s blocks) so that the flush closing
# each traced block (the writer's queued work waited for, which a run overlaps with its next steps) is
# a small part of it; it was 2 (0.16 s blocks) in earlier runs.
PPO_STEPS = 6
TOY_STEPS = 120  # toy steps per timed block (``--toy-steps``): about 0.7-1.8 s, the host's speed permitting


def _alternate(plain, traced, rounds: int, child_cpu=None) -> dict:
    """``plain()`` and ``traced(i)`` once per round, order alternating; seconds of each (``child_cpu``:
    the writer process's CPU so far, as in :func:`_rotate`)."""
    return _rotate(plain, {"on": traced}, rounds, {"on": child_cpu} if child_cpu is not None else None)["on"]


def _rotate(plain, traced: dict, rounds: int, child_cpu: dict | None = None) -> dict[str, dict]:
    """``plain()`` and each ``traced[kind](i)`` once per round, the order rotating; per kind, the
    medians and the spread of the per-round ratios (traced / that round's plain), the paired ratio
    of wall times (the verdict's) and of CPU times: ``cpu_paired`` of this process's CPU (all its
    threads: the writer thread's included) and ``all_cpu_paired`` of that plus the CPU its writer
    process used over the round (``child_cpu[kind]()``: seconds so far, or None before it started;
    charged whole to that kind's traced block, its lingering in the next blocks included). CPU time
    is not moved by the host's other guests the way wall time is (a stolen tick counts in neither)."""
    kinds = ["off", *traced]
    child_cpu = child_cpu or {}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}  # this process's CPU time, all its threads
    child: dict[str, list[float]] = {kind: [] for kind in traced}  # each writer process's CPU over a round
    for r in range(rounds):
        before = {kind: (read() or 0.0) for kind, read in child_cpu.items()}
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            t0, c0 = time.perf_counter(), time.process_time()
            plain() if kind == "off" else traced[kind](r)
            times[kind].append(time.perf_counter() - t0)
            cpu[kind].append(time.process_time() - c0)
        for kind in traced:
            read = child_cpu.get(kind)
            child[kind].append((read() or 0.0) - before[kind] if read is not None else 0.0)
    off = times["off"]
    out = {}
    for kind in traced:
        ratios = [a / b for a, b in zip(times[kind], off)]
        out[kind] = {"off_s": median(off), "on_s": median(times[kind]), "ratio": median(times[kind]) / median(off),
                     "spread": (min(ratios), max(ratios)), "paired": paired_ratio(ratios),
                     "cpu_extra_s": median(cpu[kind]) - median(cpu["off"]),
                     "cpu_paired": paired_ratio([a / b for a, b in zip(cpu[kind], cpu["off"])]),
                     "all_cpu_paired": paired_ratio([(a + c) / b for a, c, b in zip(cpu[kind], child[kind], cpu["off"])]),
                     "child_cpu_s": median(child[kind]),
                     "raw": {"plain_s": off, "traced_s": times[kind], "plain_cpu_s": cpu["off"],
                             "traced_cpu_s": cpu[kind], "child_cpu_s": child[kind]}}
    return out


def child_cpu_s(writer: TraceWriter) -> float | None:
    """The CPU time (seconds, all its threads) ``writer``'s writer process has used so far, from the
    kernel's ``/proc/<pid>/task/*/schedstat``; None while it has none (a thread writer, or the
    process not started yet). Linux only."""
    process = getattr(writer, "_process", None)
    if process is None:
        return None
    total = 0
    try:
        tasks = list(Path(f"/proc/{process.pid}/task").iterdir())
    except FileNotFoundError:
        return None
    for task in tasks:
        try:
            with open(task / "schedstat") as fh:
                total += int(fh.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return total / 1e9


def paired_ratio(ratios: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """``(geometric mean, low, high)`` of per-round ratios (traced / the same round's plain): the low
    and high ends of its 95% bootstrap interval (percentile method, ``resamples`` resamples of the
    rounds with replacement, a fixed seed so that a run prints the same interval twice). Pairing each
    traced block with the plain block beside it cancels the machine's slow drifts; the interval says
    whether the rounds measured the target or only the host's noise."""
    logs = np.log(np.asarray(ratios, dtype=np.float64))
    if logs.size < 2:
        return float(np.exp(logs.mean())), float("nan"), float("nan")
    draws = np.random.default_rng(seed).choice(logs, size=(resamples, logs.size)).mean(axis=1)
    low, high = np.percentile(draws, [2.5, 97.5])
    return float(np.exp(logs.mean())), float(np.exp(low)), float(np.exp(high))


def verdict(paired: tuple[float, float, float], target: float) -> str:
    """``met`` when the whole 95% interval is at or under ``target``, ``missed`` when it is all above,
    else ``undecided`` (more rounds, or a quieter machine, needed)."""
    _, low, high = paired
    if high <= target:
        return "met"
    if low > target:
        return "missed"
    return "undecided"


def grpo_shape(name: str, B: int, T: int, L: int, steps: int, rounds: int, tmp: str,
               writers: tuple[str, ...] = ("thread",), flush: str = "block") -> dict[str, dict]:
    """One writer per kind for the whole measurement, as in a run (opened and closed once, outside
    the timed blocks: that cost is reported apart); each traced block ends with ``flush()``, so all
    the writer's work for its steps falls inside the block that recorded them (the last batch's work
    then runs beside nothing, which a run would overlap with its next steps: blocks are long enough,
    0.7 s for the toy loop, that this costs well under 1%). The writer process is started and warmed
    by one flushed step before the rounds (its start, 1-2 s, is part of open + close)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run_loop(model, optimizer, 2, B, T, L, None)  # warm-up
    opened: dict[str, tuple[TraceWriter, float]] = {}
    for kind in writers:
        t0 = time.perf_counter()
        writer = TraceWriter(f"{tmp}/{name}_{kind}", "grpo", hyperparameters={"num_generations": 8}, writer=kind)
        run_loop(model, optimizer, 1, B, T, L, writer, step0=10**6)  # its first step: the child's start
        writer.flush()
        opened[kind] = (writer, time.perf_counter() - t0)

    def traced(kind: str):
        def run(r: int) -> None:
            writer = opened[kind][0]
            run_loop(model, optimizer, steps, B, T, L, writer, step0=r * steps)
            if _flushes(kind, flush):
                writer.flush()
        return run

    try:
        results = _rotate(lambda: run_loop(model, optimizer, steps, B, T, L, None),
                          {kind: traced(kind) for kind in writers}, rounds,
                          {kind: (lambda w=opened[kind][0]: child_cpu_s(w)) for kind in writers})
    finally:
        for kind, (writer, open_s) in opened.items():
            t0 = time.perf_counter()
            writer.close()
            opened[kind] = (writer, open_s + time.perf_counter() - t0)
    return {kind: {**res, "step_ms": 1e3 * res["off_s"] / steps, "records": steps,
                   "open_close_ms": 1e3 * opened[kind][1],
                   "per_record_us": 1e6 * (res["on_s"] - res["off_s"]) / steps, "shape": f"B={B} T={T}",
                   "cpu_us": 1e6 * res["cpu_extra_s"] / steps}
            for kind, res in results.items()}


def _load_script():
    spec = importlib.util.spec_from_file_location("minimind_ppo_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_TIMER = """
def timed(loss):
    t0, c0 = perf_counter(), thread_time()
    try:
        real(loss)
    finally:
        inside.append(perf_counter() - t0)
        inside_cpu.append(thread_time() - c0)
"""


def _timed(real, inside: list, inside_cpu: list | None = None):
    """``real`` (Watcher.on_backward) timed into ``inside`` (wall) and ``inside_cpu`` (the training
    thread's CPU, ``time.thread_time``). The wrapper's module is named as part of tracer, so the
    capture's walk out to the calling frame skips it as it skips tracer's own frames."""
    scope = {"__name__": "tracer._bench_timer", "perf_counter": time.perf_counter, "real": real, "inside": inside,
             "thread_time": time.thread_time, "inside_cpu": [] if inside_cpu is None else inside_cpu}
    exec(compile(_TIMER, "<bench timer>", "exec"), scope)  # noqa: S102  (a fixed string)
    return scope["timed"]


def ppo_setup(tmp: str, steps: int):
    """The MiniMind-style PPO script and what its ``ppo_train_epoch`` takes, on the tiny local model:
    ``(epoch, args)`` where ``epoch()`` runs one call of it."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tracer.demo.ppo_loop import Critic
    from tracer.demo.tiny_model import build_tiny_model

    script = _load_script()
    model_dir = build_tiny_model(Path(tmp) / "model", seed=0, warmup_steps=20)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_pretrained(model_dir)
    ref_model = copy.deepcopy(actor).eval().requires_grad_(False)
    critic = Critic(actor)
    optimizer = torch.optim.AdamW(list(actor.parameters()) + list(critic.parameters()), lr=1e-4)
    args = Namespace(steps=steps, batch_size=16, mini_batch_size=4, ppo_update_iters=3, max_new_tokens=16,
                     temperature=1.0, clip_epsilon=0.2, kl_coef=0.02, target_kl=1e9, gamma=1.0, lam=0.95,
                     vf_coef=0.5, seed=0, bug=None, whiten_advantages=False)
    return (lambda: script.ppo_train_epoch(actor, critic, ref_model, tokenizer, optimizer, args)), args


def _flushes(writer: str, flush: str) -> bool:
    """Whether a traced block ends with ``flush()``: always with the writer thread (its work holds the
    interpreter lock: left queued it would be charged to the next block, perhaps a plain one); with
    the writer process only under ``--flush block`` (``end``: its child writes beside the next
    block, on the other core, as in a run, where a flush waits for the child's lingering batch)."""
    return writer == "thread" or flush == "block"


def ppo_shape(steps: int, rounds: int, tmp: str, writer: str = "thread", flush: str = "block") -> dict:
    from tracer.zero_edit import watch

    epoch, args = ppo_setup(tmp, steps)
    backwards = steps * args.ppo_update_iters * (args.batch_size // args.mini_batch_size)

    inside: list[float] = []
    inside_cpu: list[float] = []  # the same calls' thread CPU
    drains: list[float] = []  # each traced block's closing flush (the writer's work still queued)
    # One watcher for the whole measurement (one trace, as in a run); the plain blocks run inside
    # ``paused()`` (torch's own backward), each traced block ends with a flush of the writer.
    with contextlib.redirect_stdout(io.StringIO()), watch(algo="ppo", out=f"{tmp}/ppo_{writer}",
                                                                 writer=writer) as w:
        w.on_backward = _timed(w.on_backward, inside, inside_cpu)

        def plain() -> None:
            with w.paused():
                epoch()

        def traced(r: int) -> None:
            epoch()
            t0 = time.perf_counter()
            if _flushes(writer, flush) or r < 0:
                w.writer.flush()
            drains.append(time.perf_counter() - t0)

        traced(-1)  # warm-up; opens the writer
        before = w.steps_recorded
        res = _alternate(plain, traced, rounds, lambda: child_cpu_s(w.writer))
        w.writer.flush()
        recorded = w.steps_recorded - before
    assert recorded == backwards * rounds and not w.failures, (recorded, backwards, w.failures)
    return {**res, "step_ms": 1e3 * res["off_s"] / steps, "records": backwards,
            "per_record_us": 1e6 * (res["on_s"] - res["off_s"]) / backwards,
            "cpu_us": 1e6 * res["cpu_extra_s"] / backwards,
            "capture_us": 1e6 * median(inside[backwards:]),  # after the warm-up (which also opens the writer)
            "capture_cpu_us": 1e6 * median(inside_cpu[backwards:]),
            "drain_ms": 1e3 * median(drains[1:]), "block_ms": 1e3 * res["off_s"],
            "shape": f"B={args.batch_size} minibatch {args.mini_batch_size} x {args.ppo_update_iters} epochs, "
                     f"{args.max_new_tokens} new tokens"}


def measure(rounds: int = 7, only: tuple[str, ...] = ("toy", "realistic", "ppo"),
            writers: tuple[str, ...] = ("thread",), ppo_steps: int = PPO_STEPS,
            flush: str = "block", toy_steps: int = TOY_STEPS) -> dict[tuple[str, str], dict]:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "toy" in only:
            for kind, res in grpo_shape("toy", 8, 16, 16, toy_steps, rounds, tmp, writers, flush).items():
                out["toy", kind] = res
        if "realistic" in only:
            for kind, res in grpo_shape("realistic", 64, 128, 32, 4, rounds, tmp, writers, flush).items():
                out["realistic", kind] = res
        if "ppo" in only:
            for kind in writers:
                out["ppo", kind] = ppo_shape(steps=ppo_steps, rounds=rounds, tmp=tmp, writer=kind, flush=flush)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", default="toy,realistic,ppo")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the writer thread gets the other core; with "
                             "2 threads on a shared 2-core machine torch's spinning threads make both modes erratic)")
    parser.add_argument("--ppo-steps", type=int, default=PPO_STEPS, help=f"PPO steps per timed block (default {PPO_STEPS})")
    parser.add_argument("--toy-steps", type=int, default=TOY_STEPS,
                        help=f"toy steps per timed block (default {TOY_STEPS}); shorter blocks, more rounds: each "
                             "pair of blocks closer in time, the closing flush a larger part of a block")
    parser.add_argument("--writer", default="thread",
                        help="comma-separated writers measured side by side: thread, process, auto (TraceWriter's "
                             "default: the process for these CPU loops where a core is free; default thread)")
    parser.add_argument("--flush", choices=("block", "end"), default="block",
                        help="block (default): every traced block ends with flush(), all its writing inside it; "
                             "end: with the writer process, only at the end (its child writes beside the next "
                             "block, as in a run); the writer thread always flushes each block")
    parser.add_argument("--json", metavar="PATH", help="also write every round's times (seconds) and the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine())
    print(trace_dir_line())
    results = measure(args.rounds, tuple(args.only.split(",")), tuple(args.writer.split(",")),
                      args.ppo_steps, args.flush, args.toy_steps)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "args": vars(args),
                                               "results": [{"loop": n, "writer": k, **r} for (n, k), r in results.items()]},
                                              indent=1))
    for (name, kind), r in results.items():
        unit = "backward" if name == "ppo" else "record"
        mean, low, high = r["paired"]
        cpu, cpu_low, cpu_high = r["cpu_paired"]
        every, every_low, every_high = r["all_cpu_paired"]
        print(f"{name:9s} {kind:7s} ({r['shape']}): plain {r['step_ms']:.1f} ms/step, traced/plain {r['ratio']:.3f} "
              f"(rounds {r['spread'][0]:.3f}-{r['spread'][1]:.3f}; paired geometric mean {mean:.3f}, 95% interval "
              f"{low:.3f}-{high:.3f}: target <= {TARGETS[name]} {verdict(r['paired'], TARGETS[name])}), "
              f"{r['per_record_us']:.0f} us per traced {unit} ({r['records']} per block), training process CPU "
              f"+{r['cpu_us']:.0f} us per {unit}; CPU traced/plain: training process {cpu:.3f} ({cpu_low:.3f}-"
              f"{cpu_high:.3f}), with the writer process {every:.3f} ({every_low:.3f}-{every_high:.3f}; its "
              f"{1e6 * r['child_cpu_s'] / r['records']:.0f} us per {unit})"
              + (f"; writer open + close {r['open_close_ms']:.1f} ms once per run" if "open_close_ms" in r else "")
              + (f"; capture on the training thread {r['capture_us']:.0f} us per backward (median; target <= 500)"
                 f", its thread CPU {r['capture_cpu_us']:.0f} us"
                 f"; closing flush {r['drain_ms']:.1f} ms per {r['block_ms']:.0f} ms block" if "capture_us" in r else ""))


if __name__ == "__main__":
    main()
