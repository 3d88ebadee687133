"""tracer.attach on a real TRL DPOTrainer (CPU, tiny local model): per-token policy and reference
logprobs of both sides of every pair, token-aligned with the ids, masks that keep only the
completion, and DPO terms that reproduce the loss TRL logged. No mocks: real trainer, real files."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

import tracer  # noqa: E402
from tracer import Trace  # noqa: E402
from tracer.demo import dpo_trl  # noqa: E402
from tracer.demo.tiny_model import torch_threads  # noqa: E402
from tracer.errors import TraceError  # noqa: E402
from tracer.integrations.trl import DPOTraceHook  # noqa: E402

B = dpo_trl.PAIRS_PER_STEP
BETA = dpo_trl.BETA
SIDES = ("chosen", "rejected")
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _train(model_dir, scratch, out, steps, **overrides):
    with torch_threads(1):
        trainer = dpo_trl.make_trainer(model_dir, scratch, steps=steps, seed=0, progress=False, **overrides)
        hook = tracer.attach(trainer, out)
        trainer.train()
    return trainer, hook


@pytest.fixture(scope="module")
def run(tmp_path_factory, model_dir):
    """Three optimizer steps of 4 pairs; returns (trace, TRL's logged loss by step, hook)."""
    root = tmp_path_factory.mktemp("dpo")
    trainer, hook = _train(model_dir, root / "trl", root / "trace", steps=3)
    logged = {entry["step"] - 1: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    return Trace(root / "trace"), logged, hook


@pytest.fixture(scope="module")
def trace(run) -> Trace:
    return run[0]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _step(trace: Trace, step: int):
    (key,) = [k for k in trace.steps() if k.step == step]
    return trace.load_step(key), trace.metadata(key)


def _token_logprobs_by_hand(model_dir, ids):
    """log p(ids[:, t] | ids[:, :t]) for t >= 1 from a fresh forward of the saved model, ``[B, S]``
    with column 0 left at 0: logits[:, k] predicts ids[:, k + 1]. Right padding needs no attention
    mask here: a causal model's position t never sees the padding after it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()  # (B, S, V)
    out = torch.zeros(ids.shape)
    out[:, 1:] = F.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return out  # (B, S)


def _masked_sum(values, mask):
    return (values * mask).sum(dim=1)


def test_one_step_file_per_optimizer_step(run):
    trace, _, hook = run
    assert isinstance(hook, DPOTraceHook)
    assert [(k.step, k.inner_step, k.micro_batch) for k in trace.steps()] == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    assert trace.algorithm == "dpo" and trace.status == "finished"
    assert (trace.manifest["steps_written"], trace.manifest["dropped_steps"]) == (3, 0)
    assert trace.manifest["config"]["trainer"] == "DPOTrainer"
    assert trace.manifest["config"]["trainer_args"]["precompute_ref_log_probs"] is False


def test_fields_shapes_and_metadata(trace):
    for key in trace.steps():
        fields, meta = trace.fields(key), trace.metadata(key)
        T = fields["chosen_ids"][0][1]
        for side in SIDES:
            for name in ("ids", "mask", "policy_logprobs", "ref_logprobs"):
                assert fields[f"{side}_{name}"][0] == [B, T], f"{side}_{name}"
            assert fields[f"{side}_rewards"][0] == [B]
        assert fields["dpo_logits"][0] == fields["dpo_loss"][0] == [B]
        assert fields["loss"][0] == []
        assert fields["chosen_ids"][1] == "I64" and fields["chosen_mask"][1] == "BOOL"
        assert (meta["beta"], meta["loss_type"], meta["loss_reduction"]) == (BETA, "sigmoid", "sequence_mean")
        assert (meta["ref_logprobs_source"], meta["dpo_token_layout"]) == ("trl_ref_model_forward", "input_ids")
        assert meta["dpo_loss_is_sigmoid"] is True and meta["f_divergence_type"] == "reverse_kl"


def test_policy_and_ref_logprobs_equal_a_fresh_forward_of_the_initial_model(trace, model_dir):
    # Step 0 runs before any update: policy == reference == the saved model. The reference stays the
    # saved model at every step; the policy has moved by step 2.
    for step in (0, 1, 2):
        data, _ = _step(trace, step)
        for side in SIDES:
            mask = data[f"{side}_mask"]
            expected = _token_logprobs_by_hand(model_dir, data[f"{side}_ids"])
            names = ("policy", "ref") if step == 0 else ("ref",)
            for model in names:
                recorded = data[f"{side}_{model}_logprobs"]
                diff = ((recorded - expected).abs() * mask).max().item()
                assert diff < 1e-5, f"step {step} {side}_{model}_logprobs: max |recorded - recomputed| = {diff:.2e}"
    moved, _ = _step(trace, 2)
    expected = _token_logprobs_by_hand(model_dir, moved["chosen_ids"])
    assert ((moved["chosen_policy_logprobs"] - expected).abs() * moved["chosen_mask"]).max().item() > 1e-3


def test_masks_keep_exactly_the_completion_on_both_sides(trace, tokenizer):
    eos = tokenizer.eos_token
    for key in trace.steps():
        data = trace.load_step(key)
        for b in range(B):
            starts, prompts = [], []
            for side in SIDES:
                ids, mask = data[f"{side}_ids"][b], data[f"{side}_mask"][b]
                kept = mask.nonzero().flatten()
                start, end = int(kept[0]), int(kept[-1]) + 1
                assert kept.tolist() == list(range(start, end)), "the completion is one contiguous run"
                assert ids[end - 1].item() == tokenizer.eos_token_id, "the completion ends with EOS (TRL adds it)"
                assert bool((ids[end:] == tokenizer.pad_token_id).all()), "only padding after the completion"
                answer = tokenizer.decode(ids[start:end].tolist())
                assert re.fullmatch(rf" \d+{re.escape(eos)}", answer), answer
                starts.append(start)
                prompts.append(tokenizer.decode(ids[:start].tolist()))
                # outside the mask TRL scores nothing: the recorded logprobs are exactly 0 there
                for model in ("policy", "ref"):
                    assert bool((data[f"{side}_{model}_logprobs"][b][~mask] == 0).all())
            assert starts[0] == starts[1] and prompts[0] == prompts[1], "both sides share the prompt"
            a, plus, c = prompts[0].split()[:3]
            chosen = tokenizer.decode(data["chosen_ids"][b][starts[0]:].tolist(), skip_special_tokens=True)
            assert int(chosen) == int(a) + int(c), f"chosen answers {prompts[0]!r} right"


def test_dpo_terms_and_loss_equal_a_recomputation_and_trls_logged_loss(run):
    trace, logged, _ = run
    assert sorted(logged) == [0, 1, 2]
    for key in trace.steps():
        data = trace.load_step(key)
        sums = {(side, model): _masked_sum(data[f"{side}_{model}_logprobs"], data[f"{side}_mask"])
                for side in SIDES for model in ("policy", "ref")}  # (B,) each
        policy_logratio = sums["chosen", "policy"] - sums["rejected", "policy"]  # (B,)
        ref_logratio = sums["chosen", "ref"] - sums["rejected", "ref"]  # (B,)
        logits = policy_logratio - ref_logratio
        torch.testing.assert_close(data["dpo_logits"], logits)
        torch.testing.assert_close(data["dpo_loss"], -F.logsigmoid(BETA * logits))
        for side in SIDES:
            torch.testing.assert_close(data[f"{side}_rewards"], BETA * (sums[side, "policy"] - sums[side, "ref"]))
        torch.testing.assert_close(data["loss"], data["dpo_loss"].mean())
        assert data["loss"].item() == pytest.approx(logged[key.step], abs=1e-6), "TRL logged another loss"
    first, _ = _step(trace, 0)
    torch.testing.assert_close(first["dpo_logits"], torch.zeros(B))  # policy == reference before any update
    last, _ = _step(trace, 2)
    assert last["dpo_logits"].abs().max().item() > 1e-3


def test_precomputed_reference_sums_are_recorded_without_per_token_ref(tmp_path, model_dir):
    trainer, hook = _train(model_dir, tmp_path / "trl", tmp_path / "trace", steps=1, precompute_ref_log_probs=True)
    assert hook.capture_failures == 0 and trainer.ref_model is None
    data, meta = _step(Trace(tmp_path / "trace"), 0)
    assert meta["ref_logprobs_source"] == "trl_precomputed_sums"
    assert "chosen_ref_logprobs" not in data and "rejected_ref_logprobs" not in data
    for side in SIDES:
        expected = _masked_sum(_token_logprobs_by_hand(model_dir, data[f"{side}_ids"]), data[f"{side}_mask"])
        torch.testing.assert_close(data[f"{side}_ref_sequence_logprobs"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(data["dpo_logits"], torch.zeros(B), atol=1e-5, rtol=0)


def test_capture_failure_is_counted_not_raised_and_strict_raises(tmp_path, model_dir, monkeypatch):
    with torch_threads(1):
        trainer = dpo_trl.make_trainer(model_dir, tmp_path / "trl", steps=1, progress=False)
    hook = tracer.attach(trainer, tmp_path / "trace")
    monkeypatch.setattr(hook.writer, "record", lambda *a, **k: 1 / 0)
    with pytest.warns(RuntimeWarning, match="could not record a step .* ZeroDivisionError"), torch_threads(1):
        trainer.train()
    assert trainer.state.global_step == 1 and hook.capture_failures == 1
    manifest = json.loads((tmp_path / "trace" / "manifest.json").read_text())
    assert (manifest["status"], manifest["dropped_steps"]) == ("finished", 1)
    assert manifest["drop_reasons"] == ["capture in _record_micro_batch: ZeroDivisionError: division by zero"]
    hook.detach()
    assert "compute_loss" not in trainer.__dict__ and not trainer.model._forward_hooks
    strict = tracer.attach(trainer, tmp_path / "strict", strict=True)
    monkeypatch.setattr(strict.writer, "record", lambda *a, **k: 1 / 0)
    with pytest.raises(TraceError, match="capture failed in _record_micro_batch: ZeroDivisionError"):
        trainer.compute_loss(trainer.model, next(iter(trainer.get_train_dataloader())))


def test_demo_runner_keeps_the_model_inside_the_trace(tmp_path):
    from tracer.demo.runner import run_demo

    out = run_demo("dpo-trl", tmp_path / "run", steps=1, seed=0, progress=False)
    trace = Trace(out)
    assert trace.algorithm == "dpo" and [k.step for k in trace.steps()] == [0]
    assert (out / "model" / "model.safetensors").is_file()
    assert trace.manifest["config"]["model"] == str(out / "model")


@pytest.mark.parametrize("overrides", [{"loss_type": ["ipo"]}, {"loss_type": ["hinge"]},
                                       {"loss_type": ["sigmoid", "sft"]}, {"use_weighting": True}],
                         ids=["ipo", "hinge", "sigmoid+sft", "weighting"])
def test_healthy_non_sigmoid_dpo_losses_pass_check(tmp_path, model_dir, overrides):
    """TRL's other DPO losses: the recorded loss is not the sigmoid mean, so recompute.dpo does not
    compare it (the hook records dpo_loss_is_sigmoid = false); no error or warning."""
    from tracer.checks import ERROR, WARNING, run_checks

    _train(model_dir, tmp_path / "scratch", tmp_path / "trace", 2, **overrides)
    findings = run_checks(tmp_path / "trace")
    assert [f.message for f in findings if f.severity in (ERROR, WARNING)] == []
