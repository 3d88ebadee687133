"""tracer.integrations.verl on verl 0.9.1's own code, on CPU: a GRPO step built from verl's ``DataProto``,
``compute_response_mask`` and ``compute_advantage`` (the driver), then verl's worker path for the update:
``to_tensordict`` → ``left_right_2_no_padding`` → ``make_iterator`` (mini-batches, epochs, shuffle) →
``prepare_micro_batches`` → ``ppo_loss`` (which calls ``get_policy_loss_fn(loss_mode)``) with a tiny
Hugging Face Qwen2 model, an optimizer step per mini-batch. Only the Ray/FSDP engine around it is left
out (it does not run on CPU, see docs/verl.md).

These tests run in the verl venv (``make test-verl``; ``make test`` runs both). In the main venv
verl is not installed: tests/conftest.py does not collect this file there (the session header says
so), so it is neither run nor counted as skipped; in the verl venv an import failure is an error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

warnings.filterwarnings("ignore", message=".*engine is not available.*")
from tensordict import TensorDict  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.debug.metrics import calculate_debug_metrics  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402
from verl.workers.utils import losses  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

import tracer.integrations.verl as tv  # noqa: E402
from tracer.checks import has_errors, run_checks  # noqa: E402
from tracer.integrations.verl_join import join  # noqa: E402
from tracer.read.reader import Trace  # noqa: E402

from tests.fixtures.verl_batches import (B, EOS, EPOCHS, G, L, MICRO, MINI, P, PAD, T, TOKENIZER, V,  # noqa: E402
                                         tiny_model)

from tests.fixtures.paths import REPO  # noqa: E402


# -- a tiny model and verl's batch ----------------------------------------------------------------


def sequence_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """``[n]``: position p holds log p(ids[p+1] | ids[:p+1]); the last position 0 (verl's unpadded layout)."""
    logits = model(input_ids=ids.unsqueeze(0)).logits[0].float()  # (n, V)
    lp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, ids[1:].unsqueeze(1)).squeeze(1)  # (n-1,)
    return torch.cat([lp, lp.new_zeros(1)])


def rollout(model, seed: int) -> DataProto:
    """A step's batch as verl's driver holds it before compute_advantage (uids interleaved, not consecutive)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, L + 1, (P,), generator=gen).repeat_interleave(G)  # (B,)
    prompt_tokens = torch.randint(2, V, (P, L), generator=gen).repeat_interleave(G, dim=0)  # (B, L)
    response_lens = torch.randint(2, T + 1, (B,), generator=gen)  # (B,)
    responses = torch.randint(2, V, (B, T), generator=gen)  # (B, T)
    prompts = torch.full((B, L), PAD)
    attention = torch.zeros(B, L + T, dtype=torch.int64)
    for b in range(B):
        n = int(prompt_lens[b])
        prompts[b, L - n:] = prompt_tokens[b, :n]
        attention[b, L - n: L + int(response_lens[b])] = 1
        responses[b, int(response_lens[b]) - 1] = EOS
        responses[b, int(response_lens[b]):] = PAD
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # rows of the two prompts interleaved
    prompts, responses, attention = prompts[order], responses[order], attention[order]
    uids = np.array([f"uid-{seed}-{int(i) // G}" for i in order], dtype=object)
    input_ids = torch.cat([prompts, responses], dim=1)  # (B, L + T)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    scores = torch.zeros(B, T)
    kept = attention[:, L:]
    rewards = torch.randint(0, 3, (B,), generator=gen).float()  # (B,) varies within each group
    scores[torch.arange(B), kept.sum(dim=1) - 1] = rewards
    data = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention,
                 "position_ids": position_ids, "token_level_scores": scores},
        non_tensors={"uid": uids})
    data.batch["response_mask"] = ray_trainer.compute_response_mask(data)
    with torch.no_grad():
        old = response_logprobs(model, data)
        ref = response_logprobs(tiny_model(seed=1), data)
    data.batch["old_log_probs"], data.batch["ref_log_prob"] = old, ref
    data.batch["rollout_log_probs"] = old + 0.01 * torch.randn(old.shape, generator=gen)  # an engine's own numbers
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    return data


def response_logprobs(model, data: DataProto) -> torch.Tensor:
    """``[B, T]`` logprobs of the responses, computed one unpadded sequence at a time (as the worker does)."""
    attention, input_ids = data.batch["attention_mask"].bool(), data.batch["input_ids"]
    out = torch.zeros(B, T)
    for b in range(B):
        ids = input_ids[b][attention[b]]
        n_resp = int(attention[b, L:].sum())
        lp = sequence_logprobs(model, ids)
        out[b, :n_resp] = lp[len(ids) - n_resp - 1: len(ids) - 1]
    return out


def model_output(model, micro: TensorDict, perturb: float = 0.0) -> dict:
    """What the engine's forward gives ppo_loss: nested ``log_probs`` over the unpadded sequences."""
    ids = micro["input_ids"]  # nested (B_micro, j)
    values = torch.cat([sequence_logprobs(model, seq) for seq in ids.unbind()])
    values = values + perturb
    return {"log_probs": torch.nested.nested_tensor_from_jagged(values, offsets=ids.offsets())}


