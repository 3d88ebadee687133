"""The Groups page states the std the run divided its group-centred rewards by, as the trace records it
(metadata) or as the recorded rewards and advantages show it (recomputed with tracer.formulas), and
"not recorded" when neither tells, never a guess. It said "population (as MiniMind's train_grpo.py)"
for any run that did not record `advantage_std`, a hand-written loop using `torch.std`'s default
(Bessel's std) included.

Real runs on the tiny local model: TRL's GRPOTrainer (records `advantage_std = "unbiased"`),
MiniMind's train_grpo.py as tests/scripts/minimind_grpo.py traced by `tracer run` (records no rule:
its population std is inferred), a hand-written loop that divides by `torch.std` (sample std, nothing
declared) and one that records no advantages. The expected std of each group is computed here with
torch from the recorded rewards."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from streamlit.testing.v1 import AppTest

import tracer
from tracer import Trace
from tracer.cli import main as cli_main
from tracer.demo import rollout as ro
from tracer.demo.tiny_model import torch_threads

from tests.fixtures.paths import SCRIPTS
from tests.fixtures.toy_traces import APP

G = 4


def _open_groups(monkeypatch, run) -> AppTest:
    monkeypatch.setenv("TRACER_ROOT", str(run.parent))
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.switch_page("app_pages/groups.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Groups" and at.selectbox(key="run").value == run  # the root's one run
    return at


def _header(at) -> str:
    (line,) = [t.value for t in at.text if t.value.startswith("advantage:")]
    return line


def _first_step(run):
    trace = Trace(run)
    key = trace.steps()[0]
    with safe_open(str(key.path), "pt") as fh:
        data = {name: fh.get_tensor(name) for name in fh.keys()}
    return data, trace.metadata(key)


def _group_std(at) -> float:
    for df in at.dataframe:
        if {"sequence", "reward", "group_std"} <= set(df.value.columns):
            return float(df.value["group_std"].iloc[0])
    raise AssertionError("no completions table")


def _hand_written_loop(model_dir, out, divide_by_sample_std: bool | None):
    """Two prompts x G samples of the tiny model (real ``generate``), rewards from the demo's reward rules;
    advantages ``(r - mean) / (std + 1e-4)`` with ``torch.std``'s default (Bessel) when
    ``divide_by_sample_std``, none recorded when it is None. Records no advantage rule or std."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(0)
    prompts = ["2 + 3 =", "4 + 1 ="]
    with torch_threads(1):
        batch = ro.rollout(model, tokenizer, prompts, G, 6, 1.0)
    completions = tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
    rewards = ro.reward_components(batch.prompts, completions).sum(dim=1)  # (B,)
    rewards[0] += 1.0  # group 0 varies whatever the tiny model wrote
    grouped = rewards.view(-1, G)  # (P, G)
    tensors = {"completion_ids": batch.completion_ids, "completion_mask": batch.completion_mask,
               "rewards": rewards, "group_ids": batch.group_ids}
    if divide_by_sample_std is not None:
        std = grouped.std(dim=1)  # torch.std: Bessel-corrected
        tensors["advantages"] = ((grouped - grouped.mean(dim=1, keepdim=True)) / (std.unsqueeze(1) + 1e-4)).reshape(-1)
    with tracer.Tracer(out, algorithm="grpo", tokenizer=tokenizer, hyperparameters={"num_generations": G}) as writer:
        writer.record(0, tensors)
    return out


def test_trl_run_shows_the_recorded_bessel_std(monkeypatch, tmp_path):
    pytest.importorskip("trl")
    from tracer.demo import grpo_trl
    from tracer.demo.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    with torch_threads(1):
        trainer = grpo_trl.make_trainer(model_dir, tmp_path / "scratch", steps=1, seed=0, progress=False)
        tracer.attach(trainer, tmp_path / "runs" / "trl")
        trainer.train()
    run = tmp_path / "runs" / "trl"
    data, meta = _first_step(run)
    assert meta["advantage_std"] == "unbiased"
    at = _open_groups(monkeypatch, run)
    assert _header(at) == ("advantage: (r − group mean) / group std · group std: unbiased (Bessel-corrected, "
                           "torch.std's default, as TRL and verl) · recorded: advantage_std = 'unbiased'")
    group = at.selectbox(key="group").value
    rewards = data["rewards"][data["group_ids"] == group].double()
    assert _group_std(at) == pytest.approx(float(rewards.std(unbiased=True)))


def test_minimind_train_grpo_shows_the_population_std_inferred(monkeypatch, tmp_path, model_dir):
    run = tmp_path / "runs" / "minimind"
    with torch_threads(1):
        assert cli_main(["run", "--algo", "grpo", "--out", str(run), "--", str(SCRIPTS / "minimind_grpo.py"),
                         "--model_dir", str(model_dir), "--steps", "1", "--num_iterations", "1"]) == 0
    data, meta = _first_step(run)
    assert "advantage_std" not in meta and "advantage_rule" not in meta  # nothing declared
    grouped, advantages = data["rewards"].double().view(-1, G), data["advantages"].double().view(-1, G)
    varies = (grouped != grouped[:, :1]).any(dim=1)
    assert bool(varies.any())  # the precondition: a group whose rewards differ tells the stds apart
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    population = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + 1e-4)
    assert torch.allclose(advantages, population, atol=1e-5)  # train_grpo.py's rule, by hand
    at = _open_groups(monkeypatch, run)
    header = _header(at)
    assert header.startswith("advantage: (r − group mean) / (group std + eps) · group std: population "
                             "(unbiased=False, as MiniMind's train_grpo.py) · inferred: the recorded advantages of "
                             f"{int(varies.sum())} group")
    assert "follow tracer.formulas.group_advantages" in header


def test_hand_written_loop_with_torch_std_shows_the_bessel_std_inferred(monkeypatch, tmp_path, model_dir):
    run = _hand_written_loop(model_dir, tmp_path / "runs" / "sample_std", divide_by_sample_std=True)
    data, _ = _first_step(run)
    at = _open_groups(monkeypatch, run)
    header = _header(at)
    assert header.startswith("advantage: (r − group mean) / group std · group std: unbiased (Bessel-corrected, "
                             "torch.std's default, as TRL and verl) · inferred: the recorded advantages of ")
    assert "follow tracer.formulas.trl_group_advantages" in header
    # the table's std is the one the run divided by: Bessel's, not the view's default population std
    group = at.selectbox(key="group").value
    rewards = data["rewards"][data["group_ids"] == group].double()
    assert _group_std(at) == pytest.approx(float(rewards.std(unbiased=True)))
    assert _group_std(at) != pytest.approx(float(rewards.std(unbiased=False)))


def test_a_run_that_records_no_advantages_says_not_recorded(monkeypatch, tmp_path, model_dir):
    run = _hand_written_loop(model_dir, tmp_path / "runs" / "rewards_only", divide_by_sample_std=None)
    at = _open_groups(monkeypatch, run)
    assert _header(at) == (
        "advantage: (r − group mean) / group std · group std: not recorded · no advantage_std or advantage_rule in "
        "the metadata, and no rewards and sequence advantages [B] to infer it from; the std column and band show "
        "the population std of the rewards")
