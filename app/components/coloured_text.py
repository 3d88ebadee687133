"""A completion as text, each token's background coloured by a chosen per-token quantity (a
diverging scale centred on its neutral value: 1 for the ratio, 0 for KL and advantage; the legend
shows only the range the quantity can take, :mod:`app.components.colour_scale`), hover showing all
its values and its mask reason; masked positions drawn apart by reason.

Pure: :func:`coloured_html` returns an HTML string for ``st.html``. Every token string and every
hover text goes through ``html.escape`` (quotes too), so a token ``<script>`` is shown as those
characters and never parsed as markup; the only markup is the spans written here.
"""

from __future__ import annotations

import html
import math

import pandas as pd

from app.components.colour_scale import (
    colour_of,
    legend_values,
    neutral_of,
    sample_colours,
    scale_ends,
)
from app.components.token_table import FILLER_REASONS, filler_marker, visible_token
from tracer.read.tables import (
    AFTER_EOS,
    ENVIRONMENT,
    KEPT,
    MASKED,
    PADDING,
    PROMPT,
    PROMPT_PADDING,
    TOOL_OUTPUT,
    TRUNCATED,
)

__all__ = ["REASON_STYLE", "colour_of", "coloured_blocks", "coloured_html", "coloured_tokens", "legend_html", "neutral_of", "span_of"]
# How a position that does not enter the loss looks, by reason (no colour of the scale).
REASON_STYLE: dict[str, str] = {
    AFTER_EOS: "background:#d9d9d9;color:#555;text-decoration:line-through;",
    PADDING: "background:#ececec;color:#777;border:1px dotted #999;",
    PROMPT_PADDING: "background:#ececec;color:#777;border:1px dotted #999;",
    MASKED: "background:repeating-linear-gradient(45deg,#e0e0e0 0 4px,#f5f5f5 4px 8px);color:#555;"
            "border:1px dashed #777;",
    TRUNCATED: "background:repeating-linear-gradient(45deg,#e0e0e0 0 4px,#f5f5f5 4px 8px);color:#555;"
               "border:1px dashed #777;",
    TOOL_OUTPUT: "background:#eef1f5;color:#555;",
    ENVIRONMENT: "background:#f1eef5;color:#555;",
    PROMPT: "background:#f4f4f4;color:#555;",
}
# Reasons the legend shows always; the others only when the table has them.
_ALWAYS_IN_LEGEND = (AFTER_EOS, PADDING, MASKED)
_SPAN = "padding:1px 0;border-radius:2px;white-space:pre-wrap;"
# Token boundaries: a hairline at the right edge of every token, 2 px clear of its last letter (an
# inset shadow and padding: no character added, so a copied text is the tokens' text alone), and
# uncoloured tokens alternate two backgrounds, so that ␣ 113 <|endoftext|> never reads as one word.
BOUNDARY = "box-shadow:inset -1px 0 0 rgba(0,0,0,0.5);padding-right:2px;"
PLAIN_BACKGROUNDS = ("#ffffff", "#e8eef7")
_BOX = ("font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:0.95rem;line-height:1.9;"
        "padding:0.6rem;border:1px solid #ddd;border-radius:0.4rem;background:#fff;color:#111;")


def span_of(values: pd.Series, centre: float) -> float:
    """Half-width of the scale: the largest |x − centre| over the finite values (1 when none)."""
    finite = values[values.map(lambda v: isinstance(v, (int, float)) and math.isfinite(v))]
    return float((finite - centre).abs().max()) if len(finite) and (finite - centre).abs().max() > 0 else 1.0


def _ink(rgb: str) -> str:
    r, g, b = (int(float(x)) for x in rgb[rgb.index("(") + 1:-1].split(","))
    return "#fff" if 0.299 * r + 0.587 * g + 0.114 * b < 110 else "#111"


def _hover(row: dict, value_columns: list[str]) -> str:
    parts = [f"position {row['position']} · {row['mask_reason']}", f"token {row['token_id']!r}: {row['token_text']!r}"]
    parts += [f"{c} = {v:.5g}" for c in value_columns
              if isinstance(v := row.get(c), (int, float)) and v == v]  # NaN (an empty value) left out
    return "\n".join(parts)


# A browser draws tens of thousands of coloured token spans slowly (a 32,768-token completion: ~10 MB
# of HTML, a minute to show): past this many the Tokens page colours a window of them at a time.
MAX_COLOURED_TOKENS = 2000


def coloured_html(table: pd.DataFrame, quantity: str | None, value_columns: list[str],
                  window: tuple[int, int] | None = None) -> str:
    """The completion rows of ``table`` (``Trace.token_table`` of one sequence) as coloured text.

    Kept tokens get the colour of ``quantity`` (none when ``quantity`` is None or the value is NaN);
    masked ones the style of their reason (:data:`REASON_STYLE`); a run of filler positions
    (padding, after EOS) is one marker ``⟪N × reason⟫``; a whitespace-only token shows its marker
    (``token_table.visible_token``: ``␣``, ``⏎``, ``⇥``). Every token ends in a hairline
    (:data:`BOUNDARY`) and uncoloured kept tokens alternate :data:`PLAIN_BACKGROUNDS`: token boundaries
    show without adding a character to the text. Hover (``title``) lists ``value_columns`` and the
    token's real string. ``window``: only the completion rows ``[start, end)`` (a long completion drawn a
    part at a time), coloured on the scale of all of them.
    """
    rows = table[table["section"] == "completion"] if "section" in table else table
    if window is None:
        return f'<div style="{_BOX}">{coloured_tokens(rows, quantity, value_columns)}</div>'
    (spans,) = coloured_blocks(rows, quantity, value_columns, [window])
    return f'<div style="{_BOX}">{spans}</div>'


