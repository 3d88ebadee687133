"""Plotly figures of the app, built by pure functions from the reader's pandas tables.

No Streamlit here and no RL maths: the values come from ``tracer.reader`` as they were recorded
(or as ``tracer.formulas`` reduced them); these functions only lay them out.
"""

from __future__ import annotations

import html

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

# Panels of the per-token figure: (title, columns drawn in it).
TOKEN_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("logprobs (nats)", ("old_logprobs", "policy_logprobs", "ref_logprobs", "sampler_logprobs")),
    ("ratio = exp(policy − old)", ("ratio",)),
    ("KL estimators (nats)", ("ref_kl_k3", "approx_kl_k2")),
    ("advantage", ("advantages",)),
)
# Panels of the per-step figure: (summary column, title).
STEP_PANELS: tuple[tuple[str, str], ...] = (
    ("mean_ratio", "mean ratio"),
    ("mean_ref_kl_k3", "mean ref KL (k3, nats)"),
    ("mean_reward", "mean reward"),
    ("clip_fraction", "clip fraction"),
)
MASK_FILL = "rgba(120, 120, 120, 0.22)"
# Beyond this many masked runs the shading becomes one marker trace (shapes get slow).
MAX_SHADED_RUNS = 64


def masked_runs(positions: list[int], kept: list[bool]) -> list[tuple[int, int]]:
    """Contiguous ``(first, last)`` position runs where ``kept`` is False."""
    runs: list[tuple[int, int]] = []
    for pos, keep in zip(positions, kept):
        if keep:
            continue
        if runs and runs[-1][1] == pos - 1:
            runs[-1] = (runs[-1][0], pos)
        else:
            runs.append((pos, pos))
    return runs


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def token_values_figure(table: pd.DataFrame) -> go.Figure:
    """Per-token values of one sequence against completion position, one panel per kind.

    Args:
        table: ``Trace.token_table(key, sequence)`` (prompt rows are ignored) or any frame with
            ``position``, ``kept`` and some of the value columns of :data:`TOKEN_PANELS`.

    Returns:
        Subplots sharing x, one line per value column present. Positions that do not enter the
        loss are shaded grey (one rectangle per contiguous run, spanning every panel); past
        :data:`MAX_SHADED_RUNS` runs they are marked by one ``masked`` marker trace instead.
    """
    rows = table[table["section"] == "completion"] if "section" in table else table
    panels = [(title, [c for c in cols if c in rows and rows[c].notna().any()]) for title, cols in TOKEN_PANELS]
    panels = [(title, cols) for title, cols in panels if cols]
    if rows.empty or not panels:
        return empty_figure("no per-token values in this sequence")
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[title for title, _ in panels])
    positions = rows["position"].tolist()
    texts = [html.escape(str(t)) for t in rows.get("token_text", pd.Series([""] * len(rows)))]
    reasons = rows.get("mask_reason", pd.Series([""] * len(rows))).tolist()
    custom = list(zip(texts, reasons))
    for i, (_, cols) in enumerate(panels, start=1):
        for col in cols:
            fig.add_trace(go.Scatter(
                x=positions, y=rows[col].tolist(), mode="lines+markers", name=col,
                marker={"size": 4}, customdata=custom,
                hovertemplate=(f"{col}=%{{y:.4g}}<br>position %{{x}} · token %{{customdata[0]}}"
                               "<br>%{customdata[1]}<extra></extra>")), row=i, col=1)
    _shade_masked(fig, rows, positions, n_panels=len(panels))
    fig.update_xaxes(title_text="completion position", row=len(panels), col=1)
    fig.update_layout(height=220 * len(panels) + 80, margin={"t": 40, "b": 40},
                      legend={"orientation": "h", "y": -0.08})
    return fig


def _shade_masked(fig: go.Figure, rows: pd.DataFrame, positions: list[int], n_panels: int) -> None:
    kept = rows["kept"].astype(bool).tolist() if "kept" in rows else [True] * len(positions)
    shade_masked(fig, positions, kept)


def shade_masked(fig: go.Figure, positions: list[int], kept: list[bool], row: int | str = "all") -> None:
    """Shade the positions that do not enter the loss on subplot ``row`` (every row by default):
    one grey rectangle per contiguous run, or one ``masked`` marker trace past
    :data:`MAX_SHADED_RUNS` runs. ``fig`` must come from ``make_subplots``."""
    runs = masked_runs(positions, kept)
    if len(runs) > MAX_SHADED_RUNS:
        masked_x = [p for p, k in zip(positions, kept) if not k]
        fig.add_trace(go.Scatter(x=masked_x, y=[0] * len(masked_x), mode="markers", name="masked",
                                 marker={"symbol": "x", "color": "grey", "size": 5}),
                      row=1 if row == "all" else row, col=1)
        return
    for first, last in runs:
        fig.add_vrect(x0=first - 0.5, x1=last + 0.5, fillcolor=MASK_FILL, line_width=0, layer="below",
                      row=row, col=1)


def step_curves_figure(summary: pd.DataFrame) -> go.Figure:
    """Per-step curves from ``Trace.step_summary()``: mean ratio, mean ref KL (k3), mean reward
    and clip fraction against step, one line per inner step (colour shared across panels), and
    per (inner step, rank) when the summary holds several ranks (``inner step 0 · rank 1``).

    Step files of the same line and step from several micro-batches are shown as the plain mean of
    their per-file values (the hover says how many files). Panels whose column is absent or all
    NaN are left out.
    """
    if summary.empty or "step" not in summary:
        return empty_figure("no steps in this trace yet")
    panels = [(col, title) for col, title in STEP_PANELS if col in summary and summary[col].notna().any()]
    if not panels:
        return empty_figure("the steps record none of ratio, ref_kl_k3, rewards, clip fraction")
    ncols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + ncols - 1) // ncols
    fig = make_subplots(rows=nrows, cols=ncols, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=[title for _, title in panels])
    frame = summary.assign(inner_step=summary["inner_step"] if "inner_step" in summary else 0,
                           rank=summary["rank"] if "rank" in summary else 0)
    per_rank = frame["rank"].nunique() > 1
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    for n, ((inner_step, rank), group) in enumerate(frame.groupby(["inner_step", "rank"] if per_rank
                                                                  else ["inner_step", lambda _: 0])):
        agg = group.groupby("step").agg(
            **{col: (col, "mean") for col, _ in panels}, files=("step", "size")).reset_index()
        name = f"inner step {inner_step}" + (f" · rank {rank}" if per_rank else "")
        colour = palette[n % len(palette)]
        for i, (col, title) in enumerate(panels):
            fig.add_trace(go.Scatter(
                x=agg["step"], y=agg[col], mode="lines+markers", name=name,
                legendgroup=name, showlegend=i == 0, line={"color": colour},
                customdata=agg["files"],
                hovertemplate=(f"{title}=%{{y:.4g}}<br>step %{{x}} · {name}"
                               "<br>%{customdata} file(s)<extra></extra>")),
                row=i // ncols + 1, col=i % ncols + 1)
    for c in range(1, ncols + 1):
        fig.update_xaxes(title_text="step", row=nrows, col=c)
    fig.update_layout(height=300 * nrows + 80, margin={"t": 40, "b": 40})
    return fig
