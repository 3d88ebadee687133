"""The run's per-row (rollout) summaries: one append-only JSON-lines file per rank at the trace root
(``rollouts.rank_N.jsonl``), so that a table of every completion of every step
(:func:`tracer.read.rollouts.rollout_frame`) reads one file instead of opening every step file.

The writer thread appends one line per step file after the file's rename (the line is written at
once: a crash loses at most the line being written, and a torn last line is skipped by readers):

    {"format": "tracer-rollouts", "version": 1, "rank": 0}                        (first line)
    {"file": "step_00000003.inner_0.mb_0.rank_0.safetensors", "step": 3, "inner_step": 0,
     "micro_batch": 0, "rank": 0, "size": 50312, "reward_component_names": ["format", "answer"],
     "rows": {"length": [12, 31], "reward": [1.0, 0.0], "advantage": [...], "mean_ratio": [...],
              "mean_ref_kl_k3": [...], "mean_abs_mismatch": [...], "mean_entropy": [...],
              "group": [0, 0], "reward_components": [[1.0, 0.0], [0.0, 0.0]],
              "text": ["The answer is 4", "..."], "text_truncated": [false, false]}}

``rows`` holds :func:`tracer.formulas.rows.row_statistics` of the step (NaN written as ``NaN``), and the
text of each row's kept completion tokens (:func:`completion_text`: the token strings of ``tokens.json``
concatenated, cut at :data:`MAX_TEXT_CHARS` characters). A line vouches for a step file as a summary
index line does (:mod:`tracer.format.run_index`): the same name in ``steps/``, the same coordinates, and
its size on disk now equal to ``size``; a file no line vouches for is read from its tensors. The
file is started again (truncated) when a writer for the rank starts on a trace without step files.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tracer.format.text import MAX_TOKEN_TEXT, shown_token

log = logging.getLogger(__name__)

ROLLOUT_FORMAT = "tracer-rollouts"
ROLLOUT_VERSION = 1
ROLLOUT_GLOB = "rollouts.rank_*.jsonl"
MAX_TEXT_CHARS = 256  # characters of a completion's text kept in a rollout table (the rest: text_truncated)
MAX_STORE_BYTES = 1 << 31  # a larger file is ignored (the step files are read instead)
NUMBER_KEYS = ("length", "reward", "advantage", "mean_ratio", "mean_ref_kl_k3", "mean_abs_mismatch",
               "mean_entropy")
COORDINATES = ("step", "inner_step", "micro_batch", "rank")


def rollout_store_name(rank: int = 0) -> str:
    """The file name of one rank's rollout summaries at the trace root."""
    return f"rollouts.rank_{rank}.jsonl"


def shown_tokens(tokens: Sequence[str] | None) -> list[str]:
    """Token strings as a table shows them (:func:`tracer.format.text.shown_token`), as the reader's
    ``Trace.token_text`` does."""
    return [t if len(t) <= MAX_TOKEN_TEXT else shown_token(t) for t in tokens or []]


def completion_text(shown: Sequence[str], ids: Iterable[int], cap: int = MAX_TEXT_CHARS) -> tuple[str, bool]:
    """The text of token ``ids`` (each id's entry of ``shown`` (:func:`shown_tokens`), ``<id N>`` for an
    id it lacks, as ``Trace.decode``), cut at ``cap`` characters; and whether it was cut."""
    n, parts, length = len(shown), [], 0
    for i in ids:
        piece = shown[i] if 0 <= i < n else f"<id {i}>"
        parts.append(piece)
        length += len(piece)
        if length > cap:
            return "".join(parts)[:cap], True
    return "".join(parts), False


def line_of(name: str, coordinates: Sequence[int], size: int, rows: Mapping[str, Any],
            texts: list[str], truncated: list[bool], component_names: list[str] | None) -> str:
    """The store line of one step file (module docstring): ``rows`` as
    :func:`tracer.formulas.rows.row_statistics` returns them (numpy arrays)."""
    body: dict[str, Any] = {k: rows[k].tolist() for k in NUMBER_KEYS}
    body["group"] = rows["group"].tolist()
    if "reward_components" in rows:
        body["reward_components"] = rows["reward_components"].tolist()
    body["text"], body["text_truncated"] = texts, truncated
    head = {"file": name, **dict(zip(COORDINATES, (int(c) for c in coordinates))), "size": int(size),
            "reward_component_names": component_names}
    return json.dumps({**head, "rows": body}, allow_nan=True) + "\n"


