"""``Trace.rollouts()``: one row per completion of every step file, equal to values computed here
independently (plain Python loops over the step files' tensors, loaded with safetensors), whether the
rows come from the writer's rollout summaries or from the tensors of an older trace."""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import load_file

from tracer.demo.grpo_loop import GRPOConfig, run
from tracer.errors import TraceError
from tracer.format.rollout_store import MAX_TEXT_CHARS, ROLLOUT_GLOB
from tracer.read import Trace
from tracer.record.writer import TraceWriter


def _row_mean(values: list[float], keep: list[bool]) -> float:
    kept = [v for v, k in zip(values, keep) if k]
    return sum(kept) / len(kept) if kept else 0.0


def _expected_rows(trace: Trace) -> list[dict]:
    """Every completion's values from the step files, by hand."""
    tokens = trace.tokens
    names = trace.manifest["hyperparameters"]["reward_component_names"]
    rows = []
    for key in trace.steps():
        t = load_file(str(key.path))
        for b in range(t["completion_ids"].shape[0]):
            keep = t["completion_mask"][b].tolist()
            policy, old, ref = (t[f][b].double().tolist() for f in ("policy_logprobs", "old_logprobs", "ref_logprobs"))
            ratio = [math.exp(p - o) for p, o in zip(policy, old)]
            k3 = [math.exp(r - p) - (r - p) - 1 for p, r in zip(policy, ref)]
            text = "".join(tokens[i] for i, k in zip(t["completion_ids"][b].tolist(), keep) if k)
            rows.append({"step": key.step, "inner_step": key.inner_step, "seq": b,
                         "group": int(t["group_ids"][b]), "reward": float(t["rewards"][b]),
                         **{f"reward/{n}": float(t["reward_components"][b, f]) for f, n in enumerate(names)},
                         "length": sum(keep), "advantage": float(t["advantages"][b]),
                         "mean_ratio": _row_mean(ratio, keep), "mean_ref_kl_k3": _row_mean(k3, keep),
                         "text": text[:MAX_TEXT_CHARS]})
    return rows


@pytest.fixture(scope="module")
def grpo_trace(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rollouts") / "grpo"
    run(out, GRPOConfig(steps=2, num_prompts=2, num_generations=3, num_iterations=2, max_new_tokens=6), model_dir)
    return out


def _assert_rows(frame, expected):
    assert len(frame) == len(expected)
    for got, want in zip(frame.to_dict("records"), expected):
        for name, value in want.items():
            if isinstance(value, float):
                assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, got, want)
            else:
                assert got[name] == value, (name, got, want)


def test_rows_of_a_hand_written_grpo_run_come_from_the_summaries_and_match_the_tensors(grpo_trace):
    trace = Trace(grpo_trace)
    frame = trace.rollouts()
    assert set(frame["source"]) == {"summary"}
    assert frame["mean_abs_mismatch"].isna().all()  # no sampler_logprobs recorded
    _assert_rows(frame, _expected_rows(trace))
    assert list(frame.columns[:7]) == ["step", "inner_step", "micro_batch", "rank", "seq", "group", "reward"]
    assert list(frame.columns[-4:]) == ["mean_entropy", "text", "text_truncated", "source"]


def test_an_older_trace_without_summaries_is_read_from_its_tensors_with_progress(grpo_trace, tmp_path):
    import shutil
    older = tmp_path / "older"
    shutil.copytree(grpo_trace, older)
    for path in older.glob(ROLLOUT_GLOB):
        path.unlink()
    calls = []
    trace = Trace(older)
    frame = trace.rollouts(progress=lambda done, total: calls.append((done, total)))
    n = trace.step_count()
    assert calls == [(i, n) for i in range(1, n + 1)]
    assert set(frame["source"]) == {"tensors"}
    _assert_rows(frame, _expected_rows(trace))
    from_summary = Trace(grpo_trace).rollouts()
    assert frame.drop(columns="source").equals(from_summary.drop(columns="source"))


