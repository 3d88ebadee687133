"""The Mismatch page's pieces: cached tables from :mod:`tracer.views.mismatch` and pure Plotly
figure builders. No RL maths here: the values come from the views as recorded (or as
:mod:`tracer.formulas` reduced them); these functions only lay them out."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from app.components.figures import TOP_LEGEND, empty_figure, integer_ticks, top_margin
from app.components.token_table import hover_tokens, visible_tokens
from tracer.views import mismatch as views

WORST_COLUMNS = ("sequence", "token", "token_text", "trainer_logprob", "sampler_logprob", "log_diff", "prob_diff",
                 "entropy", "raw_ratio", "is_weight", "cut", "policy_lag")
ROW_COLUMNS = ("sequence", "tokens", "policy_lag", "raw_sequence_ratio", "is_weight", "cut")
CUT_COLOUR, KEPT_COLOUR = "#d62728", "#1f77b4"


@st.cache_data(max_entries=32, show_spinner=False)
def tokens(trace_path: str, step_path: str, identity: tuple) -> pd.DataFrame:
    """:func:`tracer.views.mismatch.mismatch_tokens` of one step file (cached by the file's identity: path, inode, size, mtime)."""
    from app.components import trace_cache

    trace = trace_cache.open_trace(trace_path)
    frame = views.mismatch_tokens(trace, trace_cache.step_key(trace, step_path))
    frame.attrs = dict(frame.attrs)
    return frame


@st.cache_data(max_entries=8, show_spinner=False)
def steps(trace_path: str, step_files: tuple[str, ...]) -> pd.DataFrame:
    """:func:`tracer.views.mismatch.mismatch_steps` over the named step files (cached by their names)."""
    from app.components import trace_cache

    trace = trace_cache.open_trace(trace_path)
    keys = [k for k in trace.steps() if k.path.name in set(step_files)]
    return views.mismatch_steps(trace, keys)


def worst_tokens(frame: pd.DataFrame, n: int = 20) -> pd.DataFrame:
    """The ``n`` kept tokens with the largest ``|trainer - sampler|``, largest first; ``token_text``
    through ``token_table.visible_tokens`` (a space token reads ``␣``)."""
    if frame.empty:
        return frame.reindex(columns=list(WORST_COLUMNS))
    worst = frame.sort_values("abs_log_diff", ascending=False, kind="stable").head(n)
    return visible_tokens(worst[[c for c in WORST_COLUMNS if c in worst]].reset_index(drop=True))


def histogram_figure(values: pd.Series, title: str, x_title: str) -> go.Figure:
    """Histogram of ``values`` with a dashed line at 0."""
    values = values.dropna()
    if values.empty:
        return empty_figure("no values")
    fig = go.Figure(go.Histogram(x=values.tolist(), nbinsx=40, marker={"color": KEPT_COLOUR}, name=title))
    fig.add_vline(x=0, line_dash="dash", line_color="grey")
    fig.update_layout(title=title, height=300, margin={"t": 40, "b": 40}, bargap=0.05, showlegend=False)
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text="tokens")
    return fig


def scatter_figure(frame: pd.DataFrame, x: str, x_title: str, title: str) -> go.Figure:
    """``log_diff`` (trainer - sampler) of every kept token against column ``x``; tokens whose
    importance weight the cap cut in red. Hover: sequence, position, token text."""
    rows = frame[frame[x].notna()] if x in frame else frame.iloc[0:0]
    if rows.empty:
        return empty_figure(f"no {x} recorded")
    fig = go.Figure()
    for cut, colour, name in ((False, KEPT_COLOUR, "kept by the cap"), (True, CUT_COLOUR, "cut by the cap")):
        part = rows[rows["cut"] == cut]
        if part.empty:
            continue
        custom = list(zip(part["sequence"], part["token"], hover_tokens(part["token_text"])))
        fig.add_trace(go.Scatter(
            x=part[x].tolist(), y=part["log_diff"].tolist(), mode="markers", name=name,
            marker={"size": 6, "color": colour, "opacity": 0.7}, customdata=custom,
            hovertemplate=("trainer − sampler %{y:.4g} nats<br>" + x + " %{x:.4g}<br>sequence %{customdata[0]}, "
                           "token %{customdata[1]} · %{customdata[2]}<extra></extra>")))
    fig.add_hline(y=0, line_dash="dash", line_color="grey")
    fig.update_layout(title=title, height=320, margin={"t": 40, "b": 40}, legend={"orientation": "h", "y": -0.25})
    fig.update_xaxes(title_text=x_title)
    if x == "token":  # a position in the completion: whole numbers
        integer_ticks(fig, rows[x].tolist())
    fig.update_yaxes(title_text="trainer − sampler (nats)")
    return fig


def cut_tokens(frame: pd.DataFrame, n: int = 50) -> pd.DataFrame:
    """The kept tokens the importance-sampling correction truncated or masked (``cut``), the largest raw
    ratio's distance from 1 first (at most ``n``): what the cap did to each, raw ratio against weight applied."""
    if frame.empty or not frame["cut"].any():
        return frame.iloc[0:0].reindex(columns=list(WORST_COLUMNS))
    cut = frame[frame["cut"]]
    order = (cut["raw_sequence_ratio"].fillna(cut["raw_ratio"]) - 1.0).abs().sort_values(ascending=False, kind="stable")
    return visible_tokens(cut.loc[order.index[:n], [c for c in WORST_COLUMNS if c in cut]].reset_index(drop=True))


