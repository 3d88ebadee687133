"""``record(..., scalars={...})`` and the step's wall-clock time reach ``Trace.step_summary()`` as
``scalars/<name>`` and ``wall_time`` by every path a reader takes (header, summary index, summary
columns, a summary of another version recomputed from the tensors), with the per-step means the
summary gains (loss, entropy, length, reward components); bad scalars are refused by name; and
``Tracer(vocabulary=...)`` writes the token strings a user without an HF tokenizer has."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tracer.errors import SchemaError, TraceError
from tracer.format.names import summary_index_name, summary_store_name
from tracer.read import Trace
from tracer.read.overview import scalar_columns
from tracer.record.writer import TraceWriter

HYPER = {"num_generations": 2, "reward_component_names": ["format", "answer"]}


def _step(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[True, True, True, False], [True, False, False, False], [True, True, False, False],
                         [True, True, True, True]])
    return {"completion_ids": torch.randint(0, 5, (4, 4), generator=g), "completion_mask": mask,
            "policy_logprobs": -torch.rand(4, 4, generator=g), "entropy": torch.rand(4, 4, generator=g),
            "rewards": torch.rand(4, generator=g), "reward_components": torch.rand(4, 2, generator=g),
            "advantages": torch.randn(4, generator=g), "loss": torch.rand((), generator=g)}


def _write(path, steps, scalars, **kwargs):
    with TraceWriter(path, "grpo", hyperparameters=HYPER, **kwargs) as w:
        for step, (tensors, values) in enumerate(zip(steps, scalars)):
            w.record(step, tensors, scalars=values)
    return Trace(path)


def _assert_values(frame, steps, scalars, before, after):
    for row, t, values in zip(frame.to_dict("records"), steps, scalars):
        mask = t["completion_mask"]
        # entropy: masked mean over the kept tokens; length: kept tokens per row (3, 1, 2, 4), mean 2.5
        assert row["mean_entropy"] == pytest.approx(float(t["entropy"][mask].sum() / mask.sum()), rel=1e-6)
        assert row["mean_length"] == 2.5 and row["length_max"] == 4.0
        assert row["loss"] == pytest.approx(float(t["loss"]), rel=1e-7)
        assert row["mean_reward/format"] == pytest.approx(float(t["reward_components"][:, 0].mean()), rel=1e-6)
        assert row["mean_reward/answer"] == pytest.approx(float(t["reward_components"][:, 1].mean()), rel=1e-6)
        for name, value in values.items():
            got = row[f"scalars/{name}"]
            assert (math.isnan(got) and math.isnan(value)) or got == value
        assert before <= row["wall_time"] <= after


def test_scalars_and_wall_time_reach_the_step_summary_by_every_path(tmp_path):
    steps = [_step(s) for s in range(3)]
    scalars = [{"grad_norm": 0.5, "learning_rate": 1e-6}, {"grad_norm": float("nan"), "learning_rate": 2e-6},
               {"grad_norm": np.float32(0.25), "learning_rate": torch.tensor(3e-6, dtype=torch.float64)}]
    expected = [{"grad_norm": 0.5, "learning_rate": 1e-6}, {"grad_norm": math.nan, "learning_rate": 2e-6},
                {"grad_norm": 0.25, "learning_rate": 3e-6}]
    before = time.time()
    trace = _write(tmp_path / "run", steps, scalars)
    after = time.time()
    columns = trace.step_summary()  # from the summary columns written at close
    assert columns.attrs["from_index"] == 3
    _assert_values(columns, steps, expected, before, after)
    walls = columns["wall_time"].tolist()
    assert walls == sorted(walls)
    (tmp_path / "run" / summary_store_name(0)).unlink()
    from_index = Trace(tmp_path / "run").step_summary()
    (tmp_path / "run" / summary_index_name(0)).unlink()
    from_headers = Trace(tmp_path / "run").step_summary()
    assert set(from_headers["summary_source"]) == {"header"} and from_headers.attrs["from_index"] == 0
    for frame in (from_index, from_headers):
        pd_equal = frame.drop(columns=["derived"]).equals(columns.drop(columns=["derived"]))
        assert pd_equal, (frame.T, columns.T)
    # no other header key holds them: tracer diff never sees the wall clock
    meta = trace.metadata(trace.step_key(0))
    assert "wall_time" not in meta and "recorded_summary_values" not in meta
    assert meta["summary"]["scalars/grad_norm"] == 0.5
    names = scalar_columns(columns)
    assert names[:7] == ["loss", "mean_reward", "mean_reward/format", "mean_reward/answer", "mean_advantage",
                         "mean_length", "mean_entropy"]
    assert names.index("scalars/grad_norm") < names.index("kept_tokens") < names.index("reward_p10")
    assert "wall_time" not in names and "step" not in names


def test_a_summary_of_another_version_is_recomputed_and_keeps_the_recorded_values(tmp_path):
    steps = [_step(0)]
    trace = _write(tmp_path / "run", steps, [{"grad_norm": 0.75}])
    for name in (summary_index_name(0), summary_store_name(0)):
        (tmp_path / "run" / name).unlink()
    path = trace.step_key(0).path
    with safe_open(str(path), "pt") as fh:
        meta = dict(fh.metadata())
    stored = json.loads(meta["summary"])
    # an older writer's summary: version 1, no means of entropy or length; the recorded values kept
    meta["summary"] = json.dumps({"version": 1, "mean_reward": stored["mean_reward"],
                                  "wall_time": stored["wall_time"], "scalars/grad_norm": 0.75})
    save_file(load_file(str(path)), str(path), metadata=meta)
    row = Trace(tmp_path / "run").step_summary().iloc[0]
    assert row["summary_source"] == "tensors"
    assert row["scalars/grad_norm"] == 0.75 and row["wall_time"] == stored["wall_time"]
    assert row["mean_length"] == 2.5 and row["mean_entropy"] == pytest.approx(stored["mean_entropy"])


@pytest.mark.parametrize("scalars, message", [
    ({"lr": "1e-3"}, r"scalars\['lr'\]: expected a number .*got '1e-3'"),
    ({"flag": True}, r"scalars\['flag'\]: expected a number .*got True"),
    ({"v": torch.ones(2)}, r"scalars\['v'\]: expected .*got tensor of shape \(2,\)"),
    ({3: 1.0}, r"scalars: the name 3 is not a string of 1 to 100 characters"),
    ({"": 1.0}, r"scalars: the name '' is not a string"),
    ([("a", 1.0)], r"scalars: expected a dict \{name: number\}, got list"),
])
def test_bad_scalars_are_refused_by_name(tmp_path, scalars, message):
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters=HYPER) as w:
        with pytest.raises(SchemaError, match=message):
            w.record(0, _step(0), scalars=scalars)
        w.record(0, _step(0))  # the refused step was not recorded
    assert Trace(tmp_path / "run").step_count() == 1


@pytest.mark.parametrize("vocabulary", [["<pad>", "a", " b"], {0: "<pad>", 1: "a", 2: " b"},
                                        {"<pad>": 0, "a": 1, " b": 2}, ("<pad>", "a", " b")])
def test_a_plain_vocabulary_gives_the_token_strings(tmp_path, vocabulary):
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters=HYPER, vocabulary=vocabulary) as w:
        w.record(0, _step(0))
    trace = Trace(tmp_path / "run")
    assert trace.tokens == ["<pad>", "a", " b"]
    assert trace.token_text([2, 1, 7]) == [" b", "a", "<id 7>"]
    assert trace.manifest["tokenizer"] == {"class": "vocabulary", "size": 3}


def test_a_dict_with_gaps_shows_the_missing_ids_as_the_reader_does(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters=HYPER, vocabulary={3: "x", 0: "y"}) as w:
        w.record(0, _step(0))
    assert Trace(tmp_path / "run").tokens == ["y", "<id 1>", "<id 2>", "x"]


@pytest.mark.parametrize("vocabulary, message", [
    ("abc", r"vocabulary: expected a list or a dict, got 'str'"),
    (["a", 3], r"vocabulary: entry 1 is not a string, got 'int'"),
    ({"a": 1, 2: "b"}, r"vocabulary: a dict must map every int id >= 0 to its text, or every text to its int id"),
    ({-1: "a"}, r"entry -1: 'a' is neither"),
    ({"a": 0, "b": 0}, r"vocabulary: id 0 has two texts \('a' and 'b'\)"),
    ({2**22: "a"}, r"vocabulary: ids up to 2097151 are stored, got 4194304"),
])
def test_a_bad_vocabulary_is_refused_before_anything_is_written(tmp_path, vocabulary, message):
    with pytest.raises(SchemaError, match=message):
        TraceWriter(tmp_path / "run", "grpo", vocabulary=vocabulary)
    assert not (tmp_path / "run").exists()


def test_tokenizer_and_vocabulary_together_are_refused(tmp_path):
    with pytest.raises(TraceError, match="pass tokenizer= or vocabulary=, not both"):
        TraceWriter(tmp_path / "run", "grpo", tokenizer=object(), vocabulary=["a"])


def test_an_infinite_scalar_is_recorded_as_it_was(tmp_path):
    # clip_grad_norm_ returns inf on an overflowing step: the run goes on and the trace keeps the value,
    # in the step's summary (header, index, columns) and in the log of scalars that arrive later
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters=HYPER) as w:
        w.record(0, _step(0), scalars={"grad_norm": float("inf")})
        w.record(1, _step(1), scalars={"grad_norm": torch.tensor(float("-inf"))})
        w.log_scalars(1, {"late": float("inf")})
    frame = Trace(tmp_path / "run").step_summary()
    assert frame["scalars/grad_norm"].tolist() == [float("inf"), float("-inf")]
    assert frame["scalars/late"].tolist()[1] == float("inf")
