"""Plotly figures of the app, built by pure functions from the reader's pandas tables.

No Streamlit here and no RL maths: the values come from ``tracer.read.reader`` as they were recorded
(or as ``tracer.formulas`` reduced them); these functions only lay them out.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.components.token_table import hover_tokens, visible_token

# Panels of the per-token figure: (title, columns drawn in it).
TOKEN_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("logprobs (nats)", ("old_logprobs", "policy_logprobs", "ref_logprobs", "sampler_logprobs")),
    ("ratio = exp(policy − old)", ("ratio",)),
    ("KL estimators (nats)", ("ref_kl_k3", "approx_kl_k2")),
    ("advantage", ("advantages",)),
)
MASK_FILL = "rgba(120, 120, 120, 0.22)"
# Up to this many positions each line also has a marker per point (its own symbol); past it the
# markers, a few pixels apart, merge into a band, and the browser draws one SVG path per marker
# (7 lines of 256 tokens: ~1,800, most of the chart's drawing time on a step change): lines only,
# told apart by their dashes.
MAX_MARKED_POSITIONS = 64
# Beyond this many masked runs the shading becomes one marker trace (shapes get slow).
MAX_SHADED_RUNS = 64
# Up to this many positions each point's hover names its token (text and mask reason, per line of the
# chart); past it the hover gives position and value only: the token strings repeated on every line made
# a 32,768-token chart 9 MB.
MAX_HOVER_TOKENS = 4096


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
        Subplots sharing x, one line per value column present (dashed differently; with markers
        up to :data:`MAX_MARKED_POSITIONS` positions). Positions that do not enter the
        loss are shaded grey (one rectangle per contiguous run, spanning every panel); past
        :data:`MAX_SHADED_RUNS` runs they are marked by one ``masked`` marker trace instead. The
        x ticks read each token's text over its position (:func:`token_ticks`; past
        :data:`MAX_TOKEN_TICKS` tokens, positions, the text in the hover; past
        :data:`MAX_HOVER_TOKENS`, the hover gives position and value only).
    """
    rows = table[table["section"] == "completion"] if "section" in table else table
    panels = [(title, [c for c in cols if c in rows and rows[c].notna().any()]) for title, cols in TOKEN_PANELS]
    panels = [(title, cols) for title, cols in panels if cols]
    if rows.empty or not panels:
        return empty_figure("no per-token values in this sequence")
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[title for title, _ in panels])
    positions = rows["position"].tolist()
    texts = hover_tokens(rows.get("token_text", pd.Series([""] * len(rows))))
    reasons = rows.get("mask_reason", pd.Series([""] * len(rows))).tolist()
    # numpy arrays, not lists: plotly validates an array at once, a list element by element (8 lines
    # of 256 points: ~4x faster to build)
    named = len(rows) <= MAX_HOVER_TOKENS
    custom = np.array(list(zip(texts, reasons)), dtype=object).reshape(len(rows), 2) if named else None
    x = np.asarray(positions)
    kept = rows["kept"].astype(bool).tolist() if "kept" in rows else [True] * len(rows)
    keep = np.asarray(kept, dtype=bool)
    mode = "lines+markers" if len(rows) <= MAX_MARKED_POSITIONS else "lines"
    for i, (_, cols) in enumerate(panels, start=1):
        for j, col in enumerate(cols):  # masked positions are gaps: their values enter neither loss nor axis range
            if named:
                y = np.where(keep, rows[col].to_numpy(dtype=object, na_value=None), None)
            else:  # float32 with NaN gaps: sent as a binary array, not one JSON number per point
                y = np.where(keep, rows[col].to_numpy(dtype="float32", na_value=np.nan), np.float32("nan"))
            fig.add_trace(go.Scatter(  # a dash and marker per line: one equal to another stays visible
                x=x, y=y,
                mode=mode, name=col, connectgaps=False, line={"dash": DASHES[j % len(DASHES)]},
                marker={"size": 7 - j, "symbol": SYMBOLS[j % len(SYMBOLS)]}, customdata=custom,
                hovertemplate=(f"{col}=%{{y:.4g}}<br>position %{{x}} · token %{{customdata[0]}}"
                               "<br>%{customdata[1]}<extra></extra>" if named else
                               f"{col}=%{{y:.4g}}<br>position %{{x}}<extra></extra>")), row=i, col=1)
    _shade_masked(fig, rows, positions, n_panels=len(panels))
    by_text = token_ticks(fig, positions, rows.get("token_text", pd.Series([""] * len(rows))).tolist())
    fig.update_xaxes(title_text="completion token (position)" if by_text else "completion position",
                     row=len(panels), col=1)
    fig.update_layout(height=220 * len(panels) + 100, margin={"t": top_margin(fig), "b": 40}, legend=TOP_LEGEND)
    return fig


