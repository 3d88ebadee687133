"""The Step page's table, heatmap and histograms, built by pure functions from
``tracer.views.step.step_token_frame`` (one row per completion position of a step). No Streamlit.

Large steps stay responsive: the table is filtered and sorted here and shown one page at a time,
the heatmap bins positions (and rows) to at most :data:`MAX_HEATMAP_COLUMNS` x
:data:`MAX_HEATMAP_ROWS` cells keeping in each bin the value farthest from neutral (a bad token is
never averaged away), and the histograms send bin counts, not values.
"""

from __future__ import annotations

import html
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.components.colour_scale import plotly_colorscale, scale_ends
from app.components.figures import empty_figure, integer_ticks
from app.components.token_table import hover_tokens
from tracer.views.step import QUANTITIES, neutral

MAX_HEATMAP_COLUMNS = 512
MAX_HEATMAP_ROWS = 512
HISTOGRAM_BINS = 60
# Masked cells of the heatmap: a mid grey, a colour the diverging scale (blue - white - red) never takes.
MASKED_CELL_COLOUR = "#a6a6a6"
MAX_TURN_LABELS = 2_000  # turn labels drawn on the heatmap at most (more: none, the hover still says)
FARTHEST, LARGEST, SMALLEST = "farthest from neutral", "largest first", "smallest first"
ORDERS = (FARTHEST, LARGEST, SMALLEST)
# Histogram panels: (column, title, neutral line).
HISTOGRAMS = (("ratio", "ratio (kept tokens); band: clip range", 1.0),
              ("ref_kl_k3", "ref KL k3 (nats)", 0.0),
              ("old_minus_sampler", "mismatch: old − sampler (nats)", 0.0),
              ("advantages", "advantage", 0.0))


# Short column headers of the step table (the full label is the column's help).
SHORT: dict[str, str] = {"abs_policy_old": "|policy−old|", "ratio": "ratio", "ref_kl_k3": "k3", "approx_kl_k2": "k2",
                         "abs_old_sampler": "|old−sampler|", "advantages": "advantage", "entropy": "entropy",
                         "loss_share": "loss share"}


def short_label(quantity: str, derived: list[str] | tuple = ()) -> str:
    """The quantity's column header, ``*`` appended when the reader derived it."""
    return SHORT.get(quantity, quantity) + ("*" if quantity in derived else "")


def label(quantity: str, derived: list[str] | tuple = ()) -> str:
    """The quantity's label, ``(derived)`` appended when the reader derived it."""
    text = QUANTITIES.get(quantity, (quantity, 0.0))[0]
    return f"{text} (derived)" if quantity in derived else text


def filter_sort(frame: pd.DataFrame, quantity: str, order: str = FARTHEST, kept_only: bool = True,
                threshold: float = 0.0) -> pd.DataFrame:
    """The rows to list: kept ones (unless ``kept_only`` is False) whose ``quantity`` is a number at
    least ``threshold`` from its neutral value, sorted by ``order`` (stable, ties in file order)."""
    rows = frame[frame["kept"].astype(bool)] if kept_only and "kept" in frame else frame
    if quantity not in rows:
        return rows.iloc[0:0]
    values = rows[quantity]
    distance = (values - neutral(quantity)).abs()
    rows = rows[values.notna() & (distance >= threshold)]
    if order == FARTHEST:
        key = (rows[quantity] - neutral(quantity)).abs()
        return rows.loc[key.sort_values(ascending=False, kind="stable").index]
    return rows.sort_values(quantity, ascending=order == SMALLEST, kind="stable")


def page_of(rows: pd.DataFrame, page: int, size: int) -> pd.DataFrame:
    """Rows ``page * size`` to ``(page + 1) * size`` (page counted from 0)."""
    return rows.iloc[page * size:(page + 1) * size]