def rows_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per sequence of the step with :data:`ROW_COLUMNS`: its kept tokens, its policy lag, its raw
    sequence ratio (sequence modes), the weight applied to it (sequence modes; else its tokens' mean)
    and whether the correction cut it (sequence modes) or any of its tokens."""
    if frame.empty:
        return pd.DataFrame(columns=list(ROW_COLUMNS))
    grouped = frame.groupby("sequence", sort=True)
    table = pd.DataFrame({"tokens": grouped.size(), "policy_lag": grouped["policy_lag"].first(),
                          "raw_sequence_ratio": grouped["raw_sequence_ratio"].first(),
                          "is_weight": grouped["is_weight"].mean(), "cut": grouped["cut"].any()})
    return table.reset_index()[list(ROW_COLUMNS)]


def weights_figure(frame: pd.DataFrame) -> go.Figure:
    """Raw ratio before any cap (per token, or per sequence in sequence modes) against the weight
    applied, one point per token or sequence; those the correction cut in red, the line weight = raw
    ratio dashed (an uncut point lies on it)."""
    rows = frame[frame["is_weight"].notna()]
    if rows.empty:
        return empty_figure("no importance-sampling weights recorded or declared")
    sequence_mode = bool(rows["raw_sequence_ratio"].notna().any())
    if sequence_mode:
        rows = rows.drop_duplicates("sequence")
    x_column = "raw_sequence_ratio" if sequence_mode else "raw_ratio"
    fig = go.Figure()
    for cut, colour, name in ((False, KEPT_COLOUR, "as raw"), (True, CUT_COLOUR, "truncated or masked")):
        part = rows[rows["cut"] == cut]
        if part.empty:
            continue
        custom = list(zip(part["sequence"], part["token"], hover_tokens(part["token_text"])))
        fig.add_trace(go.Scatter(
            x=part[x_column].tolist(), y=part["is_weight"].tolist(), mode="markers", name=name,
            marker={"size": 7, "color": colour, "opacity": 0.75}, customdata=custom,
            hovertemplate=("raw ratio %{x:.4g} → weight %{y:.4g}<br>sequence %{customdata[0]}"
                           + ("" if sequence_mode else ", token %{customdata[1]} · %{customdata[2]}")
                           + "<extra></extra>")))
    low, high = float(rows[x_column].min()), float(rows[x_column].max())
    fig.add_trace(go.Scatter(x=[low, high], y=[low, high], mode="lines", name="weight = raw ratio",
                             line={"dash": "dash", "color": "grey"}, hoverinfo="skip"))
    unit = "sequence" if sequence_mode else "token"
    fig.update_layout(title=f"importance weight applied against the raw ratio (per {unit})", height=340,
                      margin={"t": 40, "b": 40}, legend={"orientation": "h", "y": -0.25})
    fig.update_xaxes(title_text="raw ratio exp(trainer − sampler), before any cap")
    fig.update_yaxes(title_text="weight applied")
    return fig


# Panels of the over-steps figure: (title with its unit, y-axis title, [(summary column, line name)]).
STEP_PANELS = (
    ("log space: |trainer − sampler| (nats)", "nats",
     (("mean_abs", "mean |trainer − sampler|"), ("max_abs", "max |trainer − sampler|"))),
    ("probability space: |p_trainer − p_sampler| (probability)", "probability",
     (("prob_diff_mean", "mean |p_trainer − p_sampler|"),)),
)


# shown only when some step has them: the share the correction cut and the policy lag
OPTIONAL_PANELS = (
    ("importance sampling: share cut by the correction", "share", (("cut_share", "share truncated or masked"),)),
    ("policy lag (updates)", "updates", (("mean_lag", "mean lag"), ("max_lag", "max lag"))),
)


def steps_figure(summary: pd.DataFrame) -> go.Figure:
    """Over the optimizer steps, one panel per unit: mean and max ``|trainer − sampler|`` in nats
    (log space), mean ``|p_trainer − p_sampler|`` (a probability), and, when recorded, the share of
    tokens or sequences the importance-sampling correction cut and the mean / max policy lag; one point
    per step file, the steps on whole-number ticks."""
    if summary.empty:
        return empty_figure("no step file with sampler logprobs")
    panels = list(STEP_PANELS) + [p for p in OPTIONAL_PANELS
                                  if any(c in summary and summary[c].notna().any() for c, _ in p[2])]
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.4 / len(panels),
                        subplot_titles=[title for title, _, _ in panels])
    for row, (_, unit, lines) in enumerate(panels, start=1):
        for column, name in lines:
            fig.add_trace(go.Scatter(x=summary["step"].tolist(), y=summary[column].tolist(), mode="lines+markers",
                                     name=name, hovertemplate=f"{name}=%{{y:.4g}} {unit}<br>step %{{x}}<extra></extra>"),
                          row=row, col=1)
        fig.update_yaxes(title_text=unit, rangemode="tozero", row=row, col=1)
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    integer_ticks(fig, summary["step"].tolist())
    fig.update_layout(height=240 * len(panels), margin={"t": top_margin(fig), "b": 40}, legend=TOP_LEGEND)
    return fig


def settings_text(settings: dict) -> str:
    """One line of the engine and correction settings (``key = value · ...``), or a note when none."""
    if not settings:
        return "no sampler or importance-sampling settings recorded"
    return " · ".join(f"{k} = {v}" for k, v in settings.items())
