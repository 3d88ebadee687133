"""Multi-turn and agentic rows (SPEC.md section 4, "Turns, roles and mask reasons"): what the
optional per-token fields ``turn_ids``, ``token_roles`` and ``mask_reasons`` mean, and the spans
they describe.

An episode is a prompt followed by assistant turns; between the turns sit tool results and the
environment's messages, which the model did not sample and must never be trained on. A row holds
either a whole episode (a *packed* row: the prompt's tail, every turn and every tool result in one
``[T]`` row, as MiniMind's ``train_agent.py`` and TRL's ``tools=`` build them) or one turn of it
(*per-turn* rows, tied together by the ``[B]`` field ``episode_ids``).

- ``turn_ids [B, T]`` int64: 0 = the prompt (context before the first assistant turn); k >= 1 = the
  k-th assistant turn *and* the tool results / environment messages that answer it, up to the next
  assistant turn; -1 = padding.
- ``token_roles [B, T]`` int64: index into step metadata ``role_names`` (default
  :data:`ROLE_NAMES`); -1 = padding.
- ``mask_reasons [B, T]`` int64: why each token is or is not in the loss, index into step metadata
  ``mask_reason_names`` (default :data:`MASK_REASON_NAMES`, which a trainer may extend with its own
  names). When absent the reader infers the reasons (:func:`infer_mask_reasons`).

A trace that records none of them is read as before: a single-turn completion, or, when its mask
keeps several runs of tokens separated by masked non-padding tokens, a packed episode whose turns
are those runs (:func:`infer_turn_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from tracer.format.arrays import as_bool, as_int64, is_torch, like

if TYPE_CHECKING:
    import torch

ROLE_NAMES = ("system", "user", "assistant", "tool")
ASSISTANT, TOOL, SYSTEM, USER, ENVIRONMENT_ROLE = "assistant", "tool", "system", "user", "environment"

# Why a token is (not) in the loss. ``masked``: not kept for a reason the trace does not say.
KEPT, PROMPT, PROMPT_PADDING, PADDING, AFTER_EOS, TRUNCATED, TOOL_OUTPUT, ENVIRONMENT, MASKED = (
    "kept", "prompt", "prompt_padding", "padding", "after_eos", "truncated", "tool_output", "environment", "masked")
MASK_REASON_NAMES = (KEPT, PROMPT, PADDING, AFTER_EOS, TRUNCATED, TOOL_OUTPUT, ENVIRONMENT)
NOT_TRAINED_TEXT = {
    PROMPT: "prompt", PROMPT_PADDING: "prompt padding", PADDING: "padding", AFTER_EOS: "after the end of the answer",
    TRUNCATED: "truncated", TOOL_OUTPUT: "tool output", ENVIRONMENT: "environment message", MASKED: "masked",
}
PAD_TURN = -1
TURN_FIELDS = ("turn_ids", "token_roles", "mask_reasons")


ASSISTANT_ALIASES = ("model", "gpt", "bot")  # other templates' names of the assistant role (Gemma: model)


def role_names(metadata: Mapping[str, object] | None) -> tuple[str, ...]:
    """The step's role names (metadata ``role_names``, else :data:`ROLE_NAMES`); a name of
    :data:`ASSISTANT_ALIASES` reads ``assistant`` when the names hold no ``assistant``."""
    names = (metadata or {}).get("role_names")
    if not (isinstance(names, (list, tuple)) and names):
        return ROLE_NAMES
    names = tuple(str(n) for n in names)
    if ASSISTANT not in names:
        names = tuple(ASSISTANT if n in ASSISTANT_ALIASES else n for n in names)
    return names


def reason_names(metadata: Mapping[str, object] | None) -> tuple[str, ...]:
    """The step's mask reason names (metadata ``mask_reason_names``, else :data:`MASK_REASON_NAMES`)."""
    names = (metadata or {}).get("mask_reason_names")
    return tuple(str(n) for n in names) if isinstance(names, (list, tuple)) and names else MASK_REASON_NAMES