# A horizontal legend at the top of the figure, in the top margin (container coordinates: pixels
# from the figure's edge, not a fraction of the plot's height, which put it onto the subplot titles
# of a short figure): it never covers an axis or subplot title when the margin is top_margin(fig).
TOP_LEGEND = {"orientation": "h", "yref": "container", "yanchor": "top", "y": 1.0, "xanchor": "left", "x": 0}
LEGEND_ROW_PX = 26  # one row of a horizontal legend
SUBPLOT_TITLE_PX = 34  # a subplot title above its panel, with its gap
LEGEND_WIDTH_PX = 620  # the narrowest plot a legend is laid out in (a half-width column)


def top_margin(fig: go.Figure, titles: bool = True) -> int:
    """Pixels of top margin that hold the :data:`TOP_LEGEND` of ``fig`` and, when ``titles``, the
    subplot titles under it: the legend's rows (its entries, about 7 px a character plus 40 px for
    the symbol, wrapped at :data:`LEGEND_WIDTH_PX`) times :data:`LEGEND_ROW_PX`, plus
    :data:`SUBPLOT_TITLE_PX`."""
    names = dict.fromkeys(t.legendgroup or t.name for t in fig.data if t.showlegend is not False and t.name)
    width = sum(40 + 7 * len(str(n)) for n in names)
    rows = max(1, -(-width // LEGEND_WIDTH_PX)) if names else 0
    return 12 + rows * LEGEND_ROW_PX + (SUBPLOT_TITLE_PX if titles else 8)


# Tick labels of a token axis: the token's text over its position, up to this many tokens (more:
# whole-number position ticks, the text in the hover); a longer token is cut to TICK_CHARS characters.
MAX_TOKEN_TICKS = 48
TICK_CHARS = 10


def token_tick_labels(texts, positions) -> list[str]:
    """``token<br>position`` per token: the text as the token views draw it (``token_table.visible_token``:
    ``␣`` for a space), cut to :data:`TICK_CHARS` characters with ``…``, ``<``, ``>`` and ``&``
    HTML-escaped (Plotly renders tick text as HTML: ``<|endoftext|>`` must arrive as
    ``&lt;|endoftext|&gt;``; a quote stays a quote, since Plotly shows ``&quot;`` literally)."""
    out = []
    for text, position in zip(texts, positions):
        shown = str(visible_token(text))
        shown = shown if len(shown) <= TICK_CHARS else shown[:TICK_CHARS - 1] + "…"
        out.append(f"{html.escape(shown, quote=False)}<br>{int(position)}")  # Plotly shows &quot; as it is
    return out


def token_ticks(fig: go.Figure, positions, texts, row: int | None = None, col: int | None = None) -> bool:
    """Label the x axis (of subplot ``row``, every x axis when None) with each token's text over its
    position (:func:`token_tick_labels`) when there are at most :data:`MAX_TOKEN_TICKS` tokens, and
    return True; otherwise whole-number position ticks (:func:`integer_ticks`), and False."""
    positions = list(positions)
    if not positions or len(positions) > MAX_TOKEN_TICKS:
        integer_ticks(fig, positions, axis="x")
        return False
    labels = token_tick_labels(texts, positions)
    if row is None:  # every axis: shared x, only the bottom one shows its labels (as make_subplots set it)
        fig.update_xaxes(tickmode="array", tickvals=positions, ticktext=labels)
    else:  # one panel's own tokens, shown under it
        fig.update_xaxes(tickmode="array", tickvals=positions, ticktext=labels, showticklabels=True, row=row, col=col)
    return True


def integer_ticks(fig: go.Figure, values, axis: str = "x") -> None:
    """Ticks at whole numbers only (steps, positions): a spacing of 1, 2, 5, 10… giving at most
    about 12 ticks over ``values``."""
    values = [v for v in values if v is not None and v == v]
    width = (max(values) - min(values)) if values else 1
    exponents = range(0, len(str(int(width))) + 1)  # 10 ** len(digits) > width: always found (any step number)
    dtick = next(d * 10 ** e for e in exponents for d in (1, 2, 5) if width / (d * 10 ** e) <= 12)
    update = fig.update_xaxes if axis == "x" else fig.update_yaxes
    update(tick0=0, dtick=dtick, tickformat="d")


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
    # one rect per run and panel, added in one layout update (add_vrect(row="all") works out each
    # subplot's axes again for every run: ~40% of this figure's build time on a 256-token sequence)
    panels = fig.select_xaxes() if row == "all" else [fig.get_subplot(row, 1).xaxis]
    refs = [("x" + axis.plotly_name[len("xaxis"):], f"{axis.anchor} domain") for axis in panels]
    fig.update_layout(shapes=[*fig.layout.shapes, *(
        {"type": "rect", "xref": xref, "yref": yref, "x0": first - 0.5, "x1": last + 0.5, "y0": 0, "y1": 1,
         "fillcolor": MASK_FILL, "line": {"width": 0}, "layer": "below"}
        for first, last in runs for xref, yref in refs)])


WEBGL_POINTS = 2000  # step curves longer than this are drawn with WebGL (Scattergl): SVG markers are slow
STEP_TABLE_ROWS = 2000  # the Steps page sends a longer per-step table to the browser only when asked
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
SYMBOLS = ("circle", "diamond", "square", "triangle-up", "x", "star")

