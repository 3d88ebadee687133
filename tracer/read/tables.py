"""Pandas tables over loaded step tensors: token tables (one row per token, with its turn, role and
why a position is masked) and per-step summaries. The reader calls these; the maths comes from
:mod:`tracer.formulas`, the turns, roles and mask reasons from :mod:`tracer.format.turns`.

Placeholders: at a position the loss does not use, a trainer often leaves a logprob at exactly
``0.0`` (TRL's ``old_per_token_logps`` and ``sampling_per_token_logps`` over tool output and
padding). That is no logprob, and a ratio or KL computed from it is no value either: the tables
show it, and every field computed from it, as empty (NaN), never as a number
(:func:`without_placeholders`).

The functions take numpy arrays (the reader's token tables: no torch imported) or torch tensors
(the views' and checks' data) alike (:mod:`tracer.format.arrays`); pandas is imported when a frame
is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from tracer.format import summary as summary_format
from tracer.format import turns as turn_format
from tracer.format.arrays import as_bool, float32_numpy, is_floating, keep_mask, nan_where, to_numpy
from tracer.format.derived_fields import DERIVED_FIELDS
from tracer.format.turns import (  # noqa: F401  (the reasons' one home; re-exported for the app)
    AFTER_EOS, ENVIRONMENT, KEPT, MASKED, PADDING, PROMPT, PROMPT_PADDING, TOOL_OUTPUT, TRUNCATED)

if TYPE_CHECKING:
    import pandas as pd
    import torch

# Per-token float fields shown in token tables, in display order.
TOKEN_VALUE_FIELDS = (
    "old_logprobs", "policy_logprobs", "ref_logprobs", "sampler_logprobs", "ratio", "ref_kl_k3",
    "approx_kl_k2", "entropy", "advantages", "values", "returns", "token_rewards", "per_token_loss",
)
# Fields a per-step summary reads.
SUMMARY_FIELDS = summary_format.FIELDS
# Logprob fields a trainer may fill with a placeholder 0.0 where the loss does not look.
PLACEHOLDER_FIELDS = ("old_logprobs", "sampler_logprobs", "ref_logprobs")
PLACEHOLDER = 0.0


def layout_of(data: Mapping[str, torch.Tensor], metadata: Mapping[str, Any] | None,
              token_strings: Sequence[str] | None, eos_token_id: int | None,
              pad_token_id: int | None) -> turn_format.Layout:
    """The turns and roles of a step's completion rows (:func:`tracer.format.turns.read_layout`)."""
    ids = data["completion_ids"]
    keep = keep_mask(data, "completion_mask", ids)
    return turn_format.read_layout(ids, keep, data, metadata, token_strings, eos_token_id, pad_token_id)


def mask_reasons(
    completion_ids: torch.Tensor, completion_mask: torch.Tensor, eos_token_id: int | None,
    pad_token_id: int | None = None, *, layout: turn_format.Layout | None = None,
    recorded: torch.Tensor | None = None, metadata: Mapping[str, Any] | None = None,
) -> list[list[str]]:
    """Why each completion position is kept or masked, ``[B][T]`` strings.

    ``recorded`` (the step's ``mask_reasons [B, T]``) is read through the step's
    ``mask_reason_names``; otherwise the reasons are inferred row by row with
    :func:`tracer.format.turns.infer_mask_reasons` from the mask, EOS and pad ids and, for a
    multi-turn step, the ``layout``'s turns and roles (:func:`layout_of`): ``kept``, ``prompt``,
    ``padding``, ``after_eos``, ``tool_output``, ``environment``, ``masked``…
    """
    if recorded is not None and tuple(recorded.shape) == tuple(completion_ids.shape):
        names = turn_format.reason_names(metadata)
        return [turn_format.recorded_mask_reasons(row, names) for row in recorded.tolist()]
    ids = completion_ids.tolist()
    keep = as_bool(completion_mask).tolist()
    turns = roles = None
    names = turn_format.role_names(metadata)
    if layout is not None and (layout.source != "mask" or layout.multi_turn):
        turns = layout.turn_ids.tolist()
        roles = layout.roles.tolist() if layout.roles is not None else None
        names = layout.role_names
    return [turn_format.infer_mask_reasons(ids[b], keep[b], eos_token_id, pad_token_id,
                                           turns[b] if turns is not None else None,
                                           roles[b] if roles is not None else None, names)
            for b in range(len(ids))]