def actor_config(loss_mode: str) -> ActorConfig:
    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=MICRO, rollout_n=1,
                       ppo_epochs=EPOCHS, use_dynamic_bsz=False, policy_loss=PolicyLossConfig(loss_mode=loss_mode))


def update_actor(model, data: DataProto, config: ActorConfig, perturb: dict | None = None) -> list[dict]:
    """verl's actor update on CPU: the driver's _update_actor, then train_mini_batch and the engine's
    forward_backward_batch, with ppo_loss as the loss. ``perturb`` maps (epoch, mini-batch, micro-batch)
    to an offset added to the model's log_probs there (a numerics bug). Returns each call's ppo_loss result."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, global_batch_size=MINI, mini_batch_size=MINI, epochs=EPOCHS)
    results = []
    iterator = tu.make_iterator(td, mini_batch_size=MINI, epochs=EPOCHS, seed=42, dataloader_kwargs={"shuffle": True})
    for index, mini in enumerate(iterator):
        epoch, mini_index = divmod(index, B // MINI)
        tu.assign_non_tensor(mini, global_batch_size=MINI, update_lr_scheduler=index == B // MINI * EPOCHS - 1,
                             batch_num_tokens=int(mini["loss_mask"].sum()), dp_size=1, use_dynamic_bsz=False,
                             micro_batch_size_per_gpu=MICRO)
        micro_batches, _ = prepare_micro_batches(mini, dp_group=None)
        optimizer.zero_grad()
        for k, micro in enumerate(micro_batches):
            offset = (perturb or {}).get((epoch, mini_index, k), 0.0)
            loss, metrics = losses.ppo_loss(config, model_output(model, micro, offset), micro)
            loss.backward()
            results.append({"loss": loss.detach(), "metrics": metrics})
        optimizer.step()
    return results


@pytest.fixture
def spy():
    """A policy loss that keeps what verl passed to it and what it returned, traced as tracer_spy."""
    calls = []
    vanilla = core_algos.get_policy_loss_fn("vanilla")

    def spy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                 rollout_is_weights=None):
        result = vanilla(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                         response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                         rollout_is_weights=rollout_is_weights)
        calls.append({"old": old_log_prob.detach().clone(), "policy": log_prob.detach().clone(),
                      "advantages": advantages.detach().clone(), "mask": response_mask.clone(),
                      "pg_loss": result[0].detach().clone()})
        return result

    core_algos.register_policy_loss("spy")(spy_loss)
    assert "tracer_spy" in tv.register_tracing_losses()
    yield calls
    for name in ("spy", "tracer_spy"):
        core_algos.POLICY_LOSS_REGISTRY.pop(name, None)


def grpo_step(steps: int = 1, perturb: dict | None = None, loss_mode: str = "tracer_vanilla",
              nan_at: tuple[int, int] | None = None, seed: int = 0):
    """Run ``steps`` GRPO steps through verl's functions; returns the driver batches after compute_advantage."""
    model = tiny_model(seed)
    batches = []
    for step in range(steps):
        data = rollout(model, seed=100 + step)
        if nan_at is not None and step == 0:
            data.batch["old_log_probs"][nan_at] = float("nan")
        data = ray_trainer.compute_advantage(data, adv_estimator="grpo", num_repeat=G,
                                             norm_adv_by_std_in_grpo=True, config=AlgoConfig(adv_estimator="grpo"))
        batches.append(data)
        update_actor(model, data, actor_config(loss_mode), perturb if step == 0 else None)
    tv.finish()
    return batches


# -- the hooks are installed where verl looks ---------------------------------------------------


def test_import_registers_a_tracing_twin_of_every_policy_loss():
    names = [n for n in core_algos.POLICY_LOSS_REGISTRY if not n.startswith("tracer_")]
    assert len(names) >= 12 and "vanilla" in names and "cispo" in names
    for name in names:
        assert getattr(core_algos.get_policy_loss_fn("tracer_" + name), "__tracer_wrapper__", False)
    assert getattr(ray_trainer.compute_advantage, "__tracer_wrapper__", False)
    assert getattr(losses.ppo_loss, "__tracer_wrapper__", False)


