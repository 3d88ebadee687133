"""What a tokenizer's chat template writes right after the end-of-turn token of an assistant message
(the manifest's ``tokenizer.template_end_of_turn_tail``): measured once at capture, read by
``masks.after_eos``.

A chat template closes each message with an end-of-turn token and may write more tokens after it
before the next message opens: ChatML (Qwen, MiniMind) writes ``<|im_end|>`` then ``"\\n"``; Llama 3
writes ``<|eot_id|>`` and nothing else (the next message opens with ``<|start_header_id|>``). A loss
mask built from the rendered conversation (MiniMind's ``train_dpo.py`` keeps ``<|im_end|>`` and the
newline after it) keeps that tail with the answer: it is the template's, not text after the answer.

Format (manifest key ``tokenizer.template_end_of_turn_tail``): a JSON object ``{"<end-of-turn id>":
[tail ids...]}``, keys decimal strings (JSON object keys), each list the token ids the template writes
after that end-of-turn token (``[]``: nothing). Absent when the tokenizer has no chat template or the
tail could not be measured; a reader then falls back to its own rule.

How it is measured (:func:`end_of_turn_tails`): the template renders ``[user, assistant]`` and
``[user, assistant, user]`` with ``tokenize=True``. The assistant's end-of-turn token is the last
special token of the first rendering (after it come only the template's own non-special tokens);
the tail is what both renderings write after that token (their common prefix there): what the
template writes after an answer whether or not another message follows.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

log = logging.getLogger(__name__)

TEMPLATE_TAIL_KEY = "template_end_of_turn_tail"
MAX_TAIL = 16  # a longer recorded tail is not a chat template's end of turn: ignored when read
MAX_END_TOKENS = 64  # end-of-turn tokens read from a manifest (one is recorded; more is not a trace of ours)
# The conversation rendered to measure the tail (short, plain text, no system message).
_USER, _ANSWER, _USER_AGAIN = "What is 3 + 4?", "7", "And 5 + 6?"


def end_of_turn_tails(tokenizer: Any) -> dict[str, list[int]] | None:
    """``{"<end-of-turn id>": [tail ids]}`` for a tokenizer (or processor) with a chat template, as
    :data:`TEMPLATE_TAIL_KEY` stores it; None when it has none or rendering fails (capture never
    fails because of it: the reason is logged at debug level)."""
    if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
        return None
    user, assistant = {"role": "user", "content": _USER}, {"role": "assistant", "content": _ANSWER}
    try:
        alone = _render(tokenizer, [user, assistant])
        followed = _render(tokenizer, [user, assistant, {"role": "user", "content": _USER_AGAIN}])
    except Exception as err:  # a template that needs other roles or keys: no tail recorded
        log.debug("tracer: chat template of %s not rendered: %s", type(tokenizer).__name__, err)
        return None
    special = _special_ids(tokenizer)
    ends = [k for k, i in enumerate(alone) if i in special]
    if not ends:
        return None
    at = ends[-1]
    eot = alone[at]
    nth = alone[: at + 1].count(eot)  # the same message's end in the longer rendering
    positions = [k for k, i in enumerate(followed) if i == eot]
    if len(positions) < nth:
        return None
    after_alone, after_followed = alone[at + 1:], followed[positions[nth - 1] + 1:]
    tail = []
    for x, y in zip(after_alone, after_followed):
        if x != y:
            break
        tail.append(x)
    return {str(eot): tail[:MAX_TAIL]}


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    if isinstance(out, Mapping) or hasattr(out, "keys"):  # transformers >= 5 returns a BatchEncoding
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        out = out[0]
    return [int(i) for i in out]


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens: ``all_special_ids`` and every added token marked special."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()}
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(i))
    return ids


def recorded_tails(tokenizer_entry: Any) -> dict[int, tuple[int, ...]] | None:
    """The manifest's ``tokenizer`` entry's :data:`TEMPLATE_TAIL_KEY` as ``{end-of-turn id: tail ids}``;
    None when absent or malformed (more than :data:`MAX_END_TOKENS` keys, a key that is not a decimal
    id, a tail that is not a list of at most :data:`MAX_TAIL` non-negative integers): a trace from a
    stranger never breaks a check."""
    raw = tokenizer_entry.get(TEMPLATE_TAIL_KEY) if isinstance(tokenizer_entry, Mapping) else None
    if not isinstance(raw, Mapping) or not raw or len(raw) > MAX_END_TOKENS:
        return None
    out: dict[int, tuple[int, ...]] = {}
    for key, tail in raw.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(tail, Sequence) and not isinstance(tail, str)
                and len(tail) <= MAX_TAIL and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                  for i in tail)):
            return None
        out[int(key)] = tuple(tail)
    return out


def tail_text(tail: Sequence[int], token_strings: Sequence[str] | None) -> str:
    """``[198 '\\n']`` (ids with their text when the trace holds token strings); ``nothing`` for ``()``."""
    if not tail:
        return "nothing"
    def one(i: int) -> str:
        return f"{i} {token_strings[i]!r}" if token_strings is not None and 0 <= i < len(token_strings) else str(i)
    return "[" + ", ".join(one(i) for i in tail) + "]"
