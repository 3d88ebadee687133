"""Open files from a trace that may be truncated, corrupt or hostile, with bounded reads.

Every file of a trace can come from a stranger or be cut short by a crash. Before anything is
parsed:

* a step file must be a regular file (a FIFO or a device would block or never end), at least
  8 bytes long, and the header length in its first 8 bytes (little-endian, the safetensors
  layout) must fit in the file and stay under :data:`MAX_HEADER_BYTES`;
* JSON files (manifest, token strings) must be regular files under a size cap, and parse to the
  types the reader uses (wrong-typed manifest keys are dropped, each with a note).

A step file's header is then checked against the schema (ranks, shared B/T/L/F sizes, dtype kinds
of the canonical fields) without reading tensor data. Every refusal is a :class:`TraceFormatError`
whose message names the file and says why.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from safetensors import safe_open

from tracer.errors import ChecksumError, SchemaError, TraceFormatError
from tracer.format.arrays import HeaderTensor, is_bool
from tracer.format.hashing import stored_content_sha256
from tracer.format.schema import ALGORITHMS, BOOL, FIELDS, FLOAT, INT64, check_tensors
from tracer.format.text import clean_text, may_hold_surrogates

MAX_HEADER_BYTES = 16 * 2**20  # a step file's JSON header (tensor table + metadata); real ones are a few KB
MAX_MANIFEST_BYTES = 16 * 2**20
MAX_TOKENS_BYTES = 64 * 2**20  # token strings of a 256k vocabulary take 2 to 4 MB
# What a header may make a reader allocate or loop over: the elements of all its tensors, a dim of
# length 0 counted as 1 (a [1e8, 0] tensor holds no bytes but a loop over its rows runs 1e8 times).
# Real tensors hold >= 1 byte per element, so only zero-byte tensors can exceed the file's size.
EMPTY_ELEMENT_BUDGET = 2**20
MAX_TOKEN_ENTRIES = 2**21  # 8 x the largest vocabularies in use (256k)
MAX_JSON_VALUES = 2**20  # values (and keys) a manifest may hold; real ones hold a few hundred

# safetensors dtype names that canonical fields of each kind may have on disk.
_INT_DTYPES = frozenset({"I64", "I32", "I16", "I8", "U8"})
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
# float8 for float fields only (not masks): the writer keeps a float8 field as float8 under
# keep_source_dtype=True (logprobs a loop holds in float8 to save memory), and the reader reads it
# through torch (tracer.format.arrays.NUMPY_DTYPES).
_FLOAT8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E8M0"})
_ALLOWED = {INT64: _INT_DTYPES, FLOAT: _FLOAT_DTYPES | _FLOAT8_DTYPES,
            BOOL: frozenset({"BOOL"}) | _INT_DTYPES | _FLOAT_DTYPES}

# Manifest keys tracer reads -> the JSON type they must have (tracer/read, checks, diff, views, app).
_MANIFEST_TYPES: dict[str, tuple[type, ...]] = {
    "format": (str,), "schema_version": (str, int), "algorithm": (str,), "status": (str,), "created": (str,),
    "tokenizer": (dict,), "hyperparameters": (dict,), "config": (dict,), "producers": (dict,),
    "sampling": (dict,), "capture": (dict,), "capture_report": (dict,), "world_size": (int,),
    "steps_written": (int,), "dropped_steps": (int,), "skipped_steps": (int,), "drop_reasons": (list,),
    "revision": (int,),  # time.time_ns() of the manifest's write (tracer/format/counts.py)
}
_JSON_NAMES = {dict: "a JSON object", list: "a JSON list", str: "a string", int: "an integer"}
MAX_MANIFEST_TEXT = 4096  # characters of one manifest string (a status, a drop reason); real ones hold < 300
MAX_MANIFEST_LIST = 1000  # drop reasons kept (the writer keeps 20)
MAX_COUNT = 2**62  # a count (steps, drops, ranks) or a token id is in [0, 2**62)
# Step metadata, as a safetensors header holds it: what a reader decodes (the writer refuses more).
MAX_METADATA_BYTES = 4 * 2**20
MAX_METADATA_KEYS = 10_000  # real steps hold a few dozen keys


def _regular_size(path: Path, what: str) -> int:
    """Size of ``path``; TraceFormatError when it cannot be stat'ed or is not a regular file."""
    try:
        st = os.stat(path)
    except OSError as err:
        raise TraceFormatError(f"{path}: cannot read the {what} ({err.strerror or err})") from err
    if not stat.S_ISREG(st.st_mode):
        raise TraceFormatError(f"{path}: the {what} is not a regular file (a directory, FIFO or device); "
                               "refusing to read it")
    return st.st_size


