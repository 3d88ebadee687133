"""Review 7: the writer process's child that lingers for more steps (tracer.writer_child), is hurried
by a record waiting for room, and keeps its ring views per (layout, offset). Real child processes,
real shared memory, real files: the steps written (exact lists, exact values) when the child is
killed, stopped or orphaned while it lingers, under tight bounds, through the anomaly ring, with
layouts sharing an offset, and against the writer thread's bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from tracer.capture import SamplingPolicy
from tracer.reader import Trace
from tracer.writer import TraceWriter
from tracer.writer_process import ALIGN, _Layout

from test_writer_process import _alive, _lingering_child, _wait_gone, grpo_step

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("completion_ids", "completion_mask", "policy_logprobs", "old_logprobs", "rewards", "advantages", "group_ids")


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def _assert_steps(root: Path, expected: dict[int, dict[str, torch.Tensor]]) -> None:
    """The trace holds exactly the steps of ``expected``, each with exactly its values."""
    trace = Trace(root)
    assert [k.step for k in trace.steps()] == sorted(expected)
    for key in trace.steps():
        got = trace.load_step(key, derive=False)
        for name, want in expected[key.step].items():
            assert torch.equal(got[name].to(want.dtype), want), (key.step, name)


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


# -- the linger never holds ring room a record needs -------------------------------------------------


def test_a_lingering_child_leaves_room_for_small_padded_steps_under_drop(tmp_path, monkeypatch):
    """Steps of many small fields take far more ring room (each field on a 64-byte boundary) than
    their bytes: a ring of 4 such steps holds 4 x 100 bytes. A child that lingers until half the
    ring's bytes are its steps' own bytes would hold all 4 and make the 5th drop (when_full="drop"),
    although it writes in a moment whatever it is given; it must stop lingering once half the
    ring's room is held, so that every step finds room once the child has written."""
    _lingering_child(monkeypatch)  # only the bounds end a linger
    size = _Layout(0, _tiny(0), "float32").size
    assert size == 7 * ALIGN
    ring = 4 * size
    expected = {}
    with TraceWriter(tmp_path / "p", "grpo", writer="process", max_queue_bytes=ring, when_full="drop") as writer:
        writer.record(0, _tiny(0))
        writer.flush()
        expected[0] = _tiny(0)
        process = writer._process
        for step in range(1, 13):
            assert writer.record(step, _tiny(step)) is not None, step
            expected[step] = _tiny(step)
            # the next step finds room once the child has done what it does without being told
            assert _until(lambda: process._place(size) is not None, process, 5.0), step
        assert writer.dropped_steps == 0
    _assert_steps(tmp_path / "p", expected)
    assert (_manifest(tmp_path / "p")["steps_written"], _manifest(tmp_path / "p")["dropped_steps"]) == (13, 0)
