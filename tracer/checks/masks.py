"""Masks (SPEC.md section 6): 0 after the first EOS, 0 on trailing padding, every row keeps at least
one token, and DPO chosen/rejected masks built by the same rule.

Padding is what follows the end of a row: its EOS, or the generation length limit the run recorded
(:func:`length_limit`). Pad ids a completion sampled before that limit are tokens, not padding.

"First EOS" is positional (SPEC.md section 10): the first EOS inside the answer, at or after where it
starts (:func:`answer_start`), never an EOS-like token of the prompt or of an earlier chat turn.

The EOS and pad ids come from the manifest's ``tokenizer`` (``eos_token_id``, ``pad_token_id``), or
from step metadata keys of the same names for a single step file.
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.context import StepContext
from tracer.checks.text import count
from tracer.checks.finding import ERROR, INFO, Skip, register
from tracer.format import chat_template, turns
from tracer.format.turns import TURN_FIELDS

SIDES = (("completion_ids", "completion_mask"), ("chosen_ids", "chosen_mask"), ("rejected_ids", "rejected_mask"))


def _sides(ctx: StepContext) -> list[tuple[str, str]]:
    sides = [(i, m) for i, m in SIDES if ctx.has(i, m)]
    if not sides:
        raise Skip("needs completion_ids and completion_mask (or chosen_/rejected_ ids and masks)")
    return sides


def first_index(flags: torch.Tensor) -> torch.Tensor:
    """Per row of a ``[B, T]`` bool tensor, the first True index; T where there is none."""
    B, T = flags.shape
    pos = torch.arange(T).expand(B, T)
    return torch.where(flags, pos, torch.full_like(pos, T)).min(dim=1).values  # (B,)


def answer_start(ids_name: str, keep: torch.Tensor) -> torch.Tensor:
    """Per row, where the answer starts: 0 for ``completion_ids`` (the completion is the answer,
    SPEC.md section 4); for DPO's ``chosen_ids`` / ``rejected_ids``, which hold prompt + answer, the
    first position the side's mask keeps (T for a row that keeps nothing). An EOS before it belongs to
    the prompt or an earlier chat turn (a chat template's ``<|im_end|>``), never the answer's end."""
    if ids_name == "completion_ids":
        return torch.zeros(keep.shape[0], dtype=torch.long)
    return first_index(keep)


def first_eos_of_turn(ids: torch.Tensor, start: torch.Tensor, eos: int, turn_ids: torch.Tensor | None,
                      roles: torch.Tensor | None, assistant: int | None) -> torch.Tensor:
    """Per token, the position of the first EOS of its turn at or after the row's answer start (T
    where that turn has none), ``[B, T]`` int64; padding (turn -1) counts as the turn before it. Without ``turn_ids`` the row is one turn. With roles,
    only an EOS the assistant wrote counts (a tool message's closing token does not end an answer).

    ``ids``: ``[B, T]``; ``start``: ``[B]``; ``turn_ids``, ``roles``: ``[B, T]`` or None."""
    B, T = ids.shape
    pos = torch.arange(T).expand(B, T)
    is_eos = (ids == eos) & (pos >= start.unsqueeze(1))
    if roles is not None and assistant is not None:
        is_eos &= roles == assistant
    if turn_ids is None:
        return first_index(is_eos).unsqueeze(1).expand(B, T)
    turns = turn_ids.long().cummax(dim=1).values.clamp(min=0)  # padding (-1) belongs to the turn before it
    K = int(turns.max()) + 1 if turns.numel() else 1
    slot = torch.arange(B).unsqueeze(1) * K + turns  # (B, T) one slot per (row, turn)
    candidate = torch.where(is_eos, pos, torch.full_like(pos, T))  # (B, T)
    first = torch.full((B * K,), T, dtype=torch.long).scatter_reduce(
        0, slot.reshape(-1), candidate.reshape(-1), reduce="amin")  # (B * K,) first EOS per slot
    return first[slot]


NEWLINE_TAIL = 2  # without a recorded template: newline-only tokens after an EOS taken as the template's tail


def template_tail(ctx: StepContext, ids: torch.Tensor, first_eos: torch.Tensor, eos: int) -> tuple[torch.Tensor, str]:
    """``([B, T] bool, rule)``: the tokens right after the first EOS (of each turn) that the chat template
    writes there, and the rule that said so, for the message. A loss mask built from the rendered
    conversation (MiniMind's train_dpo.py) keeps them with the answer.

    With the manifest's ``tokenizer.template_end_of_turn_tail`` (measured at capture from the tokenizer's
    chat template, :mod:`tracer.format.chat_template`): exactly the recorded tail of the EOS, token by
    token (``<|im_end|>`` then ``"\\n"`` for ChatML, nothing for Llama 3's ``<|eot_id|>``; nothing for an
    EOS that is not the template's end-of-turn token). Without it, when the trace holds token strings:
    the run of at most :data:`NEWLINE_TAIL` newline-only tokens after the EOS (a space or any other
    token is still a leak). Else nothing."""
    B, T = ids.shape
    out = torch.zeros(B, T, dtype=torch.bool)
    tokens = ctx.trace.tokens
    tails = chat_template.recorded_tails(ctx.trace.manifest.get("tokenizer"))
    if tails is not None:
        tail = tails.get(eos, ())
        ends = "; ".join(f"id {i}, then {chat_template.tail_text(t, tokens)}" for i, t in tails.items())
        rule = ("the chat template recorded at capture writes nothing after the EOS, so the mask may keep nothing "
                "after it" if eos in tails and not tail else
                f"the chat template recorded at capture writes {chat_template.tail_text(tail, tokens)} after the EOS, "
                "and the mask may keep that" if eos in tails else
                f"the chat template recorded at capture ends a turn with another token ({ends}), so nothing after "
                "this EOS is the template's")
        expected = [out] + [ids == i for i in tail]  # expected[k]: (B, T) the k-th tail token (k >= 1)
    elif tokens is not None:
        newline = [i for i, text in enumerate(tokens) if text and not text.strip("\r\n")]  # newlines only
        rule = (f"no chat template recorded (a trace written before it was, or a tokenizer without one): up to "
                f"{NEWLINE_TAIL} newline-only tokens after the EOS were taken as the template's")
        is_newline = torch.isin(ids, torch.tensor(newline, dtype=ids.dtype)) if newline else torch.zeros_like(out)
        expected = [out] + [is_newline] * NEWLINE_TAIL
    else:
        return out, "no chat template nor token strings recorded: every kept token after the EOS counts"
    pos = torch.arange(T).expand(B, T)
    for k in range(1, len(expected)):
        at = pos == first_eos + k  # (B, T) the k-th token after the turn's EOS
        out |= at & expected[k] & (k == 1 or out.roll(1, dims=1))  # ... where the (k-1)-th one was the tail's
    return out, rule


@register("masks.after_eos", "completion_mask must be 0 after the first EOS token of the answer, per turn "
          "(EOS tokens of the prompt, and the EOS that closes a chat turn, do not end the answer)")
def check_after_eos(ctx: StepContext):
    eos = ctx.eos_token_id
    if eos is None:
        raise Skip("needs the EOS token id: manifest tokenizer.eos_token_id or metadata eos_token_id")
    findings = []
    for ids_name, mask_name in _sides(ctx):
        ids, keep = ctx.data[ids_name], ctx.mask(mask_name)
        B, T = ids.shape
        if B == 0 or T == 0:
            continue  # an empty side has no token after any EOS
        pos = torch.arange(T).expand(B, T)
        layout = ctx.turn_layout() if ids_name == "completion_ids" else None
        packed = layout is not None and ctx.packed_rows
        start = answer_start("chosen_ids" if packed else ids_name, keep)  # (B,)
        multi = layout is not None and (layout.source != "mask" or layout.multi_turn)
        first_eos = first_eos_of_turn(ids, start, eos, layout.turn_ids if multi else None,
                                      layout.roles if multi else None,
                                      layout.role_code("assistant") if multi else None)  # (B, T)
        leak = keep & (pos > first_eos)
        tail, rule = template_tail(ctx, ids, first_eos, eos)  # (B, T) what the chat template writes after its EOS
        leak &= ~tail
        if multi and layout.roles is not None:  # a kept tool or environment token is turns.tool_output_trained's
            assistant = layout.role_code("assistant")
            leak &= (layout.roles < 0) | (layout.roles == assistant)
        if not bool(leak.any()):
            continue
        rows = leak.any(dim=1).nonzero().flatten().tolist()
        b = rows[0]
        t = int(first_index(leak[b : b + 1])[0])
        e = int(first_eos[b, t])
        shifted = ids_name == "completion_ids" and _shifted_by_one(rows, leak, keep, tail, first_eos,
                                                                   start if packed else None)
        n_tail = int(tail[b, e + 1: t].sum())  # template tail tokens the row keeps between its EOS and t
        beyond = (f", the first beyond the {n_tail} token{'s' * (n_tail != 1)} the chat template writes after it"
                  if n_tail else "")
        hint = (f" Every affected row keeps exactly the token after its EOS{' and template tail' if n_tail else ''} "
                f"and drops its first token: {mask_name} looks shifted right by one position." if shifted else "")
        turn_id = int(layout.turn_ids[b, : t + 1].max()) if multi else None  # padding: the turn before it
        later_eos = [r for r in rows if bool((leak[r] & (ids[r] == eos)).any())]  # a second EOS in the kept tail
        if later_eos and not multi and ids_name == "completion_ids":
            hint += (f" {len(later_eos)} of these rows keep another EOS after it: if they hold several turns (an "
                     "agent's tool results between assistant turns), that EOS closes a turn, not the answer; record "
                     "turn_ids and token_roles (docs/agentic.md) so the mask is checked turn by turn and kept tool "
                     "output is named as such.")
        turn = f" of turn {turn_id}" if multi else ""
        token_id = int(ids[b, t])
        text = f" {ctx.trace.token_text([token_id])[0]!r}" if ctx.trace.tokens is not None else ""
        message = (
            f"seq {b} keeps token {t} (id {token_id}{text}) after its first EOS{turn} (id {eos}) at token {e}{beyond}: "
            f"{mask_name} must be 0 after the first EOS{' of each turn' if multi else ''}. {len(rows)} of {count(B, 'row')} "
            f"keep {count(int(leak.sum()), 'token')} after EOS.{hint} What may follow the EOS: {rule}. Why it matters: the loss "
            "trains on tokens that are not part of the answer (padding or text after the end). Likely fix: end the "
            f"mask at the first EOS{' and the template tail' if n_tail else ''}, built at target positions (the same "
            "positions as the logprobs)."
        )
        findings.append(ctx.finding("masks.after_eos", ERROR, message, b, t, field=mask_name, ids_field=ids_name,
                                    rows=rows[:50], tokens=int(leak.sum()), shifted_by_one=shifted,
                                    turn=turn_id))
    return findings


def _shifted_by_one(rows: list[int], leak: torch.Tensor, keep: torch.Tensor, tail: torch.Tensor,
                    first_eos: torch.Tensor, start: torch.Tensor | None) -> bool:
    """True when each of ``rows`` leaks exactly one token, the one right after its EOS (and the template's
    tail), and drops its first token (``start``: per row, where a packed row's answer starts; None: 0):
    a mask shifted right by one. Only for ``completion_ids``: a DPO side's first kept token is where its
    answer starts by definition, so a shift cannot be told there. ``[B, T]`` tensors; ``start``: ``[B]``."""
    for r in rows:
        u = int(first_index(leak[r:r + 1])[0])
        right_after = u - 1 == int(first_eos[r, u]) or bool(tail[r, u - 1])
        first = int(start[r]) if start is not None else 0
        if int(leak[r].sum()) != 1 or not right_after or bool(keep[r, first]):
            return False
    return True


# Names of the generation length limit (new tokens per completion), as trainers and engines spell it:
# TRL's GRPOConfig / RLOOConfig (recorded in step metadata by tracer.integrations), transformers'
# ``generate(max_new_tokens=...)`` (a hand-written loop's argument, kept in the manifest's config by
# ``tracer run``), verl's ``data.max_response_length``.
LENGTH_LIMIT_KEYS = ("max_completion_length", "max_new_tokens", "max_response_length")


def length_limit(ctx: StepContext) -> tuple[int, str] | None:
    """``(limit, key)``: the generation length limit the run sampled with (tokens per completion), read
    from the first of :data:`LENGTH_LIMIT_KEYS` in the step metadata, the manifest's ``hyperparameters``,
    its ``config`` (a script's arguments under ``tracer run``) or ``config.trainer_args``; None when none
    is recorded as a positive integer."""
    config = ctx.trace.manifest.get("config")
    config = config if isinstance(config, dict) else {}
    trainer_args = config.get("trainer_args") if isinstance(config.get("trainer_args"), dict) else {}
    for key in LENGTH_LIMIT_KEYS:
        for value in (ctx.hyper(key, None), config.get(key), trainer_args.get(key)):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == int(value) and value > 0:
                return int(value), key
    return None


def _padding_cause(b: int, has_eos: torch.Tensor, first_eos: torch.Tensor, eos: int, limit, T: int) -> tuple[str, str]:
    """``(where, note)`` for the message about completion row ``b``'s kept trailing pad ids (``has_eos``,
    ``first_eos``: ``[B]``; ``limit``: :func:`length_limit`; T: the padded width): what makes them padding
    (after the row's EOS; past the recorded length limit; a row without EOS that stopped before the limit),
    or, with no limit recorded, a note that says what would tell them from sampled tokens."""
    if bool(has_eos[b]):
        return f" after its EOS (id {eos}) at token {int(first_eos[b])}", ""
    if limit is not None and T >= limit[0]:
        return (f" past the generation length limit ({limit[1]} = {limit[0]}: the row has no EOS, so it ran to "
                f"the limit and was padded from token {limit[0]} to the width T = {T})"), ""
    if limit is not None:
        return (f" (the row has no EOS yet stops at T = {T}, before the generation length limit {limit[1]} = "
                f"{limit[0]}: it did not run to the limit, so the pad ids after its last other token are "
                "padding)"), ""
    return "", (f" Seq {b} has no EOS (id {eos}) and no generation length limit is recorded "
                f"({' / '.join(LENGTH_LIMIT_KEYS)}): had it run to the limit, these pad ids were sampled and "
                "rightly kept; record the limit so that the check can tell.")


@register("masks.padding", "completion_mask must be 0 on trailing padding tokens (pad ids a completion sampled "
          "before the length limit are tokens, not padding)")
def check_padding(ctx: StepContext):
    """Kept padding: the trailing run of pad ids of a row that the mask keeps.

    A sampler may emit the pad id as an ordinary token (an untrained or collapsing policy; a pad id
    that is a real vocabulary entry), so a trailing pad id is padding only where the row had already
    ended: after its EOS, or, in a completion without EOS, at or past the generation length limit
    (:func:`length_limit`). A completion without EOS whose width T reaches the recorded limit ran to
    it, so every pad id before the limit was sampled and the mask rightly keeps it (TRL's and
    MiniMind's masks keep a row without EOS whole): no finding. One without EOS that stops before the
    limit was cut short and padded: an error, except a single trailing pad id (the row's last token
    may be a stop token equal to the pad id): an info. With no limit recorded the old rule stands:
    one pad id ending a completion without EOS is an info, two or more an error, and the message
    says which metadata key would settle it. DPO sides come from a dataset: every kept trailing pad
    id is padding."""
    if ctx.has("completion_ids", "completion_mask") and any(ctx.has(f) for f in TURN_FIELDS):
        return _recorded_padding(ctx)
    pad, eos = ctx.pad_token_id, ctx.eos_token_id
    if pad is None:
        raise Skip("needs the pad token id: manifest tokenizer.pad_token_id or metadata pad_token_id")
    if pad == eos:
        return []  # padding after EOS is masks.after_eos's business
    limit = length_limit(ctx)
    findings = []
    for ids_name, mask_name in _sides(ctx):
        ids, keep = ctx.data[ids_name], ctx.mask(mask_name)
        B, T = ids.shape
        is_pad = ids == pad
        trailing = is_pad.flip(1).cumprod(dim=1).flip(1).bool()  # (B, T) True on the trailing pad run
        leak = trailing & keep
        if not bool(leak.any()):
            continue
        sampled_side = ids_name == "completion_ids" and eos is not None  # DPO sides come from a dataset
        is_eos = ids == eos if eos is not None else torch.zeros_like(is_pad)
        has_eos = is_eos.any(dim=1)  # (B,)
        no_eos = ~has_eos if sampled_side else torch.zeros(B, dtype=torch.bool)  # (B,)
        pos = torch.arange(T).expand(B, T)
        settled = limit is not None and T >= limit[0]  # the limit tells sampled pad ids from padding
        # a completion without EOS that ran to the limit: every position before it was sampled
        sampled = no_eos.unsqueeze(1) & (pos < limit[0]) if settled else torch.zeros_like(leak)  # (B, T)
        lone = no_eos & (trailing.sum(dim=1) == 1) & (not settled)  # (B,) one pad id the data cannot place
        for severity, rows_leak in ((ERROR, leak & ~sampled & ~lone.unsqueeze(1)), (INFO, leak & lone.unsqueeze(1))):
            if not bool(rows_leak.any()):
                continue
            rows = rows_leak.any(dim=1).nonzero().flatten().tolist()
            b = rows[0]
            t = int(first_index(rows_leak[b : b + 1])[0])
            if severity == ERROR:
                where, note = (_padding_cause(b, has_eos, first_index(is_eos), eos, limit, T) if sampled_side
                               else ("", ""))  # a DPO side's EOS may be its prompt's: no cause named
                message = (
                    f"seq {b} keeps padding: token {t} is the pad token (id {pad}) in the row's trailing padding"
                    f"{where}, yet {mask_name} keeps it; {len(rows)} of {count(B, 'row')} "
                    f"keep {count(int(rows_leak.sum()), 'pad token')}. Why "
                    "it matters: padding is trained as if the model had produced it and dilutes every masked mean. "
                    "Likely fix: build the mask from the real lengths (or ids != pad), not all ones." + note
                )
            else:
                message = _lone_pad_message(b, t, pad, eos, mask_name, len(rows), B, T, limit)
            findings.append(ctx.finding("masks.padding", severity, message, b, t, field=mask_name, ids_field=ids_name,
                                        rows=rows[:50], tokens=int(rows_leak.sum()),
                                        length_limit=None if limit is None else limit[0]))
    return findings


def _lone_pad_message(b: int, t: int, pad: int, eos: int, mask_name: str, n: int, B: int, T: int, limit) -> str:
    """The info for completions without EOS that end with one kept pad id the data cannot place."""
    head = f"seq {b} ends with the pad token (id {pad}) at token {t}, kept by {mask_name}, and has no EOS (id {eos}); "
    if limit is None:
        return head + (
            f"{n} of {B} rows end so. No generation length limit is recorded ({' / '.join(LENGTH_LIMIT_KEYS)}): "
            "a row without EOS most likely ran to it, so this is most likely a sampled token (small or untrained "
            "models sample the pad id); it is padding only if the row was cut short without EOS (a stop string) "
            "and padded: then build the mask from the real lengths. Record the limit so that the check can tell.")
    return head + (
        f"{n} of {B} rows end so, at T = {T}, before the generation length limit ({limit[1]} = {limit[0]}): the "
        "sampler stopped the row by something else than EOS or the limit. The pad id is the row's stop token "
        "(sampled, rightly kept) if the sampler stops on it; it is padding if the row was cut one token short at "
        "a stop string: then build the mask from the real lengths.")


def _recorded_padding(ctx: StepContext):
    """masks.padding for a step that records turn fields: padding is what they say (turn or role -1, or
    the reason ``padding``), whatever the token (a sampled pad id that ends a turn is the assistant's,
    and a pad id equal to EOS no longer hides kept padding)."""
    keep = ctx.mask()
    B, T = keep.shape
    padding = torch.zeros(B, T, dtype=torch.bool)
    for name in ("turn_ids", "token_roles"):
        if ctx.has(name) and ctx.data[name].shape == keep.shape:
            padding |= ctx.data[name] < 0
    if ctx.has("mask_reasons") and ctx.data["mask_reasons"].shape == keep.shape:
        names = turns.reason_names(ctx.metadata)
        if turns.PADDING in names:
            padding |= ctx.data["mask_reasons"] == names.index(turns.PADDING)
    leak = padding & keep
    if not bool(leak.any()):
        return []
    rows = leak.any(dim=1).nonzero().flatten().tolist()
    b = rows[0]
    t = int(first_index(leak[b: b + 1])[0])
    message = (
        f"seq {b} keeps padding: token {t} is padding by the recorded turn fields (turn / role -1, or reason "
        f"'padding'), yet completion_mask keeps it; {len(rows)} of {count(B, 'row')} "
        f"keep {count(int(leak.sum()), 'padding token')}. "
        "Why it matters: padding is trained as if the model had produced it and dilutes every masked mean. Likely "
        "fix: build the mask from the real lengths (or ids != pad), not all ones."
    )
    return [ctx.finding("masks.padding", ERROR, message, b, t, field="completion_mask", rows=rows[:50],
                        tokens=int(leak.sum()))]


def _empty_row_cause(ctx: StepContext, mask_name: str, empty: list[int]) -> str:
    """What an empty row does to the update, and the one place it comes from (the mask's construction),
    for an unexplained masks.empty_row error."""
    ids_name = "completion_ids" if mask_name == "completion_mask" else mask_name.replace("_mask", "_ids")
    where = f" though {ids_name} holds tokens there" if ctx.has(ids_name) else ""
    return (f" Such a row adds nothing to the gradient yet counts in a per-sequence mean (an unclamped masked "
            f"mean divides by 0 for it): {mask_name} was built{where} from lengths or an offset that leave "
            f"{'it' if len(empty) == 1 else 'these rows'} empty.")


@register("masks.empty_row", "every row keeps at least one token")
def check_empty_row(ctx: StepContext):
    findings = []
    for _, mask_name in _sides(ctx):
        keep = ctx.mask(mask_name)
        empty = (~keep.any(dim=1)).nonzero().flatten().tolist()
        if not empty:
            continue
        truncation = bool(ctx.hyper("mask_truncated_completions", False))
        rejection = ctx.hyper("rollout_rs", None)  # verl's rollout rejection sampling empties rejected rows
        severity = INFO if truncation or rejection else ERROR
        because = (" (metadata mask_truncated_completions = true: truncated completions are dropped on "
                   "purpose)" if truncation else
                   f" (metadata rollout_rs = {rejection!r}: verl's rollout rejection sampling drops these rows on "
                   "purpose)" if rejection else "")
        message = (
            f"{len(empty)} of {keep.shape[0]} rows keep no token in {mask_name} (first: seq {empty[0]}){because}. "
            + ("" if severity == INFO else _empty_row_cause(ctx, mask_name, empty))
        )
        findings.append(ctx.finding("masks.empty_row", severity, message, empty[0], field=mask_name, rows=empty[:50]))
    return findings


def _dpo_loss(ctx: StepContext, chosen_mask: torch.Tensor, rejected_mask: torch.Tensor) -> torch.Tensor | None:
    names = ("chosen_policy_logprobs", "rejected_policy_logprobs", "chosen_ref_logprobs", "rejected_ref_logprobs")
    beta = ctx.hyper("beta", None)
    if beta is None or not ctx.has(*names):
        return None
    cp, rp, cr, rr = (ctx.tensor(n) for n in names)
    terms = formulas.dpo_terms(formulas.sequence_logprobs(cp, chosen_mask), formulas.sequence_logprobs(rp, rejected_mask),
                               formulas.sequence_logprobs(cr, chosen_mask), formulas.sequence_logprobs(rr, rejected_mask),
                               float(beta))
    return terms["dpo_loss"]  # (B,)


@register("masks.dpo_rule", "chosen and rejected masks are built by the same rule (same first kept "
          "position: the shared prompt is masked on both sides or on neither)", {"dpo"})
def check_dpo_rule(ctx: StepContext):
    chosen_ids, rejected_ids = ctx.require("chosen_ids", "rejected_ids")
    chosen_mask, rejected_mask = ctx.mask("chosen_mask"), ctx.mask("rejected_mask")
    start_c, start_r = first_index(chosen_mask), first_index(rejected_mask)  # (B,)
    rows = (start_c != start_r).nonzero().flatten().tolist()
    if not rows:
        return []
    shifted = [b for b in rows if _same_prompt_shifted(chosen_ids[b], rejected_ids[b], int(start_c[b]), int(start_r[b]))]
    cut = [b for b in rows if b not in shifted and _prompt_cut_away(ctx, chosen_ids[b], rejected_ids[b],
                                                                    chosen_mask[b], rejected_mask[b])]
    wrong = [b for b in rows if b not in shifted and b not in cut]
    if not wrong:  # every differing pair: the same prompt ending before each side's start, at different offsets
        b = (shifted or cut)[0]
        sc, sr = int(start_c[b]), int(start_r[b])
        if shifted:
            message = (
                f"pair {b}: chosen_mask first keeps position {sc}, rejected_mask position {sr}, but the tokens "
                f"before each side's start end the same way (the prompt, at offsets {sc - min(sc, sr)} and "
                f"{sr - min(sc, sr)}): both masks keep only their completion, the prompt sits at a different "
                f"offset on each side (each side truncated from the left or padded on its own, as TRL's DPO "
                f"collator does with truncation_mode='keep_end')."
            )
        else:
            side = "chosen" if sc == 0 else "rejected"
            message = (
                f"pair {b}: chosen_mask first keeps position {sc}, rejected_mask position {sr}: the {side} side "
                f"is its completion alone, cut from the left to max_length = {ctx.hyper('max_length', None)} "
                f"(truncation_mode='keep_end': a completion at least max_length long leaves none of the prompt), "
                f"and nothing the other side keeps before its start appears in it. Both masks keep only "
                f"completion tokens; that side's sum covers the end of its completion only."
            )
        message += f" {len(rows)} of {chosen_mask.shape[0]} pairs are laid out so."
        return [ctx.finding("masks.dpo_rule", INFO, message, b, None, pairs=(shifted + cut)[:50],
                            prompt_cut_away=cut[:50], chosen_start=sc, rejected_start=sr)]
    b = wrong[0]
    sc, sr = int(start_c[b]), int(start_r[b])
    side, other = ("rejected", "chosen") if sr < sc else ("chosen", "rejected")
    lo, hi = min(sc, sr), max(sc, sr)
    shared = chosen_ids[b, lo:hi].tolist() == rejected_ids[b, lo:hi].tolist()
    start = torch.arange(chosen_mask.shape[1]) >= max(sc, sr)  # both sides by the later start
    loss = _dpo_loss(ctx, chosen_mask, rejected_mask)
    fixed = _dpo_loss(ctx, chosen_mask & start, rejected_mask & start)
    loss_text = ("" if loss is None else
                 f" DPO loss of pair {b}: {float(loss[b]):.4f} with the recorded masks, {float(fixed[b]):.4f} "
                 f"with both masks starting at position {hi}.")
    message = (
        f"pair {b}: chosen_mask first keeps position {sc}, rejected_mask position {sr}: {side}_mask keeps "
        f"positions {lo}..{hi - 1}{' (tokens shared by both sides: the prompt)' if shared else ''} that "
        f"{other}_mask drops. {len(wrong)} of {chosen_mask.shape[0]} pairs differ.{loss_text} Why it matters: "
        "DPO compares summed logprobs of the two sides; extra prompt tokens on one side shift its sum, and "
        "the logits measure mask construction instead of preference. Likely fix: build both masks with the "
        "same function (prompt length and padding taken from the same tokenisation)."
    )
    return [ctx.finding("masks.dpo_rule", ERROR, message, b, lo, field=f"{side}_mask", ids_field=f"{side}_ids",
                        pairs=wrong[:50], chosen_start=sc, rejected_start=sr,
                        loss=None if loss is None else float(loss[b]),
                        loss_same_rule=None if fixed is None else float(fixed[b]))]


PROMPT_TAIL = 4  # tokens of one side's prompt end looked for in the other side's window (_prompt_cut_away)


def _prompt_cut_away(ctx: StepContext, chosen_ids: torch.Tensor, rejected_ids: torch.Tensor,
                     chosen_mask: torch.Tensor, rejected_mask: torch.Tensor) -> bool:
    """True when one side of a pair keeps no prompt at all because TRL's ``truncation_mode='keep_end'``
    cut it away: its completion is at least ``max_length`` long, so the side's window is the last
    ``max_length`` completion tokens and its mask keeps positions ``0 .. max_length - 1`` (with no
    recorded ``max_length``: the whole row). Then the other side's mask starts later, after its
    prompt tail. Told apart from a mask that keeps the prompt: the last :data:`PROMPT_TAIL` tokens
    before the other side's start (its prompt's end) must not occur in the first side's window, as
    they would where that window begins with prompt tokens, nor may the window open with the last 2
    or more of them. (A window opening with a single prompt token passes: a completion token equal
    to the prompt's last one is too common to call it; docs/checks.md.) Needs metadata
    ``truncation_mode = "keep_end"``.
    ``*_ids``, ``*_mask``: ``[T]`` of one pair."""
    if ctx.hyper("truncation_mode", None) != "keep_end":
        return False
    (a_ids, a_mask), (b_ids, b_mask) = (((chosen_ids, chosen_mask), (rejected_ids, rejected_mask))
                                        if bool(chosen_mask[0]) else ((rejected_ids, rejected_mask), (chosen_ids, chosen_mask)))
    if not bool(a_mask[0]) or bool(b_mask[0]):
        return False
    max_length = ctx.hyper("max_length", None)
    width = int(max_length) if isinstance(max_length, int) and 0 < max_length <= a_mask.shape[0] else a_mask.shape[0]
    if not bool(a_mask[:width].all()) or bool(a_mask[width:].any()):
        return False
    hi = int(first_index(b_mask.unsqueeze(0))[0])
    k = min(hi, PROMPT_TAIL)
    tail, window = b_ids[hi - k:hi].tolist(), a_ids[:width].tolist()
    if any(window[p:p + k] == tail for p in range(width - k + 1)):
        return False  # the other side's prompt end inside this window: it keeps prompt tokens
    return not any(window[:j] == tail[k - j:] for j in range(2, k))  # nor a window opening with 2+ of them


def _same_prompt_shifted(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, sc: int, sr: int) -> bool:
    """True when the two sides of a pair differ in where their masks start only because their prompt
    sits at different offsets: the positions one side keeps and the other drops hold different tokens
    on the two sides (no shared prompt kept on one side), and the shorter run of tokens before a
    side's start is the end of the longer one (the same prompt tail before each completion: each
    side cut from the left or padded on its own). ``chosen_ids``, ``rejected_ids``: ``[T]`` ids of
    one pair; ``sc``, ``sr``: each side's first kept position."""
    lo, hi = min(sc, sr), max(sc, sr)
    if lo == 0 or chosen_ids[lo:hi].tolist() == rejected_ids[lo:hi].tolist():
        return False
    return chosen_ids[sc - lo:sc].tolist() == rejected_ids[sr - lo:sr].tolist()
