"""PPO views: where each rollout row lies among minibatch files, which epochs ran before the early stop."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from tracer import formulas
from tracer.read import StepKey, Trace
from tracer.views.common import batch_size as _batch_size
from tracer.views.common import flag as _flag
from tracer.views.common import hyperparameter as _hyperparameter

# Status of one (epoch, minibatch) cell of a PPO step.
RAN, EARLY_STOP, NOT_RUN, NO_FILE = "ran", "early stop", "not run", "no file"


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
