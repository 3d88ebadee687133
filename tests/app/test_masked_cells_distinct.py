"""The Step page's sequence x position heatmap draws a masked position apart from a value of 0: a
grey layer of its own beside the values, in a colour the diverging scale never takes (a k3 of 0 is
the scale's white, which a blank cell on a light background looked like). Checked on the figure."""

from __future__ import annotations

import numpy as np
import pandas as pd

from app.components.colour_scale import sample_colours
from app.components.step_view import MASKED_CELL_COLOUR, heatmap_figure, masked_cells


def step_frame() -> pd.DataFrame:
    """Two rows of 4 positions: row 0 keeps 0..2 (k3 0, 0.2, 0) and masks 3 (after EOS); row 1 keeps 0..1 and
    masks 2..3 (padding). k3 at the masked positions is a number (the reader fills it), as in real traces."""
    return pd.DataFrame({
        "rank": 0, "micro_batch": 0, "sequence": [0] * 4 + [1] * 4, "position": [0, 1, 2, 3] * 2,
        "token_text": ["a", "b", "<e>", "<p>", "c", "<e>", "<p>", "<p>"],
        "kept": [True, True, True, False, True, True, False, False],
        "mask_reason": ["kept"] * 3 + ["after_eos"] + ["kept"] * 2 + ["padding"] * 2,
        "ref_kl_k3": [0.0, 0.2, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0],
    })


def test_masked_cells_are_their_own_grey_layer_and_zeros_stay_values():
    fig = heatmap_figure(step_frame(), "ref_kl_k3")
    values, masked = fig.data[0], fig.data[1]  # the values first (data[0], as before), then the masked layer
    assert (values.name, masked.name) == ("ref_kl_k3", "masked")
    z_masked, z_values = np.array(masked.z, dtype=float), np.array(values.z, dtype=float)
    # masked: row 0 position 3, row 1 positions 2 and 3
    assert np.array_equal(~np.isnan(z_masked), np.array([[False, False, False, True], [False, False, True, True]]))
    # a kept 0 is a value (drawn in the scale's neutral colour), never a masked cell
    assert z_values[0, 0] == 0.0 and z_values[0, 2] == 0.0 and z_values[1, 1] == 0.0
    assert np.isnan(z_values[0, 3]) and np.isnan(z_values[1, 2])
    assert {c for _, c in masked.colorscale} == {MASKED_CELL_COLOUR} and masked.showscale is False
    assert "masked: not in the loss" in masked.hovertemplate
    # no colour of the value scale is the masked grey (the scale runs blue - white - red)
    scale = sample_colours(np.linspace(0, 1, 201))
    grey = "rgb({}, {}, {})".format(*(int(MASKED_CELL_COLOUR[i:i + 2], 16) for i in (1, 3, 5)))
    assert grey not in scale
    assert fig.layout.plot_bgcolor == "#ffffff"  # a cell a row does not have stays blank, unlike either


def test_binned_cells_are_masked_only_when_every_position_in_them_is():
    frame = step_frame()
    # bins of 2 positions: row 0 -> [0-1 kept, 2-3 one kept]; row 1 -> [0-1 kept, 2-3 all masked]
    cells = masked_cells(frame, max_cols=2)
    assert cells.tolist() == [[False, False], [False, True]]


def test_hover_names_each_cell_token():
    fig = heatmap_figure(step_frame(), "ref_kl_k3")
    values = fig.data[0]
    assert np.array(values.customdata).tolist() == [["a", "b", "&lt;e&gt;", "&lt;p&gt;"],
                                                    ["c", "&lt;e&gt;", "&lt;p&gt;", "&lt;p&gt;"]]
    assert "token %{customdata}" in values.hovertemplate
