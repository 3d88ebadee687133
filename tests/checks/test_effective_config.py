"""The checks that name the setting in effect when the recorded tensors do not follow the declared one
(``recompute.loss_agg_mode``, ``recompute.advantage_std``, ``recompute.declared_settings``), on hand-built
traces whose numbers are worked out in the comments; verl's own functions run the same checks in
tests/integrations/test_verl_effective_config.py (verl venv)."""

from __future__ import annotations

import math

import pytest
import torch

from tracer.checks import run_checks
from tracer.formulas.verl_losses import verl_agg_loss
from tracer.record.writer import TraceWriter

from tests.fixtures.toy_traces import healthy_step_tensors

# per-token loss of two sequences, the second keeps one token
PG_LOSSES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[True, True, True], [True, False, False]])
# token-mean (1+2+3+4)/4 = 2.5; seq-mean-token-sum (6+4)/2 = 5; seq-mean-token-mean (2+4)/2 = 3;
# seq-mean-token-sum-norm 5/T = 5/3; token-sum 10
BY_HAND = {"token-mean": 2.5, "seq-mean-token-sum": 5.0, "seq-mean-token-mean": 3.0,
           "seq-mean-token-sum-norm": 5.0 / 3.0, "token-sum": 10.0}


@pytest.mark.parametrize("mode", list(BY_HAND))
def test_verl_agg_loss_by_hand(mode):
    assert float(verl_agg_loss(PG_LOSSES, MASK, mode)) == pytest.approx(BY_HAND[mode])


def test_verl_agg_loss_uses_the_global_mini_batch_counts():
    # two ranks, 8 kept tokens and 4 sequences in the global mini-batch: token-mean 10 / 8 * 2, seq 10 / 4 * 2
    counts = {"dp_size": 2, "batch_num_tokens": 8, "global_batch_size": 4}
    assert float(verl_agg_loss(PG_LOSSES, MASK, "token-mean", **counts)) == pytest.approx(2.5)
    assert float(verl_agg_loss(PG_LOSSES, MASK, "seq-mean-token-sum", **counts)) == pytest.approx(5.0)
    assert float(verl_agg_loss(PG_LOSSES, MASK, "seq-mean-token-sum-norm", loss_scale_factor=4)) == pytest.approx(1.25)
    with pytest.raises(ValueError, match="unknown verl loss_agg_mode 'seq-sum'"):
        verl_agg_loss(PG_LOSSES, MASK, "seq-sum")


def _worker_trace(out, pg_loss: float, meta: dict):
    tensors = {"completion_ids": torch.tensor([[5, 6, 1], [7, 1, 0]]), "completion_mask": MASK,
               "policy_logprobs": torch.full((2, 3), -1.0), "old_logprobs": torch.full((2, 3), -1.0),
               "verl_pg_losses": PG_LOSSES, "verl_pg_loss": torch.tensor(pg_loss)}
    with TraceWriter(out, "grpo", async_write=False) as writer:
        writer.record(0, tensors, metadata={"loss_mode": "vanilla", "pg_losses_from": "agg_loss", **meta})
    return out


def _found(trace, check):
    return [f for f in run_checks(trace) if f.check == check and f.severity != "skipped"]


def test_pg_loss_of_another_mode_names_the_mode_in_effect(tmp_path):
    # the loss received token-mean and called agg_loss with seq-mean-token-sum: pg_loss 5 is that mode's
    trace = _worker_trace(tmp_path / "t", 5.0, {"declared_loss_agg_mode": "token-mean", "loss_agg_mode_argument":
                                                 "token-mean", "loss_agg_mode": "seq-mean-token-sum"})
    (f,) = _found(trace, "recompute.loss_agg_mode")
    assert f.severity == "error" and f.details["in_effect"] == "seq-mean-token-sum"
    first, second = f.message.splitlines()
    assert first == ("loss aggregation in effect is seq-mean-token-sum, config declares token-mean: recorded pg_loss 5 "
                     "equals agg_loss(..., 'seq-mean-token-sum') to 0; token-mean gives 2.5.")
    assert second.startswith("the policy loss 'vanilla' received loss_agg_mode 'token-mean' and called agg_loss with "
                             "'seq-mean-token-sum': the loss does not aggregate with its argument.")


def test_a_config_value_that_does_not_reach_the_loss_is_named(tmp_path):
    # ActorConfig says token-mean, ppo_loss passed seq-mean-token-mean: pg_loss 3
    trace = _worker_trace(tmp_path / "t", 3.0, {"declared_loss_agg_mode": "token-mean", "loss_agg_mode_argument":
                                                 "seq-mean-token-mean", "loss_agg_mode": "seq-mean-token-mean"})
    (f,) = _found(trace, "recompute.loss_agg_mode")
    assert f.message.startswith("loss aggregation in effect is seq-mean-token-mean, config declares token-mean: "
                                "recorded pg_loss 3 equals")
    assert "ppo_loss called the policy loss 'vanilla' with loss_agg_mode 'seq-mean-token-mean' while the " \
           "ActorConfig it received says 'token-mean'" in f.message


