"""Tables of the run overview: manifest facts and the fields of a step file. Pure pandas."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tracer.format.schema import FIELDS, METADATA_KEYS
from tracer.read.trace_info import STATUS_TEXT

if TYPE_CHECKING:  # pandas is imported by the functions that build frames: the sidebar imports
    import pandas as pd  # status_text from here before its first element (see app.server)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def status_text(status: Any) -> str:
    """A manifest ``status`` in words, as ``tracer info`` says it (``tracer.read.trace_info.STATUS_TEXT``): a
    manifest still saying ``running`` is a writer that did not close (crashed or still running)."""
    return STATUS_TEXT.get(status, status) if isinstance(status, str) else _text(status)


def key_value_frame(mapping: Mapping[str, Any] | None, describe: bool = False) -> pd.DataFrame:
    """``key | value`` rows (values as text); with ``describe``, a ``meaning`` column from the
    schema's metadata keys (empty for keys the schema does not know: they are kept and shown)."""
    import pandas as pd

    mapping = mapping or {}
    frame = pd.DataFrame({"key": list(mapping), "value": [_text(v) for v in mapping.values()]})
    if describe:
        frame["meaning"] = [METADATA_KEYS.get(k, (None, ""))[1] for k in mapping]
    return frame


def manifest_facts(manifest: Mapping[str, Any], n_step_files: int) -> pd.DataFrame:
    """The run-level facts of a manifest that fit one line each (algorithm, status, schema
    version, creation time, steps written / dropped, world size, tokenizer identity)."""
    tokenizer = manifest.get("tokenizer") or {}
    facts = {
        "algorithm": manifest.get("algorithm", "unknown"),
        "status": status_text(manifest.get("status", "unknown")),
        "schema_version": manifest.get("schema_version", "unknown"),
        "created": manifest.get("created", ""),
        "step files on disk": n_step_files,
        "steps_written": manifest.get("steps_written", ""),
        "dropped_steps": manifest.get("dropped_steps", ""),
        "world_size": manifest.get("world_size", ""),
        "tokenizer": tokenizer.get("name_or_path", tokenizer.get("class", "none stored")),
        "eos_token_id": tokenizer.get("eos_token_id", ""),
        "pad_token_id": tokenizer.get("pad_token_id", ""),
    }
    return key_value_frame(facts)


def fields_table(fields: Mapping[str, tuple[list[int], str]], algorithm: str | None) -> pd.DataFrame:
    """One row per tensor of a step file: ``field, shape, dtype, dims, unit, description``;
    fields outside the canonical schema get empty dims/unit and ``(not in the schema)``."""
    rows = []
    for name, (shape, dtype) in fields.items():
        spec = FIELDS.get(name)
        rows.append({
            "field": name,
            "shape": str(list(shape)),
            "dtype": dtype,
            "dims": "[" + ", ".join(spec.dims_for(algorithm)) + "]" if spec else "",
            "unit": spec.unit if spec else "",
            "description": spec.description if spec else "(not in the schema)",
        })
    import pandas as pd

    return pd.DataFrame(rows, columns=["field", "shape", "dtype", "dims", "unit", "description"])
