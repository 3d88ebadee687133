"""The Steps page's figure: any per-step column of the summary (``Trace.step_summary()``, or
``views.dpo_step_summary`` for DPO) as one panel each, for one run or several overlaid, with
exponential-moving-average smoothing, a log y-axis per panel and the step or the wall-clock time
on the x-axis.

Pure functions of pandas frames (no Streamlit, no RL maths): the values are those the reader
summarised; this module only chooses, smooths and lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.components.figures import (
    DASHES,
    PALETTE,
    SYMBOLS,
    TOP_LEGEND,
    WEBGL_POINTS,
    empty_figure,
    integer_ticks,
)
from tracer.read.overview import scalar_columns

# The panels a run opens with: what the Steps page always showed.
DEFAULT_COLUMNS = ("mean_ratio", "mean_ref_kl_k3", "mean_reward", "clip_fraction")
DPO_DEFAULT_COLUMNS = ("margin", "preference_accuracy", "mean_dpo_loss", "mean_chosen_logps", "mean_rejected_logps")
# Panel titles of the columns whose name alone does not say the unit or the estimator.
TITLES = {
    "mean_ratio": "mean ratio", "mean_ref_kl_k3": "mean ref KL (k3, nats)", "mean_reward": "mean reward",
    "clip_fraction": "clip fraction", "mean_approx_kl_k2": "mean approx KL (k2, nats)",
    "mean_entropy": "mean entropy (nats)", "mean_length": "mean response length (tokens)",
    "kept_tokens": "kept tokens", "mean_mismatch": "mean old − sampler logprob (nats)", "mean_advantage": "mean advantage", "loss": "loss",
    "margin": "margin (chosen − rejected reward)", "preference_accuracy": "preference accuracy",
    "mean_dpo_loss": "DPO loss", "mean_chosen_logps": "chosen logp (policy, summed, nats)",
    "mean_rejected_logps": "rejected logp (policy, summed, nats)",
}
# x-axis choices (the URL's ``x``): the step, the time of day, the time since the run's first step.
X_AXES = {"step": "step", "wall_time": "wall-clock time", "relative_time": "time since the run's first step"}
RAW_OPACITY = 0.25  # the unsmoothed line under a smoothed one (as TensorBoard draws it)


def title_of(column: str) -> str:
    """The panel title of a per-step column: :data:`TITLES`, else the column's own name."""
    return TITLES.get(column, column)


def default_columns(frame: pd.DataFrame, algorithm: str | None) -> list[str]:
    """The panels a run opens with (:data:`DEFAULT_COLUMNS`, :data:`DPO_DEFAULT_COLUMNS`) that
    ``frame`` holds values of; the first plottable column when it holds none of them."""
    wanted = DPO_DEFAULT_COLUMNS if algorithm == "dpo" else DEFAULT_COLUMNS
    present = [c for c in wanted if c in frame and frame[c].notna().any()]
    return present or scalar_columns(frame)[:1]


def smooth(values, weight: float) -> np.ndarray:
    """Exponential moving average of ``values`` (float ``[N]``, in step order) with the debiasing
    that TensorBoard applies (and W&B's "Exponential Moving Average - Tensorboard"): ``last =
    weight * last + (1 - weight) * value`` from ``last = 0``, shown as ``last / (1 - weight ** n)``
    after ``n`` finite values, so that the first points are not pulled towards 0. Non-finite values
    are skipped and stay as they are; a constant series is returned as it is (as TensorBoard does).
    Source: TensorBoard's ``classicSmoothing``
    (``tensorboard/webapp/widgets/line_chart_v2/data_transformer.ts``). The same weighted mean,
    ``sum_i weight**i * value[t-i] / sum_i weight**i``, is ``pandas.Series.ewm(alpha=1 - weight,
    adjust=True)`` over the finite values, which computes it here. ``weight`` in [0, 1): 0 returns
    the values; raises ValueError outside."""
    raw = np.asarray(values, dtype=np.float64)
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight {weight} is outside [0, 1): 0 is no smoothing, 0.99 the most")
    if weight == 0.0 or not len(raw):
        return raw.copy()
    finite = np.isfinite(raw)
    out = raw.copy()
    if np.unique(raw[finite]).size <= 1:  # constant: the EMA would only add rounding
        return out
    out[finite] = pd.Series(raw[finite]).ewm(alpha=1.0 - weight, adjust=True).mean().to_numpy()
    return out


