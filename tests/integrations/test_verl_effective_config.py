"""``tracer check`` names the setting verl actually ran with when it is not the declared one: bugs injected
into verl 0.9.1's own code path (a policy loss that aggregates with another ``loss_agg_mode``, an
``agg_loss`` that ignores its mode, ``norm_adv_by_std_in_grpo`` that does not reach the advantage
computation), run through verl's functions as tests/integrations/test_verl_configs.py runs them. verl's
own ``agg_loss`` is the independent reference for tracer's aggregation maths.

Runs in the verl venv only (``make test-verl``); skipped where verl is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl")
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

import tracer.integrations.verl as tv  # noqa: E402
from tracer.checks import run_checks  # noqa: E402
from tracer.formulas.verl_losses import VERL_LOSS_AGG_MODES, verl_agg_loss, verl_vanilla_per_token_loss  # noqa: E402
from tracer.integrations.verl_join import join  # noqa: E402
from tracer.read.reader import Trace  # noqa: E402

from tests.fixtures.paths import REPO  # noqa: E402
from tests.fixtures.verl_batches import B, EPOCHS, G, MICRO, tiny_model  # noqa: E402
from tests.integrations.test_verl_configs import Case, actor_config, alarms, rollout, run_case, update_actor  # noqa: E402


def errors(findings, check: str) -> list:
    return [f for f in findings if f.check == check and f.severity == "error"]


def cli_check(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracer", "check", str(path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


def first_error_line(stdout: str) -> str:
    """The first line of the report that follows an error block's heading (the worst check comes first)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "error" in line.lower() and "recompute." in line)
    return " ".join(lines[start: start + 4])


# -- tracer's aggregation maths against verl's agg_loss ------------------------------------------


@pytest.mark.parametrize("mode", list(VERL_LOSS_AGG_MODES))
@pytest.mark.parametrize("counts", [{}, {"dp_size": 2, "batch_num_tokens": 23, "global_batch_size": 6},
                                    {"loss_scale_factor": 8}])
def test_verl_agg_loss_equals_verls_own(mode, counts):
    gen = torch.Generator().manual_seed(3)
    loss_mat = torch.randn(4, 6, generator=gen)  # (B, T)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    mask[2] = False  # a row the mask empties counts in no sum
    expected = core_algos.agg_loss(loss_mat, mask, mode, **counts)
    assert float(verl_agg_loss(loss_mat, mask, mode, **counts)) == pytest.approx(float(expected), rel=1e-6)


def test_verl_vanilla_per_token_loss_reduces_to_verls_pg_loss():
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(4, 6, generator=gen) * 3
    policy = old + 0.8 * torch.randn(4, 6, generator=gen)  # ratios far outside the clip range, both sides
    advantages = torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.2
    weights = torch.rand(4, 6, generator=gen) + 0.5
    config = ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                         clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=2.0,
                         policy_loss=PolicyLossConfig(loss_mode="vanilla"))
    for mode in VERL_LOSS_AGG_MODES:
        pg_loss, _ = core_algos.compute_policy_loss_vanilla(old, policy, advantages, mask, loss_agg_mode=mode,
                                                            config=config, rollout_is_weights=weights)
        ours = verl_vanilla_per_token_loss(policy, old, advantages, 0.2, 0.28, 2.0, weights)
        assert float(verl_agg_loss(ours, mask, mode)) == pytest.approx(float(pg_loss), rel=1e-5), mode


# -- loss aggregation: the mode in effect -----------------------------------------------------------


@pytest.fixture
def seq_sum_loss():
    """verl's vanilla loss edited to aggregate with seq-mean-token-sum whatever loss_agg_mode it is given."""
    vanilla = core_algos.POLICY_LOSS_REGISTRY["vanilla"]

    def vanilla_seq_sum(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                        rollout_is_weights=None):
        return vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-sum",
                       config=config, rollout_is_weights=rollout_is_weights)

    core_algos.register_policy_loss("vanilla_seq_sum")(vanilla_seq_sum)
    tv.register_tracing_losses()
    yield "vanilla_seq_sum"
    for name in ("vanilla_seq_sum", "tracer_vanilla_seq_sum"):
        core_algos.POLICY_LOSS_REGISTRY.pop(name, None)


