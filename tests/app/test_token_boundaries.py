"""Token boundaries show in the Tokens and Conversation pages' coloured text, coloured or not: every
token ends in a hairline and neighbouring uncoloured tokens have different backgrounds, so that the
tokens ``␣``, ``113``, ``<|endoftext|>`` do not read as the one word ``␣113<|endoftext|>``; and the
text a reader copies is the tokens' text, nothing added between them.

The HTML of :func:`app.components.coloured_text.coloured_html` is parsed with the standard library's
``html.parser`` (what the browser receives through ``st.html``); the PPO page's completion goes through
it too (``streamlit.testing.v1.AppTest`` on the bundled ppo-tiny trace)."""

from __future__ import annotations

from html.parser import HTMLParser

import pandas as pd
import pytest

from app.components.coloured_text import BOUNDARY, PLAIN_BACKGROUNDS, coloured_html
from tests.app.test_algorithm_pages import open_page
from tests.fixtures.paths import SAMPLES


class _Spans(HTMLParser):
    """``(style, text)`` of every ``<span>`` of the box, and all the text in reading order."""

    def __init__(self):
        super().__init__()
        self.spans: list[list[str]] = []
        self.text: list[str] = []
        self._open = False

    def handle_starttag(self, tag, attrs):
        if tag == "span":
            self.spans.append([dict(attrs).get("style", ""), ""])
            self._open = True

    def handle_endtag(self, tag):
        self._open = False if tag == "span" else self._open

    def handle_data(self, data):
        self.text.append(data)
        if self._open:
            self.spans[-1][1] += data


def spans_of(html_text: str) -> _Spans:
    parser = _Spans()
    parser.feed(html_text)
    return parser


def completion(texts: list[str], reasons: list[str], ratio: list[float | None] | None = None) -> pd.DataFrame:
    table = pd.DataFrame({"section": "completion", "position": range(len(texts)), "token_id": range(len(texts)),
                          "token_text": texts, "mask_reason": reasons})
    if ratio is not None:
        table["ratio"] = ratio
    return table


def background(style: str) -> str:
    return next(part.split(":", 1)[1] for part in style.split(";") if part.startswith("background:"))


def test_uncoloured_tokens_alternate_backgrounds_and_each_ends_in_a_hairline():
    table = completion([" ", "113", "<|endoftext|>"], ["kept"] * 3)
    spans = spans_of(coloured_html(table, None, [])).spans
    assert [text for _, text in spans] == ["␣", "113", "<|endoftext|>"]  # one span per token
    assert all(BOUNDARY in style for style, _ in spans)
    # neighbours differ: white, blue-grey, white
    assert [background(style) for style, _ in spans] == [PLAIN_BACKGROUNDS[0], PLAIN_BACKGROUNDS[1],
                                                         PLAIN_BACKGROUNDS[0]]
    assert PLAIN_BACKGROUNDS[0] != PLAIN_BACKGROUNDS[1]


def test_tokens_of_one_colour_still_show_their_boundaries():
    # ratio 1 everywhere: every token gets the scale's neutral colour, the same for all three
    table = completion([" ", "113", "<|endoftext|>"], ["kept"] * 3, ratio=[1.0, 1.0, 1.0])
    spans = spans_of(coloured_html(table, "ratio", ["ratio"])).spans
    assert len({background(style) for style, _ in spans}) == 1
    assert all(BOUNDARY in style for style, _ in spans)


def test_masked_tokens_keep_their_reason_style_and_a_boundary():
    table = completion(["a", "b", "<pad>", "<pad>"], ["kept", "masked", "after_eos", "after_eos"])
    spans = spans_of(coloured_html(table, None, [])).spans
    assert [text for _, text in spans] == ["a", "b", "⟪2 × after_eos⟫"]  # the filler run stays one marker
    assert BOUNDARY in spans[0][0] and BOUNDARY in spans[1][0]
    assert "dashed" in spans[1][0]  # masked for another reason: hatched and dashed, as before


def test_copied_text_is_the_tokens_text_with_nothing_between():
    texts = ["Hello", ",", " ", "world", "<|endoftext|>"]
    parsed = spans_of(coloured_html(completion(texts, ["kept"] * 5), None, []))
    assert "".join(parsed.text) == "Hello,␣world<|endoftext|>"  # a space token is drawn ␣, as before


def test_ppo_page_draws_the_completion_token_by_token(monkeypatch):
    """The PPO page's completion (it was one plain string: ``9<|endoftext|>`` hid a leading space token)."""
    if not (SAMPLES / "ppo-tiny").is_dir():
        pytest.skip("sample_traces/ is not in this checkout")
    at = open_page(monkeypatch, SAMPLES, SAMPLES / "ppo-tiny", "ppo", step_label="step 1 · inner 0 · mb 1 · rank 0")
    assert not at.exception
    body = next(str(h.proto.body) for h in at.get("html") if "token_rewards =" in str(h.proto.body))
    spans = spans_of(body).spans
    token_spans = [(style, text) for style, text in spans if not text.startswith("⟪")]
    assert len(token_spans) >= 2 and all(BOUNDARY in style for style, _ in token_spans)
