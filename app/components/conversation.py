"""The Conversation page's chat and tables, built by pure functions from
:func:`tracer.views.conversation` (one sequence as an episode). No Streamlit, no RL maths.

Each turn is drawn as blocks, one per span: a role label (system / user / assistant / tool…) above
the span's tokens. Assistant tokens that enter the loss are coloured by the chosen quantity on one
scale for the whole episode (:mod:`app.components.coloured_text`); a tool call is a block of its own;
a tool result, an environment message and the prompt say that they are not trained and why (the
words of :data:`tracer.format.turns.NOT_TRAINED_TEXT`). Token strings go through ``html.escape``
(:func:`app.components.coloured_text.coloured_tokens`): a token ``<script>`` is shown as text.
"""

from __future__ import annotations

import html

import pandas as pd

from app.components.coloured_text import coloured_blocks, scale_span
from tracer.format.turns import NOT_TRAINED_TEXT
from tracer.views.conversation import (
    ENVIRONMENT_BLOCK, MESSAGE, PROMPT_BLOCK, TOOL_CALL, TOOL_RESULT, Conversation, ConversationSpan)

# Left border colour of a block, by role (others: grey).
ROLE_COLOURS = {"system": "#6a737d", "user": "#1f77b4", "assistant": "#2ca02c", "tool": "#ff7f0e",
                "environment": "#9467bd", "tool_call": "#17becf"}
TRAINED_FOREIGN = "#d62728"  # a tool result or environment message the loss trains on: the bug's colour
BLOCK_LABELS = {PROMPT_BLOCK: "", MESSAGE: "", TOOL_CALL: "tool call", TOOL_RESULT: "tool result",
                ENVIRONMENT_BLOCK: "environment"}
TURNS_PER_PAGE = 16
# Columns of the per-turn table, with their headers.
TURN_HEADERS = {"turn": "turn", "roles": "roles", "tokens": "tokens", "trained_tokens": "trained",
                "mean_ratio": "mean ratio", "mean_ref_kl_k3": "mean k3", "mean_abs_old_sampler": "mean |old − sampler|",
                "advantage": "advantage", "reward": "reward"}
_BLOCK = ("margin:0.35rem 0;padding:0.3rem 0.6rem;border-left:4px solid {colour};border-radius:0.3rem;"
          "background:{background};")
_LABEL = "font-family:sans-serif;font-size:0.78rem;font-weight:600;color:{colour};margin-bottom:0.15rem;"
_TEXT = "font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:0.92rem;line-height:1.8;color:#111;"
_TURN = "font-family:sans-serif;font-size:0.85rem;color:#444;margin:0.8rem 0 0.2rem 0;border-top:1px solid #ddd;"


def role_label(span: ConversationSpan) -> str:
    """The label above a block: ``assistant · tool call``, ``tool · not trained: tool output``,
    ``user · not trained: prompt``, ``assistant`` (plain text, escaped by the caller)."""
    role = span.role or ("prompt" if span.turn == 0 else "environment")
    parts = [role]
    kind = BLOCK_LABELS.get(span.block, "")
    if kind and kind != role:
        parts.append(kind)
    if span.turn >= 1 and span.kept and span.block in (TOOL_RESULT, ENVIRONMENT_BLOCK):
        parts.append(f"TRAINED: {span.kept} of {span.length} tokens in the loss, though the model did not write "
                     "them (turns.tool_output_trained)")
    elif span.kept < span.length:
        reason = NOT_TRAINED_TEXT.get(span.mask_reason, span.mask_reason)
        parts.append(f"not trained: {reason}" if span.kept == 0 else f"{span.kept} of {span.length} trained "
                     f"(others: {reason})")
    return " · ".join(parts)


def turns_on_page(conversation: Conversation, page: int, per_page: int = TURNS_PER_PAGE) -> list[int]:
    """The turn ids page ``page`` (from 0) shows: the prompt (turn 0, recorded in the row or as
    ``prompt_ids``) with the first page's turns."""
    ids = sorted({s.turn for s in conversation.spans})
    assistant = [t for t in ids if t > 0]
    shown = assistant[page * per_page:(page + 1) * per_page]
    has_prompt = 0 in ids or bool(conversation.prompt_tokens)
    return ([0] if page == 0 and has_prompt else []) + shown


