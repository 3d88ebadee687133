"""The single-step pages' charts read right: the per-token x axes name the tokens (text over the
position), the Mismatch page's step axis has whole-number ticks and keeps nats and probabilities on
axes of their own, and a top legend sits in the figure's top margin, above the subplot titles (in a
DPO figure 340 px high it sat on the first title). Checked on the Plotly figure objects the pages draw."""

from __future__ import annotations

import pandas as pd

from app.components.dpo import dpo_curves_figure, pair_logprobs_figure
from app.components.figures import (
    LEGEND_ROW_PX,
    MAX_TOKEN_TICKS,
    SUBPLOT_TITLE_PX,
    TOP_LEGEND,
    token_tick_labels,
    token_values_figure,
    top_margin,
)
from app.components.mismatch import scatter_figure, steps_figure
from app.components.token_table import hover_tokens


def sequence(texts: list[str]) -> pd.DataFrame:
    n = len(texts)
    return pd.DataFrame({"section": "completion", "position": range(n), "token_text": texts,
                         "kept": [True] * (n - 1) + [False], "mask_reason": ["kept"] * (n - 1) + ["after_eos"],
                         "old_logprobs": [-0.5] * n, "ratio": [1.0] * n})


def test_token_axis_labels_each_position_with_its_token():
    fig = token_values_figure(sequence([" ", "113", "<|endoftext|>", "<pad>"]))
    axis = fig.layout.xaxis2  # the bottom panel's axis (the panels share x)
    assert list(axis.tickvals) == [0, 1, 2, 3]
    # a space drawn ␣, markup escaped (Plotly renders tick text as HTML), a long token cut to 9 characters and …
    assert list(axis.ticktext) == ["␣<br>0", "113<br>1", "&lt;|endofte…<br>2", "&lt;pad&gt;<br>3"]
    assert all(a.ticktext == axis.ticktext for a in (fig.layout.xaxis, fig.layout.xaxis2))
    assert axis.title.text == "completion token (position)"


def test_a_long_sequence_keeps_position_ticks():
    fig = token_values_figure(sequence(["a"] * (MAX_TOKEN_TICKS + 1)))
    axis = fig.layout.xaxis2
    assert axis.ticktext is None and axis.dtick == 5 and axis.tickformat == "d"  # 48 positions: every 5th
    assert axis.title.text == "completion position"


def test_tick_labels_cut_long_tokens_and_keep_short_ones():
    assert token_tick_labels(["abcdefghij", "abcdefghijk", "\n"], [7, 8, 9]) == [
        "abcdefghij<br>7", "abcdefghi…<br>8", "⏎<br>9"]


def test_dpo_pair_figure_labels_each_side_with_its_own_tokens():
    pair = pd.DataFrame({"position": [0, 1, 2], "chosen_token_text": ["1", "2", "<e>"],
                         "rejected_token_text": ["1", "0", "<e>"], "chosen_kept": [True, True, True],
                         "rejected_kept": [True, True, True], "chosen_policy_logprobs": [-1.0, -2.0, -0.1],
                         "rejected_policy_logprobs": [-1.0, -3.0, -0.1]})
    fig = pair_logprobs_figure(pair)
    assert list(fig.layout.xaxis.ticktext) == ["1<br>0", "2<br>1", "&lt;e&gt;<br>2"]  # chosen panel
    assert list(fig.layout.xaxis2.ticktext) == ["1<br>0", "0<br>1", "&lt;e&gt;<br>2"]  # rejected panel
    assert fig.layout.xaxis.showticklabels and fig.layout.xaxis2.showticklabels


def mismatch_summary() -> pd.DataFrame:
    return pd.DataFrame({"step": [0, 1, 2, 3], "mean_abs": [0.005, 0.005, 0.004, 0.002],
                         "max_abs": [0.021, 0.022, 0.019, 0.013], "prob_diff_mean": [0.0011, 0.0006, 0.0004, 0.0003]})


