"""The run's logged scalars: one append-only JSON-lines file per rank at the trace root
(``scalars.rank_N.jsonl``), for numbers that arrive after a step's files were written: TRL's logs
(``on_log``: loss, grad_norm, learning_rate, entropy, rewards/<func>/mean, completions/mean_length, ...)
and ``TraceWriter.log_scalars(step, {...})``. ``Trace.step_summary()`` shows them as
``scalars/<name>`` columns of the rows of their step (:mod:`tracer.read.overview`).

    {"format": "tracer-scalars", "version": 1, "rank": 0}                      (first line)
    {"step": 3, "scalars": {"loss": 0.0123, "grad_norm": 0.41, "learning_rate": 1e-06}}

Each line is appended whole with one ``write`` when the values arrive (a log comes once per
optimizer step at most). A reader skips a line that is not a complete JSON object of this shape
(the torn last line of a crash, a value that is not a number: NaN is written as ``NaN``), and
a later line's value for the same step and name wins. Scalars recorded with the step itself
(``record(..., scalars=...)``, in the step's summary) win over logged ones of the same name.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCALARS_FORMAT = "tracer-scalars"
SCALARS_VERSION = 1
SCALARS_GLOB = "scalars.rank_*.jsonl"
MAX_SCALARS_BYTES = 1 << 30  # a larger file is ignored
MAX_NAME_CHARS = 100


def scalars_name(rank: int = 0) -> str:
    """The file name of one rank's logged scalars at the trace root."""
    return f"scalars.rank_{rank}.jsonl"


class ScalarLog:
    """Appends one rank's logged scalars. Never raises on I/O: the first failure is logged and the
    log is abandoned (the step files are unaffected). The file is created (truncated) on the first
    :meth:`add`."""

    def __init__(self, root: Path, rank: int) -> None:
        self.path, self.rank = Path(root) / scalars_name(rank), rank
        self._fd: int | None = None
        self._failed = False

    def add(self, step: int, scalars: Mapping[str, float]) -> None:
        """Append the line of ``step`` (``{name: float}``, names without a prefix)."""
        if self._failed or not scalars:
            return
        line = json.dumps({"step": int(step), "scalars": {k: float(v) for k, v in scalars.items()}}, allow_nan=True)
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
                self._write(json.dumps({"format": SCALARS_FORMAT, "version": SCALARS_VERSION, "rank": self.rank})
                            + "\n")
            self._write(line + "\n")
        except OSError as err:
            log.warning("tracer: the logged scalars %s are abandoned (%s)", self.path, err)
            self._failed = True
            self.close()

    def _write(self, text: str) -> None:
        data = text.encode()
        while data:
            n = os.write(self._fd, data)
            data = data[n:]

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def read_scalars(paths: Iterable[Path]) -> dict[int, dict[str, float]]:
    """``{step: {name: value}}`` of the logged-scalar files ``paths`` (see the module docstring for
    what is skipped); every rank's together, a later line winning per (step, name)."""
    out: dict[int, dict[str, float]] = {}
    for path in paths:
        try:
            if os.stat(path).st_size > MAX_SCALARS_BYTES:
                continue
            with open(path, "rb") as fh:
                head = _parse(fh.readline())
                if head.get("format") != SCALARS_FORMAT or head.get("version") != SCALARS_VERSION:
                    continue
                data = fh.read()
        except OSError as err:
            log.info("tracer: logged scalars %s not read (%s)", path, err)
            continue
        for raw in data.split(b"\n")[:-1]:  # what follows the last newline is torn or being written
            entry = _parse(raw)
            step, values = entry.get("step"), entry.get("scalars")
            if type(step) is not int or step < 0 or not isinstance(values, dict):
                continue
            kept = {k: float(v) for k, v in values.items()
                    if isinstance(k, str) and 0 < len(k) <= MAX_NAME_CHARS and type(v) in (int, float)}
            out.setdefault(step, {}).update(kept)
    return out


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
