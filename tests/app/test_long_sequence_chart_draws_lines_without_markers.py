"""The Tokens page's per-token chart of a long completion draws lines without a marker per point
(a 256-token sequence of 7 values was ~1,800 SVG markers, most of the browser's drawing time on a
step change); a short one keeps a marker per point, each line its own symbol; at any length the
lines of one panel differ by dash, so a line equal to another (old = policy) stays visible. The
positions that do not enter the loss are shaded on every panel, over the panel's height (one
rectangle per run and panel, added in one layout update)."""

from __future__ import annotations

import pandas as pd

from app.components.figures import MAX_MARKED_POSITIONS, token_values_figure


def sequence(n: int) -> pd.DataFrame:
    """A completion of ``n`` positions, the last one after EOS, old = policy logprobs (ratio 1)."""
    return pd.DataFrame({"section": "completion", "position": range(n), "token_text": ["a"] * n,
                         "kept": [True] * (n - 1) + [False], "mask_reason": ["kept"] * (n - 1) + ["after_eos"],
                         "old_logprobs": [-0.5] * n, "policy_logprobs": [-0.5] * n, "ratio": [1.0] * n})


def test_long_sequence_lines_only_short_sequence_marked():
    long = token_values_figure(sequence(MAX_MARKED_POSITIONS + 1))
    short = token_values_figure(sequence(MAX_MARKED_POSITIONS))
    assert {t.name: t.mode for t in long.data} == dict.fromkeys(["old_logprobs", "policy_logprobs", "ratio"], "lines")
    assert {t.mode for t in short.data} == {"lines+markers"}
    old, policy = (next(t for t in short.data if t.name == name) for name in ("old_logprobs", "policy_logprobs"))
    assert old.marker.symbol != policy.marker.symbol
    for fig in (long, short):
        old, policy = (next(t for t in fig.data if t.name == name) for name in ("old_logprobs", "policy_logprobs"))
        assert old.line.dash != policy.line.dash
        assert len(old.x) == len(fig.data[0].x) and old.y[-1] is None  # every point drawn; the masked one a gap


def test_masked_positions_shaded_on_every_panel_over_its_height():
    fig = token_values_figure(sequence(MAX_MARKED_POSITIONS + 1))  # 2 panels: logprobs, ratio
    rects = sorted((s.xref, s.yref, s.x0, s.x1, s.y0, s.y1) for s in fig.layout.shapes if s.type == "rect")
    last = MAX_MARKED_POSITIONS  # the one masked position (after EOS)
    assert rects == [("x", "y domain", last - 0.5, last + 0.5, 0, 1), ("x2", "y2 domain", last - 0.5, last + 0.5, 0, 1)]
    assert {(a.plotly_name, a.anchor) for a in fig.select_xaxes()} == {("xaxis", "y"), ("xaxis2", "y2")}
