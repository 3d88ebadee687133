"""Pure builders of the PPO page: the GAE picture of one sequence and the epochs x minibatches of
one step (which ran, which stopped early). No Streamlit, no RL maths: the values come from
``tracer.read.reader`` / ``tracer.views`` as recorded; these functions lay them out."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from pandas.io.formats.style import Styler

from app.components.figures import TOP_LEGEND, empty_figure, shade_masked, token_ticks, top_margin
from app.components.token_table import hover_tokens, visible_tokens
from tracer.views import EARLY_STOP, NO_FILE, NOT_RUN, RAN

# Per-token columns of the GAE picture, in reading order.
GAE_COLUMNS = ("token_rewards", "values", "returns", "advantages")
STATUS_COLOUR = {RAN: "#1f77b4", EARLY_STOP: "#d62728", NOT_RUN: "#c7c7c7", NO_FILE: "#c7c7c7"}
STATUS_BACKGROUND = {EARLY_STOP: "#f8d7da", NOT_RUN: "#e0e0e0", NO_FILE: "#e0e0e0"}


def _completion_rows(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["section"] == "completion"] if "section" in table else table


def gae_token_frame(table: pd.DataFrame) -> pd.DataFrame:
    """The completion rows of ``Trace.token_table(key, sequence)`` with the columns of the GAE
    picture: ``position, token_text, mask_reason`` and those of :data:`GAE_COLUMNS` present;
    ``token_text`` through ``token_table.visible_tokens`` (a space token reads ``␣``)."""
    rows = _completion_rows(table)
    columns = [c for c in ("position", "token_text", "mask_reason") + GAE_COLUMNS if c in rows]
    return visible_tokens(rows[columns].reset_index(drop=True))


def gae_figure(table: pd.DataFrame) -> go.Figure:
    """One PPO sequence against completion position, in two panels sharing x.

    Top, where the reward lands: ``token_rewards`` as bars (the sequence reward on the last kept
    token), ``values`` (critic) and ``returns`` as lines. Bottom, how the advantage flows back:
    ``advantages`` (GAE). Masked positions are shaded grey in both panels.

    Args:
        table: ``Trace.token_table(key, sequence)`` of a PPO step (prompt rows are ignored), or any
            frame with ``position``, ``kept`` and some of :data:`GAE_COLUMNS`.
    """
    rows = _completion_rows(table)
    present = [c for c in GAE_COLUMNS if c in rows and rows[c].notna().any()]
    if rows.empty or not present:
        return empty_figure("no token_rewards, values, returns or advantages in this sequence")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        subplot_titles=["reward and value: where the reward lands",
                                        "advantage (GAE): how it flows back"])
    positions = rows["position"].tolist()
    texts = hover_tokens(rows.get("token_text", pd.Series([""] * len(rows))))
    kept = rows["kept"].astype(bool).tolist() if "kept" in rows else [True] * len(positions)
    for col in present:  # masked positions are gaps: their values are not in the loss, nor in the axis range
        values = [v if k else None for v, k in zip(rows[col].tolist(), kept)]
        hover = f"{col}=%{{y:.4g}}<br>position %{{x}} · token %{{customdata}}<extra></extra>"
        if col == "token_rewards":
            trace = go.Bar(x=positions, y=values, name=col, customdata=texts, hovertemplate=hover,
                           marker={"color": "#2ca02c"}, opacity=0.7)
        else:
            trace = go.Scatter(x=positions, y=values, mode="lines+markers", name=col,
                               customdata=texts, hovertemplate=hover, marker={"size": 5})
        fig.add_trace(trace, row=2 if col == "advantages" else 1, col=1)
    shade_masked(fig, positions, kept)
    fig.update_xaxes(title_text="completion token (position)", row=2, col=1)
    token_ticks(fig, positions, rows.get("token_text", pd.Series([""] * len(rows))).tolist())
    fig.update_layout(height=580, margin={"t": top_margin(fig), "b": 40}, legend=TOP_LEGEND)
    return fig


def _cell_text(rec: pd.Series) -> str:
    if rec["status"] in (NOT_RUN, NO_FILE):
        return rec["status"]
    if math.isnan(rec["mean_approx_kl_k2"]):  # the file has neither approx_kl_k2 nor both logprobs
        return "EARLY STOP" if rec["status"] == EARLY_STOP else "ran"
    k2 = f"k2 {rec['mean_approx_kl_k2']:.4g}"
    if rec["status"] == EARLY_STOP:
        comparison = ">" if rec["above_target_kl"] else "≤"
        target = f" {comparison} target {rec['target_kl']:.4g}" if not math.isnan(rec["target_kl"]) else ""
        return f"EARLY STOP · {k2}{target}"
    return f"ran · {k2}"


def early_stop_grid(minibatch_table: pd.DataFrame) -> pd.DataFrame:
    """``views.ppo_minibatch_table`` as an epochs x minibatches grid of short texts: one row per
    epoch (and rank, when there are several), one column ``mb <i>`` per minibatch; a cell reads
    ``ran · k2 0.0309``, ``EARLY STOP · k2 0.121 > target 0.1``, ``not run`` or ``no file``."""
    if minibatch_table.empty:
        return pd.DataFrame(columns=["epoch"])
    frame = minibatch_table.assign(cell=minibatch_table.apply(_cell_text, axis=1),
                                   column=minibatch_table["minibatch"].map(lambda mb: f"mb {mb}"))
    index = ["rank", "epoch"] if frame["rank"].nunique() > 1 else ["epoch"]
    grid = frame.pivot_table(index=index, columns="column", values="cell", aggfunc="first", sort=False)
    grid = grid[[f"mb {mb}" for mb in sorted(minibatch_table["minibatch"].unique())]]
    grid.columns.name = None
    return grid.reset_index()


def style_minibatch_table(minibatch_table: pd.DataFrame) -> Styler:
    """The long minibatch table, the early-stop row red, rows that never ran grey."""
    styles = minibatch_table["status"].map(
        lambda s: f"background-color: {STATUS_BACKGROUND[s]}" if s in STATUS_BACKGROUND else "")
    return (minibatch_table.style
            .apply(lambda col: styles, axis=0)
            .format({"mean_approx_kl_k2": "{:.4g}", "target_kl": "{:.4g}"}, na_rep=""))


def early_stop_figure(minibatch_table: pd.DataFrame) -> go.Figure:
    """Mean ``approx_kl_k2`` of each (epoch, minibatch) in run order as bars, coloured by status
    (the early stop red; cells that never ran labelled at 0), and ``target_kl`` as a dashed line."""
    if minibatch_table.empty:
        return empty_figure("no minibatch files for this step")
    t = minibatch_table
    labels = [f"e{e} · mb{m}" + (f" · r{r}" if t["rank"].nunique() > 1 else "")
              for e, m, r in zip(t["epoch"], t["minibatch"], t["rank"])]
    fig = go.Figure(go.Bar(
        x=labels, y=t["mean_approx_kl_k2"].fillna(0).tolist(),
        marker={"color": [STATUS_COLOUR[s] for s in t["status"]]},
        text=t["status"].tolist(), textposition="outside", name="mean approx_kl_k2",
        customdata=t["rows"].tolist(),
        hovertemplate="%{x}<br>mean approx_kl_k2=%{y:.4g} nats<br>%{text} · %{customdata} rows<extra></extra>"))
    targets = t["target_kl"].dropna().unique()
    if len(targets):
        fig.add_hline(y=float(targets[0]), line_dash="dash", line_color="#d62728",
                      annotation_text=f"target_kl {float(targets[0]):.4g}", annotation_position="top left")
    fig.update_layout(height=340, margin={"t": 30, "b": 40}, yaxis_title="mean approx_kl_k2 (nats)",
                      xaxis_title="epoch · minibatch (run order)")
    return fig
