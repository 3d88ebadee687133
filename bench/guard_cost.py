"""Cost and latency of the live guard (``TraceWriter(guard=...)``, :mod:`tracer.guard`): the step checks
of ``tracer check`` run on each step file as it is written, off the training thread.

Cost: the same GRPO-shaped CPU loop (``bench.overhead``'s, a tiny Qwen2 policy, recorded through the
explicit API) traced with guard ``off``, ``warn`` and ``stop`` side by side, and ``linger`` (an observer that checks
nothing but, as the guard does, has the writer write each batch after 0.05 s instead of 0.25 s: the
guard's cost before any check): one writer per mode for the
whole run (a run has one), each round one block of ``steps`` steps per mode, the order rotating. Round 0
(the guard's start and its first files, always checked) is reported apart; the ratio is the geometric
mean of the later rounds' ratios (mode / off, same round) with its 95% bootstrap interval
(:func:`bench.loops.paired_ratio`), called met only when the whole interval is under the target. The
process's CPU time per step (training thread + writer thread + guard thread) shows where the time
goes, and the findings file how many step files the guard checked. Shapes:

* ``toy``: hidden 32, 1 layer, B = 8, T = 16 (a step of about 4-9 ms here): target <= 1.03;
* ``realistic``: hidden 64, 2 layers, B = 16, T = 64 (tens of ms): target <= 1.01.

Latency: the same loop with the advantages negated from step ``n`` on (``recompute.advantages`` finds
it in each such step file), ``n = 0`` (the first files, always checked) and ``n`` past them (the guard
then checks within its time share): the first finding of the bug reaching a callable guard (the step it
names, and the step during which it came; target: before step ``n + 2`` ends), and the step whose
``record`` raised :class:`tracer.errors.GuardStop` under ``guard="stop"``.

    python -m bench.guard_cost [--rounds 7] [--only toy,realistic] [--writer thread|process] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from bench.common import machine, median
from bench.loops import paired_ratio, verdict
from bench.overhead import make_model
from tracer import formulas
from tracer.errors import GuardStop
from tracer.guard.guard import GUARD_LINGER_S
from tracer.record.writer import TraceWriter

MODES = ("off", "warn", "stop")
SHAPES = {"toy": {"hidden": 32, "layers": 1, "B": 8, "T": 16, "L": 8, "steps": 150, "target": 1.03},
          "realistic": {"hidden": 64, "layers": 2, "B": 16, "T": 64, "L": 16, "steps": 20, "target": 1.01}}
G = 8  # completions per prompt


def grpo_steps(model, optimizer, steps: int, B: int, T: int, L: int, writer: TraceWriter | None, step0: int = 0,
               bug_step: int | None = None, step_ends: list[float] | None = None) -> None:
    """``steps`` GRPO-shaped steps (``bench.overhead.run_loop``'s), recorded into ``writer`` when given;
    from ``bug_step`` on the advantages trained on (and recorded) are negated; ``step_ends`` receives
    ``time.perf_counter()`` at the end of each step."""
    g = torch.Generator().manual_seed(1 + step0)
    for step in range(step0, step0 + steps):
        input_ids = torch.randint(0, model.config.vocab_size, (B, L + T), generator=g)  # (B, L + T)
        completion_mask = torch.ones(B, T, dtype=torch.bool)  # (B, T)
        policy = formulas.token_logprobs(model(input_ids=input_ids).logits, input_ids, L)  # (B, T)
        old = policy.detach()
        rewards = torch.rand(B, generator=g)  # (B,)
        advantages = formulas.group_advantages(rewards, G)  # (B,)
        if bug_step is not None and step >= bug_step:
            advantages = -advantages  # the injected bug: a sign slip in the advantages
        per_token_loss = formulas.grpo_per_token_loss(policy, old, advantages, 0.2, 0.2)  # (B, T)
        loss = formulas.sequence_mean_loss(per_token_loss, completion_mask)
        if writer is not None:
            p = policy.detach()
            writer.record(step, prompt_ids=input_ids[:, :L], completion_ids=input_ids[:, L:],
                          completion_mask=completion_mask, policy_logprobs=p, old_logprobs=old,
                          ratio=formulas.ratio(p, old), approx_kl_k2=formulas.approx_kl_k2(p, old),
                          rewards=rewards, advantages=advantages, group_ids=torch.arange(B) // G,
                          per_token_loss=per_token_loss.detach(), loss=loss.detach())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step_ends is not None:
            step_ends.append(time.perf_counter())


def _writer(root: str, guard, writer: str) -> TraceWriter:
    return TraceWriter(root, "grpo", hyperparameters={"num_generations": G},
                       guard=guard, writer=writer)


def checker_cpu(writer: TraceWriter) -> float:
    """CPU seconds the guard's forked checker process has used so far (0 without one): its
    ``/proc/<pid>/stat`` user + system time."""
    import os

    pid = getattr(getattr(getattr(writer, "_observer", None), "_checker", None), "pid", None)
    if pid is None:
        return 0.0
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cost(shape: str, rounds: int, tmp: str, writer: str) -> dict:
    """Per-mode step times (ms), CPU per step (ms) and paired ratios against ``off``, in steady state: one
    writer per mode for the whole run (as a run has one), a block of each per round, round 0 (the guard's
    first files, always checked, and its start) left out of the ratios and reported apart."""
    s = SHAPES[shape]
    model = make_model(hidden=s["hidden"], layers=s["layers"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    grpo_steps(model, optimizer, 3, s["B"], s["T"], s["L"], None)  # warm-up
    writers = {m: _writer(f"{tmp}/{shape}-{m}", m, writer) for m in MODES}
    wall = {m: [] for m in MODES}
    cpu = {m: [] for m in MODES}
    child = {m: [] for m in MODES}
    n = s["steps"]
    for r in range(rounds + 1):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            k0, c0, t0 = checker_cpu(writers[mode]), time.process_time(), time.perf_counter()
            grpo_steps(model, optimizer, n, s["B"], s["T"], s["L"], writers[mode], step0=r * n)
            wall[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
            child[mode].append(checker_cpu(writers[mode]) - k0)
    close = {}
    for mode, w in writers.items():
        t0 = time.perf_counter()
        w.close()
        close[mode] = time.perf_counter() - t0
    out = {"shape": shape, "steps": n, "rounds": rounds, "target": s["target"], "B": s["B"], "T": s["T"]}
    for mode in MODES:
        steady, steady_cpu = wall[mode][1:], cpu[mode][1:]
        out[mode] = {"step_ms": 1e3 * median(steady) / n, "cpu_ms": 1e3 * median(steady_cpu) / n,
                     "checker_cpu_ms": 1e3 * sum(child[mode][1:]) / (n * max(1, len(child[mode]) - 1)),
                     "where": getattr(getattr(writers[mode], "_observer", None), "where", "-"),
                     "first_block_ms": 1e3 * wall[mode][0] / n, "close_ms": 1e3 * close[mode],
                     "checked": _checked_files(writers[mode])}
        if mode != "off":
            out[mode]["paired"] = paired_ratio([a / b for a, b in zip(steady, wall["off"][1:])])
    return out


def _checked_files(writer: TraceWriter) -> str:
    """How many of the run's step files the guard checked (its findings file's ``checked`` lines)."""
    from tracer.format.findings_log import findings_paths, read_lines

    lines = [line for path in findings_paths(writer.root) for line in read_lines(path)]
    checked = sum(1 for line in lines if line.get("kind") == "checked")
    return f"{checked} of {writer.steps_written} step files checked"


def latency(shape: str, repeats: int, tmp: str, writer: str, bug_step: int, horizon: int = 40) -> dict:
    """With the advantages negated from ``bug_step`` on: the first finding of the bug reaching a
    callable guard (the step it names, the step during which it came), and the step whose ``record``
    raised GuardStop under ``guard="stop"``; ``horizon`` steps after ``bug_step`` at most."""
    s = SHAPES[shape]
    model = make_model(hidden=s["hidden"], layers=s["layers"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    found, stopped = [], []
    for i in range(repeats):
        seen: list[tuple[float, object]] = []
        ends: list[float] = []
        w = _writer(f"{tmp}/latency-{shape}-{bug_step}-{i}", lambda f, seen=seen: seen.append((time.perf_counter(), f)),
                    writer)
        grpo_steps(model, optimizer, bug_step + horizon, s["B"], s["T"], s["L"], w, bug_step=bug_step,
                   step_ends=ends)
        w.close()
        hits = [(t, f.step) for t, f in seen if f.check == "recompute.advantages"]
        if hits:
            t, step = hits[0]
            during = next((k for k, end in enumerate(ends) if t <= end), None)  # None: after the last step
            found.append((step, during, 1e3 * (t - ends[step])))  # ms after the end of the step it names
        else:
            found.append(None)
        w = _writer(f"{tmp}/stop-{shape}-{bug_step}-{i}", "stop", writer)
        ends = []
        try:
            grpo_steps(model, optimizer, bug_step + horizon, s["B"], s["T"], s["L"], w, bug_step=bug_step,
                       step_ends=ends)
            stopped.append(None)
        except GuardStop:
            stopped.append(len(ends))  # steps 0 .. len(ends) - 1 ended; the record of this one raised
        w.close()
    return {"shape": shape, "bug_step": bug_step, "found": found, "stopped": stopped, "horizon": horizon}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3, help="latency runs per shape")
    parser.add_argument("--only", default="toy,realistic")
    parser.add_argument("--writer", default="thread", choices=("thread", "process"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training loop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine())
    print(f"writer={args.writer}, torch threads={args.threads}, rounds={args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.only.split(","):
            res = cost(shape, args.rounds, tmp, args.writer)
            off = res["off"]
            print(f"\n{shape} (B={res['B']}, T={res['T']}; {res['rounds']} rounds of {res['steps']} steps per mode after "
                  f"a first block; target <= {res['target']}):")
            for mode in MODES:
                m = res[mode]
                line = (f"  guard {mode:<4}: {m['step_ms']:7.2f} ms/step, CPU {m['cpu_ms']:7.2f} ms/step "
                        f"+ checker process {m['checker_cpu_ms']:.2f} ms/step (checks in: {m['where']}) "
                        f"(first block {m['first_block_ms']:.2f} ms/step, close {m['close_ms']:.0f} ms; {m['checked']})")
                if mode != "off":
                    gm, lo, hi = m["paired"]
                    line += (f"\n              ratio {gm:.3f} [{lo:.3f}, {hi:.3f}] -> {verdict(m['paired'], res['target'])}; "
                             f"extra CPU {m['cpu_ms'] - off['cpu_ms']:+.2f} ms/step")
                print(line)
            for bug_step in (0, 3 * res["steps"] // 2):
                lat = latency(shape, args.repeats, tmp, args.writer, bug_step)
                found = ", ".join("not found" if f is None else
                                  f"step {f[0]} during step {f[1] if f[1] is not None else 'none (after the run)'} "
                                  f"({f[2]:.0f} ms after step {f[0]} ended)" for f in lat["found"])
                stops = ", ".join("no stop" if s is None else f"step {s}" for s in lat["stopped"])
                print(f"  latency, bug from step {bug_step} (target: reported before step {bug_step + 2} ends): "
                      f"first finding {found}; guard=stop raised at the record of {stops}")

if __name__ == "__main__":
    main()