def test_a_loss_that_ignores_loss_agg_mode_is_named_with_the_mode_in_effect(traced, seq_sum_loss):
    findings = run_case(Case(loss_mode=seq_sum_loss), traced)["joined"]
    found = errors(findings, "recompute.loss_agg_mode")
    assert len(found) == B // MICRO * EPOCHS  # every micro-batch
    workers = Trace(traced / "workers")
    for f in found:
        key = workers.step_key(f.step, f.inner_step, f.micro_batch, f.rank)
        rec, meta = workers.load_step(key), workers.metadata(key)
        # the in-effect and declared settings as recorded at the call
        assert (meta["declared_loss_agg_mode"], meta["loss_agg_mode_argument"], meta["loss_agg_mode"]) == (
            "token-mean", "token-mean", "seq-mean-token-sum")
        # verl's own agg_loss is the reference for both numbers the message gives
        counts = {k: meta[k] for k in ("dp_size", "batch_num_tokens", "global_batch_size")}
        seq_sum = float(core_algos.agg_loss(rec["verl_pg_losses"], rec["completion_mask"], "seq-mean-token-sum", **counts))
        token_mean = float(core_algos.agg_loss(rec["verl_pg_losses"], rec["completion_mask"], "token-mean", **counts))
        assert seq_sum == pytest.approx(float(rec["verl_pg_loss"]), rel=1e-6)
        first = f.message.splitlines()[0]
        assert first.startswith("loss aggregation in effect is seq-mean-token-sum, config declares token-mean: "
                                f"recorded pg_loss {float(rec['verl_pg_loss']):.6g} equals agg_loss(..., "
                                "'seq-mean-token-sum') to ")
        assert first.endswith(f"; token-mean gives {token_mean:.6g}.")
        assert "received loss_agg_mode 'token-mean' and called agg_loss with 'seq-mean-token-sum'" in f.message
    assert not [a for a in alarms({"joined": findings}) if "recompute.loss_agg_mode" not in a]  # the one cause
    cli = cli_check(traced / "joined")
    assert cli.returncode == 1
    assert "loss aggregation in effect is seq-mean-token-sum, config declares token-mean" in first_error_line(cli.stdout)


def test_an_agg_loss_that_ignores_its_mode_is_found_by_recomputing_the_vanilla_loss(traced, monkeypatch):
    """agg_loss itself edited (its token-mean branch sums per sequence): the call records no per-token loss
    (the edit replaced tracer's wrapper), so the check recomputes verl's vanilla loss from the logprobs."""
    original = core_algos.agg_loss.__wrapped__

    def edited_agg_loss(loss_mat, loss_mask, loss_agg_mode, **counts):
        return original(loss_mat, loss_mask, "seq-mean-token-sum" if loss_agg_mode == "token-mean" else loss_agg_mode,
                        **counts)

    monkeypatch.setattr(core_algos, "agg_loss", edited_agg_loss)
    findings = run_case(Case(), traced)["joined"]
    found = errors(findings, "recompute.loss_agg_mode")
    assert len(found) == B // MICRO * EPOCHS
    for f in found:
        assert f.message.startswith("loss aggregation in effect is seq-mean-token-sum, config declares token-mean")
        assert "the loss's aggregation is not 'token-mean'" in f.message
        assert "recomputed per token" in f.message


# -- GRPO std normalisation: the setting in effect -------------------------------------------------


def run_advantage_case(root, estimator: str, config_norm: bool, call_norm: bool):
    """One GRPO step through verl's functions with ``AlgoConfig(norm_adv_by_std_in_grpo=config_norm)`` while
    ``compute_advantage`` is called with ``call_norm`` (a trainer whose config does not reach the call)."""
    model = tiny_model(0)
    algo = AlgoConfig(adv_estimator=estimator, norm_adv_by_std_in_grpo=config_norm)
    data = rollout(model, Case(adv_estimator=estimator))
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    data = ray_trainer.compute_advantage(data, adv_estimator=estimator, num_repeat=G,
                                         norm_adv_by_std_in_grpo=call_norm, config=algo)
    update_actor(model, data, actor_config(Case(adv_estimator=estimator)), entropy=False, lr=0.5)
    tv.finish()
    return data


