"""A guard whose checks cannot keep up leaves files out instead of making record() wait: the first
four files are always checked, later ones only as its time share allows, and it says so (a note in
the findings file, handed to the training process)."""

from __future__ import annotations

import torch

from tracer.format.findings_log import findings_paths, read_lines
from tracer.record.writer import TraceWriter


def test_a_slow_guard_checks_the_first_files_and_notes_the_rest(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TRACER_GUARD_SHARE", "0.001")  # a check of ~10 ms then rests ~10 s
    g = torch.Generator().manual_seed(0)
    got = []
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}, guard=got.append) as writer:
        for step in range(30):
            policy = -torch.rand(4, 3, generator=g)
            writer.record(step, {"policy_logprobs": policy, "old_logprobs": policy, "rewards": torch.rand(4, generator=g),
                                 "completion_mask": torch.ones(4, 3, dtype=torch.bool)})
            writer.flush()  # each file written before the next: they arrive one by one
    (path,) = findings_paths(tmp_path / "run")
    lines = list(read_lines(path))
    checked = [line["file"] for line in lines if line["kind"] == "checked"]
    assert checked[:4] == [f"step_{s:08d}.inner_0.mb_0.rank_0.safetensors" for s in range(4)]
    assert len(checked) < 30
    notes = [line["message"] for line in lines if line["kind"] == "note" and "fell behind" in line["message"]]
    assert notes and notes[0].startswith("the guard fell behind and checks about one step file in ")
    assert any(r.name == "tracer.guard" and "fell behind" in r.getMessage() for r in caplog.records)
