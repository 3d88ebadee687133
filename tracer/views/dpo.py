"""DPO views: one pair token by token and summed; margin and preference accuracy per step."""

from __future__ import annotations

import math

import pandas as pd
import torch

from tracer import formulas
from tracer.read import StepKey, Trace
from tracer.views.common import hyperparameter as _hyperparameter

_SIDES = ("chosen", "rejected")


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
    ``mean_dpo_loss``, ``mean_dpo_logits``, ``mean_chosen_logps`` / ``mean_rejected_logps`` (the
    policy's summed logprob of each side, nats). Files without the implicit rewards (and no way to
    recompute them) are skipped."""
    pooled: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
    for key in trace.steps():
        data = {**_dpo_rewards(trace, key), **_policy_sums(trace, key)}
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
            **{f"mean_{side}_logps": float(cat[f"{side}_logps"].mean()) if f"{side}_logps" in cat else math.nan
               for side in _SIDES},
        })
    return pd.DataFrame.from_records(records, columns=["step", "inner_step", "pairs", "margin", "preference_accuracy",
                                                       "mean_dpo_loss", "mean_dpo_logits", "mean_chosen_logps",
                                                       "mean_rejected_logps"])


def _policy_sums(trace: Trace, key: StepKey) -> dict[str, torch.Tensor]:
    """``chosen_logps`` and ``rejected_logps`` ``[B]`` nats: the policy's masked logprob sum of each
    side (:func:`tracer.formulas.sequence_logprobs`), for the sides the file records."""
    names = [f"{side}_{part}" for side in _SIDES for part in ("policy_logprobs", "mask")]
    data = trace.load_step(key, names)
    out = {}
    for side in _SIDES:
        logprobs = data.get(f"{side}_policy_logprobs")
        if logprobs is not None and logprobs.dim() == 2:
            mask = data.get(f"{side}_mask", torch.ones_like(logprobs, dtype=torch.bool))
            out[f"{side}_logps"] = formulas.sequence_logprobs(logprobs, mask)
    return out
