"""guard="stop" with the default writer (``"auto"``) stops a short CPU loop at its first error, as
with ``writer="thread"``. "auto" picked the writer process for CPU tensors; its start (a fresh
interpreter importing torch, 1-3 s) kept the first steps unwritten and unchecked, and a loop that closed
before it started was written by a thread at close(): the new-user trial's 6-step loop printed
"stopping at ERROR" but never raised GuardStop, and its manifest said ``stopped_at: None``. Under
guard="stop", "auto" now takes the thread, and the manifest says why."""

from __future__ import annotations

import json

import pytest

import tracer
from tracer.record.backends import GUARD_STOP_CHOICE

from tests.guard.grpo_loops import run_loop


def test_the_default_writer_under_stop_raises_by_step_2(model_dir, tmp_path):
    out = tmp_path / "flip"
    progress: list[int] = []
    with pytest.raises(tracer.GuardStop):
        run_loop(out, model_dir, "stop", bug="flip_kl", steps=6, writer="auto", progress=progress)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["capture"]["writer"] == "thread" and manifest["capture"]["writer_choice"] == GUARD_STOP_CHOICE
    assert manifest["guard"]["stopped_at"]["step"] <= 2 and progress[-1] <= 2


def test_warn_keeps_the_writer_auto_picks(model_dir, tmp_path):
    from tracer.record.modes import auto_writer

    out = run_loop(tmp_path / "healthy", model_dir, "warn", steps=1, writer="auto")
    manifest = json.loads((out / "manifest.json").read_text())
    picked, why = auto_writer(True)
    assert manifest["capture"]["writer_choice"].startswith(why)  # the process (or, on a one-core machine, a thread)