def check_step_file_bounds(path: Path) -> int:
    """Refuse a step file whose 8-byte header length does not fit the file or the cap; returns
    the file's size in bytes.

    Raises:
        TraceFormatError: not a regular file, shorter than 8 bytes, or a header length larger
            than the rest of the file or than :data:`MAX_HEADER_BYTES`.
    """
    size = _regular_size(path, "step file")
    if size < 8:
        raise TraceFormatError(f"{path}: {size} bytes, too short for a safetensors step file "
                               "(8-byte header length, JSON header, tensor data): truncated or empty")
    try:
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
    except OSError as err:
        raise TraceFormatError(f"{path}: cannot read the step file ({err.strerror or err})") from err
    if header_len > size - 8:
        raise TraceFormatError(f"{path}: the header claims {header_len} bytes but only {size - 8} follow the "
                               "8-byte length: the file is truncated or not a safetensors file")
    if header_len > MAX_HEADER_BYTES:
        raise TraceFormatError(f"{path}: a header of {header_len} bytes exceeds the {MAX_HEADER_BYTES} bytes "
                               "any step file needs; refusing to parse it")
    return size


def check_element_budget(path: Path, handle: Any, size: int) -> None:
    """Refuse a header whose shapes would cost far more than the file holds.

    Every tensor counts ``prod(max(d, 1) for d in shape)`` elements (what a loop over its dims
    visits); the sum over the file must stay <= ``size + EMPTY_ELEMENT_BUDGET``. A real tensor holds
    at least one byte per element, so only zero-byte tensors with huge dims (``[1e8, 0]``) exceed
    it: those would make tables, checks and views loop or allocate gigabytes for a tiny file.

    Raises:
        TraceFormatError: naming the file, the field, its shape and the limit.
    """
    limit, total = size + EMPTY_ELEMENT_BUDGET, 0
    for name in handle.keys():
        shape = list(handle.get_slice(name).get_shape())
        total += math.prod(max(int(d), 1) for d in shape)
        if total > limit:
            raise TraceFormatError(
                f"{path}: field {name!r} has shape {shape}: the header's shapes span {total} elements, over "
                f"the limit of {limit} for a file of {size} bytes (its size + {EMPTY_ELEMENT_BUDGET} for "
                "empty tensors); refusing a header that would cost far more to read than the file holds")


def check_metadata_bounds(path: Path, raw: Any) -> int:
    """Refuse step metadata (the header's ``__metadata__``, ``dict[str, str]``) of more than
    :data:`MAX_METADATA_KEYS` keys or :data:`MAX_METADATA_BYTES` characters of keys and values: decoding it
    would cost seconds for every reader (the writer refuses to write as much). Returns its size
    (characters of keys and values).

    Raises:
        TraceFormatError: naming the file, the count or size found and the limit.
    """
    if not raw:
        return 0
    keys = len(raw)
    if keys > MAX_METADATA_KEYS:
        raise TraceFormatError(f"{path}: the step metadata holds {keys} keys, over the limit of {MAX_METADATA_KEYS} "
                               "(real steps hold a few dozen: hyperparameters and small values); refusing to "
                               "decode it")
    size = sum(len(k) + len(v) for k, v in raw.items())
    if size > MAX_METADATA_BYTES:
        raise TraceFormatError(f"{path}: the step metadata holds {size} characters of keys and values, over the "
                               f"limit of {MAX_METADATA_BYTES} (real steps hold a few KB: hyperparameters and small "
                               "values); refusing to decode it")
    return size


def open_step_file(path: Path, framework: str = "pt"):
    """``safe_open`` a step file after :func:`check_step_file_bounds`, then
    :func:`check_element_budget` and :func:`check_metadata_bounds` (use as a context manager).

    ``framework``: what ``get_tensor`` and ``get_slice`` return, ``"pt"`` (torch tensors: importing
    torch, done by safetensors at the open) or ``"np"`` (numpy arrays: the reader's, which imports
    no torch; numpy has no bfloat16 or float8, which the reader reads through torch).

    Raises:
        TraceFormatError: the bounds check, the element budget or the metadata bounds fail, or
            safetensors refuses the header (the message carries its reason).
    """
    size = check_step_file_bounds(path)
    try:
        handle = safe_open(str(path), framework=framework, device="cpu")
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise TraceFormatError(f"{path}: not a readable safetensors step file ({err})") from err
    try:
        check_element_budget(path, handle, size)
        check_metadata_bounds(path, handle.metadata())
    except BaseException:
        handle.__exit__(None, None, None)
        raise
    return handle