@dataclass(frozen=True)
class Span:
    """A maximal run of one row's tokens with one turn and one role.

    Attributes:
        turn: the turn id (0 = prompt).
        role: the role name (``""`` when the trace records no roles: then every kept run is
            ``assistant`` and the masked runs between them ``environment``).
        start, end: token positions ``[start, end)`` in the row.
        kept: how many of its tokens the mask keeps.
    """

    turn: int
    role: str
    start: int
    end: int
    kept: int

    @property
    def length(self) -> int:
        return self.end - self.start


MIN_GAP = 2  # non-pad, non-EOS tokens a masked gap must hold to separate two turns (infer_turn_ids)


def infer_turn_ids(ids: torch.Tensor, keep: torch.Tensor, pad_token_id: int | None,
                   eos_token_id: int | None = None) -> torch.Tensor:
    """Turn ids ``[B, T]`` int64 read from the mask alone, for a trace that records none: tokens
    before the first kept one are the prompt (0); a run of kept tokens opens a new turn when the
    masked gap before it holds at least :data:`MIN_GAP` tokens that are neither pad nor EOS (a tool
    result or an environment message with its role header; a hole of padding or a lone EOS does not
    separate turns); the masked tokens after a turn's kept run belong to that turn; the trailing pad
    run is -1. A single-turn row comes out as 0 … 0, 1 … 1, -1 … -1.

    ``ids``, ``keep``: ``[B, T]`` (int64, bool), numpy arrays or torch tensors: the result is of
    ``ids``' kind."""
    B, T = keep.shape
    rows_ids, rows_keep = ids.tolist(), as_bool(keep).tolist()
    out = []
    for row_ids, row_keep in zip(rows_ids, rows_keep):
        trailing = T
        while trailing > 0 and not row_keep[trailing - 1] and pad_token_id is not None \
                and row_ids[trailing - 1] == pad_token_id:
            trailing -= 1
        turns, turn, gap = [], 0, 0
        for t in range(T):
            if t >= trailing:
                turns.append(PAD_TURN)
                continue
            if row_keep[t]:
                if turn == 0 or (t > 0 and not row_keep[t - 1] and gap >= MIN_GAP):
                    turn += 1
                gap = 0
            elif row_ids[t] != pad_token_id and row_ids[t] != eos_token_id:
                gap += 1
            turns.append(turn)
        out.append(turns)
    return like(out, ids).reshape(B, T)


def turn_count(turn_ids: torch.Tensor) -> torch.Tensor:
    """Assistant turns per row, ``[B]`` int64 (the largest turn id; 0 for a row without one), of
    ``turn_ids``' kind (numpy array or torch tensor)."""
    if is_torch(turn_ids):
        if turn_ids.numel() == 0:
            return turn_ids.new_zeros(turn_ids.shape[0]).long()
        return turn_ids.clamp(min=0).max(dim=1).values
    if turn_ids.size == 0:
        return np.zeros(turn_ids.shape[0], dtype=np.int64)
    return np.clip(turn_ids, 0, None).max(axis=1)


def row_spans(turns: Sequence[int], roles: Sequence[int] | None, keep: Sequence[bool],
              names: Sequence[str] = ROLE_NAMES) -> list[Span]:
    """The spans of one row: maximal runs of equal (turn, role), padding (turn -1) left out.

    ``turns``, ``roles``, ``keep``: the row's ``[T]`` values as lists; ``roles`` None when the trace
    records none (then a kept run is ``assistant`` and a masked run ``""`` in turn 0 and
    ``environment`` after it)."""
    spans: list[Span] = []
    T = len(turns)
    t = 0
    while t < T:
        turn = turns[t]
        key = (turn, roles[t] if roles is not None else bool(keep[t]))
        end = t + 1
        while end < T and (turns[end], roles[end] if roles is not None else bool(keep[end])) == key:
            end += 1
        if turn != PAD_TURN:
            if roles is not None:
                r = roles[t]
                role = names[r] if 0 <= r < len(names) else f"role {r}"
            else:
                role = ASSISTANT if keep[t] else ("" if turn == 0 else ENVIRONMENT_ROLE)
            spans.append(Span(int(turn), role, t, end, int(sum(1 for k in keep[t:end] if k))))
        t = end
    return spans


