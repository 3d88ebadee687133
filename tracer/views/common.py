"""Helpers shared by the per-algorithm views (metadata lookups, row counts)."""

from __future__ import annotations

import math
from typing import Any

from tracer.read import StepKey, Trace

# The algorithms whose rows come in groups of completions of one prompt (the Groups page's runs).
GROUPED_ALGORITHMS = ("grpo", "cispo", "rloo")
# Fields whose first dim is B, tried in this order to count the rows of a step file.
_B_FIELDS = ("completion_ids", "prompt_ids", "chosen_ids", "rewards", "advantages", "row_ids")


def hyperparameter(trace: Trace, meta: dict[str, Any], name: str) -> float | None:
    """A numeric hyperparameter (``beta``, ``target_kl``...): the step's metadata value, else the
    manifest's, else None. A value that is not a finite number (hostile or odd metadata) counts as
    absent, so a view shows "unknown" instead of failing."""
    for source in (meta, trace.manifest.get("hyperparameters") or {}):
        value = source.get(name) if isinstance(source, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def flag(value: Any) -> bool:
    """A metadata flag: True for ``true`` (bool, or the strings true / 1 / yes in any case)."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def batch_size(trace: Trace, key: StepKey) -> int:
    """B of one step file, from its header."""
    fields = trace.fields(key)
    sizes = [fields[name][0][0] for name in _B_FIELDS if name in fields and fields[name][0]]
    return sizes[0] if sizes else 0


EMPTY_STEP = "Empty step: this step file holds no sequences (B = 0)."


def is_empty_step(fields: dict[str, tuple[list[int], str]]) -> bool:
    """True when a step file's fields (``Trace.fields``: ``{name: (shape, dtype)}``) have a B
    field of length 0: nothing to tabulate, shown as :data:`EMPTY_STEP` rather than as a
    missing field."""
    return any(fields[name][0][:1] == [0] for name in _B_FIELDS if name in fields)