def check_step_header(path: Path, handle: Any, algorithm: str | None) -> None:
    """Check the canonical fields of an open step file against the schema, from the header only.

    Ranks, shared dimension sizes (B, T, L, F agree across fields) and the on-disk dtype of each
    canonical field (integers for ids, floats for logprobs, bool/integer/float for masks).

    Raises:
        TraceFormatError: naming the file, the field and the rule.
    """
    try:
        meta_tensors = {}
        for name in handle.keys():
            spec = FIELDS.get(name)
            if spec is None:
                continue
            sl = handle.get_slice(name)
            dtype_name, shape = sl.get_dtype(), list(sl.get_shape())
            allowed = _ALLOWED[spec.kind]
            if dtype_name not in allowed:
                raise TraceFormatError(f"{path}: field {name!r} is stored as {dtype_name}; {spec.kind} fields "
                                       f"are stored as one of {sorted(allowed)}")
            meta_tensors[name] = HeaderTensor(tuple(shape), dtype_name)
        _check_schema(meta_tensors, algorithm)
    except SchemaError as err:
        raise TraceFormatError(f"{path}: {err}") from err
    except TraceFormatError:
        raise
    except Exception as err:  # a header safetensors accepted but the schema check cannot describe
        raise TraceFormatError(f"{path}: unusable tensor table ({type(err).__name__}: {err})") from err


def check_mask_values(path: Path, tensors: dict[str, Any]) -> None:
    """A mask stored as integers or floats must hold only 0 and 1 (reads the loaded data: numpy
    arrays or torch tensors).

    Raises:
        TraceFormatError: naming the file, the field and a few offending values.
    """
    for name, tensor in tensors.items():
        spec = FIELDS.get(name)
        if spec is None or spec.kind != BOOL or is_bool(tensor):
            continue
        bad = tensor[(tensor != 0) & (tensor != 1)]
        if len(bad):
            raise TraceFormatError(f"{path}: field {name!r} is a mask but holds {bad[:3].tolist()} "
                                   "(a mask holds only 0 and 1, True = keep)")


def _check_schema(meta_tensors: dict[str, HeaderTensor], algorithm: str | None) -> None:
    """check_tensors; with no known algorithm, any algorithm whose dims fit (PPO's [B, T] advantages)."""
    if algorithm in ALGORITHMS:
        check_tensors(meta_tensors, algorithm)
        return
    overrides = sorted({a for n in meta_tensors for a in FIELDS[n].dims_by_algorithm})
    try:
        check_tensors(meta_tensors, None)
    except SchemaError:
        for candidate in overrides:
            try:
                check_tensors(meta_tensors, candidate)
                return
            except SchemaError:
                continue
        raise


def read_json(path: Path, what: str, max_bytes: int, max_values: int = MAX_JSON_VALUES,
              field: str | None = None) -> Any:
    """Parse a JSON file of at most ``max_bytes`` and at most ``max_values`` values, with every
    string made printable (:func:`tracer.format.text.clean_text`: lone surrogates become U+FFFD).

    The value count is bounded before parsing (commas, ``[`` and ``{`` bound the number of values
    and keys from above), so the parse costs memory proportional to the file, whatever it holds.
    ``field`` names the part of the file the values make up in the error (``tokens``).

    Raises:
        TraceFormatError: not a regular file, too large, too many values, not UTF-8, not JSON, or
            nested too deep.
    """
    size = _regular_size(path, what)
    if size > max_bytes:
        raise TraceFormatError(f"{path}: the {what} is {size} bytes, over the {max_bytes}-byte cap; "
                               "refusing to parse it")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(max_bytes + 1)
        values = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1  # >= the number of values and keys
        if values > max_values:
            where = f"field {field!r}" if field else "the file"
            raise TraceFormatError(f"{path}: {where} of the {what} holds up to {values} values, over the limit "
                                   f"of {max_values}; refusing to parse it")
        parsed = json.loads(raw.decode("utf-8"))
        return clean_text(parsed) if may_hold_surrogates(raw) else parsed
    except (OSError, ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        reason = "nested too deep" if isinstance(err, RecursionError) else f"{type(err).__name__}: {err}"
        raise TraceFormatError(f"{path}: could not read the {what} ({reason})") from err


def clean_manifest(raw: Any, path: Path) -> tuple[dict[str, Any], list[str]]:
    """The manifest with wrong-typed or oversized values left out, and one note per value left out.

    Every key tracer reads is checked here, once (:data:`_MANIFEST_TYPES`): its JSON type; a string
    at most :data:`MAX_MANIFEST_TEXT` characters; a count (``dropped_steps``, ``world_size``...) in
    ``[0, 2**62)``; ``drop_reasons`` a list of at most :data:`MAX_MANIFEST_LIST` strings (other entries
    left out); the tokenizer's special token ids integers in ``[0, 2**62)``. Each note names the file,
    the key, what was expected and what was found. Unknown keys are kept as they are.
    """
    if not isinstance(raw, dict):
        return {}, [f"{path}: expected a JSON object, got {type(raw).__name__}; manifest ignored"]
    manifest, notes = {}, []
    for key, value in raw.items():
        problem = _manifest_value_problem(key, value)
        if problem is not None:
            notes.append(f"{path}: key {key!r} should be {problem}; ignored")
            continue
        manifest[key] = value
    reasons = manifest.get("drop_reasons")
    if reasons is not None:
        kept = [r for r in reasons[:MAX_MANIFEST_LIST] if isinstance(r, str) and len(r) <= MAX_MANIFEST_TEXT]
        if len(kept) < len(reasons):
            found = sorted({_found(r) for r in reasons if not (isinstance(r, str) and len(r) <= MAX_MANIFEST_TEXT)})
            notes.append(f"{path}: key 'drop_reasons' should be a list of at most {MAX_MANIFEST_LIST} strings of at "
                         f"most {MAX_MANIFEST_TEXT} characters, got {len(reasons)} entries"
                         + (f" ({', '.join(found)})" if found else "")
                         + f"; {len(reasons) - len(kept)} ignored")
            manifest["drop_reasons"] = kept
    tokenizer = manifest.get("tokenizer")
    if tokenizer:
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = tokenizer.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_COUNT):
                notes.append(f"{path}: tokenizer.{key} should be an integer in [0, 2**62), got {_found(value)}; "
                             "ignored")
                manifest["tokenizer"] = tokenizer = {k: v for k, v in tokenizer.items() if k != key}
    return manifest, notes


