"""The renderings of a diff's result: :class:`DiffReport` is :class:`~tracer.diff.result.DiffResult`
with its text (short: :func:`tracer.diff.causes.render_short`; ``verbose=True`` adds every finding,
note and differing position), its per-field table (pandas, for the app) and its JSON (``--json``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict
from typing import Any

import pandas as pd

from tracer.diff.causes import render_short, update_evidence
from tracer.diff.locations import FLOAT, Location, step_label
from tracer.diff.result import DiffResult, FieldDiff, UpdateCause


class DiffReport(DiffResult):
    """The result of :func:`tracer.diff` (the data and conclusions of :class:`DiffResult`) and its
    renderings: :meth:`format` (also ``str(report)``), :meth:`details_text`, :meth:`field_table`,
    :meth:`to_dict`."""

    def format(self, max_locations: int = 10, verbose: bool = False) -> str:
        """The readable report. Short by default (``tracer.diff.causes.render_short``: the headline,
        a table of the diverging fields, the tolerances that would pass, what to do); with
        ``verbose``, the short report then :meth:`details_text`."""
        short = render_short(self)
        return f"{short}\n\ndetails (--verbose):\n{self.details_text(max_locations)}" if verbose else short

    def details_text(self, max_locations: int = 10) -> str:
        """What ``--verbose`` adds to the short report: every finding, the notes, the token
        alignment, and each differing field's details (``max_locations`` positions per field)."""
        findings = self.findings()
        lines = [f"  {self.verdict()} · {self.step_pairs} step pairs ({self.identical_by_checksum} identical by "
                 f"verified checksum) · only in a: {len(self.only_in_a)} · only in b: {len(self.only_in_b)}"]
        first = self.first_divergence
        if first:
            lines.append(f"first divergence: {first[0]} at {first[1].where()} ({first[1].values()})")
        if findings:
            lines += ["", *findings]
        if self.notes():
            lines += ["", "notes (not differences):", *("  " + n for n in self.notes())]
        tokens = [t.summary() for t in self.token_alignment.values() if t.differing_tokens or t.prompt_rows_differing]
        if tokens:
            lines += ["", "tokens:", *("  " + line for line in tokens)]
        for f in self.differing_fields:
            count = f"{f.differing} differing in {f.step_pairs_differing} step pairs" if f.differing else "drift only"
            lines += ["", f"{f.name} ({f.kind}, {count}):",
                      *("  " + line for line in field_details(f, max_locations))]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def field_table(self) -> pd.DataFrame:
        """One row per compared field, the cause first, then what follows from it (data-flow
        order), then the passing fields (a summary table for the app): ``field, role`` (``cause``,
        ``follows`` or ``""``), ``kind, passed, dtype_a, dtype_b, atol, rtol, mask, compared,
        differing, share, max_abs_diff`` (= the smallest passing atol), ``min_rtol, mean_diff,
        drift, shift, first`` (where)."""
        columns = ["field", "role", "kind", "passed", "dtype_a", "dtype_b", "atol", "rtol", "mask", "compared",
                   "differing", "share", "max_abs_diff", "min_rtol", "mean_diff", "drift", "shift", "first"]
        cause = self.cause
        failing = ([cause] if cause else []) + self.downstream
        ordered = failing + [f for f in self.fields.values() if f.passed]
        rows = [[f.name, "cause" if f is cause else ("follows" if not f.passed else ""), f.kind, f.passed,
                 f.dtype_a, f.dtype_b, f.tolerance.atol if f.tolerance else 0.0,
                 f.tolerance.rtol if f.tolerance else 0.0, f.mask, f.compared, f.differing, f.share,
                 f.max_abs_diff, f.min_rtol, f.mean_diff, f.drift, f.shift, f.first.where() if f.first else None]
                for f in ordered]
        return pd.DataFrame(rows, columns=columns)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: everything above plus ``equal``, ``findings`` and ``first_divergence``;
        non-finite floats become the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
        fields = {}
        for name, f in self.fields.items():
            fields[name] = {**asdict(f), "passed": f.passed, "share": f.share, "min_atol": f.min_atol}
        first = self.first_divergence
        out = {
            "equal": self.equal, "tensors_equal": self.tensors_equal, "findings": self.findings(),
            "notes": self.notes(), "a": self.a, "b": self.b,
            "labels": list(self.labels), "algorithm": self.algorithm, "step_pairs": self.step_pairs,
            "identical_by_checksum": self.identical_by_checksum, "only_in_a": self.only_in_a,
            "only_in_b": self.only_in_b, "missing_fields": self.missing_fields, "metadata": self.metadata,
            "unreadable": self.unreadable, "verified_files": self.verified_files, "producers": self.producers,
            "cause": self.cause.name if self.cause else None,
            "update_cause": _update_dict(self.update_cause),
            "downstream": [f.name for f in self.downstream],
            "token_alignment": {k: asdict(v) for k, v in self.token_alignment.items()},
            "first_divergence": {"field": first[0], **asdict(first[1])} if first else None,
            "fields": fields, "scalars_not_compared": self.scalars_not_compared,
            "scalars_only_in": self.scalars_only_in,
        }
        return _json_safe(out)


