"""tracer.attach on a real TRL GRPOTrainer (CPU, tiny local model): the recorded tensors are what the
trainer used, joined correctly after TRL's row shuffle. No mocks: real trainer, real files."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

import tracer  # noqa: E402
from tracer import Trace, formulas  # noqa: E402
from tracer.demo import grpo_trl  # noqa: E402
from tracer.errors import TraceError  # noqa: E402
from tests.fixtures.models import completion_logprobs

G = grpo_trl.NUM_GENERATIONS
B = G * grpo_trl.PROMPTS_PER_STEP
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
PER_TOKEN = ("completion_ids", "completion_mask", "policy_logprobs", "old_logprobs", "ref_logprobs", "ratio",
             "ref_kl_k3", "approx_kl_k2", "entropy")
PER_SEQUENCE = ("rewards", "advantages", "group_ids")


@pytest.fixture(scope="module")
def trace(tmp_path_factory, model_dir) -> Trace:
    """Two optimizer steps, num_iterations=2: step 0 = inner 0 (fresh rollout), step 1 = inner 1."""
    out = tmp_path_factory.mktemp("trace") / "grpo"
    grpo_trl.run_grpo_demo(out, steps=2, seed=0, progress=False, model_dir=model_dir)
    return Trace(out)


def _step(trace: Trace, step: int):
    (key,) = [k for k in trace.steps() if k.step == step]
    return key, trace.load_step(key), trace.metadata(key)


def test_one_file_per_step_with_inner_steps(trace):
    assert [(k.step, k.inner_step, k.micro_batch, k.rank) for k in trace.steps()] == [(0, 0, 0, 0), (1, 1, 0, 0)]
    assert trace.algorithm == "grpo"
    assert trace.status == "finished"
    assert trace.manifest["dropped_steps"] == 0
    assert trace.manifest["steps_written"] == 2


def test_fields_have_canonical_shapes_and_dtypes(trace):
    for key in trace.steps():
        fields = trace.fields(key)
        T = fields["completion_ids"][0][1]
        L = fields["prompt_ids"][0][1]
        for name in PER_TOKEN:
            assert fields[name][0] == [B, T], name
        for name in PER_SEQUENCE:
            assert fields[name][0] == [B], name
        assert fields["reward_components"][0] == [B, 2]
        assert fields["prompt_ids"][0] == fields["prompt_mask"][0] == [B, L]
        assert fields["completion_ids"][1] == fields["group_ids"][1] == "I64"
        assert fields["completion_mask"][1] == fields["prompt_mask"][1] == "BOOL"
        assert fields["policy_logprobs"][1] == fields["ratio"][1] == "F32"
        assert "sampler_logprobs" not in fields  # no vLLM here


def test_step_metadata_carries_the_trainer_config(trace, model_dir):
    for key in trace.steps():
        meta = trace.metadata(key)
        assert meta["algorithm"] == "grpo"
        assert (meta["step"], meta["inner_step"], meta["micro_batch"]) == (key.step, key.inner_step, 0)
        assert meta["num_generations"] == G
        assert meta["beta"] == grpo_trl.BETA
        assert meta["clip_epsilon_low"] == meta["clip_epsilon_high"] == 0.2  # GRPOConfig epsilon default
        assert (meta["temperature"], meta["top_p"], meta["top_k"]) == (1.0, 1.0, 0)
        assert meta["loss_type"] == "grpo" and meta["loss_reduction"] == "sequence_mean"
        assert meta["reward_component_names"] == ["correct_answer", "brevity"]
        assert meta["old_logprobs_source"] == "trl_old_per_token_logps"
        assert meta["advantage_std"] == "unbiased"
    config = trace.manifest["config"]
    assert config["model"] == str(model_dir)
    assert config["model_build"]["seed"] == 0
    assert config["trainer_args"]["num_iterations"] == 2


def test_initial_model_reproduces_old_ref_and_first_policy_logprobs(trace, model_dir):
    # Step 0 / inner 0 runs before any update: policy, old and ref are all the saved model.
    # Step 1 / inner 1 reuses the step-0 rollout: old is still the saved model, ref always is.
    for step in (0, 1):
        _, data, meta = _step(trace, step)
        mask = data["completion_mask"]
        expected = completion_logprobs(model_dir, data, meta["temperature"])
        names = ("policy_logprobs", "old_logprobs", "ref_logprobs") if step == 0 else ("old_logprobs", "ref_logprobs")
        for name in names:
            diff = ((data[name] - expected).abs() * mask).max().item()
            assert diff < 1e-5, f"step {step} {name}: max |recorded - recomputed| = {diff:.2e}"


def test_policy_equals_old_on_inner_step_0_and_moves_on_inner_step_1(trace):
    _, first, _ = _step(trace, 0)
    _, second, _ = _step(trace, 1)
    mask0, mask1 = first["completion_mask"], second["completion_mask"]
    assert ((first["policy_logprobs"] - first["old_logprobs"]).abs() * mask0).max().item() < 1e-6
    assert ((second["policy_logprobs"] - second["old_logprobs"]).abs() * mask1).max().item() > 1e-3
    assert torch.equal(first["old_logprobs"], second["old_logprobs"])  # the same rollout, same row order


def test_ratio_and_kl_terms_follow_the_formulas(trace):
    for key in trace.steps():
        data = trace.load_step(key)
        mask = data["completion_mask"]
        policy, old, ref = data["policy_logprobs"], data["old_logprobs"], data["ref_logprobs"]
        torch.testing.assert_close(data["ratio"][mask], torch.exp(policy - old)[mask])
        torch.testing.assert_close(data["ref_kl_k3"][mask], (torch.exp(ref - policy) - (ref - policy) - 1)[mask])
        torch.testing.assert_close(data["approx_kl_k2"][mask], (0.5 * (policy - old) ** 2)[mask])
        assert bool((data["ref_kl_k3"][mask] >= 0).all())


def test_group_ids_come_in_runs_of_num_generations_and_rows_join_the_rollout(trace):
    for key in trace.steps():
        data = trace.load_step(key)
        assert data["group_ids"].tolist() == [b // G for b in range(B)]
        prompts = data["prompt_ids"].view(-1, G, data["prompt_ids"].shape[1])  # (P, G, L)
        assert bool((prompts == prompts[:, :1]).all()), "rows of one group must share their prompt"
        # TRL's advantages are recomputed from the recorded rewards: only true if the join is right
        expected = formulas.trl_group_advantages(data["rewards"], G, scale_rewards="group")
        torch.testing.assert_close(data["advantages"], expected, atol=1e-5, rtol=1e-5)


def test_rewards_are_the_reward_functions_of_the_recorded_completions(trace, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for key in trace.steps():
        data = trace.load_step(key)
        prompts = tokenizer.batch_decode(data["prompt_ids"], skip_special_tokens=True)
        answers = [str(eval(p.rstrip("= "))) for p in prompts]  # "3 + 4 =" -> "7"
        kept = [ids[m].tolist() for ids, m in zip(data["completion_ids"], data["completion_mask"])]
        texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
        expected = torch.tensor([grpo_trl.correct_answer(texts, answers), grpo_trl.brevity(kept, answers)]).T
        torch.testing.assert_close(data["reward_components"], expected)
        torch.testing.assert_close(data["rewards"], expected.sum(dim=1))


def test_token_text_decodes_like_the_tokenizer(trace, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    _, data, _ = _step(trace, 0)
    assert trace.manifest["tokenizer"]["eos_token_id"] == tokenizer.eos_token_id
    for ids in data["completion_ids"].tolist():
        assert trace.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False,
                                                     clean_up_tokenization_spaces=False)
        assert trace.token_text(ids) == [tokenizer.decode([i]) for i in ids]


def test_without_old_logprobs_the_ratio_is_one_by_construction(tmp_path, model_dir):
    trainer = grpo_trl.make_trainer(model_dir, tmp_path / "trl", steps=1, progress=False, num_iterations=1)
    hook = tracer.attach(trainer, tmp_path / "trace")
    trainer.train()
    assert hook.capture_failures == 0
    trace = Trace(tmp_path / "trace")
    _, data, meta = _step(trace, 0)
    assert meta["old_logprobs_source"] == "policy_detached"
    assert "old_logprobs" not in data
    assert torch.equal(data["ratio"], torch.ones_like(data["ratio"]))
    assert torch.equal(data["approx_kl_k2"], torch.zeros_like(data["approx_kl_k2"]))
    # metadata is read off the trainer itself
    assert meta["clip_epsilon_low"] == trainer.epsilon_low and meta["clip_epsilon_high"] == trainer.epsilon_high
    assert meta["beta"] == trainer.beta and meta["temperature"] == trainer.temperature
    assert meta["num_generations"] == trainer.num_generations and meta["num_iterations"] == 1


def test_attach_passes_the_writer_options_so_a_real_run_can_be_sampled(tmp_path, model_dir):
    from tracer.record.capture import SamplingPolicy

    trainer = grpo_trl.make_trainer(model_dir, tmp_path / "trl", steps=3, progress=False, num_iterations=1)
    hook = tracer.attach(trainer, tmp_path / "trace", sampling=SamplingPolicy(every_n_steps=2), max_queue_steps=4)
    trainer.train()
    assert hook.capture_failures == 0 and trainer.state.global_step == 3
    trace = Trace(tmp_path / "trace")
    assert sorted({key.step for key in trace.steps()}) == [0, 2]  # steps 0, 1, 2: every second one written
    assert trace.manifest["sampling"]["every_n_steps"] == 2 and trace.manifest["capture"]["max_queue_steps"] == 4
    with pytest.raises(TypeError, match="every_n_steps"):  # a typo names itself
        tracer.attach(grpo_trl.make_trainer(model_dir, tmp_path / "trl2", steps=1, progress=False),
                      tmp_path / "trace2", every_n_steps=2)


def test_unwritable_steps_dir_drops_steps_and_training_finishes(tmp_path, model_dir):
    trainer = grpo_trl.make_trainer(model_dir, tmp_path / "trl", steps=1, progress=False)
    out = tmp_path / "trace"
    hook = tracer.attach(trainer, out)
    shutil.rmtree(out / "steps")
    (out / "steps").write_text("not a directory")  # blocks writes even as root, unlike chmod
    with pytest.warns(RuntimeWarning, match="dropped a step"):
        trainer.train()
    assert trainer.state.global_step == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "finished"
    assert manifest["dropped_steps"] == 1 and manifest["steps_written"] == 0
    assert hook.writer.dropped_steps == 1


def test_capture_failure_is_counted_not_raised(tmp_path, model_dir, monkeypatch):
    trainer = grpo_trl.make_trainer(model_dir, tmp_path / "trl", steps=1, progress=False)
    hook = tracer.attach(trainer, tmp_path / "trace")

    def broken_record(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(hook.writer, "record", broken_record)
    with pytest.warns(RuntimeWarning, match="could not record a step .* ValueError: boom"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert hook.capture_failures == 1
    manifest = json.loads((tmp_path / "trace" / "manifest.json").read_text())
    assert manifest["status"] == "finished"
    assert manifest["dropped_steps"] == 1
    assert manifest["drop_reasons"] == ["capture in _record_micro_batch: ValueError: boom"]


def test_strict_mode_raises_on_a_capture_failure(tmp_path, model_dir, monkeypatch):
    trainer = grpo_trl.make_trainer(model_dir, tmp_path / "trl", steps=1, progress=False)
    hook = tracer.attach(trainer, tmp_path / "trace", strict=True)
    monkeypatch.setattr(hook.writer, "record", lambda *a, **k: 1 / 0)
    with pytest.raises(TraceError, match="capture failed in _record_micro_batch: ZeroDivisionError"):
        trainer.train()


def test_attach_refuses_a_trainer_it_cannot_trace(tmp_path):
    with pytest.raises(TraceError, match=r"cannot trace a object: it lacks \['_calculate_rewards'"):
        tracer.attach(object(), tmp_path / "trace")


def test_check_recomputes_trl_s_own_loss_and_per_token_loss(trace):
    """TRL returns the loss it backpropagates; the trace records it with its scale, and recompute.loss
    and recompute.per_token_loss run (not skipped) and agree with it."""
    from tracer.checks import ERROR, SKIPPED, run_checks

    findings = run_checks(trace)
    for check in ("recompute.loss", "recompute.per_token_loss"):
        mine = [f for f in findings if f.check == check]
        assert not [f for f in mine if f.severity in (SKIPPED, ERROR)], [f.message for f in mine]
    assert not [f for f in findings if f.severity == ERROR], [f.message for f in findings if f.severity == ERROR]
    for key in trace.steps():
        data, meta = trace.load_step(key), trace.metadata(key)
        assert meta["loss_type"] == "grpo" and data["loss"].shape == ()
        # TRL's grpo loss by hand: per-sequence masked mean, mean over sequences, / accumulation steps
        keep = data["completion_mask"].double()
        ptl = data["per_token_loss"].double()
        by_hand = ((ptl * keep).sum(1) / keep.sum(1).clamp(min=1)).mean() * meta["loss_scale"]
        assert meta["loss_scale"] == 1.0 / meta["gradient_accumulation_steps"]
        assert abs(float(data["loss"]) - float(by_hand)) <= 1e-6 + 1e-4 * abs(float(by_hand))


@pytest.mark.parametrize("overrides", [
    {"loss_type": "dapo"},  # TRL 1.16's default: divided by the generation batch's token count
    {"loss_type": "dr_grpo", "scale_rewards": "none"},  # constant divisor, group-mean advantages
    {"loss_type": "cispo", "epsilon_high": 5.0},  # CISPO: the clamp bound is epsilon_high itself
    {"loss_type": "bnpo", "gradient_accumulation_steps": 2, "per_device_train_batch_size": B // 2},
    {"loss_type": "grpo", "use_bias_correction_kl": False, "scale_rewards": "batch"},
    {"loss_type": "grpo", "warmup_steps": 1},  # lr 0 at the first step: policy == old at inner step 1, healthy
], ids=["dapo", "dr_grpo", "cispo", "bnpo-accumulation", "grpo-batch-scale", "warmup"])
def test_healthy_trl_variants_pass_check_with_the_loss_recomputed(tmp_path, model_dir, overrides):
    """Healthy TRL runs of other loss types, reductions, advantage scalings and gradient accumulation:
    `tracer check` finds no error or warning, and recompute.loss ran on TRL's own loss."""
    from tracer.checks import ERROR, SKIPPED, WARNING, run_checks

    trainer = grpo_trl.make_trainer(model_dir, tmp_path / "scratch", steps=2, seed=0, progress=False, **overrides)
    tracer.attach(trainer, tmp_path / "trace")
    trainer.train()
    findings = run_checks(tmp_path / "trace")
    assert [f.message for f in findings if f.severity in (ERROR, WARNING)] == []
    loss = [f for f in findings if f.check in ("recompute.loss", "recompute.per_token_loss")]
    assert not [f for f in loss if f.severity == SKIPPED], [f.message for f in loss]
    assert all("loss" in Trace(tmp_path / "trace").load_step(k) for k in Trace(tmp_path / "trace").steps())
