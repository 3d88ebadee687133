"""Per-algorithm views of a trace: small pandas tables that the app's PPO, group and DPO pages show.

Pure reading and pandas over :class:`tracer.reader.Trace`; every reduction that is RL maths
(masked means, logprob sums, DPO terms) comes from :mod:`tracer.formulas`. Each function reads only
what it needs: headers for the early-stop overview, ``[B]`` fields for the group shares, one row
(``get_slice``) for a DPO pair.

- PPO: :func:`rollout_rows` (where each rollout row lies among the minibatch files of an epoch),
  :func:`ppo_minibatch_table` (epochs x minibatches of one step: which ran, which stopped early,
  mean ``approx_kl_k2`` against ``target_kl``), :func:`ppo_early_stops` (one row per step).
- GRPO / CISPO / RLOO: :func:`group_frame` (one row per group of a step file),
  :func:`group_completions` (the G completions of one group), :func:`zero_variance_shares`
  (share of zero-variance groups per step).
- DPO: :func:`dpo_pair_tokens` and :func:`dpo_pair_terms` (one pair, token by token and summed),
  :func:`dpo_step_summary` (margin and preference accuracy per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from tracer import formulas
from tracer.errors import TraceFormatError
from tracer.reader import AFTER_EOS, PADDING, StepKey, Trace, mask_reasons

GROUPED_ALGORITHMS = ("grpo", "cispo", "rloo")
# Status of one (epoch, minibatch) cell of a PPO step.
RAN, EARLY_STOP, NOT_RUN, NO_FILE = "ran", "early stop", "not run", "no file"
# Fields whose first dim is B, tried in this order to count the rows of a step file.
_B_FIELDS = ("completion_ids", "prompt_ids", "chosen_ids", "rewards", "advantages", "row_ids")
_SIDES = ("chosen", "rejected")


def _hyperparameter(trace: Trace, meta: dict[str, Any], name: str) -> Any:
    """A step's metadata value, else the manifest's hyperparameter of that name, else None."""
    value = meta.get(name)
    return value if value is not None else (trace.manifest.get("hyperparameters") or {}).get(name)


def _flag(value: Any) -> bool:
    """A metadata flag: True for ``true`` (bool, or the strings true / 1 / yes in any case)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _batch_size(trace: Trace, key: StepKey) -> int:
    fields = trace.fields(key)
    sizes = [fields[name][0][0] for name in _B_FIELDS if name in fields and fields[name][0]]
    return sizes[0] if sizes else 0


# -- PPO ------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class RolloutRow:
    """Where one rollout row of a PPO step lies: row ``index`` of the minibatch file ``key``."""

    row_id: int
    key: StepKey
    index: int


def rollout_rows(trace: Trace, step: int, inner_step: int = 0) -> list[RolloutRow]:
    """Every rollout row of one PPO step and epoch, sorted by row id, with the minibatch file
    (``micro_batch``) and the row within it that holds it. Reads only ``row_ids`` (``[B]``).

    Files without ``row_ids`` number their rows on from the previous file, in (micro_batch, rank)
    order. With several ranks, row ids may repeat (one per rank): each occurrence is listed.
    """
    out: list[RolloutRow] = []
    offset = 0
    for key in sorted((k for k in trace.steps() if k.step == step and k.inner_step == inner_step),
                      key=lambda k: (k.micro_batch, k.rank)):
        row_ids = trace.load_step(key, ["row_ids"]).get("row_ids")
        n = _batch_size(trace, key)
        ids = row_ids.tolist() if row_ids is not None else list(range(offset, offset + n))
        offset += n
        out += [RolloutRow(int(r), key, i) for i, r in enumerate(ids)]
    return sorted(out)


