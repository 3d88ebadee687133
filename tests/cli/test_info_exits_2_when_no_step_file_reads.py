"""``tracer info``'s exit code follows ``tracer check``'s on unreadable step files: 2 when step files
are on disk and none can be read (the reason names them), 0 when readable ones remain (the unreadable
ones listed under "problems"; ``check`` exits 1 on them), and 2 with ``--verify`` when any step file is
corrupt or unreadable. Real traces written by TraceWriter, damaged on disk as a crash or a bad copy
would."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tracer import Trace, TraceWriter
from tracer.cli import main

from tests.fixtures.paths import REPO


def _grpo_trace(root, steps):
    with TraceWriter(root, "grpo", hyperparameters={"num_generations": 2}) as writer:
        for step in range(steps):
            writer.record(step, {
                "completion_ids": torch.arange(8).reshape(2, 4),
                "completion_mask": torch.ones(2, 4, dtype=torch.bool),
                "policy_logprobs": torch.full((2, 4), -0.5),
                "rewards": torch.tensor([1.0, 0.0]),
                "group_ids": torch.tensor([0, 0]),
            })
    return root, [k.path for k in Trace(root).steps()]


def _truncate(path):
    path.write_bytes(path.read_bytes()[:5])  # shorter than the 8-byte header length


def test_info_exits_2_when_none_of_the_step_files_can_be_read(tmp_path, capsys):
    root, paths = _grpo_trace(tmp_path / "run", steps=2)
    for path in paths:
        _truncate(path)
    assert main(["info", str(root)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(
        f"tracer info: error: {root}: none of its 2 step file(s) (steps/{paths[0].name}, steps/{paths[1].name}) "
        f"can be read, nothing to summarise; the first: {paths[0]}: 5 bytes, too short")
    assert "problems (2 files" in captured.out  # the summary (manifest: finished, grpo) is still printed
    assert "status: finished" in captured.out
    assert main(["info", "--json", str(root)]) == 2
    assert sorted(json.loads(capsys.readouterr().out)["unreadable"]) == sorted(str(p) for p in paths)
    assert main(["check", str(root)]) == 2  # the same verdict as check's


def test_info_of_a_folder_of_garbage_step_files_exits_2_in_a_real_process(tmp_path):
    steps = tmp_path / "copied" / "steps"  # no manifest: e.g. a half-finished copy
    steps.mkdir(parents=True)
    (steps / "step_00000000.safetensors").write_bytes(b"not a safetensors file")
    done = subprocess.run([sys.executable, "-m", "tracer", "info", str(tmp_path / "copied")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "none of its 1 step file(s) (steps/step_00000000.safetensors) can be read" in done.stderr
    assert "Traceback" not in done.stderr


def test_info_summarises_the_readable_step_files_and_exits_0_beside_an_unreadable_one(tmp_path, capsys):
    root, paths = _grpo_trace(tmp_path / "run", steps=3)
    _truncate(paths[1])
    assert main(["info", str(root)]) == 0
    captured = capsys.readouterr()
    assert "steps: 0..2 (2 steps)   step files: 2" in captured.out
    assert f"problems (1 files; unreadable step files are left out above):\n  {paths[1]}: 5 bytes" in captured.out
    assert captured.err == ""
    assert main(["check", str(root)]) == 1  # check: a trace.unreadable error finding
    capsys.readouterr()
    # --verify asks whether every step file is whole: the unreadable one is not
    assert main(["info", "--verify", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tracer info: error: {root}: --verify: 1 step file(s) (steps/{paths[1].name}) corrupt "
                          f"or unreadable; the first: {paths[1]}: 5 bytes")


def test_info_of_a_trace_not_yet_written_to_exits_0(tmp_path, capsys):
    TraceWriter(tmp_path / "new", "grpo").close()  # no step file on disk: the manifest is all there is
    assert main(["info", str(tmp_path / "new")]) == 0
    assert main(["info", "--verify", str(tmp_path / "new")]) == 0
    assert capsys.readouterr().err == ""