def test_a_step_file_changed_after_its_summary_is_read_from_its_tensors(grpo_trace, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(grpo_trace, copy)
    trace = Trace(copy)
    key = trace.steps()[1]
    t = load_file(str(key.path))
    t["rewards"] = t["rewards"] + 10.0
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(key.path), "pt") as fh:
        meta = fh.metadata()
    save_file(t, str(key.path), metadata={**meta, "padding": "x" * 7})  # another size: not vouched for
    frame = Trace(copy).rollouts()
    rows = frame[(frame["step"] == key.step) & (frame["inner_step"] == key.inner_step)]
    assert set(rows["source"]) == {"tensors"}
    assert rows["reward"].tolist() == pytest.approx((t["rewards"]).tolist())
    assert set(frame.drop(rows.index)["source"]) == {"summary"}


def test_ppo_advantages_are_row_means_and_mismatch_is_mean_absolute_gap(tmp_path):
    # two rows, T = 3; row 0 keeps tokens 0 and 1, row 1 keeps token 0 only
    mask = torch.tensor([[True, True, False], [True, False, False]])
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    sampler = torch.tensor([[-1.5, -1.0, -9.0], [-0.25, -4.0, -4.0]])
    adv = torch.tensor([[1.0, 3.0, 100.0], [-2.0, 50.0, 50.0]])
    with TraceWriter(tmp_path / "ppo", "ppo", vocabulary=["a", "b", "c", "d"]) as w:
        w.record(0, completion_ids=torch.tensor([[1, 2, 3], [3, 0, 0]]), completion_mask=mask,
                 policy_logprobs=old, old_logprobs=old, sampler_logprobs=sampler, ref_logprobs=old,
                 rewards=torch.tensor([1.0, 0.0]), advantages=adv, values=torch.zeros(2, 3),
                 returns=adv.clone(), token_rewards=torch.zeros(2, 3))
    frame = Trace(tmp_path / "ppo").rollouts()
    # advantage: (1 + 3) / 2 = 2 and -2; |old - sampler|: (0.5 + 1.0) / 2 = 0.75 and 0.25
    assert frame["advantage"].tolist() == [2.0, -2.0]
    assert frame["mean_abs_mismatch"].tolist() == [0.75, 0.25]
    assert frame["group"].tolist() == [-1, -1]
    assert frame["length"].tolist() == [2.0, 1.0]
    assert frame["text"].tolist() == ["bc", "d"]
    assert frame["mean_ratio"].tolist() == [1.0, 1.0]


def test_long_completions_are_cut_and_flagged(tmp_path):
    T = MAX_TEXT_CHARS // 3 + 5  # each token "xyz": 3 characters
    with TraceWriter(tmp_path / "long", "grpo", vocabulary=["xyz"], hyperparameters={"num_generations": 2}) as w:
        w.record(0, completion_ids=torch.zeros(2, T, dtype=torch.long),
                 completion_mask=torch.tensor([[True] * T, [True] * 2 + [False] * (T - 2)]),
                 policy_logprobs=torch.zeros(2, T), rewards=torch.tensor([1.0, 0.0]),
                 advantages=torch.tensor([1.0, -1.0]))
    for path in [None, *sorted((tmp_path / "long").glob(ROLLOUT_GLOB))]:
        if path is not None:
            os.unlink(path)  # then read from the tensors: the same text
        frame = Trace(tmp_path / "long").rollouts()
        assert frame["text"].tolist() == ["xyz" * (MAX_TEXT_CHARS // 3) + "x", "xyzxyz"]
        assert frame["text_truncated"].tolist() == [True, False]
        assert frame["group"].tolist() == [0, 0]


def test_a_dpo_trace_has_no_rollouts(tmp_path):
    with TraceWriter(tmp_path / "dpo", "dpo") as w:
        w.record(0, chosen_ids=torch.ones(1, 2, dtype=torch.long), rejected_ids=torch.ones(1, 2, dtype=torch.long),
                 chosen_mask=torch.ones(1, 2, dtype=torch.bool), rejected_mask=torch.ones(1, 2, dtype=torch.bool),
                 chosen_policy_logprobs=torch.zeros(1, 2), rejected_policy_logprobs=torch.zeros(1, 2))
    with pytest.raises(TraceError, match="DPO trace: its rows are preference pairs"):
        Trace(tmp_path / "dpo").rollouts()
    assert not list((tmp_path / "dpo").glob(ROLLOUT_GLOB))  # the writer starts no rollout summaries for DPO