def row_labels(frame: pd.DataFrame) -> pd.Series:
    """One label per row of the step (``r0 mb0 seq 3``; ``seq 3`` with one rank and micro-batch)."""
    several = frame[["rank", "micro_batch"]].drop_duplicates().shape[0] > 1
    if several:
        return "r" + frame["rank"].astype(str) + " mb" + frame["micro_batch"].astype(str) + " seq " + \
            frame["sequence"].astype(str)
    return "seq " + frame["sequence"].astype(str)


def heatmap_matrix(frame: pd.DataFrame, quantity: str, max_cols: int = MAX_HEATMAP_COLUMNS,
                   max_rows: int = MAX_HEATMAP_ROWS) -> tuple[np.ndarray, list[str], np.ndarray, int, int]:
    """``(z, row names, first position of each column, positions per column, rows per row)``.

    ``z[r, c]`` is ``quantity`` at kept positions, NaN where masked (:func:`masked_cells`). Past
    ``max_cols`` positions (``max_rows`` rows) neighbours are binned; a bin shows its value
    farthest from neutral.
    """
    labels = row_labels(frame)
    order = pd.unique(labels)
    row = pd.Categorical(labels, categories=order).codes
    T = int(frame["position"].max()) + 1
    z = np.full((len(order), T), np.nan)
    values = frame[quantity].to_numpy(dtype=float, na_value=np.nan)
    keep = frame["kept"].to_numpy(dtype=bool)
    z[row[keep], frame["position"].to_numpy()[keep]] = values[keep]
    col_w = max(1, math.ceil(T / max_cols))
    row_w = max(1, math.ceil(len(order) / max_rows))
    z = _bin(_bin(z, col_w, neutral(quantity)).T, row_w, neutral(quantity)).T
    names = [str(order[i]) + (f" … +{row_w - 1}" if row_w > 1 else "") for i in range(0, len(order), row_w)]
    return z, names, np.arange(0, T, col_w), col_w, row_w


def masked_cells(frame: pd.DataFrame, max_cols: int = MAX_HEATMAP_COLUMNS,
                 max_rows: int = MAX_HEATMAP_ROWS) -> np.ndarray:
    """Boolean ``[rows, columns]`` on the grid of :func:`heatmap_matrix`: True where the cell holds
    positions of the step that are all masked (not in the loss); False where one of them is kept, or
    where the row has no such position at all (a row shorter than the step's longest)."""
    labels = row_labels(frame)
    order = pd.unique(labels)
    row = pd.Categorical(labels, categories=order).codes
    T = int(frame["position"].max()) + 1
    present = np.zeros((len(order), T), dtype=bool)
    kept = np.zeros((len(order), T), dtype=bool)
    positions = frame["position"].to_numpy()
    present[row, positions] = True
    kept[row, positions] = frame["kept"].to_numpy(dtype=bool)
    col_w = max(1, math.ceil(T / max_cols))
    row_w = max(1, math.ceil(len(order) / max_rows))
    return _any(_any(present, col_w).T, row_w).T & ~_any(_any(kept, col_w).T, row_w).T


def cell_tokens(frame: pd.DataFrame) -> np.ndarray:
    """``[rows, positions]`` object array of each cell's token text for the hover (unbinned grid of
    :func:`heatmap_matrix`), HTML-escaped with whitespace markers (``token_table.hover_tokens``)."""
    labels = row_labels(frame)
    order = pd.unique(labels)
    row = pd.Categorical(labels, categories=order).codes
    cells = np.full((len(order), int(frame["position"].max()) + 1), "", dtype=object)
    cells[row, frame["position"].to_numpy()] = hover_tokens(frame["token_text"])
    return cells


def _any(cells: np.ndarray, width: int) -> np.ndarray:
    """Columns of boolean ``cells`` grouped by ``width``: True where any of the group is."""
    if width == 1:
        return cells
    R, T = cells.shape
    n = math.ceil(T / width)
    padded = np.zeros((R, n * width), dtype=bool)
    padded[:, :T] = cells
    return padded.reshape(R, n, width).any(axis=2)