def field_details(f: FieldDiff, max_locations: int) -> list[str]:
    """Indented lines under the summary: tolerances, drift, shift, then positions grouped by
    sequence (worst sequence first) and token (worst first)."""
    lines = []
    if f.kind == FLOAT and f.tolerance is not None:
        mean = f"{f.mean_diff:+.1e}" if f.mean_diff is not None else "n/a"
        lines.append(f"dtype a={f.dtype_a} b={f.dtype_b}, tol: atol={f.tolerance.atol:.1e} "
                     f"rtol={f.tolerance.rtol:.1e}; mean(b-a)={mean}; would pass with "
                     f"atol>={f.max_abs_diff:.1e} (rtol=0) or rtol>={f.min_rtol:.1e} (atol=0)")
        if f.drift and f.differing:
            lines.append(f.drift_detail)
    if f.shift_detail:
        lines.append(f.shift_detail)
    groups: dict[tuple, list[Location]] = defaultdict(list)
    for loc in f.worst[:max_locations]:
        per_sequence = loc.sequence is not None and len(loc.index) > 1  # [B, T]: group by sequence
        groups[(loc.step, loc.index[:1] if per_sequence else ())].append(loc)
    for (step, seq), locs in groups.items():
        if seq:
            n = locs[0].row_differing
            count = f"{n} differing" if len(locs) >= n else f"showing {len(locs)} of {n} differing"
            lines.append(f"{step_label(step)}, seq {seq[0]} ({count})")
        else:
            lines.append(step_label(step))
        for loc in locs:
            pos = loc.position().split(", ", 1)[-1] if seq else loc.position()
            delta = f" |Δ|={loc.abs_diff:.1e}" if f.kind == FLOAT else ""
            lines.append(f"  {pos or 'value'}: {loc.values()}{delta}")
    if f.differing > min(max_locations, len(f.worst)):
        lines.append(f"… {f.differing - min(max_locations, len(f.worst))} more differing positions")
    return lines


def _update_dict(update: UpdateCause | None) -> dict[str, Any] | None:
    """:attr:`DiffResult.update_cause` for ``--json``: the two passes, the first policy field it changes
    and where, the loss fields that differ (with their numbers) or are recorded, the metadata that differs."""
    if update is None:
        return None
    return {"name": update.name(), "before": list(update.before), "after": list(update.after),
            "effect": update.effect.name, "effect_at": asdict(update.effect_at),
            "loss": {n: asdict(d) for n, d in update.loss.items()}, "loss_recorded": update.loss_recorded,
            "metadata": {k: list(v) for k, v in update.metadata.items()}, "evidence": update_evidence(update)}


def _json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats as strings (JSON has no inf/NaN), keys as strings, tuples as lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