def without_placeholders(data: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``data`` with every placeholder made NaN: at a position the mask drops, a logprob of
    :data:`PLACEHOLDER_FIELDS` that is exactly 0.0 is a filler, not a logprob; it, and every field
    computed from it (:data:`tracer.formulas.derived.DERIVED_FIELDS`: the ratio and k2 from the old
    logprobs, k3 from the reference's), become NaN there. Kept positions are never touched. Returns
    a new dict (changed fields are float copies); ``data`` is unchanged."""
    ids = data.get("completion_ids")
    if ids is None:
        return dict(data)
    dropped = ~keep_mask(data, "completion_mask", ids)
    out = dict(data)
    for name in PLACEHOLDER_FIELDS:
        value = data.get(name)
        if value is None or value.shape != ids.shape or not is_floating(value):
            continue
        filler = dropped & (value == PLACEHOLDER)
        if not bool(filler.any()):
            continue
        for target in (name, *[d for d, (inputs, _) in DERIVED_FIELDS.items() if name in inputs]):
            if target in out and out[target].shape == ids.shape and is_floating(out[target]):
                out[target] = nan_where(filler, out[target])
    return out


def prompt_frame(data: dict[str, torch.Tensor], rows: list[int], token_text: Callable[[list[int]], list[str]]) -> pd.DataFrame:
    """Prompt rows of a token table: ``mask_reason`` is prompt or prompt_padding."""
    import pandas as pd

    ids = data["prompt_ids"]
    B, L = ids.shape
    prompt_mask = keep_mask(data, "prompt_mask", ids)
    flat = ids.reshape(-1).tolist()
    return pd.DataFrame({
        "sequence": [r for r in rows for _ in range(L)],
        "section": "prompt",
        "position": list(range(L)) * B,
        "token_id": flat,
        "token_text": token_text(flat),
        "kept": False,
        "mask_reason": [PROMPT if k else PROMPT_PADDING for k in prompt_mask.reshape(-1).tolist()],
        "turn": 0,
        "role": "",
    })


def completion_frame(data: dict[str, torch.Tensor], rows: list[int], token_text: Callable[[list[int]], list[str]],
                     eos_token_id: int | None, pad_token_id: int | None,
                     metadata: Mapping[str, Any] | None = None,
                     token_strings: Sequence[str] | None = None) -> pd.DataFrame:
    """Completion rows of a token table, with each per-token value field present.

    Columns: ``sequence, section, position, token_id, token_text, kept, mask_reason`` (recorded
    ``mask_reasons``, else inferred: :func:`mask_reasons`), ``turn`` and ``role``
    (:func:`layout_of`), then the value fields, placeholders empty (:func:`without_placeholders`).
    ``metadata``: the step's (``role_names``, ``mask_reason_names``); ``token_strings``: the trace's
    (a chat template's role markers name the roles of a trace that records none)."""
    import pandas as pd

    ids = data["completion_ids"]
    B, T = ids.shape
    completion_mask = keep_mask(data, "completion_mask", ids)
    flat = ids.reshape(-1).tolist()
    layout = layout_of(data, metadata, token_strings, eos_token_id, pad_token_id)
    reasons = mask_reasons(ids, completion_mask, eos_token_id, pad_token_id, layout=layout,
                           recorded=data.get("mask_reasons"), metadata=metadata)
    turn_ids, roles = layout.turn_ids, layout.role_rows(completion_mask)
    frame = pd.DataFrame({
        "sequence": [r for r in rows for _ in range(T)],
        "section": "completion",
        "position": list(range(T)) * B,
        "token_id": flat,
        "token_text": token_text(flat),
        "kept": completion_mask.reshape(-1).tolist(),
        "mask_reason": [r for row in reasons for r in row],
        "turn": to_numpy(turn_ids).reshape(-1),
        "role": [r for row in roles for r in row],
    })
    data = without_placeholders(data)
    for name in TOKEN_VALUE_FIELDS:
        if name not in data:
            continue
        value = float32_numpy(data[name])
        if value.ndim == 1:  # [B] -> broadcast over T
            value = np.broadcast_to(value[:, None], (B, T))
        frame[name] = value.reshape(-1)
    return frame


def summary_values(meta: dict[str, Any], data: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The per-step summary of one step computed from its tensors (``SUMMARY_FIELDS`` of it), for
    files whose header holds none: :func:`tracer.formulas.summaries.compute_summary` (torch tensors;
    imported here: the formulas import torch)."""
    from tracer.formulas import summaries

    return summaries.compute_summary(data, meta)
