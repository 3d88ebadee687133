"""The hand-written demo loops (PPO, GRPO, CISPO, DPO): they run, their traces validate against the
schema, and every derived field equals an independent recomputation from the recorded raw fields."""

import math

import pytest
import torch
import torch.nn.functional as F

from tracer import Trace
from tracer.demo.runner import run_demo
from tracer.format.schema import FIELDS, required_fields


@pytest.fixture(scope="module")
def traces(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loops")
    return {algo: Trace(run_demo(algo, root / algo, steps=2, seed=0, progress=False, model_dir=model_dir))
            for algo in ("ppo", "grpo", "cispo", "dpo")}


def assert_valid(trace, algo):
    for key in trace.steps():
        data = trace.load_step(key)
        missing = set(required_fields(algo)) - set(data)
        assert not missing, f"{key.label}: missing {missing}"
        sizes = {}
        for name, tensor in data.items():
            dims = FIELDS[name].dims_for(algo)
            assert tensor.dim() == len(dims), name
            for dim, size in zip(dims, tensor.shape):
                assert sizes.setdefault(dim, size) == size, f"{name}: {dim}"


@pytest.mark.parametrize("algo", ["ppo", "grpo", "cispo", "dpo"])
def test_demo_trace_validates_against_the_schema(traces, algo):
    trace = traces[algo]
    assert trace.algorithm == algo and trace.status == "finished"
    assert {k.step for k in trace.steps()} == {0, 1}
    assert_valid(trace, algo)


@pytest.mark.parametrize("algo", ["grpo", "cispo"])
def test_grpo_family_derived_fields_equal_recomputation(traces, algo):
    trace = traces[algo]
    keys = trace.steps()
    assert [(k.step, k.inner_step) for k in keys] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for key in keys:
        d, meta = trace.load_step(key), trace.metadata(key)
        G, keep = meta["num_generations"], d["completion_mask"]
        # independent recomputation, written out here rather than through tracer.formulas
        delta = d["policy_logprobs"] - d["old_logprobs"]
        torch.testing.assert_close(d["ratio"], torch.exp(delta))
        torch.testing.assert_close(d["approx_kl_k2"], delta**2 / 2)
        d_ref = d["ref_logprobs"] - d["policy_logprobs"]
        torch.testing.assert_close(d["ref_kl_k3"], torch.exp(d_ref) - d_ref - 1)
        r = d["rewards"].view(-1, G)
        expected_adv = (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-4)
        torch.testing.assert_close(d["advantages"], expected_adv.reshape(-1))
        torch.testing.assert_close(d["rewards"], d["reward_components"].sum(1))
        assert d["group_ids"].tolist() == [i // G for i in range(len(d["group_ids"]))]
        # the recorded scalar loss is the per-sequence mean, then the mean over sequences
        per_seq = (d["per_token_loss"] * keep).sum(1) / keep.sum(1).clamp(min=1)
        torch.testing.assert_close(d["loss"], per_seq.mean())
        if key.inner_step == 0:  # fresh rollout, same weights: policy equals old
            torch.testing.assert_close(d["policy_logprobs"], d["old_logprobs"], atol=1e-5, rtol=0)
        else:  # one optimizer step later the policy has moved
            assert (delta.abs() * keep).max() > 1e-4
        # masks: True up to and including the first EOS, then nothing
        eos = trace.eos_token_id
        for ids_row, keep_row in zip(d["completion_ids"].tolist(), keep.tolist()):
            n = ids_row.index(eos) + 1 if eos in ids_row else len(ids_row)
            assert keep_row == [True] * n + [False] * (len(ids_row) - n)


def test_first_step_old_logprobs_equal_an_independent_forward(traces, model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    trace = traces["grpo"]
    d = trace.load_step(trace.steps()[0])
    ids = torch.cat([d["prompt_ids"], d["completion_ids"]], dim=1)
    att = torch.cat([d["prompt_mask"], d["completion_mask"]], dim=1).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(1) - 1).clamp(min=0)).logits
    L = d["prompt_ids"].shape[1]
    expected = torch.log_softmax(logits[:, L - 1 : -1].float(), -1).gather(2, d["completion_ids"].unsqueeze(-1))[..., 0]
    keep = d["completion_mask"]
    torch.testing.assert_close(d["old_logprobs"][keep], expected[keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(d["ref_logprobs"][keep], expected[keep], atol=1e-5, rtol=0)  # ref = initial model


def test_ppo_gae_rows_and_early_stop_metadata(traces):
    trace = traces["ppo"]
    for key in trace.steps():
        d, meta = trace.load_step(key), trace.metadata(key)
        keep = d["completion_mask"]
        # the sequence reward sits on the last kept token and nowhere else
        last = keep.shape[1] - 1 - keep.flip(1).int().argmax(1)
        for b in range(keep.shape[0]):
            row = torch.zeros(keep.shape[1])
            row[last[b]] = d["rewards"][b]
            torch.testing.assert_close(d["token_rewards"][b], row)
        # GAE by a plain loop over the recorded rewards and values
        for b in range(keep.shape[0]):
            n, acc = int(keep[b].sum()), 0.0
            v = d["values"][b, :n].tolist() + [0.0]
            for t in reversed(range(n)):
                acc = float(d["token_rewards"][b, t]) + meta["gamma"] * v[t + 1] - v[t] + meta["gamma"] * meta["lam"] * acc
                assert math.isclose(float(d["advantages"][b, t]), acc, abs_tol=1e-5)
        torch.testing.assert_close(d["returns"], (d["advantages"] + d["values"]) * keep)
        torch.testing.assert_close(d["ratio"], torch.exp(d["policy_logprobs"] - d["old_logprobs"]))
        assert isinstance(meta["early_stop"], bool)
    # minibatches of one epoch cover every rollout row exactly once
    for step in (0, 1):
        rows = [r for k in trace.steps() if k.step == step and k.inner_step == 0
                for r in trace.load_step(k)["row_ids"].tolist()]
        assert sorted(rows) == list(range(8))


def test_dpo_logits_loss_and_rewards_equal_recomputation(traces):
    trace = traces["dpo"]
    for key in trace.steps():
        d, beta = trace.load_step(key), trace.metadata(key)["beta"]
        s = {k: (d[f"{k}_logprobs"] * d[f"{k.split('_')[0]}_mask"]).sum(1)
             for k in ("chosen_policy", "rejected_policy", "chosen_ref", "rejected_ref")}
        logits = (s["chosen_policy"] - s["rejected_policy"]) - (s["chosen_ref"] - s["rejected_ref"])
        torch.testing.assert_close(d["dpo_logits"], logits)
        torch.testing.assert_close(d["dpo_loss"], -F.logsigmoid(beta * logits))
        torch.testing.assert_close(d["chosen_rewards"], beta * (s["chosen_policy"] - s["chosen_ref"]))
        torch.testing.assert_close(d["rejected_rewards"], beta * (s["rejected_policy"] - s["rejected_ref"]))
        torch.testing.assert_close(d["loss"], d["dpo_loss"].mean())
        # the same masking rule on both sides: answer tokens + EOS, never the prompt
        for side in ("chosen", "rejected"):
            ids, keep = d[f"{side}_ids"], d[f"{side}_mask"]
            assert (ids[keep] == trace.eos_token_id).sum() == ids.shape[0]  # one kept EOS per row
    first = trace.load_step(trace.steps()[0])
    torch.testing.assert_close(first["dpo_logits"], torch.zeros(4))  # policy == reference before any update