def _bin(z: np.ndarray, width: int, centre: float) -> np.ndarray:
    """Columns of ``z`` grouped by ``width``; each group keeps its value farthest from ``centre``."""
    if width == 1:
        return z
    R, T = z.shape
    n = math.ceil(T / width)
    padded = np.full((R, n * width), np.nan)
    padded[:, :T] = z
    blocks = padded.reshape(R, n, width)
    distance = np.where(np.isnan(blocks), -1.0, np.abs(blocks - centre))
    pick = distance.argmax(axis=2)
    return np.take_along_axis(blocks, pick[..., None], axis=2)[..., 0]


def scale_span(values: np.ndarray | pd.Series, centre: float) -> float:
    """Half-width of a colour scale centred on ``centre``: the 99th percentile of |x − centre| over
    the finite values (one outlier does not wash out the rest), at least 1e-6."""
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    if arr.size == 0:
        return 1.0
    return float(max(np.percentile(np.abs(arr - centre), 99), 1e-6))


def heatmap_figure(frame: pd.DataFrame, quantity: str, derived: list[str] | tuple = ()) -> go.Figure:
    """Sequence x position heatmap of ``quantity``: masked cells grey (:data:`MASKED_CELL_COLOUR`, a
    trace of their own after the values, on cells that have none: never a colour of the scale), cells
    a row does not have blank, hover naming each cell's token (unbinned), a diverging scale centred
    on the neutral value (1 for the ratio, 0 for KL and advantage), its colour axis cut to the values
    the quantity can take (from 0 for k3, k2, |differences|, entropy and the ratio;
    :func:`app.components.colour_scale.scale_ends`), symmetric for signed ones (advantage). A
    multi-turn step has its turns labelled (:func:`turn_labels`)."""
    if frame.empty or quantity not in frame or not frame.loc[frame["kept"].astype(bool), quantity].notna().any():
        return empty_figure(f"no kept token has {quantity}")
    z, names, starts, col_w, row_w = heatmap_matrix(frame, quantity)
    centre = neutral(quantity)
    span = scale_span(z, centre)
    hover = ("%{y} · position %{x}" + (f"–%{{x}}+{col_w - 1}" if col_w > 1 else "") +
             f"<br>{label(quantity, derived)} = %{{z:.4g}}<extra></extra>")
    low, high = scale_ends(quantity, centre, span)
    masked = masked_cells(frame)
    fig = go.Figure()
    texts = cell_tokens(frame) if col_w == 1 and row_w == 1 and "token_text" in frame else None
    if texts is not None:  # each row's own tokens: the axis can only show positions
        hover = hover.replace("<extra>", "<br>token %{customdata}<extra>")
    fig.add_trace(go.Heatmap(z=z, x=starts, y=names, colorscale=plotly_colorscale(low, high, centre, span),
                             zmin=low, zmax=high, hovertemplate=hover, hoverongaps=False, name=quantity,
                             customdata=texts, colorbar={"title": {"text": quantity}}))
    # masked cells are a grey layer of their own (blank, they looked like a value at the neutral colour,
    # the scale's white: a k3 of 0 and a padding position read the same); the two layers never share a cell
    fig.add_trace(go.Heatmap(z=np.where(masked, 1.0, np.nan), x=starts, y=names, name="masked", showscale=False,
                             colorscale=[[0.0, MASKED_CELL_COLOUR], [1.0, MASKED_CELL_COLOUR]], zmin=0, zmax=1,
                             hoverongaps=False, hovertemplate="%{y} · position %{x}" + (
                                 f"–%{{x}}+{col_w - 1}" if col_w > 1 else "") + "<br>masked: not in the loss"
                             "<extra></extra>"))
    fig.update_yaxes(autorange="reversed", title_text="sequence", type="category")
    fig.update_xaxes(title_text="completion position" + (f" (bins of {col_w})" if col_w > 1 else ""))
    integer_ticks(fig, list(starts), axis="x")
    if row_w == 1:
        labels = turn_labels(frame, col_w)
        if labels is not None:
            fig.add_trace(labels)
    fig.update_layout(height=min(900, 160 + 16 * len(names)), margin={"t": 30, "b": 40},
                      plot_bgcolor="#ffffff", showlegend=False)
    return fig


