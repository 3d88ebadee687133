"""Step metadata as a safetensors header holds it: ``dict[str, str]``, strings as they are and every
other value as JSON (SPEC.md section 4, "metadata"); decoded back with each known key's schema type
(:data:`tracer.format.schema.METADATA_KEYS`). ``jsonable`` makes the common non-JSON scalars of training
configs (numpy, torch, paths, enums) JSON first.
"""

from __future__ import annotations

import enum
import json
import math
import os
import sys
from typing import Any, Mapping

from tracer.errors import SchemaError
from tracer.format.schema import METADATA_KEYS
from tracer.format.text import clean_text, may_hold_surrogates


def jsonable(value: Any) -> Any:
    """``value`` with the common non-JSON scalars of training configs made JSON: numpy and torch
    scalars (``.item()``), numpy arrays and tensors (``.tolist()``), paths (``str``), tuples and sets
    (lists), enums (their value); nested
    dicts and lists are converted throughout. Anything else is returned as it is."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=repr)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported: never import it here
    if torch is not None and isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():  # numpy scalar
        return value.item()
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # numpy arrays, small tensors
        return jsonable(value.tolist())
    return value


_JSON_SCALARS = frozenset({int, float, bool, type(None)})


def _float_json(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return float.__repr__(value)


# json.dumps(value, allow_nan=True) for the scalar types, as json's own encoder writes them
_SCALAR_JSON = {int: int.__repr__, bool: lambda v: "true" if v else "false", float: _float_json}


def encode_metadata(metadata: Mapping[str, Any]) -> dict[str, str]:
    """Encode step metadata as the ``dict[str, str]`` a safetensors header holds.

    Strings are stored as they are; every other value as JSON (numpy/torch scalars, paths and
    tuples are converted first, see :func:`jsonable`). Raises SchemaError for a value that JSON
    cannot hold (the message names the key).
    """
    out: dict[str, str] = {}
    for key, value in metadata.items():
        if value is None:
            continue
        try:
            out[str(key)] = _encoded_value(value)
        except (TypeError, ValueError) as err:  # not JSON; or an int of more digits than Python writes
            raise SchemaError(
                f"metadata key {key!r}: value {_shown(value)} of type {type(value).__name__} is not JSON; "
                "pass a str, int, float, bool, list or dict"
            ) from err
    return out


def _encoded_value(value: Any) -> str:
    """One metadata value's header text (:func:`encode_metadata`). Raises TypeError or ValueError."""
    scalar = _SCALAR_JSON.get(type(value))
    if scalar is not None:  # what json.dumps writes for it, without an encoder per value
        return scalar(value)  # ValueError: an int longer than sys.get_int_max_str_digits()
    if type(value) is dict and all(type(k) is str and type(v) in _JSON_SCALARS for k, v in value.items()):
        return json.dumps(value, allow_nan=True)  # plain already (a summary)
    value = jsonable(value)
    return value if isinstance(value, str) else json.dumps(value, allow_nan=True)


def _shown(value: Any) -> str:
    """``repr(value)`` for an error message, at most 200 characters (one holding an int too long to
    write: its type alone)."""
    try:
        text = repr(value)
    except ValueError:
        return f"(a {type(value).__name__} holding an int of more than {sys.get_int_max_str_digits()} digits)"
    return text if len(text) <= 200 else text[:197] + "..."


def decode_metadata(raw: Mapping[str, str] | None) -> dict[str, Any]:
    """Decode a safetensors header's metadata; known keys get their schema type, unknown keys are
    JSON-decoded when they parse and kept as strings otherwise (nothing is dropped); lone
    surrogates in decoded strings become U+FFFD (:mod:`tracer.format.text`)."""
    out: dict[str, Any] = {}
    for key, text in (raw or {}).items():
        kind = METADATA_KEYS.get(key, (None, ""))[0]
        if kind is str:
            out[key] = text
            continue
        try:
            value = json.loads(text)
        except (ValueError, TypeError, RecursionError):  # RecursionError: hostile nesting like [[[[...
            out[key] = text
            continue
        if kind is int and isinstance(value, float):
            # a hostile or odd header ("NaN", "1e400", 2.5): keep the text rather than invent an int
            value = int(value) if math.isfinite(value) and value.is_integer() and abs(value) < 2**62 else text
        elif kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:  # an integer too large for a float: keep the text
                value = text
        out[key] = value
    return clean_text(out) if any(may_hold_surrogates(t) for t in (raw or {}).values() if isinstance(t, str)) else out