def page_count(conversation: Conversation, per_page: int = TURNS_PER_PAGE) -> int:
    return max(1, -(-len({s.turn for s in conversation.spans if s.turn > 0}) // per_page))


def chat_html(conversation: Conversation, quantity: str | None, value_columns: list[str],
              turns: list[int] | None = None) -> str:
    """The episode (or the turns ``turns`` of it) as one HTML string for ``st.html``: a heading per
    turn, a labelled block per span. Trained tokens are coloured by ``quantity`` on one scale over
    every trained token of the episode; the hover of a token lists ``value_columns``."""
    rows = conversation.tokens
    wanted = None if turns is None else set(turns)
    pieces = [p for p in conversation.spans if wanted is None or p.turn in wanted]
    lo = min((p.start for p in pieces), default=0)
    hi = max((p.end for p in pieces), default=0)
    texts = coloured_blocks(rows.iloc[lo:hi], quantity, value_columns, [(p.start - lo, p.end - lo) for p in pieces],
                            scale_span(rows, quantity))  # one scale: the whole episode's
    out, current = [], None
    if conversation.prompt_tokens and (wanted is None or 0 in wanted) and not any(p.turn == 0 for p in pieces):
        colour = ROLE_COLOURS["user"]  # the prompt_ids rows: shown as text, never trained
        out.append(f'<div style="{_TURN}">prompt</div>'
                   f'<div style="{_BLOCK.format(colour=colour, background="#fafafa")}">'
                   f'<div style="{_LABEL.format(colour=colour)}">prompt (prompt_ids) · not trained: prompt</div>'
                   f'<div style="{_TEXT}white-space:pre-wrap;">{html.escape("".join(conversation.prompt_tokens))}'
                   f'</div></div>')
        current = 0
    for piece, tokens in zip(pieces, texts):
        if piece.turn != current:
            current = piece.turn
            title = "prompt" if current == 0 else f"turn {current}"
            out.append(f'<div style="{_TURN}">{html.escape(title)}</div>')
        colour = ROLE_COLOURS.get("tool_call" if piece.block == TOOL_CALL else piece.role, "#999")
        background = "#fff" if piece.kept else "#fafafa"
        if piece.turn >= 1 and piece.kept and piece.block in (TOOL_RESULT, ENVIRONMENT_BLOCK):
            colour, background = TRAINED_FOREIGN, "#fdecea"
        out.append(f'<div style="{_BLOCK.format(colour=colour, background=background)}">'
                   f'<div style="{_LABEL.format(colour=colour)}">{html.escape(role_label(piece))}</div>'
                   f'<div style="{_TEXT}">{tokens}</div></div>')
    return f'<div>{"".join(out)}</div>'


def spans_frame(conversation: Conversation) -> pd.DataFrame:
    """One row per span: turn, role, block, start, end, tokens, trained, mask_reason, text (literal)."""
    return pd.DataFrame([{"turn": s.turn, "role": s.role, "block": s.block, "start": s.start, "end": s.end,
                          "tokens": s.length, "trained": s.kept, "mask_reason": s.mask_reason, "text": s.text}
                         for s in conversation.spans],
                        columns=["turn", "role", "block", "start", "end", "tokens", "trained", "mask_reason", "text"])


def turn_display_frame(conversation: Conversation) -> pd.DataFrame:
    """The per-turn table as shown: columns of :data:`TURN_HEADERS` present with a value, plus
    ``first_trained`` (position of the turn's first trained token, for the link to the Tokens page)."""
    turns = conversation.turns.copy()
    rows = conversation.tokens
    trained = rows[rows["kept"].astype(bool)]
    first = trained.groupby("turn")["position"].min() if len(trained) else pd.Series(dtype="int64")
    turns["first_trained"] = turns["turn"].map(first).astype("Int64")
    keep = [c for c in TURN_HEADERS if c in turns and (c in ("turn", "roles", "tokens", "trained_tokens")
                                                       or turns[c].notna().any())]
    return turns[[*keep, "first_trained"]]


def trained_positions(conversation: Conversation) -> list[int]:
    """The positions of the trained tokens, in order (what the token chooser offers)."""
    rows = conversation.tokens
    return rows.loc[rows["kept"].astype(bool), "position"].astype(int).tolist()
