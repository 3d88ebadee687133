"""``tracer diff`` names the update as the cause when every recorded input of an update is equal in
both runs and the policy the next inner pass scores differs; a pair that differs in an input keeps
naming that input. Real runs of a hand-written GRPO loop (the tiny model, two inner passes over one
rollout, traced with the explicit API) that differ in one documented way."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from tracer import Trace, Tracer, diff, formulas
from tracer.cli import main
from tracer.demo import rollout as ro

G, BETA, EPS = 4, 0.04, 0.2
INPUTS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "rewards", "advantages", "group_ids",
          "old_logprobs", "ref_logprobs", "policy_logprobs")


def grpo_run(out, model_dir, *, loss_reduction="sequence_mean", record_loss=True, learning_rate=1e-3,
             reward_scale=1.0, seed=0):
    """One rollout of 2 prompts x G, two inner passes over it (AdamW steps between them), each traced.
    The loss reduces the GRPO per-token loss by ``loss_reduction``; ``reward_scale`` scales the rewards."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    hyper = {"num_generations": G, "beta": BETA, "clip_epsilon_low": EPS, "clip_epsilon_high": EPS,
             "temperature": 1.0, "loss_reduction": loss_reduction, "learning_rate": learning_rate}
    reduce = formulas.sequence_mean_loss if loss_reduction == "sequence_mean" else formulas.token_mean_loss
    with Tracer(out, algorithm="grpo", tokenizer=tokenizer, hyperparameters=hyper) as tr:
        prompts = ro.arithmetic_prompts(2, random.Random(seed))
        model.eval()
        batch = ro.rollout(model, tokenizer, prompts, G, 8, 1.0)
        completions = tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
        rewards = ro.reward_components(batch.prompts, completions).sum(dim=1) * reward_scale  # (B,)
        advantages = formulas.group_advantages(rewards, G)  # (B,)
        L = batch.prompt_ids.shape[1]
        with torch.no_grad():
            ref_logprobs = ro.completion_logprobs(ref_model, batch.input_ids, batch.attention_mask, L, 1.0)  # (B, T)
        model.train()
        for inner in range(2):
            policy_logprobs = ro.completion_logprobs(model, batch.input_ids, batch.attention_mask, L, 1.0)  # (B, T)
            per_token_loss = formulas.grpo_per_token_loss(policy_logprobs, batch.old_logprobs, advantages, EPS, EPS,
                                                          BETA, ref_logprobs)  # (B, T)
            loss = reduce(per_token_loss, batch.completion_mask)
            losses = {"per_token_loss": per_token_loss.detach(), "loss": loss.detach()} if record_loss else {}
            tr.record(step=0, inner_step=inner, prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
                      completion_ids=batch.completion_ids, completion_mask=batch.completion_mask,
                      policy_logprobs=policy_logprobs.detach(), old_logprobs=batch.old_logprobs,
                      ref_logprobs=ref_logprobs, rewards=rewards, advantages=advantages, group_ids=batch.group_ids,
                      **losses)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return out


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("update")
    return {
        "baseline": grpo_run(root / "baseline", model_dir),
        "token_mean": grpo_run(root / "token_mean", model_dir, loss_reduction="token_mean"),
        "baseline_no_loss": grpo_run(root / "baseline_no_loss", model_dir, record_loss=False),
        "token_mean_no_loss": grpo_run(root / "token_mean_no_loss", model_dir, loss_reduction="token_mean",
                                       record_loss=False),
        "lr": grpo_run(root / "lr", model_dir, learning_rate=3e-3),
        "rewards": grpo_run(root / "rewards", model_dir, reward_scale=2.0),
    }


def step(path, inner):
    trace = Trace(path)
    (key,) = [k for k in trace.steps() if k.inner_step == inner]
    return trace.load_step(key)


def first_policy_difference(a, b) -> tuple[int, int]:
    """Independently: the first kept (seq, tok) at inner 1 where the policy logprobs differ beyond
    float32's default tolerance (atol 1e-5, rtol 1.3e-6)."""
    pa, pb, keep = a["policy_logprobs"], b["policy_logprobs"], a["completion_mask"].bool()
    fail = keep & ((pb - pa).abs() > 1e-5 + 1.3e-6 * pa.abs())
    assert fail.any(), "the two updates gave the same policy: the variant tests nothing"
    return tuple(int(i) for i in fail.nonzero()[0])


