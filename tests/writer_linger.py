"""What the tests of the writer process's lingering child share (tests/test_writer_linger_room.py,
tests/test_writer_linger_ends.py, tests/test_writer_ring_views.py, from the seventh adversarial
review): the trace's manifest, a check that a trace holds exactly the steps expected with exactly
their values, a poll of the child's results, and a step of a few bytes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tracer.read.reader import Trace

from test_writer_process import grpo_step


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def _assert_steps(root: Path, expected: dict[int, dict[str, torch.Tensor]]) -> None:
    """The trace holds exactly the steps of ``expected``, each with exactly its values."""
    trace = Trace(root)
    assert [k.step for k in trace.steps()] == sorted(expected)
    for key in trace.steps():
        got = trace.load_step(key, derive=False)
        for name, want in expected[key.step].items():
            torch.testing.assert_close(got[name].to(want.dtype), want, rtol=0, atol=0, equal_nan=True,
                                       msg=f"step {key.step}, {name}")


def _until(condition, process, timeout: float = 10.0) -> bool:
    """Poll the child's results until ``condition()`` holds (False when ``timeout`` passed first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()
        if condition():
            return True
        time.sleep(0.005)
    return False


def _tiny(step: int) -> dict[str, torch.Tensor]:
    """A step of 7 fields of a few bytes each (B=2, T=2: 100 bytes): each takes 64 in the ring."""
    return grpo_step(step, B=2, T=2)