def infer_mask_reasons(ids: Sequence[int], keep: Sequence[bool], eos_token_id: int | None, pad_token_id: int | None,
                       turns: Sequence[int] | None = None, roles: Sequence[int] | None = None,
                       names: Sequence[str] = ROLE_NAMES) -> list[str]:
    """Why each token of one row is kept or masked, ``[T]`` strings (:data:`MASK_REASON_NAMES` and
    ``masked``).

    With turns and roles: ``kept``; ``padding`` (turn -1 or the trailing pad run); ``prompt`` (turn
    0); ``tool_output`` (role tool); ``environment`` (any other non-assistant role after the
    prompt); an assistant token after an EOS *of the same turn* is ``after_eos`` (the EOS that closes
    a turn never reaches into the next one), any other masked assistant token ``masked``.
    Without them a row is one completion: ``after_eos`` after its first EOS at or after the first
    kept token, ``padding`` on pad tokens, ``prompt`` before the first kept token (a packed row's
    prompt), ``masked`` otherwise, unless the mask keeps runs separated by masked non-pad tokens (a
    packed episode, :func:`infer_turn_ids`): then the tokens before the first kept one are
    ``prompt`` and the gaps between kept runs ``environment``."""
    T = len(ids)
    if turns is None:
        inferred = infer_turn_ids(np.asarray([list(ids)], dtype=np.int64).reshape(1, T),
                                  np.asarray([list(keep)], dtype=bool).reshape(1, T), pad_token_id,
                                  eos_token_id)[0].tolist()
        multi = max(inferred, default=0) > 1
    else:
        inferred, multi = list(turns), True
    out: list[str] = []
    seen_eos_turn: int | None = None
    ever_eos = False
    first_kept = next((t for t in range(T) if keep[t]), T)
    for t in range(T):
        tok, k, turn = ids[t], bool(keep[t]), inferred[t]
        role = None
        if roles is not None:
            r = roles[t]
            role = names[r] if 0 <= r < len(names) else None
        if k:
            out.append(KEPT)
        elif turns is None and not multi:
            out.append(AFTER_EOS if ever_eos else PADDING if pad_token_id is not None and tok == pad_token_id
                       else PROMPT if 0 < first_kept < T and t < first_kept else MASKED)
        elif turn == PAD_TURN or (pad_token_id is not None and tok == pad_token_id and role is None):
            out.append(PADDING)
        elif turn == 0:
            out.append(PROMPT)
        elif role == TOOL:
            out.append(TOOL_OUTPUT)
        elif role is not None and role != ASSISTANT:
            out.append(ENVIRONMENT)
        elif role == ASSISTANT:
            out.append(AFTER_EOS if seen_eos_turn == turn else MASKED)
        else:  # no roles: a masked run inside a turn comes after its assistant tokens
            out.append(ENVIRONMENT)
        if eos_token_id is not None and tok == eos_token_id and t >= first_kept:
            ever_eos = True
            if role in (None, ASSISTANT):
                seen_eos_turn = turn
    return out


def recorded_mask_reasons(codes: Sequence[int], names: Sequence[str]) -> list[str]:
    """A recorded ``mask_reasons`` row ``[T]`` as names; an out-of-range code reads ``masked``."""
    return [names[c] if 0 <= c < len(names) else MASKED for c in codes]


IM_START = "<|im_start|>"  # ChatML: every message opens with <|im_start|>{role}\n
IM_END = "<|im_end|>"  # ... and closes with <|im_end|>
TOOL_RESPONSE = "<tool_response>"
CONTEXT_ROLE = "context"  # the tail of a prompt cut from the left: a message whose role header was cut away


def message_end_ids(token_strings: Sequence[str] | None, eos_token_id: int | None) -> set[int]:
    """Token ids that close a message: the EOS, and a ChatML template's ``<|im_end|>`` (a tokenizer
    whose EOS is another token still ends each turn with it)."""
    ends = {eos_token_id} if eos_token_id is not None else set()
    if token_strings is not None:
        ends |= {i for i, s in enumerate(token_strings) if s == IM_END}
    return ends


