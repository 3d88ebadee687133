"""The drop count survives a disk the trace's own step files fill to 0 bytes free.

A real 1 MiB tmpfs (mounted by the test: root only, skipped otherwise; CI runs as root) is filled by
real step files until every write fails with ENOSPC. The manifest cannot be rewritten then (its
atomic rewrite needs new blocks), so the writer keeps its counts in ``manifest.counts``, reserved
when the trace started (tracer/format/counts.py). ``Trace`` and ``tracer info`` must report the true
drop count, the reason and the status ``finished`` of the closed writer, never ``dropped: 0``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tracer import Trace, TraceWriter
from tracer.cli import main
from tracer.format.counts import COUNTS_NAME, SLOT_BYTES, read_counts, reserve_counts, write_counts
from tracer.read.trace_info import trace_info

from tests.fixtures.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from crash_loop import step_tensors  # noqa: E402  (values derived from the step number, ~40 KB a step)
sys.path.remove(str(SCRIPTS))

STEPS, BIG_STEPS = 60, 40  # 40 steps of ~40 KB (1.6 MB: the disk fills), then 20 of < 4 KB (they take its last blocks)
NO_SPACE = "No space left on device"


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted at ``tmp_path / "disk"``, unmounted after the test."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def step_of(step: int) -> dict:
    """Step ``step``'s tensors: whole (B = 8, T = 256) for the first BIG_STEPS, then 2 rows of 32 tokens."""
    tensors = step_tensors(step)
    if step < BIG_STEPS:
        return tensors
    return {name: (t[:2, :32] if t.dim() == 2 else t[:2]).contiguous() for name, t in tensors.items()}


def fill_disk(root: Path, writer_kind: str) -> tuple[TraceWriter, list[str]]:
    """Record STEPS real steps into ``root`` (the disk fills part way), close; the warnings given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = TraceWriter(root, "grpo", hyperparameters={"num_generations": 2}, writer=writer_kind)
        for step in range(STEPS):
            writer.record(step, step_of(step))
            if step % 8 == 7:
                writer.flush()
        writer.close()
    return writer, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("writer_kind", ["thread", "process"])
def test_info_reports_the_true_drop_count_after_the_step_files_filled_the_disk(small_disk, writer_kind, capsys):
    root = small_disk / "run"
    writer, _ = fill_disk(root, writer_kind)
    assert os.statvfs(small_disk).f_bavail == 0  # the step files filled the disk to 0 bytes free
    trace = Trace(root)
    on_disk = len(trace.steps())
    dropped = STEPS - on_disk
    assert 0 < on_disk < STEPS and writer.dropped_steps == dropped
    # every drop counted, the reasons say why, the closed writer's status kept: from manifest.counts
    assert trace.manifest["dropped_steps"] == dropped and trace.manifest["steps_written"] == on_disk
    assert trace.status == "finished"
    stale = json.loads((root / "manifest.json").read_text())  # what the manifest alone would say
    assert stale["status"] == "running" and stale["dropped_steps"] < dropped
    assert trace.manifest["drop_reasons"] and all(NO_SPACE in r for r in trace.manifest["drop_reasons"])
    assert trace.counts_note.startswith(f"status and counts from {COUNTS_NAME}: the writer could not rewrite "
                                        "manifest.json (OSError: [Errno 28] No space left on device")
    info = trace_info(root)
    assert (info["dropped_steps"], info["status"]) == (dropped, "finished")
    assert main(["info", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"dropped: {dropped}" in out and "dropped: 0" not in out
    assert f"drop count: status and counts from {COUNTS_NAME}" in out and NO_SPACE in out


def test_strict_mode_counts_every_failure_where_its_message_says(small_disk):
    """Strict mode's error says the failed writes are counted in the trace's dropped_steps: so they are."""
    from tracer import TraceError

    root = small_disk / "run"
    writer = TraceWriter(root, "grpo", hyperparameters={"num_generations": 2}, writer="thread", strict=True)
    raised = []
    for step in range(STEPS):
        try:
            writer.record(step, step_of(step))
            writer.flush()
        except TraceError as err:
            raised.append(str(err))
    try:
        writer.close()
    except TraceError as err:
        raised.append(str(err))
    assert raised and all(NO_SPACE in r for r in raised)
    trace = Trace(root)
    assert trace.manifest["dropped_steps"] == writer.dropped_steps > 0
    assert trace.manifest["dropped_steps"] + len(trace.steps()) + len(raised) >= STEPS  # a raising record takes no step


def test_counts_newer_than_the_manifest_are_read_and_older_ones_ignored(tmp_path):
    """A counts slot is used only when newer than the manifest's revision; a torn slot falls back
    to the other one (written by hand: the layout of tracer/format/counts.py)."""
    writer = TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}, writer="thread")
    writer.record(0, step_tensors(0))
    writer.close()
    root = tmp_path / "run"
    trace = Trace(root)
    assert trace.counts_note is None and trace.manifest["dropped_steps"] == 0
    revision = trace.manifest["revision"]
    body = {"status": "finished", "steps_written": 1, "dropped_steps": 3, "skipped_steps": 0,
            "drop_reasons": ["step 1: disk full"], "manifest_error": "OSError: [Errno 28] No space left on device"}
    write_counts(root, {**body, "revision": revision - 1})  # older than the manifest: ignored
    assert Trace(root).manifest["dropped_steps"] == 0
    write_counts(root, {**body, "revision": revision + 1})
    assert Trace(root).manifest["dropped_steps"] == 3 and read_counts(root)["revision"] == revision + 1
    write_counts(root, {**body, "dropped_steps": 5, "revision": revision + 2})  # replaces the older slot
    with open(root / COUNTS_NAME, "r+b") as fh:  # tear the newest slot: the other one is used
        raw = fh.read()
        newest = 0 if b'"dropped_steps":5' in raw[:SLOT_BYTES] else 1
        fh.seek(newest * SLOT_BYTES + 40)
        fh.write(b"XX")
    assert Trace(root).manifest["dropped_steps"] == 3


def test_info_says_the_drop_count_is_unknown_without_a_manifest_and_partial_for_a_running_writer(tmp_path, capsys):
    root = tmp_path / "run"
    writer = TraceWriter(root, "grpo", hyperparameters={"num_generations": 2}, writer="thread")
    writer.record(0, step_tensors(0))
    writer.flush()
    try:
        info = trace_info(root)
        assert info["status"] == "running" and info["drops_note"].startswith(
            "counted until the manifest's last update: the writer did not close")
    finally:
        writer.close()
    (root / "manifest.json").unlink()
    assert main(["info", str(root)]) == 0
    out = capsys.readouterr().out
    assert "dropped: unknown" in out and "the number of dropped steps is unknown" in out


def test_the_reserved_counts_file_is_blank_until_the_manifest_fails(tmp_path):
    reserve_counts(tmp_path)
    assert (tmp_path / COUNTS_NAME).stat().st_size == 2 * SLOT_BYTES and read_counts(tmp_path) is None
