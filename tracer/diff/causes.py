"""The short text report of a diff: the headline (the upstream cause), a table of the diverging
fields with what follows from it, the tolerances that would pass, and what to do.

The headline is :attr:`~tracer.diff.result.DiffResult.cause`: the failing field that diverges at
the earliest step and, at that step, comes first in the data-flow order
``tracer.format.schema.DATA_FLOW`` (SPEC.md section 10: prompt -> completion ids/masks -> rewards ->
values -> advantages -> sampler/old/ref logprobs -> policy logprobs -> ratio/KL -> per-token loss ->
loss). Changing the reward function changes the rewards first and every later field through them:
the headline says ``rewards``, and the rest is listed as following from it. When every recorded input
of an update is equal and the policy the next inner pass scores differs, no field is the cause: the
headline names the update (:attr:`~tracer.diff.result.DiffResult.update_cause`) and says whether the
loss differs, is equal, or is not recorded.
``DiffReport.format(verbose=True)`` (:mod:`tracer.diff.report`) keeps every detail.
"""

from __future__ import annotations

import math

from tracer.diff.locations import EXACT, FLOAT, MASK
from tracer.diff.result import DiffResult, FieldDiff, UpdateCause
from tracer.format.schema import DATA_FLOW, flow_rank
from tracer.format.summary import SCALAR_PREFIX

# A name per stage of DATA_FLOW, for the cause line.
STAGES = ("prompt", "completion", "reward", "value", "advantage", "rollout/reference logprob", "policy logprob",
          "ratio/KL", "per-token loss", "loss")
assert len(STAGES) == len(DATA_FLOW)
MAX_ROWS = 12  # diverging fields shown in the table
MAX_OTHER = 5  # other findings (metadata, missing fields, steps on one side) shown


def round_up(x: float) -> float:
    """``x`` rounded up to two significant digits (a tolerance that passes where ``x`` does)."""
    if not x > 0 or not math.isfinite(x):
        return x
    rounded = float(f"{x:.2g}")
    if rounded < x:  # rounded down: one unit of the second digit more
        rounded = float(f"{rounded + 10.0 ** (math.floor(math.log10(x)) - 1):.2g}")
    return rounded


def passes_with(f: FieldDiff) -> str:
    """The smallest tolerance that would pass ``f``, as a CLI flag, or why none does."""
    if f.kind != FLOAT:
        return "none (compared exactly)"
    if f.differing == 0:
        return "none (a drift: see --verbose)"
    if not math.isfinite(f.max_abs_diff):
        return "none (NaN/inf on one side)"
    return f"--atol {f.name}={round_up(f.max_abs_diff):g}"


def _stage(name: str) -> str:
    stage = flow_rank(name)[0]
    return STAGES[stage] if stage < len(STAGES) else "non-canonical"


def headline(report: DiffResult) -> str:
    """``rewards diverges first, at step 0, seq 1 (a=0.5, b=0.6)``, or when an update is the cause
    (:attr:`~tracer.diff.result.DiffResult.update_cause`) ``the update between step 0 inner 0 and inner 1
    (loss, gradients or optimizer state): policy_logprobs diverges first, at ...``; empty when nothing
    differs."""
    cause = report.cause
    if cause is None:
        return ""
    update = report.update_cause
    if update is not None:
        loc = update.effect_at
        return (f"{update.name()} (loss, gradients or optimizer state): {update.effect.name} diverges first, "
                f"at {loc.where()} ({loc.values()})")
    if cause.first is None:
        return f"{cause.name} drifts ({cause.drift_detail})"
    loc = cause.first
    return f"{cause.name} diverges first, at {loc.where()} ({loc.values()})"


def update_evidence(update: UpdateCause) -> str:
    """Why the update is the cause, with the numbers: ``every recorded input of inner 0 is equal, and
    the loss differs by |Δ|=0.031 (a=0.52, b=0.55)``, ``... and the loss is not recorded``, or ``... and
    so is the recorded loss``, then the scalars recorded with the pass before the update that differ
    (``scalars/learning_rate`` with both values), then the step metadata the two runs were given differently."""
    inner = update.before[1]
    text = f"every recorded input of inner {inner} is equal"
    if update.loss:
        parts = []
        for name, d in update.loss.items():
            if (flow_rank(name)[0] == len(DATA_FLOW) - 1 or name.startswith(SCALAR_PREFIX)) and not d.first.index:
                # the scalar loss (a field, or a recorded scalar): both values
                parts.append(f"{name} by |Δ|={d.max_abs_diff:.2g} ({d.first.values()})")
            else:
                parts.append(f"{name} at {d.differing} position{'s' * (d.differing != 1)} by up to "
                             f"|Δ|={d.max_abs_diff:.2g}")
        text += f", and the loss differs: {'; '.join(parts)}"
    elif update.loss_recorded:
        text += (f", and so is the recorded loss ({', '.join(update.loss_recorded)}): the gradients or the "
                 "optimizer step differ (learning rate, gradient clipping, optimizer state)")
    else:
        text += ", and the loss is not recorded"
    if update.scalars:
        text += "; the scalars recorded with it differ: " + "; ".join(
            f"{name} by |Δ|={d.max_abs_diff:.2g} at {d.first.where()} ({d.first.values()})"
            for name, d in update.scalars.items())
    if update.metadata:
        text += "; step metadata the runs were given differs: " + ", ".join(
            f"{k} a={a!r} b={b!r}" for k, (a, b) in update.metadata.items())
    return text


