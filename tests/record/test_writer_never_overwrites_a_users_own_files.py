"""A writer started on a folder that holds the user's own ``manifest.json`` or ``tokens.json`` (not a
tracer trace's) refuses, naming the file, and leaves both untouched: it used to replace them without a
word. A folder holding a tracer trace's own manifest and no step file (a run that stopped before its
first step, or another rank's start) is no obstacle."""

from __future__ import annotations

import json

import pytest
import torch

import tracer
from tracer.errors import TraceError
from tracer.read import Trace


def _record_one(tr):
    tr.record(0, {"completion_ids": torch.tensor([[1, 0]]), "completion_mask": torch.tensor([[True, False]]),
                  "policy_logprobs": torch.tensor([[-0.5, 0.0]]), "rewards": torch.tensor([1.0])})


@pytest.mark.parametrize("own", [("manifest.json",), ("tokens.json",), ("manifest.json", "tokens.json")])
def test_the_users_manifest_or_tokens_file_is_refused_and_kept(tmp_path, own):
    folder = tmp_path / "mine"
    folder.mkdir()
    texts = {"manifest.json": '{"my": "precious manifest"}', "tokens.json": "my tokens"}
    for name in own:
        (folder / name).write_text(texts[name])
    with pytest.raises(TraceError, match=rf"holds a {own[0]} that is not a tracer trace's .* would overwrite "
                                         rf".*{own[0]}: choose a new output directory or move that file away"):
        tracer.Tracer(folder, algorithm="ppo", vocabulary=["a", "b"], guard="off")
    assert {p.name: p.read_text() for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")} == {
        name: texts[name] for name in own}
    assert not (folder / "steps").exists() or not any((folder / "steps").iterdir())


def test_a_trace_that_stopped_before_its_first_step_is_reused(tmp_path):
    folder = tmp_path / "run"
    tracer.Tracer(folder, algorithm="ppo", vocabulary=["a", "b"], guard="off").close()  # no step recorded
    assert json.loads((folder / "manifest.json").read_text())["format"] == "tracer-trace"
    with tracer.Tracer(folder, algorithm="ppo", vocabulary=["a", "b"], guard="off") as tr:
        _record_one(tr)
    assert [k.step for k in Trace(folder).steps()] == [0]


def test_a_second_rank_starts_in_the_trace_the_first_began(tmp_path, monkeypatch):
    folder = tmp_path / "ranks"
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's variables: the writer's rank comes from RANK
    monkeypatch.setenv("RANK", "0")
    with tracer.Tracer(folder, algorithm="ppo", vocabulary=["a", "b"], guard="off") as first:
        _record_one(first)
        monkeypatch.setenv("RANK", "1")
        with tracer.Tracer(folder, algorithm="ppo", vocabulary=["a", "b"], guard="off") as second:
            _record_one(second)
    assert sorted(k.rank for k in Trace(folder).steps()) == [0, 1]