def _manifest_value_problem(key: str, value: Any) -> str | None:
    """What a manifest key's value should be and what it is (``"an integer, got str"``), or None when
    it fits (:func:`clean_manifest`)."""
    types = _MANIFEST_TYPES.get(key)
    if types is None:
        return None
    expected = " or ".join(_JSON_NAMES[t] for t in types)
    if not isinstance(value, types) or isinstance(value, bool):
        return f"{expected}, got {type(value).__name__}"
    if isinstance(value, str) and len(value) > MAX_MANIFEST_TEXT:
        return f"{expected} of at most {MAX_MANIFEST_TEXT} characters, got {len(value)} characters"
    low = 1 if key == "world_size" else 0
    if isinstance(value, int) and key != "schema_version" and not low <= value < MAX_COUNT:
        return f"an integer in [{low}, 2**62), got {_found(value)}"
    return None


def _found(value: Any) -> str:
    """A manifest value as a note shows it: its type, and for a scalar its first 40 characters."""
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, str):
        return f"a string of {len(value)} characters" if len(value) > 40 else repr(value)
    text = repr(value)
    return text if len(text) <= 40 else f"an integer of {len(text)} digits"


def clean_tokens(raw: Any, path: Path) -> list[str]:
    """The ``tokens`` list of ``tokens.json``, every entry a string (others become ``<not a string>``).

    Raises:
        TraceFormatError: not an object with a ``tokens`` list.
    """
    tokens = raw.get("tokens") if isinstance(raw, dict) else None
    if not isinstance(tokens, list):
        raise TraceFormatError(f"{path}: expected {{\"tokens\": [text of id 0, ...]}}, got "
                               f"{type(tokens if isinstance(raw, dict) else raw).__name__}")
    return [t if isinstance(t, str) else "<not a string>" for t in tokens]


def verify_step_file(path: Path) -> str | None:
    """Check a step file's tensor bytes against the ``content_sha256`` its header records.

    Reads every data byte once, a few MB at a time (``tracer.format.hashing.stored_content_sha256``; the
    cost per GB is in BENCHMARKS.md). Reading a step for the app or the checks stays lazy: only the
    commands that promise verification call this (``diff``, ``check``'s ``integrity.checksum``,
    ``info --verify``, the pytest helpers).

    Returns:
        The verified checksum, or None when the header records none (a step file not written by
        TraceWriter: there is nothing to verify).
    Raises:
        ChecksumError: the bytes hash to another value than the recorded one (naming the file, both
            digests and the likely cause).
        TraceFormatError: the file is not a readable safetensors step file.
    """
    size = _regular_size(path, "step file")
    check_step_file_bounds(path)
    try:
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
            meta = header.get("__metadata__") if isinstance(header, dict) else None
            recorded = meta.get("content_sha256") if isinstance(meta, dict) else None
            if not isinstance(recorded, str):
                return None
            actual = stored_content_sha256(fh, header, 8 + header_len, size)
    except (OSError, ValueError, RecursionError) as err:
        raise TraceFormatError(f"{path}: cannot verify its checksum ({err})") from err
    if actual != recorded:
        raise ChecksumError(
            f"{path}: corrupt: its tensor bytes hash to sha256 {actual[:16]}… but its header records "
            f"content_sha256 {recorded[:16]}…: the file changed after it was written (a flipped bit, a bad "
            "copy, or tensors rewritten with the old metadata); restore it from a good copy or re-record "
            "the trace")
    return recorded
