"""The colour scale's range: a quantity that is >= 0 by construction (k3, k2, |policy − old|, the
ratio) never shows a negative end, on the Step page's heatmap or on the Tokens page's legend; a
signed one (advantages) keeps a symmetric range. On the bundled GRPO demo trace (a real run of the
hand-written loop), expected ranges recomputed here from the step file's tensors."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from app.components.colour_scale import colour_of
from app.components.step_view import heatmap_figure
from tracer import Trace
from tracer.views.step import step_token_frame

from tests.fixtures.toy_traces import SAMPLES, TOKENS_PAGE, start


RUN = SAMPLES / "grpo-tiny"
STEP, INNER = 1, 1  # after an optimizer step: policy != ref, so k3 > 0 somewhere


@pytest.fixture(scope="module")
def step_tensors():
    trace = Trace(RUN)
    (key,) = [k for k in trace.steps() if (k.step, k.inner_step) == (STEP, INNER)]
    data = trace.load_step(key)
    mask = data["completion_mask"].bool()
    assert data["ref_kl_k3"][mask].max() > 0
    return data, mask


def kept(data, mask, name) -> np.ndarray:
    """``name`` at the kept completion positions ([B] fields broadcast over the tokens)."""
    values = data[name]
    if values.dim() == 1:
        values = values[:, None].expand_as(mask)  # [B] -> [B, T]
    return values[mask].double().numpy()


def test_heatmap_colour_axis_of_k3_starts_at_zero(step_tensors):
    data, mask = step_tensors
    fig = heatmap_figure(step_token_frame(Trace(RUN), STEP, INNER), "ref_kl_k3")
    heat = fig.data[0]
    span = np.percentile(np.abs(kept(data, mask, "ref_kl_k3")), 99)  # the scale's half-width (99th pct)
    assert heat.zmin == 0.0 and heat.zmax == pytest.approx(span, rel=1e-6)
    # white at 0 (k3's neutral value), full red at the top, as the Tokens page colours the same values
    assert heat.colorscale[0][1] == colour_of(0.0, 0.0, span) == colour_of(0.0, 0.0, 1.0)
    assert heat.colorscale[-1][1] == colour_of(span, 0.0, span)


def test_heatmap_of_a_signed_quantity_stays_symmetric(step_tensors):
    data, mask = step_tensors
    frame = step_token_frame(Trace(RUN), STEP, INNER)
    heat = heatmap_figure(frame, "advantages").data[0]
    span = np.percentile(np.abs(kept(data, mask, "advantages")), 99)
    assert (heat.zmin, heat.zmax) == pytest.approx((-span, span), rel=1e-6)
    assert heat.colorscale[0][1] == colour_of(-span, 0.0, span) and heat.colorscale[-1][1] == colour_of(span, 0.0, span)
    # |policy - old| >= 0: from 0 as well
    heat = heatmap_figure(frame, "abs_policy_old").data[0]
    gap = np.abs(kept(data, mask, "policy_logprobs") - kept(data, mask, "old_logprobs"))
    assert heat.zmin == 0.0 and heat.zmax == pytest.approx(np.percentile(gap, 99), rel=1e-5)


def test_ratio_scale_is_centred_on_one_and_never_below_zero():
    frame = step_token_frame(Trace(RUN), STEP, INNER)
    frame.loc[frame.index[0], "ratio"] = 4.0  # a ratio of 4 next to ratios near 1: half-width >= 3
    frame.loc[frame.index[0], "kept"] = True
    heat = heatmap_figure(frame, "ratio").data[0]
    ratios = frame.loc[frame["kept"].astype(bool), "ratio"].to_numpy(dtype=float)
    span = np.percentile(np.abs(ratios - 1.0), 99)
    assert span > 1  # so 1 - span < 0: the low end is cut at 0
    assert heat.zmin == 0.0 and heat.zmax == pytest.approx(1.0 + span)


def legend_chips(at, quantity: str) -> list[float]:
    """The numbers on the Tokens page's legend chips for ``quantity``."""
    html = [str(el.proto.body) for el in at.get("html") if f">{quantity} " in str(el.proto.body)]
    assert len(html) == 1, html
    return [float(v) for v in re.findall(rf">{quantity} (-?[0-9.e+-]+)</span>", html[0])]


def test_tokens_page_legend_of_k3_shows_no_negative_value(monkeypatch, step_tensors):
    data, mask = step_tensors
    seq = int(torch.argmax(torch.where(mask, data["ref_kl_k3"], 0).amax(dim=1)))  # the row with the largest k3
    query = {"run": "grpo-tiny", "step": str(STEP), "inner": str(INNER), "seq": str(seq), "colour": "ref_kl_k3"}
    at = start(monkeypatch, SAMPLES, query=query, page=TOKENS_PAGE)
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="colour_by").value == "ref_kl_k3"
    top = float(data["ref_kl_k3"][seq][mask[seq]].max())  # the legend's half-width: max k3 of the sequence
    chips = legend_chips(at, "ref_kl_k3")
    assert chips == pytest.approx([0.0, top / 2, top], rel=1e-3)  # printed with 4 significant digits
    # a signed quantity keeps its symmetric legend: -max|A|, 0, +max|A|
    at = start(monkeypatch, SAMPLES, query={**query, "colour": "advantages"}, page=TOKENS_PAGE)
    biggest = float(data["advantages"][seq].abs())
    assert legend_chips(at, "advantages") == pytest.approx([-biggest, 0.0, biggest], rel=1e-3)
