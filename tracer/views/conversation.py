"""The conversation view: one sequence of one step read as an episode (SPEC.md section 4, "Turns,
roles and mask reasons"): its spans in order (the prompt, each assistant turn, the tool results and
environment messages that answer it) and one row per turn with what the loss saw of it.

The spans are those of :func:`tracer.format.turns.row_spans` over the token table's ``turn`` and
``role`` columns (recorded ``turn_ids`` / ``token_roles``, else read from the mask); the mask reasons
are the token table's (recorded ``mask_reasons``, else :func:`tracer.format.turns.infer_mask_reasons`).
One thing is added here: an assistant span whose text holds a tool call (``<tool_call>…</tool_call>``,
the Hermes / Qwen template that TRL's ``tools=`` renders; or a role named ``tool_call``) is cut into
its message and its call, so that the call reads as its own block.

The per-turn means are over each turn's *trained* tokens (``completion_mask`` True) with
:func:`tracer.formulas.masked_mean`: a tool result or placeholder never enters them.

A single-turn row is an episode of one assistant turn (and its prompt rows, when the trace records
``prompt_ids``, stay on the Tokens page).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import pandas as pd
import torch

from tracer import formulas
from tracer.format import turns as turn_format
from tracer.read import StepKey, Trace
from tracer.read.tables import KEPT

# Kinds of block a span is drawn as.
PROMPT_BLOCK, MESSAGE, TOOL_CALL, TOOL_RESULT, ENVIRONMENT_BLOCK = (
    "prompt", "message", "tool_call", "tool_result", "environment")
# Where a tool call starts and ends in an assistant turn's text (Hermes / Qwen, Llama 3, Mistral).
TOOL_CALL_OPEN = ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]")
TOOL_CALL_CLOSE = ("</tool_call>", "<|eom_id|>")
TOOL_CALL_ROLE = "tool_call"
# Per-turn columns: the turn's trained-token means (name -> token table column).
TURN_MEANS = {"mean_ratio": "ratio", "mean_ref_kl_k3": "ref_kl_k3", "mean_abs_old_sampler": "abs_old_sampler",
              "advantage": "advantages"}
TURN_COLUMNS = ("turn", "roles", "tokens", "trained_tokens", *TURN_MEANS, "reward")


@dataclass(frozen=True)
class ConversationSpan:
    """A run of one row's tokens with one turn, role and kind of block.

    Attributes:
        turn: the turn id (0 = prompt).
        role: the role name (``system``, ``user``, ``assistant``, ``tool``…; ``""`` for a prompt
            whose roles the trace does not record, ``environment`` for a masked run between turns).
        block: how to draw it: ``prompt``, ``message``, ``tool_call``, ``tool_result``, ``environment``.
        start, end: positions ``[start, end)`` in the completion row.
        tokens: the token strings, one per position.
        kept: how many of its tokens the loss keeps.
        mask_reason: ``kept`` when the loss keeps them all, else the commonest reason of its
            masked tokens (``tool_output``, ``prompt``, ``after_eos``…).
    """

    turn: int
    role: str
    block: str
    start: int
    end: int
    tokens: tuple[str, ...]
    kept: int
    mask_reason: str

    @property
    def text(self) -> str:
        return "".join(self.tokens)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Conversation:
    """One sequence as an episode: ``spans`` in order, ``turns`` (one row per turn:
    :data:`TURN_COLUMNS`), ``tokens`` (the sequence's completion rows of ``Trace.token_table`` with
    ``abs_old_sampler`` added when sampler logprobs are recorded), ``reward`` (the sequence's, or None)."""

    spans: list[ConversationSpan]
    turns: pd.DataFrame
    tokens: pd.DataFrame
    reward: float | None
    prompt_tokens: tuple[str, ...] = ()

    @property
    def trained_not_written(self) -> list[ConversationSpan]:
        """Spans after the prompt that the model did not write (tool results, environment messages)
        yet the loss keeps tokens of: what ``turns.tool_output_trained`` names."""
        return [s for s in self.spans if s.turn >= 1 and s.kept and s.block in (TOOL_RESULT, ENVIRONMENT_BLOCK)]

    @property
    def assistant_turns(self) -> int:
        return int(self.turns["turn"].max()) if len(self.turns) else 0


def conversation(trace: Trace, key: StepKey, sequence: int) -> Conversation:
    """The episode of row ``sequence`` of the step file ``key`` (reads that row and the ``[B]``
    rewards only). Raises IndexError for a row out of range."""
    table = trace.token_table(key, sequence)
    rewards = trace.load_step(key, ["rewards"], derive=False).get("rewards")
    reward = float(rewards[sequence]) if rewards is not None and rewards.dim() == 1 and sequence < len(rewards) \
        else None
    return conversation_from_table(table, reward)


def conversation_from_table(table: pd.DataFrame, reward: float | None = None) -> Conversation:
    """:func:`conversation` over a token table already read (one sequence: ``Trace.token_table(key,
    sequence)``); ``reward`` is the sequence's reward (None: not recorded). The prompt rows of the
    table (``prompt_ids``, when the completion rows do not hold the prompt) become ``prompt_tokens``
    (padding left out)."""
    prompt = table[(table["section"] == "prompt") & (table["mask_reason"] == turn_format.PROMPT)] \
        if "section" in table else table.iloc[0:0]
    prompt_tokens = tuple(str(t) for t in prompt["token_text"].tolist())
    rows = table[table["section"] == "completion"] if "section" in table else table
    rows = rows.reset_index(drop=True)
    if "old_logprobs" in rows and "sampler_logprobs" in rows:
        old = torch.tensor(rows["old_logprobs"].to_numpy(dtype="float64", na_value=math.nan))
        sampler = torch.tensor(rows["sampler_logprobs"].to_numpy(dtype="float64", na_value=math.nan))
        rows = rows.assign(abs_old_sampler=formulas.sampler_log_ratio(old, sampler).abs().numpy())
    spans = episode_spans(rows)
    return Conversation(spans, turn_frame(rows, reward), rows, reward, prompt_tokens)


def episode_spans(rows: pd.DataFrame) -> list[ConversationSpan]:
    """The spans of one sequence's completion rows (``turn``, ``role``, ``kept``, ``mask_reason``,
    ``token_text`` columns), padding left out, assistant spans cut at their tool calls."""
    turns = rows["turn"].astype(int).tolist()
    roles = rows["role"].astype(str).tolist()
    keep = rows["kept"].astype(bool).tolist()
    texts = [str(t) for t in rows["token_text"].tolist()]
    reasons = rows["mask_reason"].astype(str).tolist()
    names = list(dict.fromkeys(roles))
    codes = [names.index(r) for r in roles]
    out: list[ConversationSpan] = []
    for span in turn_format.row_spans(turns, codes, keep, names):
        for start, end, block in _blocks(span, texts):
            masked = [r for r in reasons[start:end] if r != KEPT]
            reason = KEPT if not masked else max(dict.fromkeys(masked), key=masked.count)
            out.append(ConversationSpan(span.turn, span.role, block, start, end, tuple(texts[start:end]),
                                        sum(keep[start:end]), reason))
    return out


def _blocks(span: turn_format.Span, texts: Sequence[str]) -> list[tuple[int, int, str]]:
    """``(start, end, block)`` pieces of one span: a non-assistant span is one block; an assistant
    span is cut where a tool call opens and after it closes."""
    if span.turn == 0 and span.role != turn_format.ASSISTANT:
        return [(span.start, span.end, PROMPT_BLOCK)]
    if span.role == turn_format.TOOL:
        return [(span.start, span.end, TOOL_RESULT)]
    if span.role == TOOL_CALL_ROLE:
        return [(span.start, span.end, TOOL_CALL)]
    if span.role != turn_format.ASSISTANT:
        return [(span.start, span.end, ENVIRONMENT_BLOCK if span.role in ("", turn_format.ENVIRONMENT_ROLE)
                 else MESSAGE)]
    return _tool_call_pieces(span.start, span.end, texts)


def _tool_call_pieces(start: int, end: int, texts: Sequence[str]) -> list[tuple[int, int, str]]:
    """An assistant span cut into message and tool-call pieces at :data:`TOOL_CALL_OPEN` /
    :data:`TOOL_CALL_CLOSE` markers (a marker may straddle tokens: the piece starts at the token
    holding the marker's first character and ends after the token holding its last)."""
    bounds = [0]  # bounds[i]: the character offset where token start + i begins
    text = ""
    for t in range(start, end):
        text += texts[t]
        bounds.append(len(text))
    token_at = lambda char: next(i for i in range(len(bounds) - 1) if bounds[i + 1] > char)  # noqa: E731
    pieces, cursor, pos = [], start, 0
    while True:
        opens = [(text.find(m, pos), m) for m in TOOL_CALL_OPEN if text.find(m, pos) >= 0]
        if not opens:
            break
        at, marker = min(opens)
        first = start + token_at(at)
        closes = [(text.find(m, at + len(marker)), m) for m in TOOL_CALL_CLOSE if text.find(m, at + len(marker)) >= 0]
        stop_char = min(closes)[0] + len(min(closes)[1]) if closes else len(text)
        last = start + token_at(stop_char - 1) + 1
        if first > cursor:
            pieces.append((cursor, first, MESSAGE))
        pieces.append((max(first, cursor), last, TOOL_CALL))
        cursor, pos = last, stop_char
        if cursor >= end:
            break
    if cursor < end:
        pieces.append((cursor, end, MESSAGE))
    return pieces


def turn_frame(rows: pd.DataFrame, reward: float | None = None) -> pd.DataFrame:
    """One row per turn of one sequence (turn 0, the prompt, when present; padding left out):
    ``turn``, ``roles`` (in order of appearance), ``tokens``, ``trained_tokens``, the means of
    :data:`TURN_MEANS` over the turn's trained tokens (:func:`tracer.formulas.masked_mean`; NaN
    when it trains none, or the column is absent), ``reward`` (the sequence's, on its last turn)."""
    turns = torch.tensor(rows["turn"].to_numpy(dtype="int64"))  # (T,)
    keep = torch.tensor(rows["kept"].to_numpy(dtype=bool))  # (T,)
    order = torch.argsort(turns, stable=True)  # positions grouped by turn
    present, sizes = torch.unique_consecutive(turns[order], return_counts=True)
    groups = dict(zip(present.tolist(), torch.split(order, sizes.tolist())))  # turn -> its positions
    ids = [t for t in groups if t != turn_format.PAD_TURN]
    if not ids:
        return pd.DataFrame(columns=list(TURN_COLUMNS))
    trained = [keep[groups[t]] for t in ids]  # K x (n_k,)
    roles = rows["role"].astype(str).replace("", "prompt").groupby(rows["turn"], sort=False).unique()
    out = pd.DataFrame({
        "turn": ids,
        "roles": [", ".join(roles[t]) for t in ids],
        "tokens": [len(groups[t]) for t in ids],
        "trained_tokens": [int(k.sum()) for k in trained],
    })
    for name, column in TURN_MEANS.items():
        if column not in rows:
            out[name] = math.nan
            continue
        values = torch.tensor(rows[column].to_numpy(dtype="float64", na_value=math.nan))  # (T,)
        out[name] = [float(formulas.masked_mean(values[groups[t]], k)) if bool(k.any()) else math.nan
                     for t, k in zip(ids, trained)]
    out["reward"] = [reward if reward is not None and t == ids[-1] else math.nan for t in ids]
    return out