def chatml_roles(ids: torch.Tensor, keep: torch.Tensor, token_strings: Sequence[str], pad_token_id: int | None,
                 names: Sequence[str] = ROLE_NAMES) -> tuple[torch.Tensor, torch.Tensor, tuple[str, ...]] | None:
    """Roles and turns read from a ChatML chat template's markers in the token ids of packed rows
    (the prompt ahead of the turns), for a trace that records none: each message opens with
    ``<|im_start|>``, then its role's name up to a newline; the role holds until the next
    ``<|im_start|>``; each ``<|im_start|>assistant`` opens a turn (two assistant messages in a row
    are two turns). A ``user`` message opening with ``<tool_response>`` (Qwen's templates) is a tool
    result. Tokens before a row's first marker: a leading pad run the mask drops is -1 (left
    padding); the rest is the prompt's tail (turn 0; its role named by the row's leading text when
    that is a role name and a newline, as in a row that lost its ``<|im_start|>`` to
    ``input_ids[:, 1:]``, else :data:`CONTEXT_ROLE`, a row cut from the left), unless the mask keeps
    its first token (then the row opens with an assistant turn). The trailing pad run the mask
    drops is -1.

    Returns ``(roles [B, T] int64, turn_ids [B, T] int64, role names)``, the names extended by any
    other role found; None when the tokenizer has no ``<|im_start|>`` token or no row holds one."""
    start_ids = [i for i, s in enumerate(token_strings) if s == IM_START]
    if not start_ids or not bool(np.isin(np.asarray(ids.tolist(), dtype=np.int64), start_ids).any()):
        return None
    start = start_ids[0]
    names = list(names)
    B, T = ids.shape
    roles_out = np.full((B, T), -1, dtype=np.int64)
    turns_out = np.full((B, T), PAD_TURN, dtype=np.int64)

    def text(i: int) -> str:
        return token_strings[i] if 0 <= i < len(token_strings) else ""

    def header(row: list[int], t: int) -> tuple[str, int]:
        """The role named from position t up to the newline, and the position after the newline."""
        parts, u = [], t
        while u < len(row) and len(parts) < 8:
            piece = text(row[u])
            u += 1
            if "\n" in piece:
                parts.append(piece.split("\n", 1)[0])
                return "".join(parts).strip(), u
            parts.append(piece)
        return "", t

    def code(role: str) -> int:
        if role not in names:
            names.append(role)
        return names.index(role)

    assistant = code(ASSISTANT)
    for b, (row, row_keep) in enumerate(zip(ids.tolist(), as_bool(keep).tolist())):
        end = T
        while end > 0 and not row_keep[end - 1] and pad_token_id is not None and row[end - 1] == pad_token_id:
            end -= 1
        first = 0
        while first < end and not row_keep[first] and pad_token_id is not None and row[first] == pad_token_id:
            first += 1
        if first >= end:
            continue
        if row_keep[first]:
            current, turn = assistant, 1
        else:
            role, _ = header(row, first)
            current, turn = code(role if role in names else CONTEXT_ROLE), 0
        roles, turns = [], []
        for t in range(first, end):
            if row[t] == start:
                role, after = header(row, t + 1)
                if role == USER and after < end and text(row[after]).startswith(TOOL_RESPONSE):
                    role = TOOL  # Qwen's templates wrap a tool result in a user message
                current = code(role or ENVIRONMENT_ROLE)
                if current == assistant:
                    turn += 1
            roles.append(current)
            turns.append(turn)
        roles_out[b, first:end] = roles
        turns_out[b, first:end] = turns
    return like(roles_out, ids), like(turns_out, ids), tuple(names)


