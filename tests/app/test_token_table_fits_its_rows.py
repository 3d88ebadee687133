"""The Tokens page's token table is as tall as its rows (no empty grid rows under a short sequence)
and every value column is wide enough for its full header (``per_token_loss``, not ``per_token_``).

The page runs through ``streamlit.testing.v1.AppTest`` on a GRPO trace written by ``TraceWriter``
(tests/fixtures/toy_traces.py); what is asserted is the column configs the page sends to the browser.
The grid's drawn height is measured in a real browser (tests/app/test_browser_single_step_pages.py):
AppTest does not keep an element's height."""

from __future__ import annotations

import json

import pytest

from app.components.token_table import header_width, table_height
from tests.app.test_pages import token_dataframe, write_trace
from tests.fixtures.toy_traces import TOKENS_PAGE, ToyTokenizer, start


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    write_trace(root / "grpo", tokenizer=ToyTokenizer())
    return root


def test_table_height_counts_header_and_rows_then_scrolls():
    # header + 6 rows of 35 px, and the 2 px border (+1 for rounding of the grid's outline)
    assert table_height(6) == 7 * 35 + 3 == 248
    assert table_height(0) == table_height(1) == 2 * 35 + 3  # an empty table still draws its header and one row
    assert table_height(5_000) == table_height(13) == 14 * 35 + 3  # a long table scrolls


def test_header_width_grows_with_the_label():
    # "per_token_loss": 14 characters at 8 px, plus 40 px of padding and sort arrow
    assert header_width("per_token_loss") == 40 + 14 * 8 == 152
    assert header_width("ratio") < header_width("approx_kl_k2") < header_width("approx_kl_k2 (derived)")


def test_value_columns_carry_full_labels_wide_enough_for_them(monkeypatch, root):
    at = start(monkeypatch, root, page=TOKENS_PAGE)
    df = token_dataframe(at)
    config = json.loads(df.proto.columns)
    values = [c for c in ("old_logprobs", "policy_logprobs", "ratio", "ref_kl_k3", "approx_kl_k2", "advantages")
              if c in df.value.columns]
    assert {"old_logprobs", "policy_logprobs", "ratio"} <= set(values)
    for column in values:
        label = config[column]["label"]
        assert label.startswith(column)  # the full field name, "(derived)" appended when derived
        assert config[column]["width"] >= 40 + 8 * len(label)  # "small" (75 px) cut "policy_logprobs"