# Summary columns computed from a per-token field; the field the reader may have derived.
def source_field(column: str) -> str | None:
    """The per-token field a summary column is computed from, among those the reader can derive
    (``ratio``, ``ref_kl_k3``, ``approx_kl_k2``: :data:`tracer.formulas.derived.DERIVED_FIELDS`)."""
    if column in ("mean_ratio", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "clip_region") \
            or column.startswith("ratio_"):
        return "ratio"
    for name in ("ref_kl_k3", "approx_kl_k2"):
        if name in column:
            return name
    return None


def derived_fields(frame: pd.DataFrame) -> set[str]:
    """The fields the reader derived in any step file of one run's summary (its ``derived`` column)."""
    texts = frame["derived"].unique() if "derived" in frame else ()  # a few distinct texts
    return {name for text in texts if isinstance(text, str) for name in text.split(", ") if name}


@dataclass
class Layout:
    """What the figure shows, as the page chose it. ``columns``: one panel each; ``smoothing``: EMA
    weight in [0, 1); ``log_columns``: panels asked on a log y-axis; ``x``: a key of :data:`X_AXES`."""

    columns: list[str]
    smoothing: float = 0.0
    log_columns: list[str] = field(default_factory=list)
    x: str = "step"


@dataclass
class Notes:
    """What the figure could not do as asked, in words for the page: ``log`` per refused column, ``x``
    when the wall-clock axis fell back to steps, ``missing`` per run: the chosen columns it lacks."""

    log: dict[str, str] = field(default_factory=dict)
    x: str = ""
    missing: dict[str, list[str]] = field(default_factory=dict)


def log_refusals(runs: dict[str, pd.DataFrame], columns: list[str]) -> dict[str, str]:
    """``{column: why}`` for each of ``columns`` that cannot be drawn on a log axis: some recorded
    value is ≤ 0 (the count, the smallest value and where)."""
    out = {}
    for column in columns:
        parts = [(label, f) for label, f in runs.items() if column in f and f[column].notna().any()]
        if not parts:
            continue
        values = pd.concat([f[column].astype(np.float64) for _, f in parts])
        values = values[np.isfinite(values)]
        bad = int((values <= 0).sum())
        if not bad:
            continue
        label, frame = min(parts, key=lambda p: np.nanmin(p[1][column].to_numpy(dtype=np.float64, na_value=np.nan)))
        at = frame.loc[frame[column].astype(np.float64).idxmin()]
        where = f"step {int(at['step'])}" + (f", inner step {int(at['inner_step'])}" if "inner_step" in at else "") \
            + (f" of {label}" if len(runs) > 1 else "")
        out[column] = (f"{title_of(column)}: log scale not applied: {bad} of {len(values)} values are ≤ 0 "
                       f"(smallest {float(at[column]):.4g} at {where}).")
    return out


def x_fallback(runs: dict[str, pd.DataFrame], x: str) -> str:
    """Why a wall-clock ``x`` cannot be drawn ('' when it can, or when ``x`` is the step): the runs
    whose summaries carry no ``wall_time`` (traces written before the writer stored it)."""
    if x == "step":
        return ""
    lacking = [label or "this run" for label, f in runs.items()
               if "wall_time" not in f or not f["wall_time"].notna().any()]
    if not lacking:
        return ""
    return (f"{', '.join(lacking)} recorded no wall-clock time per step (written before the trace stored "
            "wall_time): the x-axis is the step.")


