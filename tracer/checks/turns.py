"""Multi-turn and agentic rows (SPEC.md section 4 "Turns, roles and mask reasons", section 6): checks
that read a step span by span.

* ``turns.tool_output_trained``: a token the model did not write (a tool result, an environment or
  user message after the prompt) inside the loss mask. Needs ``token_roles`` or ``mask_reasons``.
* ``turns.placeholder_logprobs``: a trained token whose old or sampler logprob is a placeholder
  (exactly 0.0, or one constant filling a span) where the policy gives the token a real, lower
  logprob: the fill a packing loop writes at tool positions, shifted onto trained tokens.
* ``turns.turn_shift``: within one assistant turn, the trainer's logprobs fit the other side's
  shifted by one position far better than unshifted (a shift confined to one turn, which the
  row-wide ``alignment.logprob_shift`` averages away).
* ``turns.untrained_turn``: an assistant turn whose tokens the mask drops (wholly, or cut mid-way
  before its EOS or ``<|im_end|>`` with no ``truncated`` reason), while other turns of the row are
  trained.
* ``turns.advantage_assignment``: per-token advantages that are not one value per episode (or per
  turn) as metadata ``advantage_assignment`` declares.
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.alignment import SHIFT_MIN_GAP, SHIFT_RATIO
from tracer.checks.context import StepContext
from tracer.checks.finding import ERROR, RL_ALGORITHMS, Skip, register
from tracer.format import turns as turn_format

PLACEHOLDER_GAP = 0.5  # nats: a placeholder old logprob counts where the policy gives the token below -0.5
CONSTANT_RUN = 4  # kept tokens in a row holding one and the same old logprob: a constant fill
STOP_TOKENS = 4  # an untrained tail of a turn this short is a stop string appended by the loop (vLLM drops it)
HEADER_TOKENS = 3  # tokens a role header of a chat template may take ("<|im_start|>assistant" and a newline)
RUN_SPREAD = 0.1  # nats the policy must spread over a constant run of old logprobs for it to be a fill
SPAN_MIN_TOKENS = 3  # kept tokens an assistant span needs before its own shift test means anything


def _span_text(ctx: StepContext, b: int, start: int, end: int, limit: int = 60) -> str:
    """The tokens ``[start, end)`` of row ``b`` as text (ids when the trace holds no token strings)."""
    ids = ctx.data["completion_ids"][b, start:end].tolist()
    text = "".join(ctx.trace.token_text(ids)) if ctx.trace.tokens is not None else " ".join(map(str, ids))
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _row_spans(ctx: StepContext, layout: turn_format.Layout, b: int) -> list[turn_format.Span]:
    keep = ctx.mask()[b].tolist()
    roles = layout.roles[b].tolist() if layout.roles is not None else None
    return turn_format.row_spans(layout.turn_ids[b].tolist(), roles, keep, layout.role_names)


def _not_model_written(ctx: StepContext, layout: turn_format.Layout) -> tuple[torch.Tensor, str]:
    """``[B, T]`` bool: tokens the model did not write after the prompt (roles other than assistant
    in a turn >= 1, or a recorded reason tool_output / environment), and which field says so."""
    B, T = ctx.data["completion_ids"].shape
    if layout.roles is not None:
        assistant = layout.role_code(turn_format.ASSISTANT)
        source = "token_roles" if layout.source == "recorded" else "the chat template's role markers"
        return (layout.roles >= 0) & (layout.roles != assistant) & (layout.turn_ids >= 1), source
    if "mask_reasons" in ctx.data:
        names = turn_format.reason_names(ctx.metadata)
        codes = [names.index(n) for n in (turn_format.TOOL_OUTPUT, turn_format.ENVIRONMENT) if n in names]
        reasons = ctx.data["mask_reasons"].long()
        return torch.isin(reasons, torch.tensor(codes, dtype=torch.long)), "mask_reasons"
    raise Skip("needs token_roles or mask_reasons (which tokens are tool output), which these do not record")


@register("turns.tool_output_trained", "tool results and environment messages are never in the loss mask",
          RL_ALGORITHMS)
def check_tool_output_trained(ctx: StepContext):
    layout = ctx.turn_layout()
    if layout.source == "mask" and not layout.multi_turn and not ctx.has("mask_reasons"):
        return []  # single-turn rows: no tool output to train on
    foreign, source = _not_model_written(ctx, layout)
    keep = ctx.mask()
    leak = foreign & keep
    if not bool(leak.any()):
        return []
    rows = leak.any(dim=1).nonzero().flatten().tolist()
    b = rows[0]
    t = int(leak[b].nonzero()[0])
    turn = int(layout.turn_ids[b, t])
    start, end = t, t + 1  # the run of not-model-written tokens around t, within its turn
    while start > 0 and bool(foreign[b, start - 1]) and int(layout.turn_ids[b, start - 1]) == turn:
        start -= 1
    while end < keep.shape[1] and bool(foreign[b, end]) and int(layout.turn_ids[b, end]) == turn:
        end += 1
    if layout.roles is not None:
        role = layout.role_names[int(layout.roles[b, t])]
    else:
        names = turn_format.reason_names(ctx.metadata)
        code = int(ctx.data["mask_reasons"][b, t])
        role = names[code] if 0 <= code < len(names) else "tool output"
    span = turn_format.Span(turn, role, start, end, int(keep[b, start:end].sum()))
    contradiction = ""
    if "mask_reasons" in ctx.data:
        names = turn_format.reason_names(ctx.metadata)
        code = int(ctx.data["mask_reasons"][b, t])
        recorded = names[code] if 0 <= code < len(names) else None
        if recorded not in (None, turn_format.KEPT):
            contradiction = (f" The recorded mask_reasons says {recorded!r} at token {t}, yet completion_mask keeps "
                             "it: the mask the loss used is not the one the reasons describe.")
    total = int(foreign.sum())
    message = (
        f"seq {b}, turn {span.turn}: the {role} span at tokens {span.start}..{span.end - 1} ({span.length} tokens, "
        f"{_span_text(ctx, b, span.start, span.end)}) is kept by completion_mask ({span.kept} of its tokens), though "
        f"the model did not write it (role {role}, from {source}). {len(rows)} of {keep.shape[0]} rows train "
        f"{int(leak.sum())} of the step's {total} tool/environment tokens.{contradiction} Why it matters: the policy is pushed "
        "to predict the tool's output, and those tokens' old logprobs are placeholders, so their ratio and KL are "
        "meaningless. Likely fix: multiply the loss mask by the tool mask (TRL: completion_mask * tool_mask; a "
        "packing loop: response_mask 0 for every token appended after a tool call)."
    )
    return [ctx.finding("turns.tool_output_trained", ERROR, message, b, t, field="completion_mask", turn=span.turn,
                        role=role, span=[span.start, span.end], rows=rows[:50], tokens=int(leak.sum()))]


@register("turns.placeholder_logprobs", "trained tokens carry real old / sampler logprobs, not the 0.0 (or "
          "constant) fill written at tool and prompt positions", RL_ALGORITHMS)
def check_placeholder_logprobs(ctx: StepContext):
    (policy,) = ctx.require("policy_logprobs")
    keep = ctx.mask()
    names = [n for n in ("old_logprobs", "sampler_logprobs") if n in ctx.data and n not in ctx.derived]
    if not names:
        return []  # no recorded old or sampler logprob that could hold a placeholder
    try:
        foreign = _not_model_written(ctx, ctx.turn_layout())[0]
    except Skip:
        foreign = torch.zeros_like(keep)
    findings = []
    for name in names:
        side = ctx.tensor(name)
        real_low = policy < -PLACEHOLDER_GAP  # the policy gives the token a probability well below 1
        zero = keep & (side == 0.0) & real_low
        fill = keep & real_low & _varying(policy, _constant_runs(side, keep))
        # a kept tool token, and the template tokens kept with it, are turns.tool_output_trained's finding
        bad = _outside_foreign_runs(zero | fill, foreign & keep)
        if not bool(bad.any()):
            continue
        rows = bad.any(dim=1).nonzero().flatten().tolist()
        b = rows[0]
        t = int(bad[b].nonzero()[0])
        value = float(side[b, t])
        layout = ctx.turn_layout() if ctx.has("completion_ids") else None
        turn = f", turn {int(layout.turn_ids[b, t])}" if layout is not None and layout.multi_turn else ""
        kind = "exactly 0.0" if value == 0.0 else f"the constant {value:.4f} over a run of tokens"
        message = (
            f"seq {b}{turn}, token {t}: {name} is {kind} on a trained token, where policy_logprobs is "
            f"{float(policy[b, t]):.4f}; {int(bad.sum())} trained tokens in {len(rows)} rows carry such a placeholder. "
            f"A logprob of 0.0 means probability 1; the policy disagrees by {abs(float(policy[b, t]) - value):.2f} "
            "nats, so the value is the fill a packing loop writes at prompt and tool positions, not the sampler's "
            "logprob. Why it matters: ratio = exp(policy - old) is computed from the fill, so these tokens are "
            "clipped or weighted at random. Likely fix: keep the old logprobs aligned with the tokens they score "
            "(the fill only where the mask is 0), and mask every position that has no sampled logprob."
        )
        findings.append(ctx.finding("turns.placeholder_logprobs", ERROR, message, b, t, field=name, rows=rows[:50],
                                    tokens=int(bad.sum()), value=value))
    return findings


def _outside_foreign_runs(bad: torch.Tensor, foreign: torch.Tensor) -> torch.Tensor:
    """``bad`` without the runs of consecutive ``bad | foreign`` positions that hold a ``foreign`` one:
    a tool result kept by the mask comes with the chat template's tokens around it (``<|im_end|>``,
    the next role header), whose fill is the same mistake. ``[B, T]`` bool."""
    out = bad & ~foreign
    for b in (bad & ~foreign).any(dim=1).nonzero().flatten().tolist():
        either, row_f = (bad[b] | foreign[b]).tolist(), foreign[b].tolist()
        t, T = 0, len(either)
        while t < T:
            if not either[t]:
                t += 1
                continue
            end = t
            while end < T and either[end]:
                end += 1
            if any(row_f[t:end]):
                out[b, t:end] = False
            t = end
    return out


def _constant_runs(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: kept positions inside a run of at least :data:`CONSTANT_RUN` consecutive kept
    tokens holding one and the same value (a fill; sampled logprobs never repeat exactly so long)."""
    B, T = values.shape
    out = torch.zeros(B, T, dtype=torch.bool)
    same = torch.zeros(B, T, dtype=torch.bool)
    same[:, 1:] = (values[:, 1:] == values[:, :-1]) & keep[:, 1:] & keep[:, :-1]
    for b in same.any(dim=1).nonzero().flatten().tolist():
        run = 1
        row = same[b].tolist()
        for t in range(1, T):
            run = run + 1 if row[t] else 1
            if run >= CONSTANT_RUN:
                out[b, t - run + 1:t + 1] = True
    return out


