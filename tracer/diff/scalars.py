"""The per-step scalars of two traces, compared like fields: ``scalars/<name>``.

A trace holds a step's scalars in two places (:mod:`tracer.format.summary`, :mod:`tracer.format.scalar_log`):
the ones recorded with the step (``record(..., scalars={...})``: the step file's summary header, one
value per step file) and the ones logged after it (``TraceWriter.log_scalars``, TRL's logs:
``scalars.rank_N.jsonl``, one value per step). Each scalar is compared as a float field named
``scalars/<name>`` with one position per step file (recorded) or per step (logged, at
``(step, 0, 0, 0)``, labelled ``step N``); a logged value of a step whose files recorded the same
name is left to those files, as the reader shows it (``Trace.step_summary``).

- A scalar one side has and the other lacks, at a step both sides hold (a paired step file, or a
  step both logs hold), is a note (``report.scalars_only_in``), as a metadata key one side records:
  what a run records or logs is no difference in how it trained, and a regression baseline recorded
  before its loop recorded scalars must not fail for it.
- Tolerance: ``|b - a| <= atol + rtol * |a|`` as for every float field, with the caller's
  ``atol``/``rtol`` for ``scalars/<name>`` (or ``"*"``, every float field). A scalar has no dtype
  of its own (a JSON number: a float32 loss's ``.item()``, a float64 learning rate), so its
  default is float32's rtol (1.3e-6, ``torch.testing.assert_close``) with an atol of that rtol
  times the scalar's largest ``|value|`` over both traces: relative to the scalar's own scale. A
  fixed atol would hide a learning rate of 1e-6 against 2e-6 under float32's 1e-5; no atol at
  all would call float noise around a loss near zero a difference.
- Scalars that measure the machine rather than the run (wall-clock times, throughput, memory:
  TRL's ``step_time``, verl's ``timing_s/*`` and ``perf/*``; see :func:`machine_scalar`) differ
  between any two runs and are not compared: ``report.scalars_not_compared`` names them (a note).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterable

import torch

from tracer.diff.inputs import step_id
from tracer.diff.locations import FLOAT, StepId, Tolerance
from tracer.diff.result import FieldDiff
from tracer.diff.stats import DEFAULT_TOLERANCES, FieldStats
from tracer.errors import TraceFormatError
from tracer.format.scalar_log import SCALARS_GLOB, read_scalars
from tracer.format.summary import SCALAR_PREFIX, recorded_values
from tracer.read import StepKey, Trace

SCALAR_DTYPE = "F64"  # how a JSON number is stored; the default tolerance is set by scale, not by this
SCALAR_RTOL = DEFAULT_TOLERANCES["F32"].rtol
# Words of a scalar's name (split at / _ . - and spaces) that say it measures the machine: the time
# something took, a rate per second, memory. TRL logs step_time every step; verl timing_s/*, perf/*.
MACHINE_WORDS = frozenset({"time", "times", "runtime", "timing", "timer", "elapsed", "duration", "second",
                           "seconds", "sec", "secs", "ms", "throughput", "memory", "mem", "gb", "gib", "mfu"})
_WORD = re.compile(r"[/_.\-\s]+")


def machine_scalar(name: str) -> bool:
    """Whether scalar ``name`` (without ``scalars/``) measures the machine rather than the run: a word
    of its name is one of :data:`MACHINE_WORDS` (``step_time``, ``timing_s/gen``,
    ``train_samples_per_second``, ``perf/max_memory_allocated_gb``), so two runs of the same
    training differ in it."""
    return any(word in MACHINE_WORDS for word in _WORD.split(name.lower()))


def recorded_scalars(trace: Trace, keys: Iterable[StepKey]) -> dict[StepId, dict[str, float]]:
    """``{step id: {"scalars/<name>": value}}`` of the step files ``keys``, from their headers
    (:func:`tracer.format.summary.recorded_values`); a file whose header does not read is left out
    (the diff reports it unreadable)."""
    out = {}
    for key in keys:
        try:
            values = recorded_values(trace.metadata(key))
        except TraceFormatError:
            continue
        out[step_id(key)] = {k: v for k, v in values.items() if k.startswith(SCALAR_PREFIX)}
    return out


def logged_scalars(trace: Trace) -> dict[int, dict[str, float]]:
    """``{step: {"scalars/<name>": value}}`` of the trace's logged-scalar files (every rank's); {}
    for a single step file."""
    if trace.path.is_file():
        return {}
    logged = read_scalars(sorted(Path(trace.root).glob(SCALARS_GLOB)))
    return {step: {SCALAR_PREFIX + k: v for k, v in values.items()} for step, values in logged.items()}


class ScalarPairs:
    """The scalar values of two traces, paired: :meth:`positions` lists ``(step id, name, a, b)``
    (``None`` on a side that lacks it), recorded ones per step-file pair, logged ones per step."""

    def __init__(self, trace_a: Trace, trace_b: Trace, pairs: list[tuple[StepKey, StepKey]]) -> None:
        self.recorded = [(step_id(ka), *(recorded_scalars(t, [k]).get(step_id(k), {}) for t, k in
                                         ((trace_a, ka), (trace_b, kb)))) for ka, kb in pairs]
        self.logged = logged_scalars(trace_a), logged_scalars(trace_b)
        self.paired_steps = {ka.step for ka, _ in pairs}

    def positions(self) -> list[tuple[StepId, str, float | None, float | None]]:
        """``(step id, "scalars/<name>", a, b)`` per position: every scalar either file of a step pair
        recorded, then every logged scalar of a step both logs hold or a paired step file has (at
        ``(step, 0, 0, 0)``), unless a file of that step recorded the same name."""
        out = []
        in_files: dict[int, set[str]] = {}
        for step, values_a, values_b in self.recorded:
            in_files.setdefault(step[0], set()).update(values_a, values_b)
            out.extend((step, name, values_a.get(name), values_b.get(name))
                       for name in dict.fromkeys([*values_a, *values_b]))
        log_a, log_b = self.logged
        steps = sorted((set(log_a) & set(log_b)) | (self.paired_steps & (set(log_a) | set(log_b))))
        for s in steps:
            values_a, values_b = log_a.get(s, {}), log_b.get(s, {})
            out.extend(((s, 0, 0, 0), name, values_a.get(name), values_b.get(name))
                       for name in dict.fromkeys([*values_a, *values_b]) if name not in in_files.get(s, ()))
        return out

    def names(self) -> set[str]:
        """Every ``scalars/<name>`` either trace holds at a compared position."""
        return {name for _, name, _, _ in self.positions()}


def scalar_tolerance(name: str, scale: float, atols: dict[str, float], rtols: dict[str, float]) -> Tolerance:
    """The tolerance of ``scalars/<name>``: the caller's for it (or ``"*"``), else rtol
    :data:`SCALAR_RTOL` and atol ``SCALAR_RTOL * scale`` (``scale``: its largest finite ``|value|``)."""
    return Tolerance(atols.get(name, atols.get("*", SCALAR_RTOL * scale)), rtols.get(name, rtols.get("*", SCALAR_RTOL)))


def compare_scalars(scalars: ScalarPairs, atols: dict[str, float], rtols: dict[str, float], wanted: list[str] | None,
                    drift: bool) -> tuple[dict[str, FieldStats], dict[str, dict], list[str], list]:
    """Compare every scalar of ``scalars`` (only ``wanted`` ones when given).

    Returns:
        ``(stats, missing, not_compared, differences)``: a :class:`FieldStats` per compared
        ``scalars/<name>`` (``finish()`` gives its FieldDiff); ``{name: {"only_in", "step_pairs", "first_step"}}`` for
        scalars one side lacks (positions counted); the machine scalars left out (:func:`machine_scalar`); and
        ``(step id, name, StepDifference)`` of each differing position.
    """
    positions = [p for p in scalars.positions() if wanted is None or p[1] in wanted]
    not_compared = sorted({p[1] for p in positions if machine_scalar(p[1][len(SCALAR_PREFIX):])})
    positions = [p for p in positions if p[1] not in not_compared]
    scale: dict[str, float] = {}
    for _, name, a, b in positions:
        finite = [abs(v) for v in (a, b) if v is not None and math.isfinite(v)]
        scale[name] = max([scale.get(name, 0.0), *finite])
    stats: dict[str, FieldStats] = {}
    missing: dict[str, dict] = {}
    differences = []
    for step, name, a, b in sorted(positions, key=lambda p: p[0]):
        if a is None or b is None:
            entry = missing.setdefault(name, {"only_in": "a" if b is None else "b", "step_pairs": 0,
                                              "first_step": step})
            entry["step_pairs"] += 1
            continue
        if name not in stats:
            tol = scalar_tolerance(name, scale[name], atols, rtols)
            stats[name] = FieldStats(FieldDiff(name, FLOAT, SCALAR_DTYPE, SCALAR_DTYPE, tol, None), (), drift)
        difference = stats[name].compare(step, torch.tensor(a, dtype=torch.float64),
                                         torch.tensor(b, dtype=torch.float64), None)
        if difference is not None:
            differences.append((step, name, difference))
    return stats, missing, not_compared, differences
