"""GRPO / CISPO / RLOO group views: the G completions of one prompt, zero-variance groups."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from tracer.errors import TraceFormatError
from tracer.read import StepKey, Trace
from tracer.read.tables import AFTER_EOS, PADDING, mask_reasons
from tracer.views.common import GROUPED_ALGORITHMS  # noqa: F401  (re-exported; its home is common)

# -- GRPO / CISPO / RLOO groups ---------------------------------------------------------------------


def group_std_estimator(meta: dict[str, Any]) -> str:
    """``"unbiased"`` when the step says its advantages used the Bessel-corrected std
    (``advantage_std = "unbiased"``, TRL), else ``"population"`` (the seed's ``unbiased=False``)."""
    return "unbiased" if meta.get("advantage_std") == "unbiased" else "population"


def group_ids_of(data: dict[str, torch.Tensor], meta: dict[str, Any], path: Any = "") -> torch.Tensor:
    """The group of each row, ``[B]`` int64: ``group_ids`` when recorded, else G consecutive rows
    per group from ``num_generations``.

    Raises:
        TraceFormatError: neither is there (or B is not a multiple of G); the message says which
            field or metadata key to record.
    """
    if "group_ids" in data:
        return data["group_ids"].long()
    B = data["rewards"].shape[0]
    G = meta.get("num_generations")
    if not G or B % int(G):
        raise TraceFormatError(
            f"{path}: cannot tell the groups apart: no group_ids field and num_generations = {G!r} "
            f"does not divide B = {B}; record group_ids [B] or set num_generations in the metadata")
    return torch.arange(B) // int(G)  # (B,)


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor, std: str) -> dict[int, dict[str, Any]]:
    """Per group: sequences, reward mean / std (population or unbiased) / min / max, zero variance
    (every reward of the group equal, so every advantage is 0)."""
    stats = {}
    for g in torch.unique(group_ids).tolist():
        rows = (group_ids == g).nonzero().flatten()  # (G,)
        r = rewards[rows].double()  # (G,)
        unbiased = std == "unbiased"
        std_value = float(r.std(unbiased=unbiased)) if r.numel() > int(unbiased) else math.nan
        stats[int(g)] = {"sequences": rows.tolist(), "size": r.numel(), "reward_mean": float(r.mean()),
                         "reward_std": std_value, "reward_min": float(r.min()), "reward_max": float(r.max()),
                         "zero_variance": bool((r == r[0]).all())}
    return stats


def _load_group_step(trace: Trace, key: StepKey) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    data = trace.load_step(key, ["rewards", "group_ids", "advantages", "reward_components"])
    if "rewards" not in data:
        raise TraceFormatError(f"{key.path}: no rewards field: a group view needs rewards [B]")
    return data, trace.metadata(key)


def group_frame(trace: Trace, key: StepKey) -> pd.DataFrame:
    """One row per group of one step file: ``group, size, sequences`` (row indices, text),
    ``reward_mean, reward_std, reward_min, reward_max, zero_variance``. The std estimator is
    :func:`group_std_estimator` of the file's metadata. Reads only ``[B]`` fields."""
    data, meta = _load_group_step(trace, key)
    stats = _group_stats(data["rewards"], group_ids_of(data, meta, key.path), group_std_estimator(meta))
    return pd.DataFrame([{"group": g, **s, "sequences": " ".join(map(str, s["sequences"]))}
                         for g, s in stats.items()],
                        columns=["group", "size", "sequences", "reward_mean", "reward_std", "reward_min",
                                 "reward_max", "zero_variance"])


def _visible_text(trace: Trace, ids: torch.Tensor, mask: torch.Tensor) -> tuple[str, int]:
    """A completion's text without its filler (padding, after EOS) and its count of kept tokens."""
    reasons = mask_reasons(ids.unsqueeze(0), mask.unsqueeze(0), trace.eos_token_id, trace.pad_token_id)[0]
    shown = [i for i, reason in zip(ids.tolist(), reasons) if reason not in (PADDING, AFTER_EOS)]
    return trace.decode(shown), int(mask.bool().sum())


def group_completions(trace: Trace, key: StepKey, group: int) -> pd.DataFrame:
    """The completions of one group of one step file, one row each, in row order.

    Columns: ``sequence`` (row in the file), ``completion_text`` (token strings concatenated,
    padding and positions after EOS left out; literal text, never markup), ``kept_tokens``,
    ``reward``, one column per reward component (:func:`component_columns`: names from
    ``reward_component_names``, else ``component_<f>``; a name that collides is prefixed), ``advantage`` (as recorded), ``group_mean``, ``group_std``,
    ``zero_variance``. Raises KeyError for a group the file does not hold.
    """
    data, meta = _load_group_step(trace, key)
    stats = _group_stats(data["rewards"], group_ids_of(data, meta, key.path), group_std_estimator(meta))
    if group not in stats:
        raise KeyError(f"{key.path}: no group {group}; groups here: {sorted(stats)}")
    s = stats[group]
    components = data.get("reward_components")
    names = component_columns(meta.get("reward_component_names"), components.shape[1]) if components is not None else []
    records = []
    for b in s["sequences"]:
        row = trace.load_sequence(key, b)
        ids = row.get("completion_ids", torch.zeros(0, dtype=torch.long))  # (T,)
        text, kept = _visible_text(trace, ids, row.get("completion_mask", torch.ones_like(ids, dtype=torch.bool)))
        rec: dict[str, Any] = {"sequence": b, "completion_text": text, "kept_tokens": kept,
                               "reward": float(data["rewards"][b])}
        if components is not None:
            rec.update({name: float(components[b, f]) for f, name in enumerate(names)})
        adv = data.get("advantages")
        rec["advantage"] = float(adv[b]) if adv is not None and adv.dim() == 1 else math.nan
        rec.update(group_mean=s["reward_mean"], group_std=s["reward_std"], zero_variance=s["zero_variance"])
        records.append(rec)
    return pd.DataFrame.from_records(records)