def test_mismatch_over_steps_has_whole_step_ticks():
    fig = steps_figure(mismatch_summary())
    for axis in (fig.layout.xaxis, fig.layout.xaxis2):
        assert axis.dtick == 1 and axis.tickformat == "d"  # 0..3: 0, 1, 2, 3 (it drew 0, 0.5, 1, ... 3)


def test_mismatch_over_steps_keeps_nats_and_probabilities_apart():
    fig = steps_figure(mismatch_summary())
    axis_of = {t.name: t.yaxis for t in fig.data}
    assert axis_of["mean |trainer − sampler|"] == axis_of["max |trainer − sampler|"] == "y"
    assert axis_of["mean |p_trainer − p_sampler|"] == "y2"
    assert (fig.layout.yaxis.title.text, fig.layout.yaxis2.title.text) == ("nats", "probability")
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["log space: |trainer − sampler| (nats)",
                      "probability space: |p_trainer − p_sampler| (probability)"]
    # the values as recorded, each in its own panel
    assert list(fig.data[2].y) == [0.0011, 0.0006, 0.0004, 0.0003]


def test_mismatch_against_position_has_whole_position_ticks():
    frame = pd.DataFrame({"sequence": [0, 0, 1], "token": [0, 1, 3], "token_text": ["a", "b", "c"],
                          "log_diff": [0.01, -0.02, 0.0], "cut": [False, False, False]})
    fig = scatter_figure(frame, "token", "position in the completion", "against position")
    assert fig.layout.xaxis.dtick == 1 and fig.layout.xaxis.tickformat == "d"


def test_dpo_legend_sits_in_the_top_margin_above_the_subplot_titles():
    summary = pd.DataFrame({"step": [0, 1, 2], "inner_step": 0, "pairs": 4, "margin": [0.0, 0.008, 0.011],
                            "preference_accuracy": [0.0, 0.75, 0.75], "mean_dpo_loss": [0.693, 0.689, 0.687]})
    fig = dpo_curves_figure(summary)
    legend = fig.layout.legend
    # anchored in pixels from the figure's top (container), not at a fraction of the plot height (y = 1.04
    # of a 230 px plot: 9 px above the panels, where the subplot titles are)
    assert (legend.yref, legend.yanchor, legend.y) == ("container", "top", 1.0) == (
        TOP_LEGEND["yref"], TOP_LEGEND["yanchor"], TOP_LEGEND["y"])
    # one legend row ("inner step 0"), then the titles: the margin holds both
    assert fig.layout.margin.t == top_margin(fig) == 12 + LEGEND_ROW_PX + SUBPLOT_TITLE_PX
    assert all(a.yref == "paper" and a.y == 1.0 and a.yanchor == "bottom" for a in fig.layout.annotations)


def test_top_margin_grows_with_a_legend_that_wraps():
    few = token_values_figure(sequence(["a", "b"]))
    names = [t.name for t in few.data]
    assert names == ["old_logprobs", "ratio"]  # 2 entries: (40 + 7 * 12) + (40 + 7 * 5) = 199 px, one row
    assert top_margin(few) == 12 + 26 + 34
    wide = pd.DataFrame({"position": [0, 1], "kept": True, **{c: [-1.0, -2.0] for c in (
        "old_logprobs", "policy_logprobs", "ref_logprobs", "sampler_logprobs", "ratio", "ref_kl_k3",
        "approx_kl_k2", "advantages")}})
    # 8 entries of 5 to 16 characters: 40 * 8 + 7 * 94 = 978 px, two rows at 620 px
    assert top_margin(token_values_figure(wide)) == 12 + 2 * 26 + 34


def test_quotes_reach_plotly_as_quotes():
    # Plotly decodes &lt; &gt; &amp; in tick and hover text but draws &quot; as those six characters
    # (seen in Chromium on a tool call's '{"name": …' tokens)
    assert token_tick_labels(['{"', "a&b"], [0, 1]) == ['{"<br>0', "a&amp;b<br>1"]
    assert hover_tokens(['"', "<b>", "'"]) == ['"', "&lt;b&gt;", "'"]