def scale_span(rows: pd.DataFrame, quantity: str | None) -> float:
    """The half-width of ``quantity``'s scale over the kept rows of ``rows`` (:func:`span_of`)."""
    kept_values = rows.loc[rows["mask_reason"] == KEPT, quantity] if quantity in rows else pd.Series(dtype=float)
    return span_of(kept_values, neutral_of(quantity or ""))


def coloured_tokens(rows: pd.DataFrame, quantity: str | None, value_columns: list[str],
                    span: float | None = None) -> str:
    """The spans of :func:`coloured_html` for ``rows`` (no enclosing box): one per token, one per
    filler run. ``span``: the scale's half-width (None: from these rows' kept values)."""
    return coloured_blocks(rows, quantity, value_columns, [(0, len(rows))], span)[0]


def coloured_blocks(rows: pd.DataFrame, quantity: str | None, value_columns: list[str],
                    blocks: list[tuple[int, int]], span: float | None = None) -> list[str]:
    """:func:`coloured_tokens` of each ``rows.iloc[start:end]`` of ``blocks``, on one scale (``span``,
    None: from all the rows' kept values), the colours and rows read once for all the blocks (an
    episode of thousands of tokens drawn turn by turn)."""
    centre = neutral_of(quantity or "")
    span = scale_span(rows, quantity) if span is None else span
    needed = dict.fromkeys(c for c in ("position", "mask_reason", "token_id", "token_text", *value_columns) if c in rows)
    records = rows[list(needed)].to_dict("records")  # only what a span shows: a wide table converts slowly
    colours = _colours(rows, quantity, centre, span)
    return [_block(records[start:end], colours[start:end], value_columns) for start, end in blocks]


def _block(records: list[dict], colours: list[str | None], value_columns: list[str]) -> str:
    out, run = [], []
    for i, (row, colour) in enumerate(zip(records, colours)):
        reason = row["mask_reason"]
        if reason in FILLER_REASONS and (not run or run[0]["mask_reason"] == reason):
            run.append(row)
            continue
        out += _filler(run)
        run = [row] if reason in FILLER_REASONS else []
        if not run:
            out.append(_token_span(row, colour, value_columns, i))
    out += _filler(run)
    return "".join(out)


def _colours(rows: pd.DataFrame, quantity: str | None, centre: float, span: float) -> list[str | None]:
    """The scale's colour of each kept row with a value of ``quantity`` (one colour-scale call), else None."""
    if quantity not in rows:
        return [None] * len(rows)
    values = rows[quantity].astype(float)
    use = (rows["mask_reason"] == KEPT) & values.notna() & values.map(math.isfinite)
    ts = (0.5 + (values[use] - centre) / (2 * span)).clip(0.0, 1.0).tolist()
    sampled = iter(sample_colours(ts))
    return [next(sampled) if u else None for u in use.tolist()]


def _token_span(row: dict, colour: str | None, value_columns: list[str], index: int = 0) -> str:
    """One token's span: the colour of its value, else its mask reason's style, else (a kept token with
    no value) the ``index``-th of :data:`PLAIN_BACKGROUNDS`; always the :data:`BOUNDARY` hairline."""
    style = REASON_STYLE.get(row["mask_reason"]) or f"background:{PLAIN_BACKGROUNDS[index % 2]};"
    if colour is not None:
        style = f"background:{colour};color:{_ink(colour)};"
    style += BOUNDARY
    title = html.escape(_hover(row, value_columns), quote=True)
    text = html.escape(str(visible_token(row["token_text"])), quote=True)
    return f'<span title="{title}" style="{_SPAN}{style}">{text}</span>'


def _filler(run: list[dict]) -> list[str]:
    if not run:
        return []
    reason = run[0]["mask_reason"]
    title = html.escape(f"positions {run[0]['position']}–{run[-1]['position']} · {reason} (not in the loss)", quote=True)
    text = html.escape(filler_marker(len(run), reason))
    return [f'<span title="{title}" style="{_SPAN}{REASON_STYLE.get(reason, "")}">{text}</span>']


def legend_html(quantity: str | None, table: pd.DataFrame) -> str:
    """One line: the scale's ends and middle for ``quantity`` (only values it can take: from 0 for
    k3, k2 and the ratio, up to 0 for logprobs; :func:`scale_ends`) and a chip per masked reason."""
    rows = table[table["section"] == "completion"] if "section" in table else table
    chips = []
    if quantity in rows:
        centre = neutral_of(quantity)
        span = span_of(rows.loc[rows["mask_reason"] == KEPT, quantity], centre)
        low, high = scale_ends(quantity, centre, span)
        for value in legend_values(low, centre, high):
            colour = colour_of(value, centre, span)
            chips.append(f'<span style="{_SPAN}background:{colour};color:{_ink(colour)};padding:1px 6px;">'
                         f'{html.escape(quantity)} {value:.4g}</span>')
    present = set(rows["mask_reason"]) if "mask_reason" in rows else set()
    for reason, style in REASON_STYLE.items():
        if reason != PROMPT_PADDING and (reason in _ALWAYS_IN_LEGEND or reason in present):
            chips.append(f'<span style="{_SPAN}{style}padding:1px 6px;">{html.escape(reason)}</span>')
    return f'<div style="font-size:0.85rem;">{" ".join(chips)}</div>'