class RolloutWriter:
    """Appends one rank's rollout lines (:meth:`add`, on the writer thread). Never raises: the first
    failure is logged and the store is abandoned for the rest of the run (readers then read the
    step files). ``resume``: append to the file a dead writer process left (a torn last line is
    ended first), instead of starting it again."""

    def __init__(self, root: Path, rank: int, resume: bool = False, enabled: bool = True) -> None:
        """``enabled=False``: no file (a DPO run has no completions to list); :meth:`add` does nothing."""
        self.path = Path(root) / rollout_store_name(rank)
        self._fd: int | None = None
        if not enabled:
            return
        try:
            if resume and self.path.is_file():
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
                with open(self.path, "rb") as fh:
                    fh.seek(0, os.SEEK_END)
                    if fh.tell():
                        fh.seek(-1, os.SEEK_END)
                        if fh.read(1) != b"\n":
                            self._write(b"\n")
                return
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
            self._write((json.dumps({"format": ROLLOUT_FORMAT, "version": ROLLOUT_VERSION, "rank": rank}) + "\n")
                        .encode())
        except OSError as err:
            self._fail(err)

    def add(self, line: str) -> None:
        """Append one line made by :func:`line_of`."""
        if self._fd is not None:
            try:
                self._write(line.encode("utf-8", "surrogateescape"))
            except OSError as err:
                self._fail(err)

    def _write(self, data: bytes) -> None:
        while data:  # os.write may write less than asked
            n = os.write(self._fd, data)
            data = data[n:]

    def _fail(self, err: OSError) -> None:
        log.warning("tracer: the rollout summaries %s are abandoned (%s); readers read the step files instead",
                    self.path, err)
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def read_store(paths: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """``{step file name: entry}`` of the rollout files ``paths`` (a later line for a name wins).
    A file that cannot be read, is over :data:`MAX_STORE_BYTES` or does not start with this format's
    first line gives nothing; a line that is not a complete, well-formed entry (a torn last line, a
    list of the wrong length, a hostile value) is skipped: its file is read from its tensors."""
    out: dict[str, dict[str, Any]] = {}
    for path in paths:
        try:
            if os.stat(path).st_size > MAX_STORE_BYTES:
                continue
            with open(path, "rb") as fh:
                head = _parse(fh.readline())
                if head.get("format") != ROLLOUT_FORMAT or head.get("version") != ROLLOUT_VERSION:
                    continue
                data = fh.read()
        except OSError as err:
            log.info("tracer: rollout summaries %s not read (%s)", path, err)
            continue
        for raw in data.split(b"\n")[:-1]:  # what follows the last newline is torn or being written
            entry = _parse(raw)
            if _well_formed(entry):
                out[entry["file"]] = entry
    return out


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**62


def _array(values: Any, dtype: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """``values`` (a JSON list) as an array of ``dtype`` and ``shape``, None when it is not one (a
    string, a nested list of other lengths, a float where ints are expected); ``None`` items read as NaN."""
    if not isinstance(values, list):
        return None
    try:
        array = np.asarray(values, dtype=dtype) if dtype is not np.int64 else np.asarray(values)
    except (ValueError, TypeError, OverflowError):
        return None
    if array.shape != shape or (dtype is np.int64 and array.dtype.kind not in "iu" and array.size):
        return None
    return array.astype(dtype, copy=False)


def _well_formed(entry: dict[str, Any]) -> bool:
    """Whether a parsed line is an entry this reader can use; its number lists become arrays
    (``float64 [B]``, ``int64 [B]`` groups, ``float64 [B, F]`` components), its texts are checked."""
    rows, names = entry.get("rows"), entry.get("reward_component_names")
    if not (isinstance(entry.get("file"), str) and all(_count(entry.get(k)) for k in (*COORDINATES, "size"))
            and isinstance(rows, dict) and isinstance(rows.get("length"), list)):
        return False
    n = len(rows["length"])
    arrays = {k: _array(rows.get(k), np.float64, (n,)) for k in NUMBER_KEYS}
    arrays["group"] = _array(rows.get("group"), np.int64, (n,))
    text, cut = rows.get("text"), rows.get("text_truncated")
    if any(a is None for a in arrays.values()) or not (
            isinstance(text, list) and len(text) == n
            and all(type(t) is str and len(t) <= MAX_TEXT_CHARS for t in text)
            and isinstance(cut, list) and len(cut) == n and all(type(c) is bool for c in cut)):
        return False
    components = rows.get("reward_components")
    if components is not None:
        width = len(components[0]) if isinstance(components, list) and components and isinstance(components[0], list) \
            else -1
        arrays["reward_components"] = _array(components, np.float64, (n, width))
        if arrays["reward_components"] is None or (names is not None and not (
                isinstance(names, list) and len(names) == width and all(isinstance(x, str) for x in names))):
            return False
    elif names is not None and not isinstance(names, list):
        return False
    rows.update(arrays)
    return True