def _varying(policy: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
    """``runs`` where the policy's logprobs over the kept tokens of the row's runs spread over more
    than :data:`RUN_SPREAD` nats (a degenerate repetition repeats the policy's values too)."""
    out = runs.clone()
    for b in runs.any(dim=1).nonzero().flatten().tolist():
        values = policy[b][runs[b]]
        if float(values.max() - values.min()) <= RUN_SPREAD:
            out[b] = False
    return out


def _shift_fit(a: torch.Tensor, b: torch.Tensor, ok: torch.Tensor, shift: int) -> tuple[float, int]:
    """Mean |a[j] - b[j + shift]| over positions j with ``ok[j]`` and ``ok[j + shift]``; (mae, count).
    ``a``, ``b``, ``ok``: ``[n]`` of one span."""
    n = a.shape[0]
    lo, hi = max(0, -shift), min(n, n - shift)
    if hi <= lo:
        return float("nan"), 0
    both = ok[lo:hi] & ok[lo + shift:hi + shift]
    if not bool(both.any()):
        return float("nan"), 0
    return float(formulas.masked_mean((a[lo:hi] - b[lo + shift:hi + shift]).abs(), both)), int(both.sum())


@register("turns.turn_shift", "within each assistant turn, the logprobs fit the sampler's (or at the first "
          "pass, the policy's) at shift 0, not -1/+1", RL_ALGORITHMS)
def check_turn_shift(ctx: StepContext):
    layout = ctx.turn_layout()
    if not layout.multi_turn:
        return []  # single-turn rows: alignment.logprob_shift tests whole rows
    pairs = _shift_pairs(ctx)
    if not pairs:
        raise Skip("needs old_logprobs with sampler_logprobs, or old and policy logprobs at inner step 0")
    findings = []
    for b, span, name, other, sh, best, mae0, n0, fits in _shifted_spans(ctx, layout, pairs):
        if any(f.sequence == b for f in findings):
            continue  # one finding per row
        s, e = span.start, span.end
        message = (
            f"seq {b}, turn {span.turn} (tokens {s}..{e - 1}): {name} fit {other} shifted by {sh:+d} (mean "
            f"|Δ| {best:.4f} nats) far better than unshifted ({mae0:.4f} nats over {n0} tokens): inside this "
            f"turn {name}[j] holds the logprob of the {'next' if sh > 0 else 'previous'} token. Why it "
            "matters: this turn's tokens are trained with their neighbours' logprobs. Likely fix: when "
            "concatenating turns, append each turn's logprobs at the same offsets as its tokens (a token "
            "dropped or added between turns, e.g. an EOS filtered from the ids but not from the logprobs, "
            "moves every later turn by one)."
        )
        findings.append(ctx.finding("turns.turn_shift", ERROR, message, b, s, field=name, turn=span.turn,
                                    shift=sh, span=[s, e], mae_by_shift={str(k): v[0] for k, v in fits.items()}))
        if len(findings) >= 5:
            break
    return findings


def _shift_pairs(ctx: StepContext) -> list[tuple[str, str]]:
    """(recorded, reference) logprob pairs a per-turn shift is tested on: old against the sampler's,
    and at inner step 0 (the policy scored the same tokens with the same weights) against the
    policy's, which also shows a shift that old and sampler share (both read from one buffer);
    [] when there is none."""
    pairs = []
    if ctx.has("old_logprobs", "sampler_logprobs"):
        pairs.append(("old_logprobs", "sampler_logprobs"))
    if ctx.has("old_logprobs", "policy_logprobs") and ctx.key.inner_step == 0 and "old_logprobs" not in ctx.derived:
        pairs.append(("old_logprobs", "policy_logprobs"))
    return pairs


def _shifted_spans(ctx: StepContext, layout: turn_format.Layout, pairs: list[tuple[str, str]]) -> list[tuple]:
    """Every assistant span (>= :data:`SPAN_MIN_TOKENS` kept tokens, turn >= 1) whose recorded
    logprobs fit the reference shifted by ±1 clearly better than unshifted: ``(row, span, name,
    other, shift, mae shifted, mae unshifted, tokens, fits)``."""
    keep = ctx.mask()
    out = []
    for name, other in pairs:
        a, ref = ctx.tensor(name), ctx.tensor(other)
        for b in range(keep.shape[0]):
            for span in _row_spans(ctx, layout, b):
                if span.kept < SPAN_MIN_TOKENS or span.turn < 1:
                    continue
                s, e = span.start, span.end
                ok = keep[b, s:e] & torch.isfinite(a[b, s:e]) & torch.isfinite(ref[b, s:e])
                fits = {sh: _shift_fit(a[b, s:e], ref[b, s:e], ok, sh) for sh in (-1, 0, 1)}
                mae0, n0 = fits[0]
                shifted = [(m, sh) for sh, (m, n) in fits.items() if sh != 0 and n >= SPAN_MIN_TOKENS - 1]
                if not shifted or not mae0 > SHIFT_MIN_GAP:
                    continue
                best, sh = min(shifted)
                if best < SHIFT_RATIO * mae0:
                    out.append((b, span, name, other, sh, best, mae0, n0, fits))
    return out


def explained_positions(ctx: StepContext) -> torch.Tensor:
    """Kept positions ``[B, T]`` bool whose old logprob a ``turns`` check already names as wrong: tool
    or environment tokens in the loss mask, placeholder old logprobs, turns whose logprobs are
    shifted. ``identity.first_step`` leaves them out, so one cause gives one finding."""
    keep = ctx.mask()
    out = torch.zeros_like(keep)
    if not ctx.has("completion_ids", "policy_logprobs", "old_logprobs"):
        return out
    layout = ctx.turn_layout()
    try:
        out |= _not_model_written(ctx, layout)[0] & keep
    except Skip:
        pass
    if "old_logprobs" not in ctx.derived:
        policy, old = ctx.tensor("policy_logprobs"), ctx.tensor("old_logprobs")
        fill = (old == 0.0) | _varying(policy, _constant_runs(old, keep))
        out |= keep & fill & (policy < -PLACEHOLDER_GAP)
    if layout.multi_turn:
        for b, span, *_ in _shifted_spans(ctx, layout, _shift_pairs(ctx)):
            out[b, span.start:span.end] |= keep[b, span.start:span.end]
    return out


@register("turns.untrained_turn", "every assistant turn of a rollout is trained up to its end (an EOS, or a "
          "'truncated' reason), not only the first ones", RL_ALGORITHMS)
def check_untrained_turn(ctx: StepContext):
    layout = ctx.turn_layout()
    if layout.roles is None and not layout.multi_turn:
        return []  # single-turn rows: no later turn to leave out
    if layout.roles is None:
        raise Skip("needs token_roles (which tokens the assistant wrote), which these do not record")
    keep = ctx.mask()
    ids = ctx.data["completion_ids"]
    ends = turn_format.message_end_ids(ctx.trace.tokens, ctx.eos_token_id)  # EOS, and ChatML's <|im_end|>
    reasons = None
    if "mask_reasons" in ctx.data:
        names = turn_format.reason_names(ctx.metadata)
        reasons = [[names[c] if 0 <= c < len(names) else "" for c in row] for row in ctx.data["mask_reasons"].tolist()]
    if ctx.hyper("rollout_rs", None):  # verl's rollout rejection sampling masks tokens or rows on purpose
        return []
    not_said = {turn_format.KEPT, turn_format.MASKED, ""}  # any other recorded reason says why a token is dropped
    findings = []
    for b in range(keep.shape[0]):
        spans = [s for s in _row_spans(ctx, layout, b) if s.role == turn_format.ASSISTANT and s.turn >= 1]
        if not any(s.kept for s in spans):
            continue  # a row trained on nothing is masks.empty_row's
        for span in spans:
            dropped = [t for t in range(span.start, span.end) if not bool(keep[b, t])]
            if not dropped:
                continue
            if reasons is not None:
                dropped = [t for t in dropped if reasons[b][t] in not_said]
            first_eos = next((t for t in range(span.start, span.end) if int(ids[b, t]) in ends), span.end)
            first_kept = next((t for t in range(span.start, span.end) if bool(keep[b, t])), None)
            if first_kept is None:  # the whole turn dropped (a bare role header of the template does not count)
                dropped = dropped if span.length > HEADER_TOKENS else []
            else:  # dropped after the turn's first trained token and before its EOS (leading ones: its header)
                dropped = [t for t in dropped if first_kept < t < first_eos]
            if dropped and first_kept is not None and len(dropped) <= STOP_TOKENS \
                    and dropped == list(range(dropped[0], first_eos)):  # a run ending at the EOS (or the turn's end)
                dropped = []  # a short untrained tail: a stop string the loop appended after the sampled text
            if not dropped:
                continue
            if span.kept == 0:
                what = f"none of its {span.length} assistant tokens is trained"
            else:
                before = sum(1 for u in range(span.start, dropped[0]) if bool(keep[b, u]))
                what = (f"its mask drops {len(dropped)} of the turn's tokens from token {dropped[0]} (after {before} "
                        "trained ones) before its end, with no EOS before them and no recorded reason such as "
                        "'truncated'")
            message = (
                f"seq {b}, turn {span.turn} (tokens {span.start}..{span.end - 1}, {_span_text(ctx, b, span.start, span.end)}): "
                f"{what}, while other turns of the rollout are. Why it matters: the reward is given for the whole "
                "episode, but the later turns that earned it get no gradient. Likely fix: build the loss mask over "
                "every assistant turn of the packed row (not only up to the first tool call), and record a "
                "'truncated' mask reason where the rollout was cut on purpose."
            )
            findings.append(ctx.finding("turns.untrained_turn", ERROR, message, b, dropped[0], field="completion_mask",
                                        turn=span.turn, span=[span.start, span.end], dropped=len(dropped)))
            break
        if len(findings) >= 5:
            break
    return findings


ASSIGNMENTS = ("episode", "turn")


@register("turns.advantage_assignment", "per-token advantages follow the declared multi-turn assignment: one "
          "value over the whole episode ('episode') or one per turn ('turn')", RL_ALGORITHMS - {"ppo"})
def check_advantage_assignment(ctx: StepContext):
    declared = ctx.hyper("advantage_assignment", None)
    if declared is None:
        return []  # nothing declared: the advantage checks judge the values by their rule
    if declared not in ASSIGNMENTS:
        raise Skip(f"metadata advantage_assignment = {declared!r} is neither of {', '.join(ASSIGNMENTS)}")
    name = next((n for n in ("token_advantages", "advantages") if n in ctx.data and ctx.data[n].dim() == 2), None)
    if name is None:
        return []  # [B] advantages: broadcast over the row, one per episode by construction
    layout = ctx.turn_layout()
    values, keep = ctx.tensor(name), ctx.mask()
    for b in range(keep.shape[0]):
        kept = keep[b].nonzero().flatten().tolist()
        if not kept:
            continue
        groups: dict[int, list[int]] = {}
        for t in kept:
            groups.setdefault(0 if declared == "episode" else int(layout.turn_ids[b, t]), []).append(t)
        for group, positions in groups.items():
            row = values[b, positions]
            spread = float(row.max() - row.min())
            if spread <= ctx.tol.atol + ctx.tol.rtol * float(row.abs().max()):
                continue
            t = positions[int((row - row[0]).abs().argmax())]
            where = "the episode" if declared == "episode" else f"turn {group}"
            message = (
                f"seq {b}: metadata advantage_assignment = {declared!r} (one advantage per "
                f"{'episode' if declared == 'episode' else 'turn'}), but {name} takes {row.unique().numel()} "
                f"values over the trained tokens of {where} ({float(row.min()):.4f} .. {float(row.max()):.4f}; token "
                f"{positions[0]}: {float(row[0]):.4f}, token {t}: {float(values[b, t]):.4f}, turn "
                f"{int(layout.turn_ids[b, t])}). Why it matters: turns of one episode are credited differently from "
                "what the run declares. Likely fix: broadcast the episode's outcome advantage over every turn's "
                "tokens (or declare advantage_assignment = 'turn' when each turn is scored on its own)."
            )
            return [ctx.finding("turns.advantage_assignment", ERROR, message, b, t, field=name, declared=declared,
                                spread=spread)]
    return []