def test_runs_that_differ_only_in_the_loss_reduction_are_headlined_by_the_update(runs, capsys):
    a0, b0 = step(runs["baseline"], 0), step(runs["token_mean"], 0)
    for name in (*INPUTS, "per_token_loss"):  # the precondition: every input of the first update is equal
        assert torch.equal(a0[name], b0[name]), name
    ptl, keep = a0["per_token_loss"].double(), a0["completion_mask"].double()
    sequence_mean = float(((ptl * keep).sum(1) / keep.sum(1)).mean())
    token_mean = float((ptl * keep).sum() / keep.sum())
    assert float(a0["loss"]) == pytest.approx(sequence_mean, rel=1e-6)
    assert float(b0["loss"]) == pytest.approx(token_mean, rel=1e-6)
    seq, tok = first_policy_difference(step(runs["baseline"], 1), step(runs["token_mean"], 1))

    report = diff(runs["baseline"], runs["token_mean"])
    assert report.cause.name == "loss" and report.cause.first.step == (0, 0, 0, 0)
    update = report.update_cause
    assert (update.before, update.after, update.effect.name) == ((0, 0), (0, 1), "policy_logprobs")
    assert (update.effect_at.sequence, update.effect_at.token) == (seq, tok)
    assert update.metadata == {"loss_reduction": ("sequence_mean", "token_mean")}
    assert main(["diff", str(runs["baseline"]), str(runs["token_mean"])]) == 1
    out = capsys.readouterr().out
    assert out.startswith("tracer diff: DIFFERENT: the update between step 0 inner 0 and inner 1 (loss, gradients or "
                          f"optimizer state): policy_logprobs diverges first, at step 0, inner 1, seq {seq}, tok {tok} ")
    loss_delta = abs(float(b0["loss"]) - float(a0["loss"]))
    assert (f"cause: the update between step 0 inner 0 and inner 1 (loss, gradients or optimizer state): every "
            f"recorded input of inner 0 is equal, and the loss differs: loss by |Δ|={loss_delta:.2g} "
            f"(a={float(a0['loss']):.7g}, b={float(b0['loss']):.7g}); step metadata the runs were given differs: "
            "loss_reduction a='sequence_mean' b='token_mean'; then policy_logprobs differs at inner 1") in out
    assert main(["diff", str(runs["baseline"]), str(runs["token_mean"]), "--json"]) == 1
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["update_cause"]["name"] == "the update between step 0 inner 0 and inner 1"
    assert as_json["cause"] == "loss"


def test_without_a_recorded_loss_the_headline_says_so(runs, capsys):
    seq, tok = first_policy_difference(step(runs["baseline_no_loss"], 1), step(runs["token_mean_no_loss"], 1))
    report = diff(runs["baseline_no_loss"], runs["token_mean_no_loss"])
    assert report.cause.name == "policy_logprobs" and report.cause.first.step == (0, 1, 0, 0)
    assert report.update_cause.loss == {} and report.update_cause.loss_recorded == []
    assert main(["diff", str(runs["baseline_no_loss"]), str(runs["token_mean_no_loss"])]) == 1
    out = capsys.readouterr().out
    assert out.startswith("tracer diff: DIFFERENT: the update between step 0 inner 0 and inner 1 (loss, gradients or "
                          f"optimizer state): policy_logprobs diverges first, at step 0, inner 1, seq {seq}, tok {tok} ")
    assert "every recorded input of inner 0 is equal, and the loss is not recorded;" in out


def test_an_equal_loss_and_a_different_learning_rate_name_the_optimizer_step(runs, capsys):
    report = diff(runs["baseline"], runs["lr"])
    update = report.update_cause
    assert report.cause.name == "policy_logprobs" and update is not None and update.loss == {}
    assert update.metadata == {"learning_rate": (1e-3, 3e-3)}
    assert main(["diff", str(runs["baseline"]), str(runs["lr"])]) == 1
    assert ("every recorded input of inner 0 is equal, and so is the recorded loss (per_token_loss, loss): the "
            "gradients or the optimizer step differ (learning rate, gradient clipping, optimizer state); step metadata "
            "the runs were given differs: learning_rate a=0.001 b=0.003") in capsys.readouterr().out


def test_a_pair_that_differs_in_an_input_keeps_naming_that_input(runs, capsys):
    a0, b0 = step(runs["baseline"], 0), step(runs["rewards"], 0)
    assert torch.equal(a0["completion_ids"], b0["completion_ids"]) and not torch.equal(a0["rewards"], b0["rewards"])
    report = diff(runs["baseline"], runs["rewards"])
    assert report.cause.name == "rewards" and report.update_cause is None
    assert main(["diff", str(runs["baseline"]), str(runs["rewards"])]) == 1
    out = capsys.readouterr().out
    assert out.startswith("tracer diff: DIFFERENT: rewards diverges first, at step 0, seq ")
    assert "the update between" not in out


def test_comparing_some_fields_only_makes_no_claim_about_every_input(runs):
    report = diff(runs["baseline_no_loss"], runs["token_mean_no_loss"], fields=["policy_logprobs"])
    assert report.cause.name == "policy_logprobs" and report.update_cause is None


def test_the_diff_page_headlines_the_update_too(runs, monkeypatch):
    """The app's Diff page says what `tracer diff` says: the update, then what follows from it."""
    from tests.fixtures.toy_traces import start

    root = runs["baseline"].parent
    at = start(monkeypatch, root)
    at.switch_page("app_pages/diff.py").run()
    at.selectbox(key="diff_a").select(runs["baseline"]).run()
    at.selectbox(key="diff_b").select(runs["token_mean"]).run()
    assert not at.exception, [e.value for e in at.exception]
    texts = [t.value for t in at.text]
    assert any(t.startswith("cause: the update between step 0 inner 0 and inner 1 (loss, gradients or optimizer "
                            "state): policy_logprobs diverges first, at step 0, inner 1") for t in texts), texts
    follows = [t for t in texts if t.startswith("follows from ")]
    assert all(t.startswith("follows from the update between step 0 inner 0 and inner 1: ") for t in follows)