def panel_title(column: str, runs: dict[str, pd.DataFrame], derived: dict[str, set[str]]) -> str:
    """The title of ``column``'s panel, marked ``(derived)`` when every run drawn in it computed the
    column from a field the reader derived (``derived``: :func:`derived_fields` per run), ``(derived
    for a, b)`` when only some did: overlaid runs are compared by quantity, whichever way each got it."""
    field_name = source_field(column)
    drawn = [label for label, f in runs.items() if column in f and f[column].notna().any()]
    marked = [label for label in drawn if field_name is not None and field_name in derived[label]]
    if not marked:
        return title_of(column)
    if len(marked) == len(drawn):
        return f"{title_of(column)} (derived)"
    return f"{title_of(column)} (derived for {', '.join(marked)})"


def step_curves_figure(runs: dict[str, pd.DataFrame], layout: Layout) -> tuple[go.Figure, Notes]:
    """Per-step curves of ``runs`` (``{run label: per-step summary}``, the first the run chosen;
    labels name the lines only when there are several): one panel per column of ``layout.columns``
    that some run holds values of, one line per run, inner step and rank (one colour per run when
    overlaid, else per line; inner steps differ by dash and marker). Step files of the same line
    and step (micro-batches) are drawn as the plain mean of their values. With ``layout.smoothing``
    each line is drawn smoothed (:func:`smooth`) over its raw values, drawn faint. Each point's
    ``customdata`` is ``[step, files]`` (int64), each trace's ``meta`` ``[inner_step, run index]``
    (:func:`clicked_step`). Lines of more than :data:`WEBGL_POINTS` steps are ``Scattergl`` traces.
    Returns the figure and the :class:`Notes` on what it could not draw as asked."""
    runs = {k: v for k, v in runs.items() if not v.empty and "step" in v}
    notes = Notes()
    if not runs:
        return empty_figure("no steps in this trace yet"), notes
    shown = [c for c in layout.columns if any(c in v and v[c].notna().any() for v in runs.values())]
    notes.missing = {label: missing for label, f in runs.items()
                     if (missing := [c for c in layout.columns if c not in f or not f[c].notna().any()])}
    if not shown:
        return empty_figure("no values of " + ", ".join(layout.columns) if layout.columns
                            else "choose a quantity to plot"), notes
    notes.log = log_refusals(runs, [c for c in layout.log_columns if c in shown])
    notes.x = x_fallback(runs, layout.x)
    x_kind = "step" if notes.x else layout.x
    unit_name, unit_s = _time_unit(runs) if x_kind == "relative_time" else ("", 1.0)
    derived = {label: derived_fields(f) for label, f in runs.items()}
    ncols = 2 if len(shown) > 1 else 1
    nrows = (len(shown) + ncols - 1) // ncols
    fig = make_subplots(rows=nrows, cols=ncols, shared_xaxes=True, vertical_spacing=min(0.14, 100 / (300 * nrows)),
                        subplot_titles=[panel_title(c, runs, derived) for c in shown])
    n = 0
    for r, (label, frame) in enumerate(runs.items()):
        origin = float(frame["wall_time"].min()) if x_kind == "relative_time" else 0.0
        wanted = shown + (["wall_time"] if x_kind != "step" else [])
        for line, (inner_step, rank, agg) in enumerate(_lines(frame, wanted)):
            name = (f"{label} · " if len(runs) > 1 else "") + f"inner step {inner_step}" + \
                   (f" · rank {rank}" if rank is not None else "")
            colour = PALETTE[(r if len(runs) > 1 else n) % len(PALETTE)]
            if x_kind == "step":
                x = agg["step"].to_numpy()
            elif x_kind == "wall_time":  # milliseconds since the epoch on a date axis: a typed array, not strings
                x = agg["wall_time"].to_numpy(dtype=np.float64) * 1000.0
            else:
                x = (agg["wall_time"].to_numpy(dtype=np.float64) - origin) / unit_s
            line_style = _LineStyle(name, colour, inner_step, line, [inner_step, r])
            _add_line(fig, agg, x, shown, ncols, line_style, layout.smoothing)
            n += 1
    _lay_out_axes(fig, runs, shown, ncols, nrows, x_kind, unit_name)
    for i, column in enumerate(shown):
        if column in layout.log_columns and column not in notes.log:
            fig.update_yaxes(type="log", row=i // ncols + 1, col=i % ncols + 1)
        elif (span := constant_range(runs, column)) is not None:
            fig.update_yaxes(range=span, row=i // ncols + 1, col=i % ncols + 1)
    return fig, notes


def constant_range(runs: dict[str, pd.DataFrame], column: str) -> list[float] | None:
    """``[low, high]`` around the one finite value ``column`` takes in every run (a constant learning
    rate of 1e-3), so that the line is drawn at its value: Plotly's own range for a constant series is
    the value ± 1, which puts 0.001 on the 0 gridline. None when the values vary (or there are none)."""
    values = np.concatenate([f[column].to_numpy(dtype=np.float64) for f in runs.values() if column in f])
    values = values[np.isfinite(values)]
    if not len(values) or values.min() != values.max():
        return None
    value = float(values[0])
    half = abs(value) * 0.5 if value else 1.0
    return [value - half, value + half]


@dataclass
class _LineStyle:
    name: str
    colour: str
    inner_step: int
    line: int
    meta: list[int]


def _add_line(fig: go.Figure, agg: pd.DataFrame, x, shown: list[str], ncols: int, style: _LineStyle,
              smoothing: float) -> None:
    """One line's traces in every panel of ``shown`` it has values of: its values, or with
    ``smoothing`` its raw values faint and its smoothed values over them."""
    customdata = np.column_stack([agg["step"].to_numpy(dtype=np.int64), agg["files"].to_numpy(dtype=np.int64)])
    scatter = go.Scattergl if len(agg) > WEBGL_POINTS else go.Scatter
    line = {"color": style.colour, "dash": DASHES[style.inner_step % len(DASHES)], "width": 2}
    marker = {"symbol": SYMBOLS[style.inner_step % len(SYMBOLS)], "size": 9 - 2 * min(style.line, 2),
              "color": style.colour}
    first = True
    for i, column in enumerate(shown):
        if column not in agg or not agg[column].notna().any():
            continue
        raw = agg[column].to_numpy(dtype=np.float64, na_value=np.nan)
        where = {"row": i // ncols + 1, "col": i % ncols + 1}
        hover = (f"{title_of(column)}=%{{y:.4g}}{{kind}}<br>step %{{customdata[0]}} · {style.name}"
                 "<br>%{customdata[1]} file(s) · click to open this step<extra></extra>")
        common = {"x": x, "name": style.name, "legendgroup": style.name, "customdata": customdata,
                  "meta": style.meta}
        if smoothing:
            fig.add_trace(scatter(y=raw, mode="lines", showlegend=False, opacity=RAW_OPACITY,
                                  line={**line, "width": 1}, hovertemplate=hover.replace("{kind}", " (raw)"),
                                  **common), **where)
        fig.add_trace(scatter(y=smooth(raw, smoothing), mode="lines+markers", showlegend=first, line=line,
                              marker=marker, opacity=0.9,
                              hovertemplate=hover.replace("{kind}", " (smoothed)" if smoothing else ""), **common),
                      **where)
        first = False


def _lay_out_axes(fig: go.Figure, runs: dict[str, pd.DataFrame], shown: list[str], ncols: int, nrows: int,
                  x_kind: str, unit_name: str) -> None:
    if x_kind == "step":
        integer_ticks(fig, [s for v in runs.values() for s in v["step"].tolist()], axis="x")
    elif x_kind == "wall_time":
        fig.update_xaxes(type="date")
    x_title = {"step": "step", "wall_time": "wall-clock time (UTC)",
               "relative_time": f"time since the run's first step ({unit_name})"}[x_kind]
    for c in range(1, ncols + 1):
        # the bottom panel of each column carries the axis title (an odd count leaves column 2 one row short)
        last_row = max(i // ncols + 1 for i in range(len(shown)) if i % ncols + 1 == c) if len(shown) >= c else nrows
        fig.update_xaxes(title_text=x_title, row=last_row, col=c, showticklabels=True)
    fig.update_layout(height=300 * nrows + 120, margin={"t": 90, "b": 40}, legend=TOP_LEGEND,
                      clickmode="event+select")


def _time_unit(runs: dict[str, pd.DataFrame]) -> tuple[str, float]:
    """(name, seconds) of the unit that shows the longest run's wall-clock span in a few digits."""
    span = max(float(f["wall_time"].max() - f["wall_time"].min()) for f in runs.values())
    return ("s", 1.0) if span < 120 else ("min", 60.0) if span < 7200 else ("h", 3600.0)


def clicked_step(fig: go.Figure, point: dict) -> tuple[int, int, int]:
    """``(step, inner_step, run index)`` of a point the browser reports clicked on a
    :func:`step_curves_figure`: the trace by ``curve_number``, the step from the trace's
    ``customdata`` at ``point_index`` (whatever the x-axis shows), else the point's ``x``."""
    trace = fig.data[int(point.get("curve_number") or 0)]
    inner_step, run = (trace.meta or (0, 0))[:2]
    index = point.get("point_index", point.get("point_number"))
    if trace.customdata is not None and index is not None:
        return int(trace.customdata[int(index)][0]), int(inner_step), int(run)
    return int(point["x"]), int(inner_step), int(run)


def _lines(frame: pd.DataFrame, columns: list[str]):
    """``(inner_step, rank or None, per-step means)`` per line of one run's summary; ``files`` counts
    the step files of each point (a line with one file per step, the common case, is taken as it
    is, sorted by step)."""
    frame = frame.assign(inner_step=frame.get("inner_step", 0), rank=frame.get("rank", 0))
    per_rank = frame["rank"].nunique() > 1
    present = [c for c in columns if c in frame]
    for (inner_step, rank), group in frame.groupby(["inner_step", "rank"] if per_rank
                                                   else ["inner_step", lambda _: 0]):
        if group["step"].is_unique:
            agg = group[["step", *present]].sort_values("step", kind="stable").reset_index(drop=True)
            agg[present] = agg[present].astype(np.float64)
            agg["files"] = 1
        else:
            agg = group.groupby("step").agg(**{c: (c, "mean") for c in present},
                                            files=("step", "size")).reset_index()
        yield int(inner_step), (int(rank) if per_rank else None), agg


def with_step_columns(dpo_summary: pd.DataFrame, step_summary: pd.DataFrame) -> pd.DataFrame:
    """``dpo_summary`` (one row per step and inner step: ``views.dpo_step_summary``) with the
    plottable columns of ``step_summary`` it lacks (``wall_time``, ``loss``, ``scalars/…``), the
    mean over the step's files (micro-batches, ranks); ``wall_time`` is the last file's."""
    extra = [c for c in scalar_columns(step_summary) if c not in dpo_summary] + \
            (["wall_time"] if "wall_time" in step_summary and "wall_time" not in dpo_summary else [])
    if dpo_summary.empty or not extra or "step" not in step_summary:
        return dpo_summary
    keys = [k for k in ("step", "inner_step") if k in dpo_summary and k in step_summary]
    how = {c: ("max" if c == "wall_time" else "mean") for c in extra}
    per_step = step_summary.groupby(keys)[extra].agg(how).reset_index()
    return dpo_summary.merge(per_step, on=keys, how="left")


def split_names(text: str | None, options: list[str]) -> tuple[list[str], list[str]]:
    """``(names, unknown)``: the comma-separated names of a URL parameter matched against
    ``options``, a name that holds commas itself (a run folder or a scalar named ``a,b``) included
    (the longest run of pieces that is an option wins), each once; ``unknown``: the pieces no option
    matches."""
    pieces = (text or "").split(",")
    names, unknown, i = [], [], 0
    while i < len(pieces):
        j = next((j for j in range(len(pieces), i, -1) if ",".join(pieces[i:j]) in options), None)
        if j is None:
            if pieces[i]:
                unknown.append(pieces[i])
            i += 1
        else:
            names.append(",".join(pieces[i:j]))
            i = j
    return list(dict.fromkeys(names)), unknown
