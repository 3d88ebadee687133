"""Turns, roles and mask reasons of TRL's tool-calling rollouts (``GRPOTrainer(tools=...)`` or
``environment_factory=``), read from the token ids and the chat template, never from TRL's masks.

Facts from TRL 1.16's ``grpo_trainer.py`` (``_generate``, ``_tool_call_loop``,
``_get_tool_suffix_ids``, ``_generate_and_score_completions``) that shape a tool-calling row:

- A completion row is a *packed episode*: assistant turn 1 as sampled, up to and including the EOS
  that stopped generation (``<|im_end|>`` for ChatML templates); then the tokens TRL appended for
  the tool results (``_get_tool_suffix_ids``: the template's rendering of the tool messages, from
  just after that EOS through the next generation prompt, e.g. ``\\n<|im_start|>user\\n<tool_response>
  \\n7\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``); then assistant turn 2; and so on, at
  most ``max_tool_calling_iterations`` times. The row is right-padded with ``pad_token_id``.
- ``tool_mask`` is 0 on the appended tokens and 1 elsewhere (padding included); the loss keeps
  ``completion_mask * tool_mask``. ``completion_mask`` is 1 on every unpadded token, except that
  ``mask_truncated_completions`` zeroes a whole row whose last token is neither EOS nor pad.

The roles here come from the structure alone: a sampled run ends at an EOS, the tokens after that
EOS up to the end of the next generation prompt are the tool's (TRL inserted them, the model did not
sample them), the trailing pad run is padding. So a bug that leaves tool tokens in the loss shows
in the trace as ``token_roles`` = tool with ``mask_reasons`` = kept.

Codes follow :mod:`tracer.format.turns`: roles index :data:`ROLE_NAMES`, reasons index
:data:`TRL_MASK_REASON_NAMES` (the defaults plus ``masked``: an assistant token TRL left out of the
loss for a reason the row does not show).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tracer.format.turns import (ASSISTANT, KEPT, MASK_REASON_NAMES, MASKED, PAD_TURN, PADDING, ROLE_NAMES,
                                 TOOL, TOOL_OUTPUT, TRUNCATED)

__all__ = ["ChatMarkers", "TRL_MASK_REASON_NAMES", "chat_markers", "episode_roles", "mask_reasons",
           "turn_metadata"]

TRL_MASK_REASON_NAMES = (*MASK_REASON_NAMES, MASKED)
_ASSISTANT, _TOOL = ROLE_NAMES.index(ASSISTANT), ROLE_NAMES.index(TOOL)
_REASON = {name: code for code, name in enumerate(TRL_MASK_REASON_NAMES)}
_PAD_ROLE = -1


@dataclass(frozen=True)
class ChatMarkers:
    """The token ids that delimit turns in a TRL tool-calling completion row.

    Attributes:
        eos_token_ids: the ids that stop generation (TRL's ``eos_token_ids``): each sampled run ends
            with one.
        pad_token_id: the right-padding id (may equal an EOS id).
        generation_prompt: the ids the template appends after tool messages to open the next
            assistant turn (``<|im_start|>assistant\\n``); empty when the template renders none.
    """

    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    generation_prompt: tuple[int, ...]


def chat_markers(trainer: Any) -> ChatMarkers:
    """The :class:`ChatMarkers` of a TRL trainer: its EOS and pad ids, and the generation prompt its
    chat template renders after a tool message (the template TRL itself uses: ``trainer.chat_template``
    when TRL replaced it by a training template, with ``chat_template_kwargs``)."""
    tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class
    eos = getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id]
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "f", "content": "y"}]
    options = dict(tokenize=True, return_dict=False, chat_template=getattr(trainer, "chat_template", None),
                   **(getattr(trainer, "chat_template_kwargs", None) or {}))
    closed = list(tokenizer.apply_chat_template(messages, add_generation_prompt=False, **options))
    opened = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **options))
    header = tuple(opened[len(closed):]) if opened[:len(closed)] == closed else ()
    return ChatMarkers(tuple(int(i) for i in eos if i is not None), tokenizer.pad_token_id, header)


def _unpadded_length(row: Sequence[int], markers: ChatMarkers) -> int:
    """Tokens before the trailing pad run; when pad is also an EOS, the run's first token is the
    row's own EOS and counts."""
    T = len(row)
    end = T
    while end > 0 and row[end - 1] == markers.pad_token_id:
        end -= 1
    if end < T and markers.pad_token_id in markers.eos_token_ids:
        end += 1
    return end


def _find(row: Sequence[int], pattern: Sequence[int], start: int, stop: int) -> int:
    """First index ``i`` in ``[start, stop - len(pattern)]`` with ``row[i:i+len(pattern)] == pattern``, else -1."""
    n = len(pattern)
    for i in range(start, stop - n + 1):
        if row[i] == pattern[0] and list(row[i:i + n]) == list(pattern):
            return i
    return -1


def _row_roles(row: Sequence[int], markers: ChatMarkers) -> tuple[list[int], list[int], bool]:
    """One row's turn ids and role codes ``[T]``, and whether its last sampled run was cut (no EOS)."""
    T = len(row)
    L = _unpadded_length(row, markers)
    turns, roles = [PAD_TURN] * T, [_PAD_ROLE] * T
    eos = set(markers.eos_token_ids)
    pos, turn = 0, 1
    while pos < L:
        end = next((t + 1 for t in range(pos, L) if row[t] in eos), L)  # sampled run [pos, end), EOS included
        turns[pos:end], roles[pos:end] = [turn] * (end - pos), [_ASSISTANT] * (end - pos)
        if end >= L:
            break
        header = _find(row, markers.generation_prompt, end, L) if markers.generation_prompt else -1
        tool_end = header + len(markers.generation_prompt) if header >= 0 else L  # tool block [end, tool_end)
        turns[end:tool_end], roles[end:tool_end] = [turn] * (tool_end - end), [_TOOL] * (tool_end - end)
        pos, turn = tool_end, turn + 1
    truncated = L > 0 and row[L - 1] not in eos and row[L - 1] != markers.pad_token_id
    return turns, roles, truncated


def episode_roles(completion_ids: torch.Tensor, markers: ChatMarkers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turns and roles of TRL tool-calling completion rows, from the ids alone (module docstring).

    Args:
        completion_ids: ``[B, T]`` int64, right-padded with ``markers.pad_token_id``.
        markers: from :func:`chat_markers`.

    Returns:
        ``turn_ids`` ``[B, T]`` int64 (k >= 1 = assistant turn k and the tool result answering it;
        -1 = padding; no 0: the prompt is not in the completion row), ``token_roles`` ``[B, T]``
        int64 (:data:`~tracer.format.turns.ROLE_NAMES` codes, -1 = padding) and ``truncated``
        ``[B]`` bool (the row ends without EOS: TRL's own test, what ``mask_truncated_completions``
        masks).
    """
    B, T = completion_ids.shape
    rows = [_row_roles(row, markers) for row in completion_ids.tolist()]
    turn_ids = torch.tensor([r[0] for r in rows], dtype=torch.long).reshape(B, T)  # (B, T)
    token_roles = torch.tensor([r[1] for r in rows], dtype=torch.long).reshape(B, T)  # (B, T)
    truncated = torch.tensor([r[2] for r in rows], dtype=torch.bool).reshape(B)  # (B,)
    return turn_ids, token_roles, truncated


def mask_reasons(token_roles: torch.Tensor, keep: torch.Tensor, truncated_masked: torch.Tensor) -> torch.Tensor:
    """Why each token is in the loss or not, ``[B, T]`` int64 codes into :data:`TRL_MASK_REASON_NAMES`.

    ``kept`` where ``keep`` (whatever the role: a kept tool token is the bug this field exposes);
    otherwise ``padding`` (role -1), ``tool_output`` (role tool), ``truncated`` (an assistant token
    of a row TRL masked for ``mask_truncated_completions``), ``masked`` (any other assistant token).

    Args:
        token_roles: ``[B, T]`` int64, from :func:`episode_roles`.
        keep: ``[B, T]`` bool, the mask the loss used (``completion_mask * tool_mask``).
        truncated_masked: ``[B]`` bool, rows TRL masked because they were truncated.
    """
    reasons = torch.full_like(token_roles, _REASON[MASKED])  # (B, T)
    reasons[truncated_masked.unsqueeze(1).expand_as(token_roles) & (token_roles == _ASSISTANT)] = _REASON[TRUNCATED]
    reasons[token_roles == _TOOL] = _REASON[TOOL_OUTPUT]
    reasons[token_roles == _PAD_ROLE] = _REASON[PADDING]
    reasons[keep.bool()] = _REASON[KEPT]
    return reasons


def turn_metadata() -> dict[str, Any]:
    """Step metadata of a tool-calling step: the code names and TRL's advantage assignment (one
    outcome advantage per episode, broadcast over all its turns)."""
    return {"role_names": list(ROLE_NAMES), "mask_reason_names": list(TRL_MASK_REASON_NAMES),
            "advantage_assignment": "episode"}
