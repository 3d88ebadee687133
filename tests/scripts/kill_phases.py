"""What a SIGKILL of the training process loses, per writer (thread, process) and phase:

    starting   steps recorded right after the writer was made (the writer process still starting)
    running    steps recorded between flushes, the writer up and idle before them
    flushing   killed inside ``flush()`` (the steps recorded just before it)
    closing    killed inside ``close()``

    python tests/scripts/kill_phases.py [RUNS_PER_CELL] [SEED]      (prints a Markdown table)

Each run is a fresh interpreter (``--loop``) recording B = 8, T = 256 GRPO steps (~40 KB files, 2 ms
apart) and printing ``R <step>`` once ``record`` returned for it, ``F`` before ``flush()``, ``C``
before ``close()``. The driver SIGKILLs it a seeded random 0-30 ms after a seeded random line of the
phase, waits until the steps folder stops changing (a writer process outlives the loop and writes
what it holds), then counts the recorded steps without a complete step file on disk (lost). A step
``flush()`` returned for is never lost (tests/reliability/test_crash.py); this measures the others.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
PHASES = ("starting", "running", "flushing", "closing")


def loop(out: str, writer_kind: str, phase: str) -> None:
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from crash_loop import step_tensors
    from tracer import TraceWriter

    torch.set_num_threads(1)
    say = lambda line: os.write(1, (line + "\n").encode())  # noqa: E731
    writer = TraceWriter(out, "grpo", hyperparameters={"num_generations": 2}, writer=writer_kind)
    first = 0
    if phase != "starting":  # the writer up (a writer process started) and idle
        writer.record(0, step_tensors(0))
        writer.flush()
        time.sleep(0.5)
        first = 1
    say("GO")
    for step in range(first, first + STEPS):
        writer.record(step, step_tensors(step))
        say(f"R {step}")
        time.sleep(0.002)
    if phase == "flushing":
        say("F")
        writer.flush()
    say("C")
    writer.close()
    say("END")
    time.sleep(5)


def _on_disk(out: Path) -> set[int]:
    steps = out / "steps"
    return {int(p.name[5:13]) for p in steps.glob("step_*.safetensors")} if steps.is_dir() else set()


def _settled(out: Path, quiet_s: float = 1.5, limit_s: float = 15.0) -> None:
    """Wait until the steps folder has not changed for ``quiet_s``."""
    start, last, since = time.monotonic(), None, time.monotonic()
    while time.monotonic() - start < limit_s:
        now = sorted(os.listdir(out / "steps")) if (out / "steps").is_dir() else []
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)


def one_run(tmp: Path, writer_kind: str, phase: str, rng: random.Random) -> tuple[int, int]:
    """(steps recorded, of them lost) for one kill."""
    out = tmp / f"{writer_kind}-{phase}-{rng.randrange(10**9)}"
    proc = subprocess.Popen([sys.executable, __file__, "--loop", str(out), writer_kind, phase],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    trigger = {"starting": f"R {rng.randrange(STEPS)}", "running": f"R {1 + rng.randrange(STEPS)}",
               "flushing": "F", "closing": "C"}[phase]
    recorded = set()
    for raw in proc.stdout:
        line = raw.decode().strip()
        if line.startswith("R "):
            recorded.add(int(line[2:]))
        if line == trigger or line == "END":
            break
    time.sleep(rng.uniform(0, 0.030))
    proc.send_signal(signal.SIGKILL)
    for raw in proc.stdout:  # lines written before the kill landed
        line = raw.decode().strip()
        if line.startswith("R "):
            recorded.add(int(line[2:]))
    proc.wait()
    _settled(out)
    return len(recorded), len(recorded - _on_disk(out))


def main(runs: int, seed: int) -> None:
    rng = random.Random(seed)
    print("| writer | phase | kills | steps recorded | lost | kills that lost any | most lost in one kill |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for writer_kind in ("thread", "process"):
            for phase in PHASES:
                results = [one_run(Path(tmp), writer_kind, phase, rng) for _ in range(runs)]
                recorded, lost = sum(r for r, _ in results), sum(l for _, l in results)
                print(f"| {writer_kind} | {phase} | {runs} | {recorded} | {lost} | "
                      f"{sum(l > 0 for _, l in results)} | {max(l for _, l in results)} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--loop"]:
        loop(*sys.argv[2:5])
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 6, int(sys.argv[2]) if len(sys.argv) > 2 else 0)
