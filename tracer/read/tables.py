"""Pandas tables over loaded step tensors: token tables (one row per token, with why a position is
masked) and per-step summaries. The reader calls these; the maths comes from :mod:`tracer.formulas`."""

from __future__ import annotations

from typing import Any, Callable

import pandas as pd
import torch

from tracer.formulas import summaries
from tracer.format import summary as summary_format

# Per-token float fields shown in token tables, in display order.
TOKEN_VALUE_FIELDS = (
    "old_logprobs", "policy_logprobs", "ref_logprobs", "sampler_logprobs", "ratio", "ref_kl_k3",
    "approx_kl_k2", "entropy", "advantages", "values", "returns", "token_rewards", "per_token_loss",
)
# Why a position is (not) in the loss.
KEPT, PROMPT, PROMPT_PADDING, AFTER_EOS, PADDING, MASKED = (
    "kept", "prompt", "prompt_padding", "after_eos", "padding", "masked")
# Fields a per-step summary reads.
SUMMARY_FIELDS = summary_format.FIELDS


def mask_reasons(
    completion_ids: torch.Tensor, completion_mask: torch.Tensor, eos_token_id: int | None,
    pad_token_id: int | None = None,
) -> list[list[str]]:
    """Why each completion position is kept or masked, ``[B][T]`` strings.

    ``kept`` when the mask keeps it; otherwise ``after_eos`` when an EOS token appears earlier in
    the row, ``padding`` when the token is the pad token, ``masked`` for any other reason
    (truncation, tool output, a trainer's own rule).
    """
    B, T = completion_ids.shape
    ids = completion_ids.tolist()
    keep = completion_mask.bool().tolist()
    out: list[list[str]] = []
    for b in range(B):
        row, seen_eos = [], False
        for t in range(T):
            if keep[b][t]:
                row.append(KEPT)
            elif seen_eos:
                row.append(AFTER_EOS)
            elif pad_token_id is not None and ids[b][t] == pad_token_id:
                row.append(PADDING)
            else:
                row.append(MASKED)
            if eos_token_id is not None and ids[b][t] == eos_token_id:
                seen_eos = True
        out.append(row)
    return out


def prompt_frame(data: dict[str, torch.Tensor], rows: list[int], token_text: Callable[[list[int]], list[str]]) -> pd.DataFrame:
    """Prompt rows of a token table: ``mask_reason`` is prompt or prompt_padding."""
    ids = data["prompt_ids"]
    B, L = ids.shape
    prompt_mask = data.get("prompt_mask", torch.ones_like(ids, dtype=torch.bool)).bool()
    flat = ids.reshape(-1).tolist()
    return pd.DataFrame({
        "sequence": [r for r in rows for _ in range(L)],
        "section": "prompt",
        "position": list(range(L)) * B,
        "token_id": flat,
        "token_text": token_text(flat),
        "kept": False,
        "mask_reason": [PROMPT if k else PROMPT_PADDING for k in prompt_mask.reshape(-1).tolist()],
    })

def completion_frame(data: dict[str, torch.Tensor], rows: list[int], token_text: Callable[[list[int]], list[str]],
                 eos_token_id: int | None, pad_token_id: int | None) -> pd.DataFrame:
    """Completion rows of a token table, with each per-token value field present."""
    ids = data["completion_ids"]
    B, T = ids.shape
    completion_mask = data.get("completion_mask", torch.ones_like(ids, dtype=torch.bool)).bool()
    flat = ids.reshape(-1).tolist()
    reasons = mask_reasons(ids, completion_mask, eos_token_id, pad_token_id)
    frame = pd.DataFrame({
        "sequence": [r for r in rows for _ in range(T)],
        "section": "completion",
        "position": list(range(T)) * B,
        "token_id": flat,
        "token_text": token_text(flat),
        "kept": completion_mask.reshape(-1).tolist(),
        "mask_reason": [r for row in reasons for r in row],
    })
    for name in TOKEN_VALUE_FIELDS:
        if name not in data:
            continue
        value = data[name].float()
        if value.dim() == 1:  # [B] -> broadcast over T
            value = value.unsqueeze(1).expand(B, T)
        frame[name] = value.reshape(-1).numpy()
    return frame


def summary_values(meta: dict[str, Any], data: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The per-step summary of one step computed from its tensors (``SUMMARY_FIELDS`` of it), for
    files whose header holds none: :func:`tracer.formulas.summaries.compute_summary`."""
    return summaries.compute_summary(data, meta)
