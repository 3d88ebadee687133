"""The token table of one sequence: which columns to show, in which order, how masked positions
look, and the prompt / completion as plain text. Pure pandas, no Streamlit: tests call it.

Token text is always shown literally (a token ``<b>`` is the four characters ``<b>``): tables go
through ``st.dataframe``, text through ``st.code``; nothing here produces HTML or Markdown. Only a
token made of whitespace alone, invisible otherwise, is drawn as markers (:func:`visible_token`),
on every page that shows token text (tables through :func:`visible_tokens`, Plotly hovers through
:func:`hover_tokens`); the plain-text views (:func:`section_text`) keep the real string.
"""

from __future__ import annotations

import html

import pandas as pd
from pandas.io.formats.style import Styler

from tracer.read.tables import (
    AFTER_EOS,
    ENVIRONMENT,
    KEPT,
    MASKED,
    PADDING,
    PROMPT,
    PROMPT_PADDING,
    TOKEN_VALUE_FIELDS,
    TOOL_OUTPUT,
    TRUNCATED,
)

# Why a position is (not) in the loss -> what it means, for the legend.
MASK_LEGEND: dict[str, str] = {
    KEPT: "completion token that enters the loss (completion_mask = True)",
    PROMPT: "prompt token: context, never in the loss",
    PROMPT_PADDING: "prompt padding (prompt_mask = False)",
    AFTER_EOS: "completion position after the first EOS",
    PADDING: "completion padding (the pad token id)",
    TOOL_OUTPUT: "a tool's result inside the completion (agentic rows): the model did not sample it",
    ENVIRONMENT: "an environment or user message between assistant turns: not sampled by the model",
    TRUNCATED: "completion token cut by truncation",
    MASKED: "completion token masked for another reason (the trace does not say which)",
}
# Row background per reason; kept rows stay unstyled. Greys, darker for positions that are pure filler.
MASK_BACKGROUND: dict[str, str] = {
    PROMPT: "#eef1f5",
    PROMPT_PADDING: "#d0d0d0",
    AFTER_EOS: "#d0d0d0",
    PADDING: "#d0d0d0",
    MASKED: "#e0e0e0",
    TRUNCATED: "#e0e0e0",
    TOOL_OUTPUT: "#e6ebf2",
    ENVIRONMENT: "#ebe6f2",
}
MASKED_TEXT_COLOUR = "#6e6e6e"
# The token a finding points at (Health page -> Tokens page): amber, bold, a left border.
HIGHLIGHT_STYLE = "background-color: #ffd54f; color: #000000; font-weight: bold; border-left: 3px solid #e65100"
# Columns first in the table, in this order; other value columns follow in reader order.
LEAD_COLUMNS = ("section", "position", "token_id", "token_text", "mask_reason")
VALUE_COLUMNS = ("old_logprobs", "policy_logprobs", "ref_logprobs", "sampler_logprobs", "ratio",
                 "ref_kl_k3", "approx_kl_k2", "advantages")
# The turn and role of each token, shown for an episode of several turns or recorded roles.
TURN_COLUMNS = ("turn", "role")
# Above this many cells the table is shown unstyled (the mask_reason column still says it all).
MAX_STYLED_CELLS = 200_000
# Filler positions that the plain-text views collapse into one marker.
FILLER_REASONS = (PROMPT_PADDING, AFTER_EOS, PADDING)


# How a token made only of whitespace is drawn (it would be invisible); the real string stays in the
# hover of the coloured text and in the plain-text views.
WHITESPACE_MARKERS: dict[str, str] = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}
OTHER_WHITESPACE_MARKER = "·"  # another whitespace character (no-break space, ideographic space...)
EMPTY_TOKEN_MARKER = "∅"  # a token that decodes to the empty string
# The help of every "token text" column (each page's table shows token text through visible_tokens).
WHITESPACE_NOTE = ("a token made only of whitespace shows as ␣ (space), ⏎ (newline), ⇥ (tab), ␍ (carriage "
                   "return) or · (other whitespace), an empty one as ∅")
TOKEN_TEXT_HELP = f"the token's string, shown literally; {WHITESPACE_NOTE}"