def test_verl_imports_the_module_named_in_its_environment_variable(tmp_path):
    code = ("import verl.trainer.ppo.core_algos as c, verl.workers.utils.losses as l, verl.trainer.ppo.ray_trainer as r;"
            "c.register_policy_loss('mine')(lambda **kw: (0, {}));"  # a loss registered after tracer's import
            "print(sorted(n for n in c.POLICY_LOSS_REGISTRY if n.startswith('tracer_'))[:2],"
            " l.ppo_loss.__tracer_wrapper__, r.compute_advantage.__tracer_wrapper__,"
            " l.get_policy_loss_fn('tracer_mine').__tracer_wrapper__)")
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "tracer.integrations.verl", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "['tracer_bypass_mode', 'tracer_cispo'] True True True"


def test_untraced_loss_and_tracing_loss_return_the_same(traced):
    model = tiny_model()
    data = rollout(model, seed=100)
    data = ray_trainer.compute_advantage(data, adv_estimator="grpo", num_repeat=G, config=AlgoConfig(adv_estimator="grpo"))
    plain = update_actor(tiny_model(), data, actor_config("vanilla"))
    tv.finish()
    traced_run = update_actor(tiny_model(), data, actor_config("tracer_vanilla"))
    assert len(plain) == len(traced_run) == B // MICRO * EPOCHS
    for a, b in zip(plain, traced_run):
        assert torch.equal(a["loss"], b["loss"])


# -- what the driver and the workers record -------------------------------------------------------


def _files(root: Path, sub: str) -> tuple[Trace, list]:
    trace = Trace(root / sub)
    return trace, trace.steps()


