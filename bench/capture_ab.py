"""Zero-edit capture per backward, an older commit's tracer and this one's side by side in one process.

The ``tracer/`` package of ``--base`` (a git revision of this repository) is unpacked into a
temporary folder and imported as ``tracer._base`` (its imports rewritten to that name, so that its
frames count as tracer's own in the walk out to the calling frame). Two watchers, one of each, watch
``tests/scripts/minimind_ppo.py``'s ``ppo_train_epoch`` (MiniMind's PPO in the seed's names, 12
backwards a PPO step, 19 fields a capture) on the tiny local model, each writing its own trace; in
each epoch only one of them captures (the other's wrapper returns at once), the order alternating
from round to round. For every captured backward it takes ``Watcher.on_backward``'s thread CPU
(``time.thread_time``) and wall time, and prints the medians of both and their ratio, per writer
(``--writer thread,process``). (The two traces are of different epochs, the model training on
between them: what is recorded is compared apart, on the same runs made by each tree.)

    python -m bench.capture_ab [--base 95f3de2] [--rounds 6] [--writer thread,process]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

import tracer
from bench.common import machine, median
from bench.loops import ppo_setup

REPO = Path(__file__).resolve().parents[1]
_TIMER = """
def timed(loss):
    if active[0] != me:
        return
    t0, c0 = perf_counter(), thread_time()
    try:
        real(loss)
    finally:
        cpu.append(thread_time() - c0)
        wall.append(perf_counter() - t0)
"""
_IMPORTS = re.compile(r"\b(from|import) tracer(\.| import)")


def unpack_base(revision: str, folder: Path):
    """``tracer/`` at ``revision``, importable as ``tracer._base`` (returns its ``watch`` module)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "tracer"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    base = folder / "_base"
    (folder / "tracer").rename(base)
    for path in base.rglob("*.py"):
        text = path.read_text()
        path.write_text(_IMPORTS.sub(lambda m: f"{m.group(1)} tracer._base{m.group(2)}", text))
    (base / "_base").symlink_to(base)  # its writer child imports `tracer._base` with tracer's path set to it
    tracer.__path__.append(str(folder))
    return _watch_module("tracer._base")


def _watch_module(package: str):
    """The watcher's module of ``package``: ``zero_edit/watch.py`` in the packages by stage, ``watch.py``
    in revisions before them (imported by name: ``tracer.watch`` is also the function's name)."""
    if importlib.util.find_spec(f"{package}.zero_edit") is not None:
        return importlib.import_module(f"{package}.zero_edit.watch")
    return importlib.import_module(f"{package}.watch")


def _gate(watcher, me: str, active: list, cpu: list, wall: list) -> None:
    scope = {"__name__": "tracer._bench_timer", "perf_counter": time.perf_counter, "thread_time": time.thread_time,
             "real": watcher.on_backward, "cpu": cpu, "wall": wall, "active": active, "me": me}
    exec(compile(_TIMER, "<bench timer>", "exec"), scope)  # noqa: S102  (a fixed string)
    watcher.on_backward = scope["timed"]


def measure(base_watch, writer: str, rounds: int, tmp: str) -> dict[str, tuple[list, list]]:
    new_watch = _watch_module("tracer")

    epoch, _ = ppo_setup(f"{tmp}/{writer}", 1)
    times: dict[str, tuple[list, list]] = {"base": ([], []), "new": ([], [])}
    active: list = [None]
    with contextlib.redirect_stdout(io.StringIO()), \
            new_watch.Watcher("ppo", f"{tmp}/{writer}/new", writer=writer) as new, \
            base_watch.Watcher("ppo", f"{tmp}/{writer}/base", writer=writer) as old:
        watchers = {"new": new, "base": old}
        for me, w in watchers.items():
            _gate(w, me, active, *times[me])
        for r in range(-1, rounds):
            for me in ("new", "base") if r % 2 == 0 else ("base", "new"):
                done = len(times[me][0])
                active[0] = me
                epoch()
                watchers[me].writer.flush()
                if r < 0:  # the warm-up epoch: plans made, writers opened
                    del times[me][0][done:], times[me][1][done:]
        active[0] = None
    assert not new.failures and not old.failures
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="95f3de2", help="git revision of the 'before' tracer (default 95f3de2)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of one epoch each (12 backwards) per side")
    parser.add_argument("--writer", default="thread,process")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        base_watch = unpack_base(args.base, Path(tmp) / "pkg")
        for writer in args.writer.split(","):
            times = measure(base_watch, writer, args.rounds, tmp)
            (b_cpu, b_wall), (n_cpu, n_wall) = times["base"], times["new"]
            print(f"ppo zero-edit capture, writer={writer}, {len(n_cpu)} backwards each: on_backward thread CPU "
                  f"base {1e6 * median(b_cpu):.0f} us -> this tree {1e6 * median(n_cpu):.0f} us "
                  f"({median(n_cpu) / median(b_cpu):.2f}x); wall {1e6 * median(b_wall):.0f} -> "
                  f"{1e6 * median(n_wall):.0f} us")


if __name__ == "__main__":
    sys.exit(main())
