"""tracer.attach on a real TRL RLOOTrainer (CPU, tiny local model): per-token old/ref logprobs taken
from the rollout and joined to the shuffled loss rows, advantages that follow TRL's leave-one-out
rule, the sequence-level ratio TRL clips. No mocks: real trainer, real files."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

import tracer  # noqa: E402
from tracer import Trace  # noqa: E402
from tracer.demo import rloo_trl  # noqa: E402
from tracer.integrations.trl import RLOOTraceHook  # noqa: E402
from tests.fixtures.models import completion_logprobs

G = rloo_trl.NUM_GENERATIONS
B = G * rloo_trl.PROMPTS_PER_STEP
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def trace(tmp_path_factory, model_dir) -> Trace:
    """Three optimizer steps, num_iterations=2: step 0 = rollout 0 inner 0, step 1 = rollout 0
    inner 1, step 2 = rollout 1 inner 0 (sampled after two updates: old and ref differ)."""
    out = tmp_path_factory.mktemp("trace") / "rloo"
    rloo_trl.run_rloo_demo(out, steps=3, seed=0, progress=False, model_dir=model_dir)
    return Trace(out)


def _step(trace: Trace, step: int):
    (key,) = [k for k in trace.steps() if k.step == step]
    return trace.load_step(key), trace.metadata(key)


def _max_masked_diff(a, b, mask) -> float:
    return ((a - b).abs() * mask).max().item()


def test_steps_inner_steps_and_trace_status(trace):
    assert [(k.step, k.inner_step, k.micro_batch) for k in trace.steps()] == [(0, 0, 0), (1, 1, 0), (2, 0, 0)]
    assert trace.algorithm == "rloo"
    assert trace.status == "finished"
    assert (trace.manifest["steps_written"], trace.manifest["dropped_steps"]) == (3, 0)
    assert trace.manifest["config"]["trainer"] == "RLOOTrainer"


def test_fields_shapes_and_metadata(trace):
    for key in trace.steps():
        fields, meta = trace.fields(key), trace.metadata(key)
        T = fields["completion_ids"][0][1]
        for name in ("completion_mask", "policy_logprobs", "old_logprobs", "ref_logprobs", "ratio", "ref_kl_k3",
                     "approx_kl_k2", "entropy"):
            assert fields[name][0] == [B, T], name
        for name in ("rewards", "advantages", "group_ids", "sequence_ratio", "old_sequence_logprobs", "reward_kl_k1"):
            assert fields[name][0] == [B], name
        assert fields["loss"][0] == []
        assert meta["algorithm"] == "rloo" and meta["num_generations"] == G
        assert meta["beta"] == rloo_trl.BETA
        assert (meta["advantage_rule"], meta["importance_ratio"], meta["loss_reduction"]) == \
            ("rloo_kl", "sequence_sum", "sequence_mean")
        assert meta["normalize_advantages"] is False and "reward_clip_range" not in meta
        assert (meta["old_logprobs_source"], meta["ref_logprobs_source"]) == ("trl_rollout_forward",
                                                                              "trl_ref_model_forward")


def test_advantages_follow_trls_leave_one_out_rule_with_the_kl_penalty(trace):
    # TRL 1.16 rloo_trainer.py: r' = r - beta * sum_t (old - ref) * mask, A_i = r'_i - mean_{j != i} r'_j
    beta = rloo_trl.BETA
    for key in trace.steps():
        data = trace.load_step(key)
        mask = data["completion_mask"].float()
        penalised = data["rewards"] - beta * ((data["old_logprobs"] - data["ref_logprobs"]) * mask).sum(dim=1)
        expected = torch.empty(B)
        for i in range(B):
            group = range(i - i % G, i - i % G + G)
            others = [penalised[j].item() for j in group if j != i]
            expected[i] = penalised[i] - sum(others) / len(others)
        torch.testing.assert_close(data["advantages"], expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(data["reward_kl_k1"], ((data["old_logprobs"] - data["ref_logprobs"]) * mask).sum(1))
    later, _ = _step(trace, 2)
    assert later["reward_kl_k1"].abs().max().item() > 1e-4, "after two updates the KL penalty must not be zero"


def test_ratios_follow_the_recorded_logprobs(trace):
    for key in trace.steps():
        data = trace.load_step(key)
        mask = data["completion_mask"]
        policy, old = data["policy_logprobs"], data["old_logprobs"]
        torch.testing.assert_close(data["ratio"][mask], torch.exp(policy - old)[mask])
        policy_sum, old_sum = (policy * mask).sum(dim=1), (old * mask).sum(dim=1)
        # TRL's own old_logps (a rollout-dict tensor that travelled with its row) equals the masked sum
        # of the per-token old logprobs the hook joined by row id: only true if the join is right
        torch.testing.assert_close(data["old_sequence_logprobs"], old_sum, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(data["sequence_ratio"], torch.exp(policy_sum - old_sum), atol=1e-5, rtol=1e-5)


def test_loss_is_the_clipped_sequence_level_objective(trace):
    for key in trace.steps():
        data, meta = trace.load_step(key), trace.metadata(key)
        ratio, advantages = data["sequence_ratio"], data["advantages"]
        clipped = ratio.clamp(1 - meta["clip_epsilon_low"], 1 + meta["clip_epsilon_high"])
        expected = -torch.min(ratio * advantages, clipped * advantages).mean()
        torch.testing.assert_close(data["loss"], expected, atol=1e-6, rtol=1e-5)


def test_group_ids_in_runs_of_g_with_one_prompt_per_group(trace):
    for key in trace.steps():
        data = trace.load_step(key)
        assert data["group_ids"].tolist() == [b // G for b in range(B)]
        prompts = data["prompt_ids"].view(-1, G, data["prompt_ids"].shape[1])  # (P, G, L)
        assert bool((prompts == prompts[:, :1]).all())


def test_old_and_ref_are_the_models_they_claim_to_be(trace, model_dir):
    # rollout 0 (steps 0, 1): old == ref == the saved model, and policy too at inner step 0.
    # rollout 1 (step 2): ref is still the saved model; old is the policy after two updates.
    for step, same in ((0, ("policy_logprobs", "old_logprobs", "ref_logprobs")), (1, ("old_logprobs", "ref_logprobs")),
                       (2, ("ref_logprobs",))):
        data, meta = _step(trace, step)
        mask = data["completion_mask"]
        expected = completion_logprobs(model_dir, data, meta["temperature"])
        for name in same:
            diff = _max_masked_diff(data[name], expected, mask)
            assert diff < 1e-5, f"step {step} {name}: max |recorded - recomputed| = {diff:.2e}"
    data, meta = _step(trace, 2)
    initial = completion_logprobs(model_dir, data, meta["temperature"])
    assert _max_masked_diff(data["old_logprobs"], initial, data["completion_mask"]) > 1e-3
    moved, _ = _step(trace, 1)
    assert _max_masked_diff(moved["policy_logprobs"], moved["old_logprobs"], moved["completion_mask"]) > 1e-3


def test_attach_picks_the_rloo_hook_and_detach_restores_the_trainer(tmp_path, model_dir):
    trainer = rloo_trl.make_trainer(model_dir, tmp_path / "trl", steps=1, progress=False)
    hook = tracer.attach(trainer, tmp_path / "trace")
    assert isinstance(hook, RLOOTraceHook)
    assert "compute_loss" in trainer.__dict__
    hook.detach()
    assert not any(name in trainer.__dict__ for name in ("compute_loss", "_calculate_rewards",
                                                         "_generate_and_score_completions",
                                                         "_get_per_token_logps_and_entropies"))
    hook.close()


def test_demo_runner_keeps_the_model_inside_the_trace(tmp_path):
    from tracer.demo.runner import run_demo

    out = run_demo("rloo-trl", tmp_path / "run", steps=1, seed=0, progress=False)
    trace = Trace(out)
    assert trace.algorithm == "rloo" and [k.step for k in trace.steps()] == [0]
    assert (out / "model" / "model.safetensors").is_file()
    assert trace.manifest["config"]["model"] == str(out / "model")


def test_check_recomputes_trl_s_rloo_loss(trace):
    """RLOO's loss (one clipped ratio per sequence, mean over the micro-batch) is recomputed, not skipped."""
    from tracer.checks import ERROR, SKIPPED, run_checks

    mine = [f for f in run_checks(trace) if f.check == "recompute.loss"]
    assert not [f for f in mine if f.severity in (SKIPPED, ERROR)], [f.message for f in mine]
    for key in trace.steps():
        data, meta = trace.load_step(key), trace.metadata(key)
        sr, adv = data["sequence_ratio"].double(), data["advantages"].double()
        lo, hi = 1 - meta["clip_epsilon_low"], 1 + meta["clip_epsilon_high"]
        by_hand = (-torch.min(sr * adv, sr.clamp(lo, hi) * adv)).mean()
        assert abs(float(data["loss"]) - float(by_hand)) <= 1e-6 + 1e-4 * abs(float(by_hand))
