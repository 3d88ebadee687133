"""``tracer diff`` compares the per-step scalars a run recorded with its steps (``record(..., scalars=...)``)
and logged after them (``log_scalars``: ``scalars.rank_N.jsonl``) as ``scalars/<name>`` fields: the same
tolerance rule, in the text and the ``--json`` report; a scalar one run lacks, and the machine's own
measurements (a step's wall time), are notes, not differences. Real runs of a
hand-written GRPO loop on the tiny model (two steps, one inner pass each), traced with the explicit
API, that differ in one documented way."""

from __future__ import annotations

import copy
import json
import random
import shutil
import time

import pytest
import torch

from tracer import Tracer, diff, formulas
from tracer.cli import main
from tracer.demo import rollout as ro
from tracer.diff.scalars import machine_scalar

from tests.fixtures.paths import SAMPLES

G, BETA, EPS, STEPS = 4, 0.04, 0.2, 2


def grpo_run(out, model_dir, *, learning_rate=1e-3, extra_scalar=False, inner_steps=1):
    """Two GRPO steps of 2 prompts x G on the tiny model, ``inner_steps`` passes (an update each) over each
    rollout. Each pass records its tensors and the scalars ``loss``, ``grad_norm`` (after backward, before
    the update), ``learning_rate`` and ``step_time`` (wall clock); each step logs ``reward_mean`` after its
    updates; ``extra_scalar`` also records ``clip_ratio`` and logs ``num_tokens``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    rng = random.Random(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    hyper = {"num_generations": G, "beta": BETA, "clip_epsilon_low": EPS, "clip_epsilon_high": EPS,
             "temperature": 1.0, "loss_reduction": "sequence_mean"}
    with Tracer(out, algorithm="grpo", tokenizer=tokenizer, hyperparameters=hyper) as tr:
        for step in range(STEPS):
            started = time.perf_counter()
            model.eval()
            batch = ro.rollout(model, tokenizer, ro.arithmetic_prompts(2, rng), G, 8, 1.0)
            completions = tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
            rewards = ro.reward_components(batch.prompts, completions).sum(dim=1)  # (B,)
            advantages = formulas.group_advantages(rewards, G)  # (B,)
            L = batch.prompt_ids.shape[1]
            with torch.no_grad():
                ref_logprobs = ro.completion_logprobs(ref_model, batch.input_ids, batch.attention_mask, L, 1.0)
            model.train()
            for inner in range(inner_steps):
                policy_logprobs = ro.completion_logprobs(model, batch.input_ids, batch.attention_mask, L, 1.0)  # (B, T)
                per_token_loss = formulas.grpo_per_token_loss(policy_logprobs, batch.old_logprobs, advantages, EPS,
                                                              EPS, BETA, ref_logprobs)  # (B, T)
                loss = formulas.sequence_mean_loss(per_token_loss, batch.completion_mask)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                scalars = ro.step_scalars(optimizer, loss, step_time=time.perf_counter() - started)
                if extra_scalar:
                    scalars["clip_ratio"] = 0.0
                tr.record(step=step, inner_step=inner, prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask,
                          completion_ids=batch.completion_ids, completion_mask=batch.completion_mask,
                          policy_logprobs=policy_logprobs.detach(), old_logprobs=batch.old_logprobs,
                          ref_logprobs=ref_logprobs, rewards=rewards, advantages=advantages,
                          group_ids=batch.group_ids, scalars=scalars)
                optimizer.step()
            logged = {"reward_mean": float(rewards.mean())}
            if extra_scalar:
                logged["num_tokens"] = float(batch.completion_mask.sum())
            tr.log_scalars(step, logged)
    return out


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("scalars")
    return {"baseline": grpo_run(root / "baseline", model_dir), "again": grpo_run(root / "again", model_dir),
            "lr": grpo_run(root / "lr", model_dir, learning_rate=3e-3),
            "extra": grpo_run(root / "extra", model_dir, extra_scalar=True),
            "inner": grpo_run(root / "inner", model_dir, inner_steps=2),
            "inner_lr": grpo_run(root / "inner_lr", model_dir, inner_steps=2, learning_rate=3e-3)}


def test_two_runs_of_one_loop_compare_their_scalars_and_leave_the_wall_time_out(runs, capsys):
    report = diff(runs["baseline"], runs["again"])
    assert report.equal, report.format(verbose=True)
    # recorded with each of the 2 step files; reward_mean logged once per step: 2 positions each
    for name in ("scalars/loss", "scalars/grad_norm", "scalars/learning_rate", "scalars/reward_mean"):
        field = report.fields[name]
        assert (field.compared, field.differing, field.dtype_a) == (STEPS, 0, "F64"), name
    assert "scalars/step_time" not in report.fields and report.scalars_not_compared == ["scalars/step_time"]
    assert ("scalars not compared (they measure the machine, not the run: times, throughput, memory): "
            "scalars/step_time") in report.notes()
    assert main(["diff", str(runs["baseline"]), str(runs["again"]), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["fields"]["scalars/learning_rate"]["passed"] is True
    assert as_json["scalars_not_compared"] == ["scalars/step_time"]


def test_a_changed_learning_rate_is_named_by_its_scalar_at_the_first_step(runs, capsys):
    report = diff(runs["baseline"], runs["lr"])
    # step 0 scores one rollout with the same initial weights in both runs: every tensor and the loss and
    # gradient norm are equal; only the learning rate the optimizer holds differs (1e-3 vs 3e-3), from step 0
    lr = report.fields["scalars/learning_rate"]
    assert (lr.compared, lr.differing, lr.max_abs_diff) == (STEPS, STEPS, abs(3e-3 - 1e-3))
    assert (lr.first.step, lr.first.a, lr.first.b) == ((0, 0, 0, 0), 1e-3, 3e-3)
    assert report.fields["scalars/grad_norm"].first.step[0] == 1  # equal before the first update
    assert report.cause.name == "scalars/learning_rate" and report.first_divergence[1].step == (0, 0, 0, 0)
    assert main(["diff", str(runs["baseline"]), str(runs["lr"])]) == 1
    out = capsys.readouterr().out
    assert out.startswith("tracer diff: DIFFERENT: scalars/learning_rate diverges first, at step 0 (a=0.001, b=0.003)")
    assert ("cause: scalars/learning_rate (a per-step scalar the run recorded or logged, beside the data flow): "
            "2 of 2 positions differ (100.0%), max |Δ|=0.002, mean(b-a)=+0.002") in out
    assert main(["diff", str(runs["baseline"]), str(runs["lr"]), "--json"]) == 1
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["cause"] == "scalars/learning_rate"
    assert as_json["fields"]["scalars/learning_rate"]["differing"] == STEPS


def test_a_scalar_tolerance_is_given_like_a_field_s(runs, capsys):
    a, b = str(runs["baseline"]), str(runs["lr"])
    delta = abs(3e-3 - 1e-3)  # the learning rates' difference, at every step
    assert main(["diff", a, b, "--fields", "scalars/learning_rate", "--atol", f"scalars/learning_rate={delta}"]) == 0
    tighter = f"scalars/learning_rate={delta * 0.99}"
    assert main(["diff", a, b, "--fields", "scalars/learning_rate", "--atol", tighter]) == 1
    # relative to |a| = 1e-3: rtol 2 allows |Δ| <= 2e-3
    assert main(["diff", a, b, "--fields", "scalars/learning_rate", "--rtol", "scalars/learning_rate=2"]) == 0
    capsys.readouterr()
    assert main(["diff", a, b, "--atol", "scalars/lr=1"]) == 2
    assert "atol names ['scalars/lr'], which neither trace has" in capsys.readouterr().err


def test_a_scalar_one_run_records_or_logs_and_the_other_does_not_is_a_note(runs, capsys):
    """What a run records or logs is no difference in how it trained: a baseline recorded before its loop
    recorded a scalar still passes, and the report says which scalars were not compared and why."""
    report = diff(runs["baseline"], runs["extra"])
    assert report.equal and report.missing_fields == {}, report.format(verbose=True)  # the same run otherwise
    assert report.scalars_only_in == {
        "scalars/clip_ratio": {"only_in": "b", "step_pairs": STEPS, "first_step": (0, 0, 0, 0)},
        "scalars/num_tokens": {"only_in": "b", "step_pairs": STEPS, "first_step": (0, 0, 0, 0)}}
    assert main(["diff", str(runs["extra"]), str(runs["baseline"])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tracer diff: EQUAL within tolerance")
    assert ("scalars only in a (b neither records nor logs them, so not compared): scalars/clip_ratio (2 step pairs, "
            "first at step 0), scalars/num_tokens (2 step pairs, first at step 0)") in out
    assert main(["diff", str(runs["baseline"]), str(runs["extra"]), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["scalars_only_in"]["scalars/num_tokens"]["only_in"] == "b"
    assert as_json["findings"] == []


def test_a_changed_learning_rate_between_inner_passes_is_the_evidence_of_the_update(runs, capsys):
    """Two passes over each rollout: the first pass is equal in both runs but for the learning rate the
    optimizer holds; the policy the second pass scores differs. The tensors name the update between the
    passes as the cause, and the learning-rate scalar recorded with the first pass is its evidence."""
    report = diff(runs["inner"], runs["inner_lr"])
    update = report.update_cause
    assert report.cause.name == "policy_logprobs" and report.cause.first.step == (0, 1, 0, 0)
    assert (update.before, update.after, update.effect.name) == ((0, 0), (0, 1), "policy_logprobs")
    (name, lr), = update.scalars.items()
    assert (name, lr.differing, lr.max_abs_diff, lr.first.a, lr.first.b) == (
        "scalars/learning_rate", 1, abs(3e-3 - 1e-3), 1e-3, 3e-3)
    assert main(["diff", str(runs["inner"]), str(runs["inner_lr"])]) == 1
    out = capsys.readouterr().out
    assert out.startswith("tracer diff: DIFFERENT: the update between step 0 inner 0 and inner 1 (loss, gradients or "
                          "optimizer state): policy_logprobs diverges first, at step 0, inner 1, ")
    # the loss the first pass recorded (a scalar) is equal too: the optimizer step is what differs
    assert update.loss == {} and update.loss_recorded == ["scalars/loss"]
    assert ("every recorded input of inner 0 is equal, and so is the recorded loss (scalars/loss): the gradients or "
            "the optimizer step differ (learning rate, gradient clipping, optimizer state); the scalars recorded with "
            "it differ: scalars/learning_rate by |Δ|=0.002 at step 0 (a=0.001, b=0.003); then policy_logprobs "
            "differs at inner 1") in out


@pytest.mark.parametrize("name, machine", [
    ("step_time", True), ("timing_s/gen", True), ("perf/max_memory_allocated_gb", True),
    ("train_samples_per_second", True), ("perf/throughput", True), ("perf/mfu/actor", True),
    ("grad_norm", False), ("learning_rate", False), ("num_tokens", False), ("completions/mean_length", False),
    ("timestep", False), ("epoch", False), ("rewards/correct_answer/mean", False)])
def test_machine_measurements_are_told_by_a_word_of_their_name(name, machine):
    assert machine_scalar(name) is machine


def test_a_trl_run_s_logged_step_time_is_no_difference(tmp_path, capsys):
    """TRL logs ``step_time`` (wall clock) every step: two runs of one training differ in it. The bundled
    TRL trace against a copy whose log says each step took one second longer (a later line for a step
    wins) is equal; the note names the scalar; grad_norm, changed by 1e-3 at step 1, is a difference."""
    a = SAMPLES / "grpo-trl-tiny"
    b = tmp_path / "grpo-trl-tiny"
    shutil.copytree(a, b)
    lines = [json.loads(line) for line in (a / "scalars.rank_0.jsonl").read_text().splitlines()[1:]]
    with open(b / "scalars.rank_0.jsonl", "a") as log:
        for entry in lines:
            log.write(json.dumps({"step": entry["step"], "scalars": {"step_time": entry["scalars"]["step_time"] + 1}})
                      + "\n")
    report = diff(a, b)
    assert report.equal and report.scalars_not_compared == ["scalars/step_time"], report.format(verbose=True)
    grad_norm = {e["step"]: e["scalars"]["grad_norm"] for e in lines}
    with open(b / "scalars.rank_0.jsonl", "a") as log:
        log.write(json.dumps({"step": 1, "scalars": {"grad_norm": grad_norm[1] + 1e-3}}) + "\n")
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"tracer diff: DIFFERENT: scalars/grad_norm diverges first, at step 1 "
                          f"(a={grad_norm[1]:.7g}, b={grad_norm[1] + 1e-3:.7g})")
