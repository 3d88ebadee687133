"""Token alignment: where the two traces of a step pair sampled the same tokens.

A logprob at completion position t (and the ratio, KL, entropy, value, advantage and per-token
loss derived from it) is a function of the prompt and of every completion token up to t. Where
the two runs sampled different tokens, comparing those values compares the logprob of one token
under one context with that of another token under another: a number (``max |Δ| = 7.3``) that
means nothing. So token-aligned ``[B, T]`` fields are compared only where both sides have the same
context: the same prompt (``prompt_ids`` on kept prompt positions and ``prompt_mask``, when
recorded) and the same ids (``completion_ids``, or ``chosen_ids``/``rejected_ids`` for DPO) at
every position up to and including t. The ids and masks themselves are still compared everywhere,
and :class:`TokenAlignment` counts the positions whose tokens differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracer.diff.locations import Location, StepId


@dataclass
class TokenAlignment:
    """How the sampled tokens of one ids field (``completion_ids``, ``chosen_ids``, ``rejected_ids``)
    line up over the step pairs, and what that left out of the token-aligned comparisons.

    Attributes:
        ids: the ids field.
        kept_both: positions both sides keep (the field's mask; every position without one).
        differing_tokens: of them, positions whose token ids differ.
        not_compared: of them, positions whose context differs (a different token there or before
            it, or a different prompt): token-aligned fields (logprobs, ratio, KL, values, per-token
            loss) are not compared there, since their values belong to different tokens.
        prompt_rows_differing: sequences whose prompt differs (all their positions are left out).
        first: the first kept position whose token differs (``a``/``b`` are the two token ids).
    """

    ids: str
    kept_both: int = 0
    differing_tokens: int = 0
    not_compared: int = 0
    prompt_rows_differing: int = 0
    first: Location | None = None

    def summary(self) -> str:
        """One line: how many positions had different tokens, the first one, what was left out."""
        if not (self.differing_tokens or self.prompt_rows_differing):
            return f"{self.ids}: the same tokens at all {self.kept_both} kept positions"
        first = f" (first at {self.first.where()}: {self.first.values()})" if self.first else ""
        prompts = (f"; {self.prompt_rows_differing} sequences (summed over step pairs) have another prompt"
                   if self.prompt_rows_differing else "")
        compared = self.kept_both - self.not_compared
        return (f"{self.ids}: different tokens at {self.differing_tokens} of {self.kept_both} positions both "
                f"traces keep{first}{prompts}; token-aligned fields are compared only at the {compared} "
                "positions whose prompt and tokens so far agree (values of different tokens are not comparable)")


# ids field -> the mask of its positions (the family of token-aligned fields it anchors)
ID_FIELDS = {"completion_ids": "completion_mask", "chosen_ids": "chosen_mask", "rejected_ids": "rejected_mask"}


def prompt_rows_same(ids_a: torch.Tensor | None, ids_b: torch.Tensor | None, mask_a: torch.Tensor | None,
                     mask_b: torch.Tensor | None) -> torch.Tensor | None:
    """``[B]`` bool: rows whose prompt is the same on both sides (same mask, same ids where kept);
    None when the prompt ids are not recorded on both sides. Inputs ``[B, L]``, padded to one width."""
    if ids_a is None or ids_b is None or ids_a.shape != ids_b.shape or ids_a.dim() != 2:
        return None
    if mask_a is None or mask_b is None or mask_a.shape != ids_a.shape or mask_b.shape != ids_b.shape:
        return (ids_a == ids_b).all(dim=1)  # (B,)
    kept = mask_a.bool()
    return (kept == mask_b.bool()).all(dim=1) & ((ids_a == ids_b) | ~kept).all(dim=1)  # (B,)


def same_context(ids_a: torch.Tensor, ids_b: torch.Tensor, prompts_same: torch.Tensor | None) -> torch.Tensor:
    """``[B, T]`` bool: True where the prompt and the ids at positions ``0..t`` agree.
    ``ids_a``, ``ids_b``: ``[B, T]`` integers of one shape (padded with -1 past a side's width)."""
    context = torch.cumprod((ids_a == ids_b).to(torch.int8), dim=1).bool()  # (B, T)
    if prompts_same is not None and prompts_same.shape[0] == context.shape[0]:
        context &= prompts_same[:, None]
    return context


def account(acc: TokenAlignment, step: StepId, ids_a: torch.Tensor, ids_b: torch.Tensor, kept: torch.Tensor,
            context: torch.Tensor, prompts_same: torch.Tensor | None) -> Location | None:
    """Add one step pair to ``acc`` (``kept``: positions both sides keep, ``[B, T]``); returns the
    new :attr:`TokenAlignment.first` when this step sets it (its token text is filled by the caller)."""
    differ = kept & (ids_a != ids_b)  # (B, T)
    acc.kept_both += int(kept.sum())
    acc.differing_tokens += int(differ.sum())
    acc.not_compared += int((kept & ~context).sum())
    if prompts_same is not None:
        acc.prompt_rows_differing += int((~prompts_same).sum())
    if acc.first is None and bool(differ.any()):
        s, t = (int(i) for i in differ.nonzero()[0])
        acc.first = Location(step, (s, t), ("B", "T"), int(ids_a[s, t]), int(ids_b[s, t]), float("inf"),
                             int(differ[s].sum()))
        return acc.first
    return None