def test_pg_loss_of_the_declared_mode_is_silent(tmp_path):
    for mode, value in BY_HAND.items():
        meta = {"declared_loss_agg_mode": mode, "loss_agg_mode_argument": mode, "loss_agg_mode": mode}
        assert _found(_worker_trace(tmp_path / mode, value, meta), "recompute.loss_agg_mode") == []


def test_a_pg_loss_no_mode_gives_is_an_error_naming_every_mode(tmp_path):
    meta = {"declared_loss_agg_mode": "token-mean", "loss_agg_mode_argument": "token-mean", "loss_agg_mode": "token-mean"}
    (f,) = _found(_worker_trace(tmp_path / "t", 7.0, meta), "recompute.loss_agg_mode")
    assert f.message.startswith("pg_loss 7 is no verl loss_agg_mode of the per-token loss agg_loss received (config "
                                "declares token-mean): token-mean 2.5, seq-mean-token-sum 5, seq-mean-token-mean 3, "
                                "seq-mean-token-sum-norm 1.66667, token-sum 10.")


def _driver_trace(out, advantages: torch.Tensor, meta: dict):
    tensors = healthy_step_tensors(0, 0)
    B = tensors["rewards"].shape[0]
    tensors["rewards"] = torch.tensor([1.0, 0.0, 2.0, 2.0, 0.0, 3.0][:B])
    tensors["advantages"] = advantages
    with TraceWriter(out, "grpo", hyperparameters={"num_generations": 2}, async_write=False) as writer:
        writer.record(0, tensors, metadata={"adv_estimator": "grpo", **meta})
    return out, tensors


def test_std_normalisation_in_effect_is_named_against_the_config(tmp_path):
    tensors = healthy_step_tensors(0, 0)
    groups = tensors["group_ids"].tolist()
    assert tensors["rewards"].shape[0] == 4 and groups == [0, 0, 1, 1]
    # rewards [1, 0 | 2, 2]: group 0 mean 0.5, Bessel std sqrt(0.5); group 1 std 0
    z = 0.5 / (math.sqrt(0.5) + 1e-6)
    with_std = torch.tensor([z, -z, 0.0, 0.0])
    trace, _ = _driver_trace(tmp_path / "t", with_std, {"declared_norm_adv_by_std_in_grpo": False,
                                                       "norm_adv_by_std_in_grpo": True, "advantage_rule": "verl_grpo"})
    (f,) = _found(trace, "recompute.advantage_std")
    first, second = f.message.splitlines()
    assert first == ("advantage std normalisation in effect is on, config declares norm_adv_by_std_in_grpo=False: "
                     "recorded advantages equal verl's GRPO z-score (r - mean_g) / (std_g + 1e-6) to 0 over 4 rows; "
                     f"norm_adv_by_std_in_grpo=False gives 0.5 at seq 0 (recorded {z:.6g}).")
    assert second == ("compute_advantage was called with norm_adv_by_std_in_grpo=True: the config's value did not "
                      "reach the call.")
    assert not [g for g in _found(trace, "recompute.advantages") if g.severity == "error"]


def test_advantages_of_the_declared_std_setting_are_silent(tmp_path):
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0])  # r - mean_g
    trace, _ = _driver_trace(tmp_path / "t", centred, {"declared_norm_adv_by_std_in_grpo": False,
                                                      "norm_adv_by_std_in_grpo": False, "advantage_rule": "group_mean"})
    assert _found(trace, "recompute.advantage_std") == []


def test_a_setting_at_the_call_that_differs_from_the_config_is_an_error(tmp_path):
    trace = _worker_trace(tmp_path / "t", 2.5, {"declared_loss_agg_mode": "token-mean", "loss_agg_mode": "token-mean",
                                                "loss_agg_mode_argument": "token-mean", "declared_clip_ratio_high": 0.28,
                                                "clip_ratio_high": 0.2, "declared_clip_ratio_low": 0.2,
                                                "clip_ratio_low": 0.2})
    (f,) = _found(trace, "recompute.declared_settings")
    assert f.message.splitlines()[0] == "clip_ratio_high in effect is 0.2, config declares clip_ratio_high = 0.28."
    # the second line names the setting as written in the config, not capitalised ("Clip_ratio_high")
    assert f.message.splitlines()[1].startswith("The clip_ratio_high of the config the policy loss received differs")
    assert _found(_worker_trace(tmp_path / "ok", 2.5, {"declared_clip_ratio_low": 0.2, "clip_ratio_low": 0.2}),
                  "recompute.declared_settings") == []
