"""Pure builders of the DPO page: the pair table with each side's masked cells greyed, the text of a
side, the per-position logprobs of both sides, and margin / preference accuracy over steps.
No Streamlit and no RL maths: the numbers come from ``tracer.views``."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from pandas.io.formats.style import Styler
from plotly.subplots import make_subplots

from app.components.figures import (
    TOP_LEGEND,
    empty_figure,
    integer_ticks,
    shade_masked,
    token_ticks,
    top_margin,
)
from app.components.token_table import (
    MASK_BACKGROUND,
    MASKED_TEXT_COLOUR,
    hover_tokens,
    visible_tokens,
)
from tracer.read.tables import MASKED

SIDES = ("chosen", "rejected")
MASKED_CELL = f"background-color: {MASK_BACKGROUND[MASKED]}; color: {MASKED_TEXT_COLOUR}"
# Panels of the per-step figure: (summary column, title, y-axis format).
DPO_STEP_PANELS = (("margin", "margin (chosen_rewards − rejected_rewards)", None),
                   ("preference_accuracy", "preference accuracy", ".0%"),
                   ("mean_dpo_loss", "mean dpo_loss", None))
_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]


def _kept(value: object) -> bool:
    """True only for a true mask value (a NaN-padded slot of the shorter side is not kept)."""
    return isinstance(value, (bool, np.bool_)) and bool(value)


def style_pair_table(frame: pd.DataFrame) -> Styler:
    """``views.dpo_pair_tokens`` with each side's cells greyed where that side's mask drops the
    position (``chosen_kept`` / ``rejected_kept`` False); floats to 4 significant digits; token
    texts through ``token_table.visible_tokens`` (a space token reads ``␣``)."""
    def side_styles(col: pd.Series) -> list[str]:
        side = next((s for s in SIDES if col.name.startswith(f"{s}_")), None)
        if side is None or f"{side}_kept" not in frame:
            return [""] * len(col)
        return ["" if _kept(k) else MASKED_CELL for k in frame[f"{side}_kept"]]

    floats = [c for c in frame.columns if pd.api.types.is_float_dtype(frame[c])]
    return visible_tokens(frame).style.apply(side_styles, axis=0).format("{:.4g}", subset=floats, na_rep="")


def side_text(pair_tokens: pd.DataFrame, side: str) -> str:
    """The kept tokens of one side (``chosen`` or ``rejected``) concatenated: what the loss sums over."""
    texts, kept = pair_tokens.get(f"{side}_token_text"), pair_tokens.get(f"{side}_kept")
    if texts is None:
        return ""
    return "".join(str(t) for t, k in zip(texts, kept if kept is not None else [True] * len(texts)) if _kept(k))


def pair_logprobs_figure(pair_tokens: pd.DataFrame) -> go.Figure:
    """Policy and reference logprobs of each side against position, one panel per side, each
    side's masked positions shaded grey in its own panel, each panel's x ticks that side's tokens
    (``figures.token_ticks``: the text over the position).

    Args:
        pair_tokens: ``views.dpo_pair_tokens`` of one pair.
    """
    sides = [s for s in SIDES if f"{s}_policy_logprobs" in pair_tokens or f"{s}_ref_logprobs" in pair_tokens]
    if pair_tokens.empty or not sides:
        return empty_figure("no chosen / rejected logprobs in this pair")
    fig = make_subplots(rows=len(sides), cols=1, shared_xaxes=True, vertical_spacing=0.2,  # room for tick labels
                        subplot_titles=[f"{s} (nats)" for s in sides])
    positions = pair_tokens["position"].tolist()
    for i, side in enumerate(sides, start=1):
        texts = hover_tokens(pair_tokens.get(f"{side}_token_text", [""] * len(positions)))
        kept = pair_tokens[f"{side}_kept"].tolist() if f"{side}_kept" in pair_tokens else [True] * len(positions)
        for model, dash in (("policy", "solid"), ("ref", "dot")):
            col = f"{side}_{model}_logprobs"
            if col not in pair_tokens:
                continue
            fig.add_trace(go.Scatter(  # the side's masked positions are gaps
                x=positions, y=[v if _kept(k) else None for v, k in zip(pair_tokens[col].tolist(), kept)], mode="lines+markers", name=col, customdata=texts,
                line={"dash": dash}, marker={"size": 5},
                hovertemplate=f"{col}=%{{y:.4g}}<br>position %{{x}} · token %{{customdata}}<extra></extra>"),
                row=i, col=1)
        shade_masked(fig, positions, [_kept(k) for k in kept], row=i)
        # each side its own tokens under its panel (the two sides share positions, not tokens)
        by_text = token_ticks(fig, positions, pair_tokens.get(f"{side}_token_text", [""] * len(positions)), row=i,
                              col=1)
    fig.update_xaxes(title_text="token (position)" if by_text else "position", row=len(sides), col=1)
    fig.update_layout(height=250 * len(sides) + 130, margin={"t": top_margin(fig), "b": 40}, legend=TOP_LEGEND)
    return fig


def dpo_curves_figure(summary: pd.DataFrame) -> go.Figure:
    """Margin, preference accuracy and mean loss against step (``views.dpo_step_summary``), one
    line per inner step; panels whose column is absent or all NaN are left out."""
    panels = [p for p in DPO_STEP_PANELS if p[0] in summary and summary[p[0]].notna().any()]
    if summary.empty or not panels:
        return empty_figure("no step with chosen_rewards and rejected_rewards yet")
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[title for _, title, _ in panels])
    for n, (inner_step, part) in enumerate(summary.groupby("inner_step")):
        for i, (col, title, fmt) in enumerate(panels, start=1):
            fig.add_trace(go.Scatter(
                x=part["step"], y=part[col], mode="lines+markers", name=f"inner step {inner_step}",
                legendgroup=str(inner_step), showlegend=i == 1, line={"color": _PALETTE[n % len(_PALETTE)]},
                customdata=part["pairs"],
                hovertemplate=f"{col}=%{{y:.4g}}<br>step %{{x}} · %{{customdata}} pairs<extra></extra>"),
                row=1, col=i)
            fig.update_xaxes(title_text="step", row=1, col=i)
            if fmt:
                fig.update_yaxes(tickformat=fmt, range=[-0.05, 1.05], row=1, col=i)
    integer_ticks(fig, summary["step"].tolist())
    # the legend in the top margin, the subplot titles under it (a legend at a fraction of this short
    # figure's height sat on the first title)
    fig.update_layout(height=360, margin={"t": top_margin(fig), "b": 40}, legend=TOP_LEGEND)
    return fig
