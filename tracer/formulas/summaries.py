"""Per-step summaries computed from a step's tensors (the keys and their header form are
:mod:`tracer.format.summary`): the writer computes them once per step file, the reader for files
without one, with the same function, so both paths give the same numbers."""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Mapping

import numpy as np
import torch

from tracer.format.summary import COMPONENT_PREFIX, QUANTILES, FIELDS, ordered_keys, recorded_values
from tracer.formulas import advantages, losses, reductions

# Steps are stacked only up to this many values per field: the stacked copies, sort and masks cost
# several times the steps' own bytes, and batching pays off for small steps only (interpreter time).
MAX_STACKED_VALUES = 2**18


def _number(value: Any) -> float | None:
    """A clip epsilon as a float, when it is a real number (not a bool)."""
    kind = type(value)
    if kind is float or kind is int:  # the usual case, without an abstract-class check
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


Columns = dict[str, list]  # summary key -> its value at each of the S steps summarised together


def _stats(cols: Columns, token: dict[str, np.ndarray], per_seq: dict[str, np.ndarray],
           mask: np.ndarray | None, S: int) -> None:
    """``mean_<name>`` and the quantiles of each of ``token`` (each ``[S, B, T]``, at ``mask``'s kept
    positions, ``[S, B, T]`` bool) and ``per_seq`` (each ``[S, B]``, all positions) into ``cols``,
    and the counts of non-finite values among them (``nonfinite_values``, ``nonfinite_kept``).
    Every field of every step goes through the same few operations, the quantiles of all of them
    through one (the writer thread shares the interpreter with the training loop, so the number of
    calls is what costs, and torch's more than numpy's): the values are stacked as float32
    ``(S, K, N)`` blocks, which one ``(S, K_token + K_seq, max N)`` array holds for the quantiles
    (the padding is not kept); the means are torch's float32 sums (:func:`tracer.formulas.masked_mean`)."""
    blocks = []  # (names, (S, K, N) float32 values, (S, N) kept positions or None for all)
    if token:
        blocks.append((list(token), _block(token.values(), S), mask.reshape(S, -1)))
    if per_seq:
        blocks.append((list(per_seq), _block(per_seq.values(), S), None))
    width = max(values.shape[2] for _, values, _ in blocks)
    rows = sum(len(names) for names, _, _ in blocks)
    padded = np.zeros((S, rows, width), dtype=np.float32)  # finite padding: counted by no NaN count
    kept = np.zeros((S, rows, width), dtype=bool)
    start, nonfinite, nonfinite_kept = 0, 0, 0
    for names, values, keep in blocks:
        K, N = len(names), values.shape[2]
        if keep is None and N == 0:
            means = torch.zeros(S, K)  # masked_mean of nothing kept: 0 (its count is clamped to 1), not mean's NaN
        elif keep is None:
            means = torch.from_numpy(values).mean(dim=2)  # = masked_mean with every position kept (tested)
        else:
            means = reductions.masked_mean(torch.from_numpy(values), torch.from_numpy(keep).unsqueeze(1).expand(S, K, N),
                                         dim=2)
        for name, column in zip(names, means.T.tolist()):
            cols[f"mean_{name}"] = column
        padded[:, start:start + K, :N] = values
        kept[:, start:start + K, :N] = True if keep is None else keep[:, None, :]
        bad = ~np.isfinite(values)
        nonfinite = nonfinite + bad.sum(axis=(1, 2))
        if keep is not None:
            nonfinite_kept = (bad & keep[:, None, :]).sum(axis=(1, 2))
        start += K
    quantiles = reductions.masked_row_quantiles(padded.reshape(S * rows, width), kept.reshape(S * rows, width),
                                              tuple(QUANTILES.values()))
    names = [name for block_names, _, _ in blocks for name in block_names]
    for name, qs in zip(names, quantiles.numpy().reshape(S, rows, -1).transpose(1, 2, 0).tolist()):  # qs: (Q, S)
        for q, column in zip(QUANTILES, qs):
            cols[f"{name}_{q}"] = column
    cols["nonfinite_values"] = np.broadcast_to(nonfinite, (S,)).tolist()
    cols["nonfinite_kept"] = np.broadcast_to(nonfinite_kept, (S,)).tolist()


def _block(values, S: int) -> np.ndarray:
    """Arrays ``[S, ...]`` of one shape as one float32 ``(S, K, N)`` array (torch's ``.float()``
    conversion: the same rounding)."""
    return np.stack([v.astype(np.float32, copy=False) for v in values], axis=1).reshape(S, len(values), -1)