def _mean_approx_kl_k2(trace: Trace, key: StepKey) -> float:
    """Masked mean of the recorded ``approx_kl_k2`` (or of k2 from policy and old logprobs)."""
    data = trace.load_step(key, ["approx_kl_k2", "completion_mask"])
    if "approx_kl_k2" not in data:
        logprobs = trace.load_step(key, ["policy_logprobs", "old_logprobs"])
        if len(logprobs) < 2:
            return math.nan
        data["approx_kl_k2"] = formulas.approx_kl_k2(logprobs["policy_logprobs"], logprobs["old_logprobs"])
    k2 = data["approx_kl_k2"].float()  # (B, T)
    completion_mask = data.get("completion_mask", torch.ones_like(k2, dtype=torch.bool))
    return float(formulas.masked_mean(k2, completion_mask))


def ppo_minibatch_table(trace: Trace, step: int) -> pd.DataFrame:
    """The epochs x minibatches of one PPO step, one row per (epoch, minibatch, rank) in run order.

    The grid spans every epoch (``inner_step``) and minibatch (``micro_batch``) seen anywhere in
    the trace. Columns: ``step, epoch, minibatch, rank, status`` (``ran``; ``early stop``: the
    file's metadata says ``early_stop = true``, the minibatch was not applied and the epochs
    ended; ``not run``: after an early stop; ``no file``: missing for another reason, e.g. a
    dropped step), ``early_stop`` (metadata), ``mean_approx_kl_k2`` (masked mean, nats; NaN
    without file), ``target_kl`` (metadata, else manifest), ``above_target_kl``, ``rows``,
    ``row_ids`` (text).
    """
    all_keys = trace.steps()
    epochs = sorted({k.inner_step for k in all_keys})
    minibatches = sorted({k.micro_batch for k in all_keys})
    step_keys = [k for k in all_keys if k.step == step]
    by_cell = {(k.inner_step, k.micro_batch, k.rank): k for k in step_keys}
    records = []
    for rank in sorted({k.rank for k in step_keys}) or [0]:
        stopped = False
        for epoch in epochs:
            for mb in minibatches:
                key = by_cell.get((epoch, mb, rank))
                rec: dict[str, Any] = {"step": step, "epoch": epoch, "minibatch": mb, "rank": rank,
                                       "status": NOT_RUN if stopped else NO_FILE, "early_stop": False,
                                       "mean_approx_kl_k2": math.nan, "target_kl": math.nan,
                                       "above_target_kl": False, "rows": 0, "row_ids": ""}
                if key is not None:
                    meta = trace.metadata(key)
                    target = _hyperparameter(trace, meta, "target_kl")
                    row_ids = trace.load_step(key, ["row_ids"]).get("row_ids")
                    early_stop = _flag(meta.get("early_stop", False))
                    rec.update(status=EARLY_STOP if early_stop else RAN, early_stop=early_stop,
                               mean_approx_kl_k2=_mean_approx_kl_k2(trace, key),
                               target_kl=float(target) if target is not None else math.nan,
                               rows=_batch_size(trace, key),
                               row_ids=" ".join(map(str, row_ids.tolist())) if row_ids is not None else "")
                    rec["above_target_kl"] = bool(rec["mean_approx_kl_k2"] > rec["target_kl"])
                    stopped = stopped or rec["early_stop"]
                records.append(rec)
    return pd.DataFrame.from_records(records)