def _cause_line(report: DiffResult, cause: FieldDiff) -> str:
    update = report.update_cause
    if update is not None:
        return (f"cause: {update.name()} (loss, gradients or optimizer state): {update_evidence(update)}; "
                f"then {update.effect.name} differs at inner {update.after[1]}")
    n = f"{cause.differing} of {cause.compared} {'kept ' if cause.mask else ''}positions differ ({cause.share:.1%})"
    if cause.kind == FLOAT and cause.differing:
        n += f", max |Δ|={cause.max_abs_diff:.2g}, mean(b-a)={cause.mean_diff or 0.0:+.2g}"
    elif cause.kind == MASK:
        n += f" (kept only in a: {cause.kept_only_in_a}, only in b: {cause.kept_only_in_b})"
    stage = flow_rank(cause.name)[0]
    same = [f.name for f in report.downstream if flow_rank(f.name)[0] == stage and f.first is not None
            and cause.first is not None and f.first.step == cause.first.step]
    also = f"; same stage, same step: {', '.join(same)}" if same else ""
    where = (f"{_stage(cause.name)} stage of the data flow" if not cause.name.startswith(SCALAR_PREFIX)
             else "a per-step scalar the run recorded or logged, beside the data flow")
    return f"cause: {cause.name} ({where}): {n}{also}"


def _table(fields: list[FieldDiff]) -> list[str]:
    rows = [("field", "kind", "differing", "share", "max |Δ|", "first at", "passes with")]
    for f in fields[:MAX_ROWS]:
        max_d = f"{f.max_abs_diff:.2g}" if f.kind == FLOAT else "-"
        first = f.first.where() if f.first else "(drift)"
        rows.append((f.name, f.kind, f"{f.differing}/{f.compared}", f"{f.share:.1%}", max_d, first, passes_with(f)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if len(fields) > MAX_ROWS:
        lines.append(f"  … {len(fields) - MAX_ROWS} more diverging fields (--verbose)")
    return lines


def _others(report: DiffResult) -> list[str]:
    field_lines = {f.summary() for f in report.fields.values() if not f.passed}
    others = [line for line in report.findings() if line not in field_lines]
    if len(others) > MAX_OTHER:
        others = others[:MAX_OTHER] + [f"… {len(others) - MAX_OTHER} more (--verbose)"]
    return others


def _what_to_do(report: DiffResult, failing: list[FieldDiff]) -> list[str]:
    lines = ["what to do:"]
    if report.metadata_conflicts:
        keys = list(report.metadata_conflicts)
        flags = " ".join(f"--ignore-metadata {k}" for k in keys)
        lines.append(f"  step metadata {', '.join(keys)} differs (hyperparameters the runs were configured with); "
                     f"if that is intended: {flags}")
    floats = [f for f in failing if f.kind == FLOAT and f.differing and math.isfinite(f.max_abs_diff)]
    exact = [f.name for f in failing if f.kind in (EXACT, MASK)]
    if exact:
        lines.append(f"  {', '.join(exact)} differ exactly: no tolerance passes; if the change is intended, "
                     "re-record the baseline (pytest --tracer-regen), else look at the cause above")
    elif floats:
        if report.kernels_differ:
            lines.append(f"  a ran on {report.kernels('a')} CPU kernels, b on {report.kernels('b')}: float32 results differ in the "
                         "last bits between kernel paths and every optimizer step amplifies that; to compare runs of "
                         "two machines, run both with ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 (docs/regression-testing.md)")
        flags = " ".join(passes_with(f) for f in floats)
        lines.append(f"  to accept differences this size: {flags}")
    lines.append("  --verbose: also every finding and each field's differing positions; --json: everything; --fields F1,F2: compare some fields only")
    return lines


def render_short(report: DiffResult) -> str:
    """The default text report: fits a screen for the common case."""
    findings = report.findings()
    head = headline(report)
    verdict = f"DIFFERENT: {head}" if head else report.verdict()
    lines = [f"tracer diff: {verdict}"]
    for side, label, path in (("a", report.labels[0], report.a), ("b", report.labels[1], report.b)):
        lines.append(f"  {side}{f' ({label})' if label != side else ''}: {path}")
    compared = (f"{len(report.fields)} fields compared" if report.fields or report.identical_by_checksum < report.step_pairs
                else "nothing left to compare")
    lines.append(f"  {report.algorithm or 'unknown algorithm'} · {report.step_pairs} step pairs "
                 f"({report.identical_by_checksum} byte-identical) · {report.verified_files} files verified by "
                 f"checksum · {compared}")
    cause = report.cause
    failing = ([cause] if cause else []) + report.downstream
    if cause is not None:
        lines += ["", _cause_line(report, cause)]
        if report.update_cause is not None:
            lines.append("follows from the update (these fields, at the steps shown):")
        elif report.downstream:
            lines.append(f"follows from {cause.name} (later in the data flow, or at later steps):")
        lines += _table(failing)
    tokens = [t.summary() for t in report.token_alignment.values() if t.differing_tokens or t.prompt_rows_differing]
    if tokens:
        lines += ["", "tokens:", *("  " + t for t in tokens)]
    others = _others(report)
    if others:
        lines += ["", "also:", *("  " + line for line in others)]
    notes = report.notes()
    if notes:
        lines += ["", "notes (not differences):", *("  " + line for line in notes)]
    if findings:
        lines += ["", *_what_to_do(report, failing)]
    return "\n".join(lines)


__all__ = ["headline", "passes_with", "render_short", "round_up", "update_evidence"]
