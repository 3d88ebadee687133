"""The Groups page's reward chart shows a completion whose reward is 0: its bar has no height, so each
bar has a dash at its top (at 0 on the zero line) and its value under it on the x axis. Checked on the
figure."""

from __future__ import annotations

import pandas as pd

from app.components.groups import REWARD_COLOUR, group_rewards_figure


def completions(rewards: list[float]) -> pd.DataFrame:
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5  # population std, as train_grpo.py
    return pd.DataFrame({"sequence": range(len(rewards)), "reward": rewards,
                         "advantage": [(r - mean) / (std + 1e-4) for r in rewards], "group_mean": mean,
                         "group_std": std})


def test_a_zero_reward_shows_its_value_and_a_dash():
    fig = group_rewards_figure(completions([0.0, 0.0, 1.0, 1.0]))  # mean 0.5, std 0.5
    bars = next(t for t in fig.data if t.type == "bar")
    assert list(bars.y) == [0.0, 0.0, 1.0, 1.0]
    assert list(fig.layout.xaxis.tickvals) == ["seq 0", "seq 1", "seq 2", "seq 3"]
    assert list(fig.layout.xaxis.ticktext) == ["seq 0<br>reward 0", "seq 1<br>reward 0", "seq 2<br>reward 1",
                                               "seq 3<br>reward 1"]
    dashes = next(t for t in fig.data if t.type == "scatter" and t.marker.symbol == "line-ew")
    assert list(dashes.x) == ["seq 0", "seq 1", "seq 2", "seq 3"] and list(dashes.y) == [0.0, 0.0, 1.0, 1.0]
    assert dashes.marker.line.width >= 2 and dashes.marker.size >= 20 and dashes.marker.line.color == REWARD_COLOUR
    assert dashes.showlegend is False and dashes.legendgroup == bars.legendgroup  # one legend entry, "reward"
    # the advantages as recorded: (0 - 0.5) / (0.5 + 1e-4) = -0.9998
    advantage = next(t for t in fig.data if t.name == "advantage")
    assert [round(a, 4) for a in advantage.y] == [-0.9998, -0.9998, 0.9998, 0.9998]


def test_a_group_of_zero_rewards_is_still_drawn():
    fig = group_rewards_figure(completions([0.0, 0.0]))  # zero variance: no band, all bars empty
    dashes = next(t for t in fig.data if t.type == "scatter" and t.marker.symbol == "line-ew")
    assert list(dashes.y) == [0.0, 0.0]
    assert list(fig.layout.xaxis.ticktext) == ["seq 0<br>reward 0", "seq 1<br>reward 0"]
