"""Alignment (SPEC.md section 6): logprobs scored for the right token, completions cut at the padded
prompt width.

* ``alignment.logprob_shift``: compare the trainer's logprobs with the sampler's at shifts -1, 0, +1
  (``recorded[j]`` against ``sampler[j + s]``); a shift that fits clearly better than 0 means the
  trainer read each token's logprob one position off (the ``logits[:, k]`` predicts
  ``input_ids[:, k + 1]`` rule broken, or a mask taken at input instead of target positions). When no
  shift fits, the positions where a token repeats its neighbour tell the classic ``logits[:, L:]``
  (each token scored with the next position's distribution): there ``recorded[j] == sampler[j+1]``.
* ``alignment.completion_start``: with left-padded prompts, a completion cut at the count of real
  prompt tokens instead of the padded width begins with the prompt's last tokens, as many as the
  row has padding.
"""

from __future__ import annotations

import torch

from tracer import formulas
from tracer.checks.context import NO_ENGINE, StepContext, engine_sampled
from tracer.checks.text import count
from tracer.checks.finding import ERROR, RL_ALGORITHMS, not_applicable, register

SHIFTS = (-1, 0, 1)
SHIFT_MIN_GAP = 0.1  # nats: mean |Δ| at shift 0 must exceed this before another shift can win
SHIFT_RATIO = 0.5  # the winning shift's mean |Δ| must be below this share of shift 0's
REPEAT_MIN = 3  # repeated-token positions that must show the next (previous) position's distribution ...
REPEAT_RATIO = 0.1  # ... fitting it within this share of their unshifted |Δ| and of the whole rows' (with
# 0.15-0.3 nats of noise between trainer and sampler, 1 position at half its |Δ| flagged 4-9 healthy
# step files in 100 in a Monte Carlo simulation; tests/checks/test_foreign_loops.py keeps a healthy run silent)


def shifted_mae(recorded: torch.Tensor, reference: torch.Tensor, keep: torch.Tensor, shift: int):
    """Mean |recorded[:, j] - reference[:, j + shift]| over kept j (both finite); (mae, count)."""
    B, T = recorded.shape
    lo, hi = max(0, -shift), min(T, T - shift)
    if hi <= lo:
        return float("nan"), 0
    a = recorded[:, lo:hi]  # (B, T - |s|)
    b = reference[:, lo + shift : hi + shift]  # (B, T - |s|)
    ok = keep[:, lo:hi] & torch.isfinite(a) & torch.isfinite(b)
    n = int(ok.sum())
    if n == 0:
        return float("nan"), 0
    return float(formulas.masked_mean((a - b).abs(), ok)), n


@register("alignment.logprob_shift", "trainer logprobs fit the sampler's best at shift 0, not -1/+1",
          RL_ALGORITHMS)
def check_logprob_shift(ctx: StepContext):
    name = "old_logprobs" if ctx.has("old_logprobs") else "policy_logprobs"
    if not ctx.has("sampler_logprobs") and not engine_sampled(ctx):
        raise not_applicable(NO_ENGINE)
    recorded, sampler = ctx.require(name, "sampler_logprobs")
    keep = ctx.mask()
    fits = {s: shifted_mae(recorded, sampler, keep, s) for s in SHIFTS}
    mae0, n0 = fits[0]
    candidates = [(m, s) for s, (m, n) in fits.items() if s != 0 and n > 0]
    if n0 == 0 or not candidates or not mae0 > SHIFT_MIN_GAP:
        return []
    best_mae, best = min(candidates)
    if not best_mae < SHIFT_RATIO * mae0:
        return _wrong_position_evidence(ctx, name, recorded, sampler, keep, mae0, n0)
    diff = (recorded - sampler).abs().masked_fill(~keep | ~torch.isfinite(recorded - sampler), -1.0)
    b, t = divmod(int(diff.argmax()), diff.shape[1])
    sums = (float(formulas.masked_sum(recorded[b], keep[b])), float(formulas.masked_sum(sampler[b], keep[b])))
    direction = "next" if best > 0 else "previous"
    message = (
        f"{name} fit sampler_logprobs shifted by {best:+d} (mean |Δ| {best_mae:.4f} nats over "
        f"{count(fits[best][1], 'token')}) far better than unshifted (mean |Δ| {mae0:.4f} nats over {count(n0, 'token')}): "
        f"{name}[j] holds the logprob of the {direction} token. At seq {b}, token {t}: recorded "
        f"{float(recorded[b, t]):.4f}, sampler {float(sampler[b, t]):.4f}; the kept tokens of seq {b} sum to "
        f"{sums[0]:.4f} instead of {sums[1]:.4f}. Why it matters: every token is trained with its "
        "neighbour's logprob, so ratio, KL and loss are computed for the wrong tokens. Likely fix: read "
        "completion token j at logits position prompt_len - 1 + j (logits[:, k] predicts input_ids[:, k+1]), "
        "and take the completion mask at target positions, not input positions."
    )
    return [ctx.finding("alignment.logprob_shift", ERROR, message, b, t, field=name,
                        shift=best, mae_by_shift={str(s): m for s, (m, _) in fits.items()})]


