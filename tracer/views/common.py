"""Helpers shared by the per-algorithm views (metadata lookups, row counts)."""

from __future__ import annotations

from typing import Any

from tracer.reader import StepKey, Trace

# Fields whose first dim is B, tried in this order to count the rows of a step file.
_B_FIELDS = ("completion_ids", "prompt_ids", "chosen_ids", "rewards", "advantages", "row_ids")


def hyperparameter(trace: Trace, meta: dict[str, Any], name: str) -> Any:
    """A step's metadata value, else the manifest's hyperparameter of that name, else None."""
    value = meta.get(name)
    return value if value is not None else (trace.manifest.get("hyperparameters") or {}).get(name)


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