@pytest.mark.parametrize("config_norm", [False, True])
def test_norm_adv_by_std_that_does_not_reach_the_call_is_named(traced, config_norm):
    data = run_advantage_case(traced, "grpo", config_norm=config_norm, call_norm=not config_norm)
    rollout_trace = Trace(traced / "rollout")
    meta = rollout_trace.metadata(rollout_trace.steps()[0])
    assert (meta["declared_norm_adv_by_std_in_grpo"], meta["norm_adv_by_std_in_grpo"]) == (config_norm, not config_norm)
    findings = run_checks(traced / "rollout")
    (f,) = errors(findings, "recompute.advantage_std")
    state = "on" if not config_norm else "off"
    assert f.message.startswith(f"advantage std normalisation in effect is {state}, config declares "
                                f"norm_adv_by_std_in_grpo={config_norm}: recorded advantages equal verl's GRPO ")
    # the value the config would have given, at the row the message names: verl's own estimator
    expected, _ = core_algos.compute_grpo_outcome_advantage(data.batch["token_level_rewards"], data.batch["response_mask"],
                                                            data.non_tensor_batch["uid"], norm_adv_by_std_in_grpo=config_norm)
    row_value = expected[f.sequence][data.batch["response_mask"][f.sequence].bool()][0]
    stated = re.search(rf"norm_adv_by_std_in_grpo={config_norm} gives (\S+) at seq {f.sequence} ", f.message)
    assert stated and float(stated.group(1)) == pytest.approx(float(row_value), rel=1e-5, abs=1e-6)
    assert f"called with norm_adv_by_std_in_grpo={not config_norm}: the config's value did not reach the call" in f.message
    assert not errors(findings, "recompute.advantages")  # one cause, said once
    cli = cli_check(traced / "rollout")
    assert cli.returncode == 1
    assert f"advantage std normalisation in effect is {state}, config declares" in first_error_line(cli.stdout)


def test_grpo_vectorized_ignoring_norm_adv_by_std_is_named(traced):
    """verl 0.9.1's compute_advantage passes norm_adv_by_std_in_grpo only to 'grpo'; grpo_vectorized keeps
    its default True: config and call say False, the advantages are divided by the group std."""
    run_advantage_case(traced, "grpo_vectorized", config_norm=False, call_norm=False)
    findings = run_checks(traced / "rollout")
    (f,) = errors(findings, "recompute.advantage_std")
    assert f.message.startswith("advantage std normalisation in effect is on, config declares "
                                "norm_adv_by_std_in_grpo=False")
    assert "adv_estimator 'grpo_vectorized' did not apply it" in f.message
    assert not errors(findings, "recompute.advantages")


def test_healthy_runs_record_the_same_declared_and_in_effect_settings(traced):
    findings = run_case(Case(actor={"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}), traced)
    assert not alarms(findings)
    workers = Trace(traced / "workers")
    meta = workers.metadata(workers.steps()[0])
    assert meta["declared_loss_agg_mode"] == meta["loss_agg_mode"] == meta["loss_agg_mode_argument"] == "token-mean"
    assert (meta["declared_clip_ratio_low"], meta["clip_ratio_low"], meta["declared_clip_ratio_high"]) == (0.2, 0.2, 0.28)
    assert meta["pg_losses_from"] == "agg_loss"
    driver = Trace(traced / "rollout")
    dmeta = driver.metadata(driver.steps()[0])
    assert (dmeta["declared_adv_estimator"], dmeta["adv_estimator"]) == ("grpo", "grpo")
    assert (dmeta["declared_use_kl_in_reward"], dmeta["use_kl_in_reward"]) == (False, False)
    joined = Trace(join(traced, traced / "joined2"))
    assert not errors(run_checks(joined), "recompute.declared_settings")