def turn_labels(frame: pd.DataFrame, col_w: int = 1) -> go.Scatter | None:
    """Text marks ``T1``, ``T2``… at the first position of each assistant turn of each row of a
    multi-turn step (``turn`` and ``role`` columns of ``step_token_frame``), hover naming the
    turn's span and its roles (``turn 2 · positions 13–15 · assistant, tool``); None for single-turn
    steps or past :data:`MAX_TURN_LABELS` turns. ``col_w``: the heatmap's positions per column."""
    if "turn" not in frame or frame.empty or frame["turn"].max() <= 1:
        return None
    rows = frame[frame["turn"] > 0]
    names = row_labels(rows)
    spans = (rows.assign(_row=names).groupby(["_row", "turn"], sort=False)
             .agg(first=("position", "min"), last=("position", "max"),
                  roles=("role", lambda r: ", ".join(dict.fromkeys(str(x) for x in r if x)))).reset_index())
    if len(spans) > MAX_TURN_LABELS:
        return None
    hover = [html.escape(f"{row} · turn {turn} · positions {first}–{last}" + (f" · {roles}" if roles else ""))
             for row, turn, first, last, roles in spans[["_row", "turn", "first", "last", "roles"]].itertuples(
                 index=False)]
    return go.Scatter(x=(spans["first"] // col_w * col_w).to_numpy(), y=spans["_row"].to_numpy(), mode="text",
                      text=[f"T{t}" for t in spans["turn"]], textposition="middle right",
                      textfont={"size": 10, "color": "#333"}, hovertext=hover, hoverinfo="text", name="turns")


def histograms_figure(frame: pd.DataFrame, clip: tuple[float, float] | None = None,
                      derived: list[str] | tuple = ()) -> go.Figure:
    """Histograms of ratio (the clip band ``[1 − ε_low, 1 + ε_high]`` shaded), ref KL k3, sampler
    mismatch and advantage over the kept tokens; panels whose quantity is absent are left out."""
    kept = frame[frame["kept"].astype(bool)] if "kept" in frame else frame
    panels = [(c, t, n) for c, t, n in HISTOGRAMS if c in kept and kept[c].notna().any()]
    if not panels:
        return empty_figure("no ratio, k3, sampler logprobs or advantages in this step")
    ncols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / ncols)
    titles = [t + (" (derived)" if c in derived else "") for c, t, _ in panels]
    fig = make_subplots(rows=nrows, cols=ncols, subplot_titles=titles, vertical_spacing=0.18)
    for i, (column, _, centre) in enumerate(panels):
        r, c = i // ncols + 1, i % ncols + 1
        values = kept[column].dropna().to_numpy(dtype=float)
        values = values[np.isfinite(values)]
        counts, edges = np.histogram(values, bins=HISTOGRAM_BINS) if values.size else (np.array([]), np.array([0, 1]))
        fig.add_trace(go.Bar(x=(edges[:-1] + edges[1:]) / 2, y=counts, width=np.diff(edges), name=column,
                             showlegend=False, marker={"color": "#4c78a8"},
                             hovertemplate=f"{column} %{{x:.4g}}<br>%{{y}} tokens<extra></extra>"), row=r, col=c)
        if column == "ratio" and clip is not None:
            fig.add_vrect(x0=clip[0], x1=clip[1], fillcolor="rgba(44, 160, 44, 0.15)", line_width=0,
                          layer="below", row=r, col=c)
        fig.add_vline(x=centre, line={"color": "grey", "dash": "dot", "width": 1}, row=r, col=c)
        fig.update_yaxes(title_text="tokens", row=r, col=c)
    fig.update_layout(height=280 * nrows + 60, margin={"t": 40, "b": 30}, bargap=0)
    return fig