def visible_token(text: object) -> object:
    """``text`` as drawn in the token views: a whitespace-only token has each character replaced by
    its marker (``' '`` → ``␣``, ``'\\n'`` → ``⏎``, ``'\\t'`` → ``⇥``, ``'\\r'`` → ``␍``, other
    whitespace → ``·``) and the empty string is ``∅``; any other token (and a non-string) is
    returned unchanged."""
    if not isinstance(text, str):
        return text
    if text == "":
        return EMPTY_TOKEN_MARKER
    if not text.isspace():
        return text
    return "".join(WHITESPACE_MARKERS.get(ch, OTHER_WHITESPACE_MARKER) for ch in text)


def is_token_text_column(name: object) -> bool:
    """True for a column of token strings: ``token_text``, ``chosen_token_text``, ``token_text_a``..."""
    return isinstance(name, str) and (name == "token_text" or name.endswith("_token_text")
                                      or name.startswith("token_text_"))


def visible_tokens(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` as the token tables show it: every token text column (:func:`is_token_text_column`)
    through :func:`visible_token`, so a space or newline token reads ``␣`` / ``⏎``. Returns a copy
    (``frame`` itself when it has no such column); the other columns are untouched."""
    columns = [c for c in frame.columns if is_token_text_column(c)]
    if not columns:
        return frame
    return frame.assign(**{c: frame[c].map(visible_token) for c in columns})


def hover_tokens(texts) -> list[str]:
    """Token strings for a Plotly hover: :func:`visible_token`, then ``<``, ``>`` and ``&``
    HTML-escaped (Plotly renders hover text as HTML, so ``<b>`` must arrive as ``&lt;b&gt;``); quotes
    stay as they are (Plotly decodes ``&lt;``, ``&gt;``, ``&amp;`` but shows ``&quot;`` literally)."""
    return [html.escape(str(visible_token(t)), quote=False) for t in texts]


def token_display_frame(table: pd.DataFrame, include_prompt: bool = True) -> pd.DataFrame:
    """The columns of ``Trace.token_table(key, sequence)`` worth showing, in reading order.

    Completion rows come first, then prompt rows (``include_prompt``). Drops the columns that are
    constant for one sequence (step, inner_step, rank, sequence) and the ``kept`` flag (``mask_reason == "kept"`` says the same). Value columns follow the order
    old, policy, ref, sampler logprobs, ratio, ref_kl_k3, approx_kl_k2, advantages, then the rest.
    ``token_text`` goes through :func:`visible_token` (a whitespace-only token shows as ``␣``…).
    ``turn`` and ``role`` follow the lead columns when the sequence is an episode (:func:`multi_turn`).
    """
    if not include_prompt and "section" in table:
        table = table[table["section"] != "prompt"]
    if "section" in table:  # completion rows first (what the loss runs over), then the prompt
        table = table.sort_values("section", key=lambda s: s != "completion", kind="stable")
    values = [c for c in VALUE_COLUMNS if c in table]
    values += [c for c in TOKEN_VALUE_FIELDS if c in table and c not in values]
    columns = [c for c in LEAD_COLUMNS if c in table] + [c for c in TURN_COLUMNS if multi_turn(table)] + values
    return visible_tokens(table[columns].reset_index(drop=True))  # a whitespace-only token shows its marker


def multi_turn(table: pd.DataFrame) -> bool:
    """True when ``table`` holds an episode: more than one assistant turn, or roles other than
    ``assistant`` after the prompt (tool results, environment messages)."""
    if "turn" not in table or "role" not in table or table.empty:
        return False
    completion = table[table["section"] == "completion"] if "section" in table else table
    return bool(completion["turn"].max() > 1) or bool(
        (completion.loc[completion["turn"] > 0, "role"] != "assistant").any())


def _row_style(reason: str) -> str:
    background = MASK_BACKGROUND.get(reason)
    if background is None:
        return ""
    return f"background-color: {background}; color: {MASKED_TEXT_COLOUR}"


def highlighted_rows(frame: pd.DataFrame, token: int | None) -> pd.Series:
    """Boolean per row: the completion token at position ``token`` (all False when None)."""
    if token is None or "position" not in frame:
        return pd.Series(False, index=frame.index)
    hit = frame["position"] == token
    if "section" in frame:
        hit &= frame["section"] == "completion"
    return hit


def style_token_table(frame: pd.DataFrame, highlight: int | None = None) -> Styler | pd.DataFrame:
    """Grey the rows that do not enter the loss, mark the highlighted token, format the values.

    Rows are coloured by ``mask_reason`` (:data:`MASK_BACKGROUND`); kept rows stay white. The
    completion token at position ``highlight`` (a finding's token) gets :data:`HIGHLIGHT_STYLE`
    whatever its mask. Floats show 4 significant digits, NaN (a value the position does not have)
    as an empty cell. Returns ``frame`` itself, unstyled, when it has more than
    :data:`MAX_STYLED_CELLS` cells.
    """
    if frame.size > MAX_STYLED_CELLS or "mask_reason" not in frame:
        return frame
    styles = frame["mask_reason"].map(_row_style).where(~highlighted_rows(frame, highlight), HIGHLIGHT_STYLE)
    float_columns = [c for c in frame.columns if pd.api.types.is_float_dtype(frame[c])]
    return (frame.style
            .apply(lambda col: styles, axis=0)
            .format("{:.4g}", subset=float_columns, na_rep=""))


# Streamlit's data grid draws the header and every row 35 px high, inside a 1 px border (its
# DEFAULT_ROW_HEIGHT); a table longer than MAX_TABLE_ROWS rows scrolls inside that height.
GRID_ROW_PX = 35
MAX_TABLE_ROWS = 13
# Header text of the grid: about 8 px a character (14 px Source Sans), plus the cell padding and the
# sort arrow / menu that the header keeps room for.
HEADER_CHAR_PX = 8
HEADER_PAD_PX = 40


def table_height(n_rows: int, max_rows: int = MAX_TABLE_ROWS) -> int:
    """Pixel height of an ``st.dataframe`` that shows ``n_rows`` rows with no empty grid row under
    them: the header and each row, :data:`GRID_ROW_PX` each, plus the 2 px border; past
    ``max_rows`` rows the table scrolls inside the height of ``max_rows`` rows."""
    return (min(max(n_rows, 1), max_rows) + 1) * GRID_ROW_PX + 3


def header_width(label: str) -> int:
    """Pixel width of a grid column whose header ``label`` shows whole (not cut to ``per_token_``)."""
    return HEADER_PAD_PX + HEADER_CHAR_PX * len(label)


def value_column_config(columns, derived=(), helps: dict[str, str] | None = None) -> dict[str, dict]:
    """``st.dataframe`` column configs (plain dicts, as ``st.column_config.NumberColumn`` builds them)
    of the per-token value ``columns``: the full field name as the label (`` (derived)`` appended
    when the reader derived it, ``derived``), a width that shows the whole label
    (:func:`header_width`), and ``helps[column]`` as the header's help (the values' format is the
    Styler's, :func:`style_token_table`)."""
    helps = helps or {}
    config = {}
    for column in columns:
        label = column + (" (derived)" if column in derived else "")
        config[column] = {"label": label, "width": header_width(label), "help": helps.get(column),
                          "type_config": {"type": "number"}}
    return config


def legend_frame(reasons: list[str] | None = None) -> pd.DataFrame:
    """``mask_reason | meaning`` rows for the legend (all reasons, or those in ``reasons``)."""
    keys = [r for r in MASK_LEGEND if reasons is None or r in reasons]
    return pd.DataFrame({"mask_reason": keys, "meaning": [MASK_LEGEND[k] for k in keys]})


def filler_marker(count: int, reason: str) -> str:
    """The marker that stands for ``count`` filler tokens in the plain-text views."""
    return f"⟪{count} × {reason}⟫"


def section_text(table: pd.DataFrame, section: str) -> str:
    """The text of one section (``prompt`` or ``completion``) of one sequence, token strings
    concatenated, each run of filler tokens (prompt padding, padding, after EOS) replaced by
    :func:`filler_marker` so that padding cannot be mistaken for text."""
    rows = table[table["section"] == section] if "section" in table else table
    parts: list[str] = []
    run_reason, run_count = None, 0
    for text, reason in zip(rows["token_text"], rows["mask_reason"]):
        if reason in FILLER_REASONS:
            if reason != run_reason and run_count:
                parts.append(filler_marker(run_count, run_reason))
                run_count = 0
            run_reason, run_count = reason, run_count + 1
            continue
        if run_count:
            parts.append(filler_marker(run_count, run_reason))
            run_reason, run_count = None, 0
        parts.append(str(text))
    if run_count:
        parts.append(filler_marker(run_count, run_reason))
    return "".join(parts)


def reason_counts(table: pd.DataFrame) -> dict[str, int]:
    """How many positions of the table carry each mask reason, in legend order."""
    counts = table["mask_reason"].value_counts()
    return {r: int(counts[r]) for r in MASK_LEGEND if r in counts}