def ppo_early_stops(trace: Trace) -> pd.DataFrame:
    """One row per PPO step from the step files' headers: ``step, epochs`` (distinct epochs with
    a file), ``files``, ``early_stop`` (any file says so), ``stop_epoch``, ``stop_minibatch``
    (the first such file; -1 when none), ``target_kl``."""
    records: dict[int, dict[str, Any]] = {}
    for key in trace.steps():
        meta = trace.metadata(key)
        rec = records.setdefault(key.step, {"step": key.step, "epochs": set(), "files": 0, "early_stop": False,
                                            "stop_epoch": -1, "stop_minibatch": -1, "target_kl": math.nan})
        rec["epochs"].add(key.inner_step)
        rec["files"] += 1
        target = _hyperparameter(trace, meta, "target_kl")
        if target is not None:
            rec["target_kl"] = float(target)
        if _flag(meta.get("early_stop", False)) and not rec["early_stop"]:
            rec.update(early_stop=True, stop_epoch=key.inner_step, stop_minibatch=key.micro_batch)
    frame = pd.DataFrame.from_records(list(records.values()),
                                      columns=["step", "epochs", "files", "early_stop", "stop_epoch",
                                               "stop_minibatch", "target_kl"])
    frame["epochs"] = frame["epochs"].map(len)
    return frame


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
    ``reward``, one column per reward component (names from ``reward_component_names``, else
    ``component_<f>``), ``advantage`` (as recorded), ``group_mean``, ``group_std``,
    ``zero_variance``. Raises KeyError for a group the file does not hold.
    """
    data, meta = _load_group_step(trace, key)
    stats = _group_stats(data["rewards"], group_ids_of(data, meta, key.path), group_std_estimator(meta))
    if group not in stats:
        raise KeyError(f"{key.path}: no group {group}; groups here: {sorted(stats)}")
    s = stats[group]
    components = data.get("reward_components")
    names = list(meta.get("reward_component_names") or [])
    if components is not None and len(names) != components.shape[1]:
        names = [f"component_{f}" for f in range(components.shape[1])]
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


def group_prompt_text(trace: Trace, key: StepKey, sequence: int) -> str:
    """The prompt of one row as text (real prompt tokens only); ``""`` without ``prompt_ids``."""
    row = trace.load_sequence(key, sequence)
    if "prompt_ids" not in row:
        return ""
    ids = row["prompt_ids"]  # (L,)
    keep = row.get("prompt_mask", torch.ones_like(ids, dtype=torch.bool)).bool()
    return trace.decode(ids[keep].tolist())


def zero_variance_shares(trace: Trace) -> pd.DataFrame:
    """Share of zero-variance groups per (step, inner_step): ``step, inner_step, groups,
    zero_variance_groups, zero_variance_share``.

    Micro-batch files of one (step, inner_step, rank) are pooled by ``group_ids`` (a group split
    across micro-batches counts once); without ``group_ids`` each file's G consecutive rows form
    its groups. Counts are summed over ranks. Files without rewards are skipped. Reads ``[B]``
    fields only.
    """
    pooled: dict[tuple[int, int], dict[Any, list[torch.Tensor]]] = {}
    for n, key in enumerate(trace.steps()):
        data = trace.load_step(key, ["rewards", "group_ids"])
        if "rewards" not in data:
            continue
        group_ids = group_ids_of(data, trace.metadata(key), key.path)
        groups = pooled.setdefault((key.step, key.inner_step), {})
        for g in torch.unique(group_ids).tolist():
            where = (key.rank, g) if "group_ids" in data else (n, g)
            groups.setdefault(where, []).append(data["rewards"][group_ids == g])
    records = []
    for (step, inner_step), groups in sorted(pooled.items()):
        zero = sum(bool((r := torch.cat(parts)).eq(r[0]).all()) for parts in groups.values())
        records.append({"step": step, "inner_step": inner_step, "groups": len(groups),
                        "zero_variance_groups": zero, "zero_variance_share": zero / len(groups)})
    return pd.DataFrame.from_records(records, columns=["step", "inner_step", "groups", "zero_variance_groups",
                                                       "zero_variance_share"])


# -- DPO --------------------------------------------------------------------------------------------


def dpo_pair_tokens(trace: Trace, key: StepKey, pair: int) -> pd.DataFrame:
    """Chosen and rejected tokens of one pair side by side, one row per position.

    Columns: ``position``, then per side (``chosen_``, ``rejected_``): ``token_id``,
    ``token_text``, ``kept`` (the side's mask), ``policy_logprobs``, ``ref_logprobs`` (nats;
    absent fields left out). A side shorter than the other is NaN-padded. Reads only the pair's row.
    """
    row = trace.load_sequence(key, pair)
    frames = []
    for side in _SIDES:
        if f"{side}_ids" not in row:
            continue
        ids = row[f"{side}_ids"].tolist()  # (T,)
        frame = pd.DataFrame({f"{side}_token_id": ids, f"{side}_token_text": trace.token_text(ids)})
        keep = row.get(f"{side}_mask")
        frame[f"{side}_kept"] = keep.bool().tolist() if keep is not None else True
        for model in ("policy", "ref"):
            name = f"{side}_{model}_logprobs"
            if name in row:
                frame[name] = row[name].float().numpy()
        frames.append(frame)
    if not frames:
        return pd.DataFrame()
    table = pd.concat(frames, axis=1)
    table.insert(0, "position", range(len(table)))
    return table


def _pair_sums(row: dict[str, torch.Tensor]) -> dict[str, float]:
    sums = {}
    for side in _SIDES:
        mask = row.get(f"{side}_mask")
        for model in ("policy", "ref"):
            lp = row.get(f"{side}_{model}_logprobs")
            if lp is not None:
                keep = mask if mask is not None else torch.ones_like(lp, dtype=torch.bool)
                sums[f"{side}_{model}"] = float(formulas.sequence_logprobs(lp.unsqueeze(0), keep.unsqueeze(0))[0])
    return sums


def dpo_pair_terms(trace: Trace, key: StepKey, pair: int) -> pd.DataFrame:
    """The per-side sums and DPO terms of one pair: ``quantity | recorded | recomputed | formula``.

    ``recorded`` is what the step file holds (``dpo_logits``, ``dpo_loss``, ``chosen_rewards``,
    ``rejected_rewards``; NaN for sums, which traces do not store); ``recomputed`` comes from the
    per-token logprobs and masks through :func:`tracer.formulas.sequence_logprobs` and
    :func:`tracer.formulas.dpo_terms` with the step's ``beta`` (NaN where a field or beta is missing).
    """
    row = trace.load_sequence(key, pair)
    meta = trace.metadata(key)
    beta = _hyperparameter(trace, meta, "beta")
    sums = _pair_sums(row)
    nan = math.nan
    terms: dict[str, float] = {}
    if len(sums) == 4:
        t = formulas.dpo_terms(*(torch.tensor([sums[k]], dtype=torch.float64) for k in (
            "chosen_policy", "rejected_policy", "chosen_ref", "rejected_ref")), beta=float(beta or 1.0))
        terms = {k: float(v[0]) if beta is not None or k == "dpo_logits" else nan for k, v in t.items()}
        terms["policy_logratio"] = sums["chosen_policy"] - sums["rejected_policy"]
        terms["ref_logratio"] = sums["chosen_ref"] - sums["rejected_ref"]
    recorded = {k: float(row[k]) for k in ("dpo_logits", "dpo_loss", "chosen_rewards", "rejected_rewards") if k in row}
    if "chosen_rewards" in recorded and "rejected_rewards" in recorded:
        recorded["margin"] = recorded["chosen_rewards"] - recorded["rejected_rewards"]
    if "chosen_rewards" in terms:
        terms["margin"] = terms["chosen_rewards"] - terms["rejected_rewards"]
    rows = [
        ("chosen policy sum π_c", "chosen_policy", "Σ chosen_policy_logprobs · chosen_mask"),
        ("rejected policy sum π_r", "rejected_policy", "Σ rejected_policy_logprobs · rejected_mask"),
        ("chosen ref sum ref_c", "chosen_ref", "Σ chosen_ref_logprobs · chosen_mask"),
        ("rejected ref sum ref_r", "rejected_ref", "Σ rejected_ref_logprobs · rejected_mask"),
        ("policy logratio", "policy_logratio", "π_c − π_r"),
        ("reference logratio", "ref_logratio", "ref_c − ref_r"),
        ("dpo_logits", "dpo_logits", "(π_c − π_r) − (ref_c − ref_r)"),
        ("dpo_loss", "dpo_loss", "−logsigmoid(β · logits)"),
        ("chosen_rewards", "chosen_rewards", "β (π_c − ref_c)"),
        ("rejected_rewards", "rejected_rewards", "β (π_r − ref_r)"),
        ("margin", "margin", "chosen_rewards − rejected_rewards"),
    ]
    return pd.DataFrame([{"quantity": label, "recorded": recorded.get(name, nan),
                          "recomputed": sums.get(name, terms.get(name, nan)), "formula": formula}
                         for label, name, formula in rows])


def _dpo_rewards(trace: Trace, key: StepKey) -> dict[str, torch.Tensor]:
    """Recorded ``chosen_rewards``, ``rejected_rewards``, ``dpo_loss``, ``dpo_logits`` (``[B]``), each
    recomputed through :func:`tracer.formulas.dpo_terms` when the file lacks it and can derive it."""
    data = trace.load_step(key, ["chosen_rewards", "rejected_rewards", "dpo_loss", "dpo_logits"])
    if len(data) == 4:
        return data
    beta = _hyperparameter(trace, trace.metadata(key), "beta")
    names = [f"{side}_{model}_logprobs" for side in _SIDES for model in ("policy", "ref")]
    tokens = trace.load_step(key, names + ["chosen_mask", "rejected_mask"])
    if beta is None or not all(n in tokens for n in names):
        return data
    sums = {n: formulas.sequence_logprobs(tokens[n], tokens.get(f"{n.split('_')[0]}_mask",
                                                                 torch.ones_like(tokens[n], dtype=torch.bool)))
            for n in names}  # each (B,)
    terms = formulas.dpo_terms(sums["chosen_policy_logprobs"], sums["rejected_policy_logprobs"],
                               sums["chosen_ref_logprobs"], sums["rejected_ref_logprobs"], float(beta))
    return {**terms, **data}


def dpo_step_summary(trace: Trace) -> pd.DataFrame:
    """Per (step, inner_step), pooled over micro-batches and ranks: ``pairs``, ``margin`` (mean of
    ``chosen_rewards - rejected_rewards``), ``preference_accuracy`` (share of pairs with
    ``chosen_rewards > rejected_rewards``, ties count as wrong, as TRL's ``rewards/accuracies``),
    ``mean_dpo_loss``, ``mean_dpo_logits``. Files without the implicit rewards (and no way to
    recompute them) are skipped."""
    pooled: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
    for key in trace.steps():
        data = _dpo_rewards(trace, key)
        if "chosen_rewards" in data and "rejected_rewards" in data:
            pooled.setdefault((key.step, key.inner_step), []).append(data)
    records = []
    for (step, inner_step), parts in sorted(pooled.items()):
        cat = {k: torch.cat([p[k].double() for p in parts]) for k in parts[0] if all(k in p for p in parts)}
        margin = cat["chosen_rewards"] - cat["rejected_rewards"]  # (pairs,)
        records.append({
            "step": step, "inner_step": inner_step, "pairs": margin.numel(), "margin": float(margin.mean()),
            "preference_accuracy": float((cat["chosen_rewards"] > cat["rejected_rewards"]).double().mean()),
            "mean_dpo_loss": float(cat["dpo_loss"].mean()) if "dpo_loss" in cat else math.nan,
            "mean_dpo_logits": float(cat["dpo_logits"].mean()) if "dpo_logits" in cat else math.nan,
        })
    return pd.DataFrame.from_records(records, columns=["step", "inner_step", "pairs", "margin", "preference_accuracy",
                                                       "mean_dpo_loss", "mean_dpo_logits"])
