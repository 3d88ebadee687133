"""tracer.views.group_std: the std a step's advantages were divided by is what the metadata declares, else
what the recorded advantages follow (recomputed from the recorded rewards with tracer.formulas), else
None with the reason: never a default. Values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tracer.views.group_std import declared_group_std, inferred_group_std, restate_std

# One group of G = 4: rewards 1, 0, 0, 0. mean 0.25; centred 0.75, -0.25, -0.25, -0.25;
# population std sqrt((0.75² + 3 · 0.25²) / 4) = sqrt(0.1875) = 0.4330127; Bessel's std sqrt(0.75 / 3) = 0.5.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0])
CENTRED = torch.tensor([0.75, -0.25, -0.25, -0.25])
POPULATION_ADV = CENTRED / (0.4330127 + 1e-4)  # 1.7317, -0.5772 (MiniMind train_grpo.py)
UNBIASED_ADV = CENTRED / (0.5 + 1e-4)  # 1.4997, -0.4999 (TRL)


@pytest.mark.parametrize("advantages, estimator", [(POPULATION_ADV, "population"), (UNBIASED_ADV, "unbiased"),
                                                   (CENTRED, "none")])
def test_the_rule_the_recorded_advantages_follow_is_named(advantages, estimator):
    found = inferred_group_std(REWARDS, advantages, None, 4)
    assert (found.estimator, found.recorded) == (estimator, False)
    assert found.source.startswith("inferred: the recorded advantages of 1 group follow tracer.formulas.")


def test_shuffled_rows_are_grouped_by_group_ids_and_partial_groups_left_out():
    # a micro-batch of a shuffled batch: group 7 whole (rows 3, 0, 5, 1), group 2 has 2 of its 4 rows
    rewards = torch.tensor([0.0, 0.0, 5.0, 1.0, 9.0, 0.0])
    group_ids = torch.tensor([7, 7, 2, 7, 2, 7])
    order = [3, 0, 5, 1]  # group 7's rows; their rewards 1, 0, 0, 0
    advantages = torch.zeros(6)
    advantages[order] = UNBIASED_ADV
    advantages[[2, 4]] = torch.tensor([-1.0, 1.0])  # whatever the whole group 2 gave: not judged
    found = inferred_group_std(rewards, advantages, group_ids, 4)
    assert found.estimator == "unbiased" and "of 1 group follow" in found.source


def test_values_that_cannot_tell_give_none_and_say_why():
    flat = inferred_group_std(torch.ones(4), torch.zeros(4), None, 4)
    assert flat.estimator is None and "zero reward variance" in flat.source
    neither = inferred_group_std(REWARDS, 2 * POPULATION_ADV, None, 4)
    assert neither.estimator is None and "follow none of the group rules" in neither.source
    assert "population std max |Δ| 1.73" in neither.source  # |2a - a| at the first row
    partial = inferred_group_std(REWARDS[:3], POPULATION_ADV[:3], torch.tensor([0, 0, 0]), 4)
    assert partial.estimator is None and "no complete group" in partial.source


def test_the_metadata_is_read_first_and_scale_rewards_none_wins():
    assert declared_group_std({"advantage_std": "unbiased"}).estimator == "unbiased"
    assert declared_group_std({"advantage_rule": "seed"}).estimator == "population"  # alias of group_zscore
    assert declared_group_std({"advantage_rule": "verl_grpo"}).estimator == "unbiased"
    assert declared_group_std({"advantage_std": "unbiased", "scale_rewards": "none"}).estimator == "none"
    assert declared_group_std({"scale_rewards": "group"}).source == "recorded: scale_rewards = 'group' (TRL)"
    assert declared_group_std({"advantage_rule": "gae"}) is None and declared_group_std({}) is None


def test_restate_std_applies_bessels_correction():
    assert restate_std(0.4330127, 4, "population", "unbiased") == pytest.approx(0.5, abs=1e-7)
    assert restate_std(0.5, 4, "unbiased", "population") == pytest.approx(0.4330127, abs=1e-7)
    assert restate_std(0.5, 4, "unbiased", "unbiased") == 0.5
    assert math.isnan(restate_std(0.0, 1, "population", "unbiased"))
