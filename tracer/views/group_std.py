"""Which std a GRPO-family run divided its group-centred rewards by, as the Groups page states it:
read from what the trace records, never guessed.

TRL's ``GRPOTrainer`` and verl divide by the Bessel-corrected std (``torch.std``'s default, TRL
``trl/trainer/utils.py:nanstd``, verl ``core_algos.compute_grpo_outcome_advantage``); MiniMind's
``trainer/train_grpo.py`` by the population std (``std(unbiased=False)``); Dr. GRPO and TRL's
``scale_rewards="none"`` by none. A trace says which in its metadata (``advantage_std``,
``advantage_rule``, TRL's ``scale_rewards``); without it, the step's recorded ``advantages`` are
compared with each rule of :mod:`tracer.formulas.advantages` recomputed from its recorded
``rewards``, and the rule they follow, when exactly one does, is the answer. Otherwise the answer is
"not recorded", with the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tracer import formulas
from tracer.read import StepKey, Trace

POPULATION, UNBIASED, NO_STD = "population", "unbiased", "none"

# advantage_rule (canonical, tracer.formulas.ADVANTAGE_RULES) -> the std it divides by
STD_OF_RULE = {"group_zscore": POPULATION, "group_zscore_unbiased": UNBIASED, "batch_zscore_unbiased": UNBIASED,
               "verl_grpo": UNBIASED, "group_mean": NO_STD, "rloo": NO_STD, "rloo_kl": NO_STD}
# the rules tried on the recorded values, each with the std it stands for (TRL's scale_rewards="group"
# eps and MiniMind's are both 1e-4; verl's 1e-6 is within the tolerance below)
CANDIDATES: dict[str, tuple[str, Callable[[torch.Tensor, int], torch.Tensor]]] = {
    POPULATION: ("tracer.formulas.group_advantages", formulas.group_advantages),
    UNBIASED: ("tracer.formulas.trl_group_advantages", lambda r, G: formulas.trl_group_advantages(r, G, "group")),
    NO_STD: ("tracer.formulas.group_mean_advantages", formulas.group_mean_advantages),
}
ATOL, RTOL = 1e-4, 2e-3  # |recorded - recomputed| <= ATOL + RTOL * |recomputed|; the two stds differ by
# a factor sqrt(G / (G - 1)), over 1.002 for any G < 250


@dataclass(frozen=True)
class GroupStd:
    """The std a step's advantages were divided by.

    ``estimator``: ``"population"``, ``"unbiased"`` (Bessel-corrected), ``"none"`` (not divided), or
    None when the trace cannot tell. ``recorded``: True when the metadata says so, False when inferred
    from the values (or unknown). ``source``: one clause saying where the answer comes from, or why
    there is none, with the numbers."""

    estimator: str | None
    recorded: bool
    source: str


def declared_group_std(meta: dict[str, Any]) -> GroupStd | None:
    """The std the step's metadata declares: TRL's ``scale_rewards = "none"`` (no std), else
    ``advantage_std`` (population | unbiased), else the std of ``advantage_rule`` (:data:`STD_OF_RULE`),
    else another ``scale_rewards`` (Bessel's std, TRL 1.16 ``_generate_and_score_completions``). None
    when none is there."""
    scale = meta.get("scale_rewards")
    if scale in ("none", False):  # TRL centres only, whatever advantage_std says
        return GroupStd(NO_STD, True, f"recorded: scale_rewards = {scale!r} (TRL)")
    std = meta.get("advantage_std")
    if std in (POPULATION, UNBIASED):
        return GroupStd(std, True, f"recorded: advantage_std = {std!r}")
    rule = meta.get("advantage_rule")
    if isinstance(rule, str):
        try:
            canonical = formulas.advantage_rule_name(rule)
        except ValueError:
            canonical = None
        if canonical in STD_OF_RULE:
            return GroupStd(STD_OF_RULE[canonical], True, f"recorded: advantage_rule = {rule!r}")
    if scale is not None:
        return GroupStd(UNBIASED, True, f"recorded: scale_rewards = {scale!r} (TRL)")
    return None


def _complete_groups(rewards: torch.Tensor, group_ids: torch.Tensor | None, G: int | None) -> tuple[torch.Tensor, int]:
    """Row indices of the step's complete groups, group after group (``[N]`` int64, N = groups * G), and
    G: groups of ``group_ids`` holding exactly G rows (G: ``num_generations``, else the commonest group
    size), else G consecutive rows. A micro-batch of a shuffled batch may hold only parts of groups:
    those are left out."""
    B = rewards.shape[0]
    if group_ids is None:
        if not G or B % G:
            return torch.zeros(0, dtype=torch.long), int(G or 0)
        return torch.arange(B), G
    ids, counts = torch.unique(group_ids, return_counts=True)
    if G is None and counts.numel():
        G = int(torch.mode(counts).values)
    full = [torch.nonzero(group_ids == g).flatten() for g, n in zip(ids.tolist(), counts.tolist()) if n == G]
    return (torch.cat(full) if full else torch.zeros(0, dtype=torch.long)), int(G or 0)


def inferred_group_std(rewards: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor | None,
                       num_generations: int | None) -> GroupStd:
    """The std that the recorded advantages follow, from the recorded rewards: each rule of
    :data:`CANDIDATES` recomputed on the step's complete groups and compared with the advantages.

    Args:
        rewards: ``[B]`` float. advantages: ``[B]`` float (as recorded). group_ids: ``[B]`` int64 or None
        (then G consecutive rows). num_generations: G, or None (then the commonest size of ``group_ids``).
    Returns:
        The one rule that matches (``recorded=False``); ``estimator=None`` with the reason when no
        complete group of G >= 2 rows varies, or when none or several match.
    """
    rows, G = _complete_groups(rewards, group_ids, num_generations)
    if G < 2 or rows.numel() == 0:
        return GroupStd(None, False, f"no complete group of G >= 2 rows in this step file (G = {G or 'unknown'})")
    r, a = rewards[rows].double(), advantages[rows].double()  # (N,) group after group
    varies = (r.view(-1, G) != r.view(-1, G)[:, :1]).any(dim=1)  # (N / G,)
    if not bool(varies.any()):
        return GroupStd(None, False, f"every one of the {varies.numel()} complete groups has zero reward variance, "
                                     "so every rule gives the same advantages")
    gaps = {}
    for estimator, (name, rule) in CANDIDATES.items():
        expected = rule(r.float(), G).double()  # (N,)
        excess = (a - expected).abs() - (ATOL + RTOL * expected.abs())
        gaps[estimator] = (float((a - expected).abs().max()), bool((excess <= 0).all()), name)
    matched = [e for e, (_, ok, _) in gaps.items() if ok]
    shown = ", ".join(f"{e} std max |Δ| {gap:.3g}" for e, (gap, _, _) in gaps.items() if e != NO_STD)
    if len(matched) != 1:
        why = "follow none of the group rules" if not matched else f"match several rules ({', '.join(matched)})"
        return GroupStd(None, False, f"the recorded advantages {why} ({shown})")
    (estimator,) = matched
    gap, _, name = gaps[estimator]
    groups = int(varies.sum())
    return GroupStd(estimator, False, f"inferred: the recorded advantages of {groups} group{'s' * (groups != 1)} "
                                      f"follow {name} (max |Δ| {gap:.2g}; {shown})")


def group_std(trace: Trace, key: StepKey) -> GroupStd:
    """The std one step file's advantages were divided by: :func:`declared_group_std` of its metadata,
    else :func:`inferred_group_std` of its ``rewards``, ``advantages`` (``[B]``) and ``group_ids``; else
    ``estimator=None`` saying what is missing. Reads only ``[B]`` fields."""
    meta = trace.metadata(key)
    declared = declared_group_std(meta)
    if declared is not None:
        return declared
    data = trace.load_step(key, ["rewards", "advantages", "group_ids"])
    if "rewards" not in data or "advantages" not in data or data["advantages"].dim() != 1:
        return GroupStd(None, False, "no advantage_std or advantage_rule in the metadata, and no rewards and "
                                     "sequence advantages [B] to infer it from")
    G = meta.get("num_generations")
    G = int(G) if isinstance(G, (int, float)) and not isinstance(G, bool) and G >= 1 else None
    found = inferred_group_std(data["rewards"], data["advantages"], data.get("group_ids"), G)
    if found.estimator is None:
        return GroupStd(None, False, f"no advantage_std or advantage_rule in the metadata, and {found.source}")
    return found


def restate_std(std: float, size: int, computed_with: str, wanted: str) -> float:
    """A group std computed with one estimator restated in the other: the unbiased std is the population
    std times ``sqrt(n / (n - 1))`` (Bessel's correction), NaN for a group of one under it. Unchanged
    when the estimators are equal or ``wanted`` is not population or unbiased."""
    if computed_with == wanted or wanted not in (POPULATION, UNBIASED) or std != std:
        return std
    if size < 2:
        return math.nan if wanted == UNBIASED else 0.0
    factor = math.sqrt(size / (size - 1))
    return std * factor if wanted == UNBIASED else std / factor