def test_driver_records_what_compute_advantage_returned(traced):
    (data,) = grpo_step(steps=1)
    trace, keys = _files(traced, "rollout")
    assert [(k.step, k.inner_step, k.micro_batch, k.rank) for k in keys] == [(0, 0, 0, 0)]
    rec, meta = trace.load_step(keys[0]), trace.metadata(keys[0])
    batch = data.batch
    assert torch.equal(rec["completion_ids"], batch["responses"])
    assert torch.equal(rec["prompt_ids"], batch["prompts"])
    assert torch.equal(rec["completion_mask"], batch["response_mask"].bool())
    for name, verl_name in (("old_logprobs", "old_log_probs"), ("ref_logprobs", "ref_log_prob"),
                            ("sampler_logprobs", "rollout_log_probs"), ("token_rewards", "token_level_rewards")):
        assert torch.equal(rec[name], batch[verl_name]), name
    assert torch.equal(rec["rewards"], batch["token_level_rewards"].sum(dim=-1))
    # uid strings -> int64 group ids by first appearance; the strings kept in metadata
    uids = list(data.non_tensor_batch["uid"])
    assert meta["uids"] == uids
    assert rec["group_ids"].tolist() == [0, 1, 0, 1, 0, 1, 0, 1]  # rollout() interleaves the two prompts
    # verl's token-level advantages, one value per row: by hand, (r - mean) / (Bessel std + 1e-6) per uid
    import statistics
    rewards = rec["rewards"].tolist()
    for b in range(B):
        group = [r for r, u in zip(rewards, uids) if u == uids[b]]
        expected = (rewards[b] - statistics.mean(group)) / (statistics.stdev(group) + 1e-6)
        assert float(rec["advantages"][b]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert torch.all(batch["advantages"][b][batch["response_mask"][b].bool()] == rec["advantages"][b])
    # the row ids travel with the batch to the workers
    assert batch[tv.ROW_ID_KEY].tolist() == list(range(B)) == rec["row_ids"].tolist()
    assert meta["advantage_rule"] == "verl_grpo" and meta["num_generations"] == G


def test_worker_records_what_the_policy_loss_received_and_returned(traced, spy):
    (data,) = grpo_step(steps=1, loss_mode="tracer_spy")
    trace, keys = _files(traced, "workers")
    assert len(keys) == len(spy) == B // MICRO * EPOCHS
    keys = sorted(keys, key=lambda k: k.micro_batch)  # micro_batch = call order within the step
    for key, call in zip(keys, spy):
        rec = trace.load_step(key)
        assert torch.equal(rec["policy_logprobs"], call["policy"])
        assert torch.equal(rec["old_logprobs"], call["old"])
        assert torch.equal(rec["completion_mask"], call["mask"])
        assert torch.equal(rec["verl_pg_loss"], call["pg_loss"])
        first = call["mask"].float().argmax(dim=1)
        assert torch.equal(rec["advantages"], call["advantages"].gather(1, first[:, None])[:, 0])
        assert torch.allclose(rec["ratio"], torch.exp(call["policy"] - call["old"]))
        # the micro-batch's rows, by their ids, are rows of the driver's batch
        rows = rec["row_ids"]
        T_micro = call["mask"].shape[1]
        assert torch.equal(rec["old_logprobs"], data.batch["old_log_probs"][rows, :T_micro])
        assert torch.equal(rec["completion_ids"], data.batch["responses"][rows, :T_micro])


def test_worker_coordinates_follow_epochs_mini_batches_and_micro_batches(traced):
    grpo_step(steps=2)
    trace, keys = _files(traced, "workers")
    calls_per_epoch = B // MICRO
    for step in (0, 1):
        mine = sorted((k for k in keys if k.step == step), key=lambda k: k.micro_batch)
        assert [k.micro_batch for k in mine] == list(range(calls_per_epoch * EPOCHS))
        metas = [trace.metadata(k) for k in mine]
        # epoch e = inner step e; mini-batch m of MINI rows = MINI / MICRO micro-batches
        assert [k.inner_step for k in mine] == [c // calls_per_epoch for c in range(len(mine))]
        assert [m["mini_batch"] for m in metas] == [(c % calls_per_epoch) // (MINI // MICRO) for c in range(len(mine))]
        assert [m["micro_batch_in_mini_batch"] for m in metas] == [c % (MINI // MICRO) for c in range(len(mine))]
        # only the first mini-batch of the first epoch runs before any optimizer step
        assert [m["fresh_rollouts"] for m in metas] == [c < MINI // MICRO for c in range(len(mine))]
        # every row is seen once per epoch
        epoch_rows = [sorted(sum((trace.load_step(k)["row_ids"].tolist() for k in mine if k.inner_step == e), []))
                      for e in range(EPOCHS)]
        assert epoch_rows == [list(range(B))] * EPOCHS
    # fresh micro-batches: the ratio is exactly 1 (same model, same per-sequence forward as old)
    for key in keys:
        if trace.metadata(key)["fresh_rollouts"]:
            rec = trace.load_step(key)
            assert torch.all(rec["ratio"][rec["completion_mask"]] == 1.0)


# -- the joined trace ------------------------------------------------------------------------------


def test_joined_trace_passes_tracer_check_and_opens_in_the_app(traced, monkeypatch):
    (data, _) = grpo_step(steps=2)
    out = join(traced)
    trace = Trace(out)
    keys = trace.steps()
    assert len(keys) == 2 * B // MICRO * EPOCHS
    for key in [k for k in keys if k.step == 0]:
        rec, meta = trace.load_step(key), trace.metadata(key)
        rows = rec["row_ids"].tolist()
        assert rec["rewards"].tolist() == data.batch["token_level_rewards"].sum(-1)[rows].tolist()
        assert rec["group_ids"].tolist() == [[0, 1][r % 2] for r in rows]
        assert meta["uids"] == [data.non_tensor_batch["uid"][r] for r in rows]
        assert torch.equal(rec["sampler_logprobs"], data.batch["rollout_log_probs"][rows, : rec["completion_mask"].shape[1]])
        assert meta["driver_old_logprobs_max_abs_diff"] == 0.0
    findings = run_checks(out)
    assert not has_errors(findings), [f.message for f in findings if f.severity == "error"]
    # the health family is advice on how far a run moves, not a bug class: this fixture steps SGD at a rate
    # far above a real run's so that one update shows, and health.clip_fraction says so, truthfully
    warned = [f for f in findings if f.severity == "warning" and f.family != "health"]
    assert not warned, [f.message for f in warned]
    cli = subprocess.run([sys.executable, "-m", "tracer", "check", str(out)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert cli.returncode == 0, cli.stdout + cli.stderr
    # the app opens the joined trace and shows a sequence's tokens as the tokenizer decodes them
    from tests.fixtures.toy_traces import TOKENS_PAGE, start

    at = start(monkeypatch, out, page=TOKENS_PAGE)
    assert not at.exception
    at.selectbox(key="run").select(out).run()
    assert not at.exception
    table = next(df.value for df in at.dataframe if {"token_text", "mask_reason"} <= set(df.value.columns))
    first = trace.load_step(trace.steps()[0])
    kept = first["completion_ids"][0][first["completion_mask"][0]].tolist()
    shown = table[(table["section"] == "completion") & (table["mask_reason"] == "kept")]["token_text"].tolist()
    assert shown == [TOKENIZER.decode([i]) for i in kept]


def test_join_cli_writes_the_joined_trace(traced):
    grpo_step(steps=1)
    cli = subprocess.run([sys.executable, "-m", "tracer.integrations.verl_join", str(traced)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert cli.returncode == 0, cli.stderr
    assert len(Trace(traced / "joined").steps()) == B // MICRO * EPOCHS
    again = subprocess.run([sys.executable, "-m", "tracer.integrations.verl_join", str(traced)], capture_output=True,
                           text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert again.returncode == 2 and "already holds a trace" in again.stderr


# -- the checks that matter at this scale ----------------------------------------------------------


def test_ratio_not_one_at_one_micro_batch_position_is_located(traced):
    grpo_step(steps=1, perturb={(0, 0, 1): 0.05})  # epoch 0, mini-batch 0, second micro-batch: numerics bug
    findings = run_checks(join(traced))
    first_step = [f for f in findings if f.check == "identity.first_step" and f.severity == "error"]
    assert [(f.step, f.inner_step, f.micro_batch) for f in first_step] == [(0, 0, 1)]
    (position,) = [f for f in findings if f.check == "identity.micro_batch_position"]
    assert position.severity == "error"
    assert position.details["deviating_positions"] == [1] and position.details["exact_positions"] == [0]
    assert "position 1: 1 of 1 files" in position.message


def test_nan_old_logprobs_are_located_in_the_rollout_and_in_the_micro_batch(traced):
    (data,) = grpo_step(steps=1, nan_at=(3, 1))
    (driver,) = [f for f in run_checks(traced / "rollout") if f.check == "nonfinite.values" and f.severity == "error"]
    assert (driver.field, driver.sequence, driver.token) == ("old_logprobs", 3, 1)
    trace = Trace(join(traced))
    found = [f for f in run_checks(trace) if f.check == "nonfinite.values" and f.severity == "error"
             and f.field == "old_logprobs"]
    # the two micro-batches (one per epoch) that hold row 3, with the row's place in each
    assert len(found) == EPOCHS
    for f in found:
        key = trace.step_key(f.step, f.inner_step, f.micro_batch, f.rank)
        assert trace.load_step(key)["row_ids"][f.sequence] == 3 and f.token == 1
        assert trace.metadata(key)["uids"][f.sequence] == data.non_tensor_batch["uid"][3]


def test_probability_space_gap_equals_verls_own_metric(traced):
    (data,) = grpo_step(steps=1)
    expected = calculate_debug_metrics(data)  # verl's training/rollout_probs_diff_* on the same batch
    (finding,) = [f for f in run_checks(traced / "rollout") if f.check == "sampler.probs_diff"]
    assert finding.severity == "info"
    for key in ("max", "mean", "std"):
        assert finding.details[f"probs_diff_{key}"] == pytest.approx(expected[f"training/rollout_probs_diff_{key}"], rel=1e-4)
    assert finding.details["pearson"] == pytest.approx(expected["training/rollout_actor_probs_pearson_corr"], rel=1e-4)


def test_probability_space_gap_warns_on_a_temperature_applied_on_one_side(traced):
    model = tiny_model()
    data = rollout(model, seed=100)
    data.batch["rollout_log_probs"] = data.batch["old_log_probs"] * 0.3  # engine at temperature 1/0.3-ish
    data = ray_trainer.compute_advantage(data, adv_estimator="grpo", num_repeat=G, config=AlgoConfig(adv_estimator="grpo"))
    tv.finish()
    (finding,) = [f for f in run_checks(traced / "rollout") if f.check == "sampler.probs_diff"]
    expected = calculate_debug_metrics(data)
    assert expected["training/rollout_probs_diff_mean"] > 0.05
    assert finding.severity == "warning"
    assert finding.details["probs_diff_mean"] == pytest.approx(expected["training/rollout_probs_diff_mean"], rel=1e-4)


def test_a_tracing_failure_never_stops_training(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("TRACER_DIR", str(blocker))
    tv.finish()
    model = tiny_model()
    data = rollout(model, seed=100)
    with pytest.warns(RuntimeWarning, match="could not record") as caught:
        data = ray_trainer.compute_advantage(data, adv_estimator="grpo", num_repeat=G, config=AlgoConfig(adv_estimator="grpo"))
        results = update_actor(model, data, actor_config("tracer_vanilla"))
    assert len(results) == B // MICRO * EPOCHS and all(torch.isfinite(r["loss"]) for r in results)
    # one warning per side (the trace cannot be opened), not one per micro-batch
    assert len([w for w in caught if "could not record" in str(w.message)]) == 2
    tv.finish()