def _floating(a: np.ndarray | None) -> bool:
    return a is not None and np.issubdtype(a.dtype, np.floating)


def compute_summary(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The summary of one step from its (stored, CPU) tensors and its metadata (for the clip
    epsilons). Returns ``{key: int | float}`` with the keys of the module docstring that the step's
    fields allow; floats may be NaN. Shapes as in SPEC.md section 4 (``[B, T]`` token fields, ``[B]``
    rewards, ``[B]`` or ``[B, T]`` advantages); a field whose shape does not fit is left out."""
    return compute_summaries([(tensors, metadata)])[0]


def compute_summaries(steps: list[tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """:func:`compute_summary` of each ``(tensors, metadata)`` in ``steps``, in order. Steps whose
    summarised fields have the same names, shapes and dtypes (and the same clip epsilons) are
    stacked and summarised together, so S small steps cost about the tensor calls of one; a stack
    holds at most :data:`MAX_STACKED_VALUES` values per field (large steps go one by one, so the
    memory a batch needs stays that of its largest step)."""
    groups: dict[tuple, list[int]] = {}
    for i, (tensors, metadata) in enumerate(steps):
        used = tuple((n, t.shape, t.dtype) for n in FIELDS
                     if (t := tensors.get(n)) is not None and isinstance(t, torch.Tensor))
        names = metadata.get("reward_component_names")
        eps = (_number(metadata.get("clip_epsilon_low")), _number(metadata.get("clip_epsilon_high")),
               _number(metadata.get("num_generations")),
               tuple(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) else None)
        groups.setdefault((used, eps), []).append(i)
    out: list[dict[str, Any]] = [{} for _ in steps]
    for (used, _eps), members in groups.items():
        names = [n for n, _, _ in used]
        per_step = max([math.prod(shape) for _, shape, _ in used] + [1])
        size = max(1, MAX_STACKED_VALUES // per_step)
        for chunk in (members[c:c + size] for c in range(0, len(members), size)):
            stacked = {n: np.stack([reductions.host_array(steps[i][0][n]) for i in chunk]) for n in names}
            with np.errstate(all="ignore"):  # NaN/inf are data here (counted), as in torch: no numpy warning
                for i, summary in zip(chunk, _summarise_group(stacked, steps[chunk[0]][1], len(chunk))):
                    out[i] = summary
    for summary, (_, metadata) in zip(out, steps):
        summary.update(recorded_values(metadata))  # wall_time, scalars/<name>: recorded, not computed
    return out


def _summarise_group(tensors: dict[str, np.ndarray], metadata: Mapping[str, Any], S: int) -> list[dict[str, Any]]:
    """The summaries of S steps whose fields are stacked in ``tensors`` (``[S, ...]`` numpy arrays)."""
    cols: Columns = {}
    mask = tensors.get("completion_mask")
    mask = mask.astype(bool, copy=False) if mask is not None else None
    token = {name: tensors[name] for name in ("ratio", "ref_kl_k3", "approx_kl_k2") if name in tensors}
    if "old_logprobs" in tensors and "sampler_logprobs" in tensors:
        token["mismatch"] = (tensors["old_logprobs"].astype(np.float32, copy=False)
                             - tensors["sampler_logprobs"].astype(np.float32, copy=False))
    per_seq: dict[str, np.ndarray] = {}
    rewards, adv = tensors.get("rewards"), tensors.get("advantages")
    if _floating(rewards) and rewards.ndim == 2:
        per_seq["reward"] = rewards
    if _floating(adv) and adv.ndim == 2 and (not per_seq or adv.shape == rewards.shape):
        per_seq["advantage"] = adv  # [B] like the rewards (the schema check makes them agree)
    if "entropy" in tensors:
        token["entropy"] = tensors["entropy"]
    if mask is not None:
        cols["kept_tokens"] = mask.reshape(S, -1).sum(axis=1).tolist()
        if mask.ndim == 3 and (not per_seq or next(iter(per_seq.values())).shape == mask.shape[:2]):
            per_seq["length"] = mask.sum(axis=2, dtype=np.float32)  # (S, B) kept completion tokens per sequence
        token = {n: v for n, v in token.items() if v.shape == mask.shape and _floating(v)}
        if _floating(adv) and adv.shape == mask.shape:
            token["advantage"] = adv  # PPO: per token
    else:
        token = {}
    if token or per_seq:
        _stats(cols, token, per_seq, mask, S)
    else:
        cols["nonfinite_values"] = cols["nonfinite_kept"] = [0] * S
    _clip(cols, tensors, mask, metadata)
    if "reward" in per_seq:
        _groups(cols, per_seq["reward"], tensors.get("group_ids"), metadata)
    loss = tensors.get("loss")
    if _floating(loss) and loss.shape == (S,):
        cols["loss"] = loss.astype(np.float64).tolist()
    _components(cols, tensors.get("reward_components"), metadata)
    keys = ordered_keys(cols)  # counts, token statistics, per-sequence ones, clip, NaN counts, component means
    return [dict(zip(keys, row)) for row in zip(*(cols[k] for k in keys))]


def _components(cols: Columns, components: np.ndarray | None, metadata: Mapping[str, Any]) -> None:
    """``mean_reward/<name>``: the mean over B of each reward component (``[S, B, F]``; names from
    ``reward_component_names`` when it names F components, else ``component_<f>``; a NaN makes the mean NaN)."""
    if not _floating(components) or components.ndim != 3:
        return
    F = components.shape[2]
    names = metadata.get("reward_component_names")
    if not (isinstance(names, list) and len(names) == F and all(isinstance(n, str) for n in names)
            and len(set(names)) == F):
        names = [f"component_{f}" for f in range(F)]
    means = torch.from_numpy(components.astype(np.float32, copy=False)).mean(dim=1)  # (S, F)
    for name, column in zip(names, means.T.tolist()):
        cols[f"{COMPONENT_PREFIX}{name}"[:len(COMPONENT_PREFIX) + 100]] = column


def _clip(cols: Columns, tensors: Mapping[str, np.ndarray], mask: np.ndarray | None,
          metadata: Mapping[str, Any]) -> None:
    eps_low, eps_high = _number(metadata.get("clip_epsilon_low")), _number(metadata.get("clip_epsilon_high"))
    ratio, adv = tensors.get("ratio"), tensors.get("advantages")
    if mask is None or ratio is None or adv is None or eps_low is None or eps_high is None:
        return
    if ratio.shape != mask.shape or adv.shape not in (mask.shape, mask.shape[:2]):
        return
    ratio, adv = ratio.astype(np.float32, copy=False), adv.astype(np.float32, copy=False)
    adv = adv if adv.ndim == mask.ndim else adv[:, :, None]  # (S, B, 1): over T
    dims = tuple(range(1, mask.ndim))
    fr = {k: v.tolist() for k, v in losses.clip_fractions(ratio, adv, mask, eps_low, eps_high, dims).items()}
    cols["clip_fraction_low"], cols["clip_fraction_high"] = fr["low"], fr["high"]
    cols["clip_fraction"] = [low + high for low, high in zip(fr["low"], fr["high"])]
    cols["clip_region"] = fr["region"]


def _groups(cols: Columns, rewards: np.ndarray, group_ids: np.ndarray | None, metadata: Mapping[str, Any]) -> None:
    """Group counts of S steps (``rewards`` ``[S, B]``): groups from ``group_ids`` ``[S, B]`` when
    recorded, else ``num_generations`` consecutive rows (as ``tracer.views.groups.group_ids_of``);
    nothing when neither tells the groups apart (the reader then counts from the tensors)."""
    S, B = rewards.shape
    if group_ids is not None:
        if group_ids.shape != rewards.shape or _floating(group_ids) or group_ids.dtype == np.bool_:
            return
        ids, recorded = group_ids.astype(np.int64, copy=False), 1
    else:
        G = _number(metadata.get("num_generations"))
        if not G or G != int(G) or G < 1 or B % int(G):
            return
        ids, recorded = np.broadcast_to(consecutive_groups(B, int(G)), (S, B)), 0
    cols["groups"], cols["zero_variance_groups"] = advantages.zero_variance_counts(rewards, ids)
    cols["group_ids_recorded"] = [recorded] * S


@functools.lru_cache(maxsize=64)
def consecutive_groups(B: int, G: int) -> np.ndarray:
    """The group of each of B rows when groups are G consecutive rows (``[B]`` int64, read-only; a
    run has a few (B, G), made once each)."""
    ids = np.arange(B, dtype=np.int64) // G
    ids.flags.writeable = False
    return ids


