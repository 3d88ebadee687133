"""The colour scale of a per-token quantity, shared by the Tokens page's coloured text and legend
and the Step page's heatmap: white at the quantity's neutral value (1 for a ratio, 0 otherwise),
blue below it, red above (Plotly's ``RdBu_r``), as far as the values reach.

The range shown is the part of ``[neutral − span, neutral + span]`` the quantity can take: a
quantity that is ≥ 0 by construction (the k3 and k2 estimators, |differences|, entropy, ratios,
importance weights, clip fractions) never shows a negative end, a logprob (≤ 0) never a positive
one; a signed quantity (advantages, logprob differences, values, losses) keeps the symmetric range.
A value keeps the colour it has on the full symmetric scale, so the same value has the same colour
on every page. Pure: no Streamlit.
"""

from __future__ import annotations

import numpy as np
from plotly.colors import get_colorscale, sample_colorscale

SCALE = "RdBu_r"
# Quantities >= 0 by construction (SPEC.md section 3: ratio = exp(.), k3 = exp(d) - d - 1 >= 0,
# k2 = 0.5 d^2; entropy; absolute differences; importance weights and clip fractions).
NON_NEGATIVE = frozenset({
    "ratio", "sequence_ratio", "ref_kl_k3", "approx_kl_k2", "entropy", "abs_policy_old", "abs_old_sampler",
    "is_weights", "sequence_is_weights", "clip_fraction", "clip_fraction_low", "clip_fraction_high",
})
# Quantities <= 0 by construction: log-probabilities (nats).
NON_POSITIVE = frozenset({
    "policy_logprobs", "old_logprobs", "ref_logprobs", "sampler_logprobs", "chosen_policy_logprobs",
    "rejected_policy_logprobs", "chosen_ref_logprobs", "rejected_ref_logprobs",
})
_SCALE_STEPS = 11  # colours sampled for a Plotly colour scale over part of the range


def neutral_of(quantity: str) -> float:
    """1 for a ratio or importance weight (``*ratio``, ``*is_weights``), 0 for the other quantities."""
    return 1.0 if quantity.endswith(("ratio", "is_weights")) else 0.0


def scale_ends(quantity: str, centre: float, span: float) -> tuple[float, float]:
    """``(low, high)``: ``centre ∓ span`` cut to the values ``quantity`` can take (``[0, ∞)`` for
    :data:`NON_NEGATIVE`, ``(−∞, 0]`` for :data:`NON_POSITIVE`); symmetric for the others."""
    low, high = centre - span, centre + span
    if quantity in NON_NEGATIVE:
        low = max(low, 0.0)
    if quantity in NON_POSITIVE:
        high = min(high, 0.0)
    return low, high


def _position(value: float, centre: float, span: float) -> float:
    return min(max(0.5 + (value - centre) / (2 * span), 0.0), 1.0)


def colour_of(value: float, centre: float, span: float) -> str:
    """The scale's colour for ``value`` (``rgb(r, g, b)``): white at ``centre``, full blue / red at
    ``centre ∓ span``; values beyond are clipped."""
    return sample_colorscale(SCALE, [_position(value, centre, span)])[0]


def _stops() -> tuple[np.ndarray, np.ndarray]:
    """The scale's stops ``[S]`` and their colours ``[S, 3]`` as 0-1 floats (as Plotly reads them)."""
    pairs = get_colorscale(SCALE)
    stops = np.array([float(p) for p, _ in pairs])
    rgb = np.array([[float(x) / 255.0 for x in c[c.index("(") + 1:-1].split(",")] for _, c in pairs])
    return stops, rgb


def sample_colours(ts) -> list[str]:
    """``plotly.colors.sample_colorscale(SCALE, ts)`` with numpy: the same ``rgb(r, g, b)`` strings
    (the same interpolation between the two stops around each point, rounded half to even as
    Plotly's ``convert_to_RGB_255``), for thousands of tokens at once. ``ts``: points in [0, 1]."""
    t = np.asarray(ts, dtype=float)
    if t.size == 0:
        return []
    stops, rgb = _stops()
    high = np.searchsorted(stops, t, side="left")  # bisect_left, as Plotly
    low = high - 1  # -1 at t = 0: Plotly's scale[-1], which gives the first colour all the same
    interpolant = (t - stops[low]) / (stops[high] - stops[low])
    colour = rgb[low] + interpolant[:, None] * (rgb[high] - rgb[low])  # (N, 3)
    channels = np.round(colour * 255.0).astype(int)  # numpy rounds half to even, as Decimal ROUND_HALF_EVEN
    return [f"rgb({r}, {g}, {b})" for r, g, b in channels.tolist()]


def plotly_colorscale(low: float, high: float, centre: float, span: float) -> list[list]:
    """A Plotly colour scale for a colour axis from ``low`` to ``high`` (:func:`scale_ends`) whose
    colours are those :func:`colour_of` gives (white at ``centre``): ``[[0, colour], ..., [1, colour]]``."""
    if high <= low:
        return [[0.0, colour_of(low, centre, span)], [1.0, colour_of(low, centre, span)]]
    values = [low + (high - low) * i / (_SCALE_STEPS - 1) for i in range(_SCALE_STEPS)]
    colours = sample_colorscale(SCALE, [_position(v, centre, span) for v in values])
    return [[i / (_SCALE_STEPS - 1), colour] for i, colour in enumerate(colours)]


def legend_values(low: float, centre: float, high: float) -> list[float]:
    """Three values to label a legend with: the ends and the centre, or the midpoint when the centre
    is an end (a non-negative quantity starts at its neutral 0)."""
    middle = centre if low < centre < high else (low + high) / 2
    return [low, middle, high]
