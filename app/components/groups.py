"""Pure builders of the group page (GRPO / CISPO / RLOO): group labels, the completions table with
zero-variance groups marked, a reward picture of one group, and the zero-variance share over steps.
No Streamlit and no RL maths: the numbers come from ``tracer.views``."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from pandas.io.formats.style import Styler

from app.components.figures import (
    DASHES,
    SYMBOLS,
    TOP_LEGEND,
    empty_figure,
    integer_ticks,
    top_margin,
)

ZERO_VARIANCE_BACKGROUND = "#fff3cd"
ZERO_VARIANCE_MARK = "zero variance"
REWARD_COLOUR = "#1f77b4"
_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def group_label(group: pd.Series) -> str:
    """Selectbox label of one row of ``views.group_frame``: ``group 1 · 4 rows · mean 1 · zero variance``."""
    label = f"group {group['group']} · {group['size']} rows · mean {group['reward_mean']:.4g}"
    return label + f" · {ZERO_VARIANCE_MARK}" if group["zero_variance"] else label


def style_group_table(frame: pd.DataFrame) -> Styler | pd.DataFrame:
    """Rows of zero-variance groups on an amber background, floats to 4 significant digits. Works
    on ``views.group_frame`` and ``views.group_completions`` (both carry ``zero_variance``)."""
    if "zero_variance" not in frame:
        return frame
    styles = frame["zero_variance"].map(lambda z: f"background-color: {ZERO_VARIANCE_BACKGROUND}" if z else "")
    floats = [c for c in frame.columns if pd.api.types.is_float_dtype(frame[c])]
    return frame.style.apply(lambda col: styles, axis=0).format("{:.4g}", subset=floats, na_rep="")


def group_rewards_figure(completions: pd.DataFrame) -> go.Figure:
    """The completions of one group side by side: reward bars, each topped by a dash and its value
    under it on the x axis (a reward of 0 shows as a dash on the zero line, not as nothing), with the group
    mean (dashed) and ± one std band, and the recorded advantage of each completion as a marker on a
    second axis (round ticks of its own, no grid).

    Args:
        completions: ``views.group_completions`` (``sequence, reward, advantage, group_mean, group_std``).
    """
    if completions.empty:
        return empty_figure("no completions in this group")
    x = [f"seq {s}" for s in completions["sequence"]]
    rewards = completions["reward"].tolist()
    fig = go.Figure()
    # a dash at each bar's top and its value under it on the axis: a reward of 0 is a bar of no height,
    # which would otherwise show nothing at all (a label over the bar collides with the advantage diamonds)
    fig.add_trace(go.Bar(x=x, y=rewards, name="reward", marker={"color": REWARD_COLOUR}, legendgroup="reward",
                         hovertemplate="%{x}<br>reward=%{y:.4g}<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=rewards, mode="markers", name="reward", legendgroup="reward", showlegend=False,
                             marker={"symbol": "line-ew", "size": 44, "line": {"width": 4, "color": REWARD_COLOUR}},
                             hovertemplate="%{x}<br>reward=%{y:.4g}<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=completions["advantage"].tolist(), name="advantage", yaxis="y2",
                             mode="markers", marker={"size": 11, "symbol": "diamond", "color": "#d62728"},
                             hovertemplate="%{x}<br>advantage=%{y:.4g}<extra></extra>"))
    mean, std = float(completions["group_mean"].iloc[0]), float(completions["group_std"].iloc[0])
    fig.add_hline(y=mean, line_dash="dash", line_color="#444", annotation_text=f"group mean {mean:.4g}")
    if std == std and std > 0:  # not NaN
        fig.add_hrect(y0=mean - std, y1=mean + std, fillcolor="rgba(68, 68, 68, 0.1)", line_width=0)
    # The advantage axis picks its own round ticks (plotly.js would otherwise sync them to the reward
    # axis's grid: 0.904, 0.002, -0.9...) and draws no grid of its own (one grid: the reward's).
    fig.update_xaxes(tickmode="array", tickvals=x, ticktext=[f"{name}<br>reward {r:.4g}" for name, r in zip(x, rewards)])
    fig.update_layout(height=360, margin={"t": top_margin(fig, titles=False) + 12, "b": 50}, yaxis_title="reward",
                      yaxis2={"title": "advantage", "overlaying": "y", "side": "right", "zeroline": True,
                              "tickmode": "auto", "nticks": 8, "showgrid": False},
                      legend=TOP_LEGEND)
    return fig


def zero_variance_figure(shares: pd.DataFrame) -> go.Figure:
    """Share of zero-variance groups against step, one line per inner step.

    Args:
        shares: ``views.zero_variance_shares`` (``step, inner_step, groups, zero_variance_groups,
            zero_variance_share``).
    """
    if shares.empty:
        return empty_figure("no step with rewards and groups yet")
    fig = go.Figure()
    for n, (inner_step, part) in enumerate(shares.groupby("inner_step")):
        fig.add_trace(go.Scatter(
            x=part["step"], y=part["zero_variance_share"], mode="lines+markers", name=f"inner step {inner_step}",
            line={"color": _PALETTE[n % len(_PALETTE)], "dash": DASHES[n % len(DASHES)]},  # equal lines stay visible
            marker={"symbol": SYMBOLS[n % len(SYMBOLS)], "size": 9 - 2 * min(n, 2)},
            customdata=part[["zero_variance_groups", "groups"]].to_numpy(),  # an array: validated at once
            hovertemplate=("step %{x}: %{customdata[0]} of %{customdata[1]} groups"
                           f" (%{{y:.0%}}) · inner step {inner_step}<extra></extra>")))
    fig.update_layout(height=320, margin={"t": top_margin(fig, titles=False), "b": 40}, xaxis_title="step", legend=TOP_LEGEND,
                      yaxis={"title": "share of zero-variance groups", "range": [-0.05, 1.05], "tickformat": ".0%"})
    integer_ticks(fig, shares["step"].tolist())
    return fig


def advantage_rule_text(algorithm: str | None, meta: dict, estimator: str | None, source: str | None = None,
                        column: str | None = None) -> str:
    """How this run's advantages relate to the group's rewards, for the page's header line: RLOO's
    leave-one-out baseline (no std), centring only (no std), or the z-score with the std the run
    divided by: Bessel-corrected (TRL, verl, ``torch.std``'s default) or population (MiniMind's
    train_grpo.py), or "not recorded" when the trace cannot tell.

    Args:
        algorithm: the trace's algorithm. meta: the step file's metadata.
        estimator: ``"unbiased"``, ``"population"``, ``"none"`` (not divided) or None (cannot tell):
            ``tracer.views.group_std.GroupStd.estimator`` (for RLOO: the std of the table's column).
        source: ``GroupStd.source`` (recorded in the metadata, inferred from the values, or why neither),
            appended after `` · ``; None for the estimator alone.
        column: the std the table's std column and the figure's band show (``views.group_std_estimator``)
            where it is not the run's (RLOO, no std, not recorded).
    """
    rule = meta.get("advantage_rule")
    column = column or (estimator if estimator in ("population", "unbiased") else "population")
    tail = f" · {source}" if source else ""
    if algorithm == "rloo" or (isinstance(rule, str) and rule.startswith("rloo")):
        kl = " on rewards − β·Σ(old − ref)" if rule == "rloo_kl" else ""
        return (f"advantage: leave-one-out{kl}, A_i = r_i − mean of the other G − 1 rewards (no std); the "
                f"std column is the {column} std of the rewards, for reference")
    if meta.get("scale_rewards") in ("none", False):
        return f"advantage: r − group mean (scale_rewards none: not divided) · group std: {column}"
    if estimator == "none":
        return (f"advantage: r − group mean (not divided by a std){tail}; the std column is the {column} std of "
                "the rewards, for reference")
    if estimator is None:
        return (f"advantage: (r − group mean) / group std · group std: not recorded{tail}; the std column and band "
                f"show the {column} std of the rewards")
    over = "batch" if meta.get("scale_rewards") == "batch" else "group"  # TRL scale_rewards="batch"
    if estimator == "unbiased":
        named = "as TRL" if source is None else "torch.std's default, as TRL and verl"
        return f"advantage: (r − group mean) / {over} std · {over} std: unbiased (Bessel-corrected, {named}){tail}"
    return ("advantage: (r − group mean) / (group std + eps) · group std: population (unbiased=False, as MiniMind's "
            f"train_grpo.py){tail}")