def turns_from_roles(roles: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """Turn ids ``[B, T]`` from roles: each assistant message (a run of assistant tokens after a
    token of another role, or the row's start) opens the next turn; tokens before the first one are
    the prompt (0); padding (-1) stays -1. ``roles``: ``[B, T]`` int64 codes into ``names``."""
    assistant = list(names).index(ASSISTANT) if ASSISTANT in names else -2
    codes = np.asarray(roles.tolist(), dtype=np.int64).reshape(roles.shape)
    is_a = codes == assistant
    opens = is_a.copy()
    opens[:, 1:] &= ~is_a[:, :-1]
    turns = opens.astype(np.int64).cumsum(axis=1)
    return like(np.where(codes < 0, PAD_TURN, turns), roles)


@dataclass(frozen=True)
class Layout:
    """Turns and roles of a step's ``[B, T]`` completion rows, however the trace tells them.

    Attributes:
        turn_ids: ``[B, T]`` int64, 0 = prompt, k >= 1 = turn k, -1 = padding.
        roles: ``[B, T]`` int64 codes into ``role_names`` (-1 = padding), or None when no roles are
            known (then a kept run is ``assistant`` and a masked run after the prompt ``environment``).
        role_names: the names of the role codes.
        source: ``"recorded"`` (turn_ids or token_roles in the file), ``"chat_template"`` (roles read
            from the ChatML markers of the token strings, :func:`chatml_roles`) or ``"mask"`` (turns
            read from the mask, :func:`infer_turn_ids`).
    """

    turn_ids: torch.Tensor
    roles: torch.Tensor | None
    role_names: tuple[str, ...]
    source: str

    def role_code(self, name: str) -> int | None:
        return self.role_names.index(name) if name in self.role_names else None

    @property
    def multi_turn(self) -> bool:
        return bool((self.turn_ids > 1).any())

    def role_rows(self, keep: torch.Tensor) -> list[list[str]]:
        """Role names ``[B][T]`` (``""`` in padding; without roles: ``assistant`` for kept tokens,
        ``environment`` for masked ones after the prompt, ``""`` in the prompt)."""
        if self.roles is not None:
            table = list(self.role_names)
            return [[table[c] if 0 <= c < len(table) else "" for c in row] for row in self.roles.tolist()]
        return [[ASSISTANT if k else (ENVIRONMENT_ROLE if turn > 0 else "") for turn, k in zip(turns, keeps)]
                for turns, keeps in zip(self.turn_ids.tolist(), as_bool(keep).tolist())]


def read_layout(ids: torch.Tensor, keep: torch.Tensor, fields: Mapping[str, torch.Tensor],
                metadata: Mapping[str, object] | None, token_strings: Sequence[str] | None,
                eos_token_id: int | None, pad_token_id: int | None) -> Layout:
    """The one reading of a step's turns and roles (checks, tables, views and ``tracer info`` all
    call it): recorded ``turn_ids`` / ``token_roles`` first; else, for packed rows (no
    ``prompt_ids`` recorded: the template's prompt is inside the rows), roles and turns from the
    ChatML markers of the token strings (:func:`chatml_roles`) when they show more than one turn or
    a message after the prompt; else turns from the mask (:func:`infer_turn_ids`) and no roles. A
    completion with its prompt in ``prompt_ids`` is never read by its markers: a model can write
    ``<|im_start|>user`` itself (a base model imitating a chat), and those tokens are its own.

    ``ids``, ``keep``: ``[B, T]``; ``fields``: the step's tensors (``turn_ids``, ``token_roles`` used
    when ``[B, T]``)."""
    shape = tuple(ids.shape)
    turn_ids, roles = fields.get("turn_ids"), fields.get("token_roles")
    turn_ids = as_int64(turn_ids) if turn_ids is not None and tuple(turn_ids.shape) == shape else None
    roles = as_int64(roles) if roles is not None and tuple(roles.shape) == shape else None
    names = role_names(metadata)
    if turn_ids is not None or roles is not None:
        if turn_ids is None:
            turn_ids = turns_from_roles(roles, names)
        return Layout(turn_ids, roles, names, "recorded")
    if token_strings is not None and "prompt_ids" not in fields:  # packed rows: the template's prompt is in them
        read = chatml_roles(ids, keep, token_strings, pad_token_id, names)
        if read is not None:
            roles, turn_ids, names = read
            if bool((turn_ids > 1).any()) or bool(((roles != names.index(ASSISTANT)) & (turn_ids >= 1)).any()):
                return Layout(turn_ids, roles, names, "chat_template")
    return Layout(infer_turn_ids(ids, keep, pad_token_id, eos_token_id), None, names, "mask")