# The columns group_completions sets itself: a reward component may not take one of these names.
COMPLETION_COLUMNS = ("sequence", "completion_text", "kept_tokens", "reward", "advantage", "group_mean",
                      "group_std", "zero_variance")
COMPONENT_PREFIX = "component: "


def component_columns(raw_names: Any, count: int) -> list[str]:
    """Column names of ``count`` reward components: ``reward_component_names`` when it is a list of
    that length, else ``component_<f>``. A name that collides with a column of the view
    (:data:`COMPLETION_COLUMNS`: ``reward_component_names = ["reward"]`` would overwrite the recorded
    reward) or with an earlier component is shown under :data:`COMPONENT_PREFIX` (``component:
    reward``), with the component's index added if that is taken too."""
    names = [str(n) for n in raw_names] if isinstance(raw_names, list) and len(raw_names) == count else \
        [f"component_{f}" for f in range(count)]
    taken, out = set(COMPLETION_COLUMNS), []
    for f, name in enumerate(names):
        column = name if name not in taken else f"{COMPONENT_PREFIX}{name}"
        column = column if column not in taken else f"{COMPONENT_PREFIX}{f} {name}"
        taken.add(column)
        out.append(column)
    return out


def group_prompt_text(trace: Trace, key: StepKey, sequence: int) -> str:
    """The prompt of one row as text (real prompt tokens only); ``""`` without ``prompt_ids``."""
    row = trace.load_sequence(key, sequence)
    if "prompt_ids" not in row:
        return ""
    ids = row["prompt_ids"]  # (L,)
    keep = row.get("prompt_mask", torch.ones_like(ids, dtype=torch.bool)).bool()
    return trace.decode(ids[keep].tolist())


def zero_variance_shares(trace: Trace, summary: pd.DataFrame | None = None) -> pd.DataFrame:
    """Share of zero-variance groups per (step, inner_step): ``step, inner_step, groups,
    zero_variance_groups, zero_variance_share``.

    Micro-batch files of one (step, inner_step, rank) are pooled by ``group_ids`` (a group split
    across micro-batches counts once); without ``group_ids`` each file's G consecutive rows form
    its groups. Counts are summed over ranks. Files without rewards are skipped; a step whose files
    hold no rows (B = 0) has 0 groups and a NaN share.

    The counts of a file come from its summary (``groups``, ``zero_variance_groups``,
    :mod:`tracer.format.summary`: no tensor read) unless its groups may span several files (group_ids
    recorded and another file of its step, inner step and rank that may hold them too) or its
    summary lacks them (older traces, files without rewards): then its ``[B]`` fields are read and
    pooled as described. ``summary``: ``trace.step_summary()`` when the caller has it; else it is
    read when the run has a summary index (cheap), and every file is read otherwise.
    """
    keys = trace.steps()
    if summary is None:
        summary = trace.step_summary() if keys and (trace.summary_index() or trace.summary_columns()) \
            else pd.DataFrame()
    known, pooled = _summarised_group_counts(keys, summary)
    groups_by_file: dict[tuple[int, int], dict[Any, list[torch.Tensor]]] = {}
    for n, key in enumerate(keys):
        if known[n]:
            continue
        data = trace.load_step(key, ["rewards", "group_ids"])
        if "rewards" not in data:
            continue
        group_ids = group_ids_of(data, trace.metadata(key), key.path)
        groups = groups_by_file.setdefault((key.step, key.inner_step), {})
        for g in torch.unique(group_ids).tolist():
            where = (key.rank, g) if "group_ids" in data else (n, g)
            groups.setdefault(where, []).append(data["rewards"][group_ids == g])
    for step, groups in groups_by_file.items():
        zero = sum(bool((r := torch.cat(parts)).eq(r[0]).all()) for parts in groups.values())
        total = pooled.setdefault(step, [0, 0])
        total[0] += len(groups)
        total[1] += zero
    records = [{"step": step, "inner_step": inner_step, "groups": g, "zero_variance_groups": z,
                "zero_variance_share": z / g if g else math.nan}  # an empty step (B = 0) has no groups
               for (step, inner_step), (g, z) in sorted(pooled.items())]
    return pd.DataFrame.from_records(records, columns=["step", "inner_step", "groups", "zero_variance_groups",
                                                       "zero_variance_share"])


def _summarised_group_counts(keys: list[StepKey], summary: pd.DataFrame
                             ) -> tuple[list[bool], dict[tuple[int, int], list[int]]]:
    """Which of ``keys`` the run overview ``summary`` (one row per key, in order) counts exactly, and
    those counts summed per (step, inner_step) as ``[groups, zero_variance_groups]``."""
    if summary.empty or "groups" not in summary or len(summary) != len(keys):
        return [False] * len(keys), {}
    frame = summary[["step", "inner_step", "rank"]].copy()
    frame["groups"] = summary["groups"]
    frame["zero"] = summary["zero_variance_groups"]
    by_ids = summary["group_ids_recorded"].fillna(1) != 0  # unknown: may pool
    mates = by_ids.groupby([frame["step"], frame["inner_step"], frame["rank"]]).transform("sum")
    known = frame["groups"].notna() & (~by_ids | (mates <= 1))
    sums = frame[known].groupby(["step", "inner_step"])[["groups", "zero"]].sum()
    pooled = {(int(s), int(i)): [int(g), int(z)] for (s, i), g, z in
              zip(sums.index, sums["groups"].tolist(), sums["zero"].tolist())}
    return known.tolist(), pooled