def _wrong_position_evidence(ctx: StepContext, name: str, recorded: torch.Tensor, sampler: torch.Tensor,
                             keep: torch.Tensor, mae0: float, n0: int):
    """The classic off-by-one, ``logits[:, L:]`` gathered at the completion ids: each token is scored
    with the distribution of the *next* position (``recorded[j] = log p_{L+j}(c_j)``), which the
    sampler used for token j + 1 (``sampler[j+1] = log p_{L+j}(c_{j+1})``). The two agree exactly where
    a token repeats the one before it (``c_j == c_{j+1}``), and nowhere in general, so no shift of the
    whole row fits; at those positions (at least :data:`REPEAT_MIN`, fitting within :data:`REPEAT_RATIO`
    of the unshifted gap: sampler noise fits one position by chance) the fit names the bug (and
    ``logits[:, L-2:-2]``, the previous position's distribution, at shift -1). An error finding, or []
    without such evidence."""
    if not ctx.has("completion_ids"):
        return []
    ids = ctx.data["completion_ids"]
    if ids.shape != recorded.shape:
        return []
    for shift in (1, -1):
        lo, hi = max(0, -shift), min(ids.shape[1], ids.shape[1] - shift)
        repeats = (ids[:, lo:hi] == ids[:, lo + shift:hi + shift]) & keep[:, lo:hi] & keep[:, lo + shift:hi + shift]
        n = int(repeats.sum())
        if n < REPEAT_MIN:
            continue
        here, there = recorded[:, lo:hi][repeats], sampler[:, lo + shift:hi + shift][repeats]
        fit, unshifted = float((here - there).abs().mean()), float((here - sampler[:, lo:hi][repeats]).abs().mean())
        if not (fit < REPEAT_RATIO * unshifted and fit < REPEAT_RATIO * mae0):
            continue
        b, j = (int(i) for i in repeats.nonzero()[0])
        j += lo
        position = "next" if shift > 0 else "previous"
        read = "prompt_len + j (logits[:, L:])" if shift > 0 else "prompt_len - 2 + j (logits[:, L-2:-2])"
        message = (
            f"{name} do not fit sampler_logprobs (mean |Δ| {mae0:.4f} nats over {count(n0, 'token')}, and no shift of whole "
            f"rows fits), but at the {n} kept positions where a token repeats its {position} neighbour, {name}[j] "
            f"equals sampler_logprobs[j{shift:+d}] (mean |Δ| {fit:.4f} nats, against {unshifted:.4f} unshifted): "
            f"each token is scored with the distribution of the {position} position. At seq {b}, token {j}: "
            f"recorded {float(recorded[b, j]):.4f}, sampler {float(sampler[b, j]):.4f}, sampler at token "
            f"{j + shift} {float(sampler[b, j + shift]):.4f}. Why it matters: ratio, KL and loss are computed from "
            f"the wrong distribution for every token, consistently on the policy, old and reference sides, so no "
            f"other check sees it. Likely fix: read completion token j at logits position prompt_len - 1 + j "
            f"(logits[:, L-1:-1]), not {read}.")
        return [ctx.finding("alignment.logprob_shift", ERROR, message, b, j, field=name, shift=shift,
                            distribution_shift=shift, repeated_positions=n, mae_repeats_shifted=fit,
                            mae_repeats_unshifted=unshifted)]
    return []


def _left_padding(prompt_mask: torch.Tensor) -> list[int]:
    """Per row, the number of leading padding positions when the row is left-padded, else 0."""
    out = []
    for row in prompt_mask.bool().tolist():
        pad = next((i for i, keep in enumerate(row) if keep), len(row))
        out.append(pad if all(row[pad:]) else 0)
    return out


@register("alignment.completion_start", "the completion starts at the padded prompt width, not at "
          "the count of real prompt tokens", RL_ALGORITHMS)
def check_completion_start(ctx: StepContext):
    prompt_ids, prompt_mask, completion_ids = ctx.require("prompt_ids", "prompt_mask", "completion_ids")
    L, T = prompt_ids.shape[1], completion_ids.shape[1]
    padded = [(b, p) for b, p in enumerate(_left_padding(prompt_mask)) if 0 < p <= min(T, L)]
    leaked = [(b, p) for b, p in padded
              if completion_ids[b, :p].tolist() == prompt_ids[b, L - p :].tolist()]
    if not leaked or len(leaked) != len(padded) or sum(p for _, p in leaked) < 2:
        return []
    b, p = leaked[0]
    real = L - p
    message = (
        f"completion_ids of seq {b} begin with {completion_ids[b, :p].tolist()}, the last {p} real prompt "
        f"tokens: the completion was cut at the count of real prompt tokens ({real}) instead of the padded "
        f"prompt width ({L}). All {len(padded)} left-padded rows begin with as many prompt tokens as they "
        "have padding. Why it matters: prompt tokens are scored and trained as if the model had generated "
        "them, and the completion's last tokens are lost. Likely fix: slice the generated rows at the padded "
        "prompt width, output_ids[:, prompt_ids.shape[1]:], and read logprobs at prompt_len - 1 + j with "
        "prompt_len = the padded width."
    )
    return [ctx.finding("alignment.completion_start", ERROR, message, b, 0, field="completion_ids",
                        rows=[r for r, _ in leaked], padding=[q for _, q in leaked], padded_width=L)]
