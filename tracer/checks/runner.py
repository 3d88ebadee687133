"""Run the registered checks over a trace: every step check on every step file, then the trace
checks; skips are merged into one ``skipped`` finding per (check, reason); findings come back
worst first (error, warning, info, skipped), then by check id and location.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from pathlib import Path

from tracer.checks.context import CheckOptions, StepContext, clear_check_memos
from tracer.checks.coverage import NOT_CHECKED, not_checked
from tracer.checks.finding import (
    ALL_ALGORITHMS,
    CHECKS,
    ERROR,
    INFO,
    NOT_APPLICABLE,
    SEVERITY_RANK,
    SKIPPED,
    WARNING,
    Check,
    Finding,
    Skip,
)
from tracer.checks.guard_records import GuardRecords
from tracer.errors import TraceError, TraceFormatError
from tracer.read import StepKey, Trace

log = logging.getLogger(__name__)
UNREADABLE = "trace.unreadable"  # finding id of a step file that cannot be read (not a registered check)
TRACE_FILES = "trace.files"  # finding id of a manifest or token-strings file that is (partly) ignored
UNFINISHED = "trace.unfinished"  # finding id of a trace whose writer has not closed (manifest status "running")
# what the report says of the findings about the trace's files, which are not registered checks
TRACE_FINDINGS = {UNREADABLE: "a step file that cannot be read",
                  TRACE_FILES: "a manifest or token strings file the reader had to ignore",
                  UNFINISHED: "the writer has not closed: the trace may grow or be cut short",
                  NOT_CHECKED: "a common bug class none of whose checks could run (tracer.checks.coverage)"}


def description(check_id: str) -> str:
    """What a finding id stands for: a registered check's rule, or what a finding about the trace's
    files (:data:`TRACE_FINDINGS`) is about; empty for an id neither knows."""
    check = CHECKS.get(check_id)
    return check.description if check is not None else TRACE_FINDINGS.get(check_id, "")


def select_checks(select: Iterable[str] | None = None) -> list[Check]:
    """The checks named by ``select`` (ids like ``masks.after_eos`` or whole families like ``masks``);
    all when None. Raises TraceError for a name that is neither."""
    if not select:
        return list(CHECKS.values())
    chosen: dict[str, Check] = {}
    for name in select:
        hits = [c for c in CHECKS.values() if c.id == name or c.family == name]
        if not hits:
            raise TraceError(f"unknown check {name!r}; known checks: {', '.join(sorted(CHECKS))} "
                             f"(or a family: {', '.join(sorted({c.family for c in CHECKS.values()}))})")
        chosen.update((c.id, c) for c in hits)
    return [c for c in CHECKS.values() if c.id in chosen]


def _sort_key(f: Finding):
    loc = tuple(-1 if v is None else v for v in (f.step, f.inner_step, f.micro_batch, f.rank, f.sequence, f.token))
    return (f.check != UNFINISHED, SEVERITY_RANK[f.severity], f.check, loc)  # an unfinished run is said first


EPISODE_CHECKS = ("advantages.", "recompute.advantages")  # judged on one row per episode (per-turn rows)


def _run_step_check(check: Check, ctx: StepContext) -> list[Finding]:
    """``check`` on ``ctx``; the per-sequence advantage checks on its episode view (one row per
    episode when per-turn rows share ``episode_ids``), their rows mapped back to the step's."""
    rows = ctx.episode_rows() if check.id.startswith(EPISODE_CHECKS) else None
    if rows is None:
        return check.run(ctx)
    return [replace(f, sequence=rows[f.sequence] if f.sequence is not None and 0 <= f.sequence < len(rows)
                    else f.sequence) for f in check.run(ctx.episode_view())]


def _crash(check: Check, err: Exception, key=None) -> Finding:
    where = f" on {key.label}" if key is not None else ""
    return Finding(check.id, WARNING, f"check {check.id} could not run{where}: {type(err).__name__}: {err}",
                   step=getattr(key, "step", None), inner_step=getattr(key, "inner_step", None),
                   micro_batch=getattr(key, "micro_batch", None), rank=getattr(key, "rank", None),
                   path=str(key.path) if key is not None else None)


def _unreadable(key: StepKey, err: TraceFormatError) -> Finding:
    return Finding(UNREADABLE, ERROR, f"step file not checked: {err}", step=key.step, inner_step=key.inner_step,
                   micro_batch=key.micro_batch, rank=key.rank, path=str(key.path))


def _file_notes(trace: Trace) -> list[Finding]:
    """Warnings for a manifest or token strings the reader had to ignore (in whole or in part), and
    an info finding when the manifest says the writer has not closed (status ``running``)."""
    notes = [(trace.root / "manifest.json", note) for note in trace.manifest_notes]
    if trace.tokens_problem is not None:
        notes.append((trace.root / "tokens.json", trace.tokens_problem))
    found = [Finding(TRACE_FILES, WARNING, note, path=str(path)) for path, note in notes]
    if trace.status == "running":
        found.append(Finding(
            UNFINISHED, INFO,
            "this trace is unfinished: its manifest says status 'running', so the writer has not closed "
            "(the run is still going, or it crashed or was killed before close()). Only the step files "
            "on disk now were checked; steps the writer had not written yet are missing.",
            path=str(trace.root / "manifest.json"), details={"status": "running"}))
    return found


# a check that reads another step file (a first rollout, an earlier micro-batch) may meet an unreadable one:
# TraceError is then that check's crash (a warning), not the end of the run (trace.unreadable names the file)


@dataclass
class StepResult:
    """What the step checks found on one step file: ``findings`` (crashes and the unknown-algorithm
    warning included), ``ran`` (check ids that ran), ``skipped`` (check id -> the reason it could not
    run) and ``depends`` (check ids whose result read other step files of the trace: filled by a
    caller that watches the trace, :mod:`tracer.guard`)."""

    findings: list[Finding] = dataclass_field(default_factory=list)
    ran: list[str] = dataclass_field(default_factory=list)
    skipped: dict[str, str] = dataclass_field(default_factory=dict)
    depends: list[str] = dataclass_field(default_factory=list)


def check_step(ctx: StepContext, checks: Iterable[Check], before: Callable[[Check], None] | None = None,
               after: Callable[[Check], None] | None = None) -> StepResult:
    """Run the step checks of ``checks`` that apply to ``ctx``'s algorithm on it, as ``tracer check``
    does for each step file (the live guard calls this too: the same code, the same findings).
    ``before(check)`` / ``after(check)``: called around each check (the guard watches what it reads)."""
    result = StepResult()
    key = ctx.key
    if ctx.algorithm not in ALL_ALGORITHMS:
        result.findings.append(Finding(
            "fields.required", WARNING,
            f"unknown algorithm {ctx.algorithm!r} in this step's metadata (expected one of "
            f"{sorted(a for a in ALL_ALGORITHMS if a)}): no algorithm-specific check ran on it",
            step=key.step, inner_step=key.inner_step, micro_batch=key.micro_batch, rank=key.rank,
            path=str(key.path)))
    for check in checks:
        if check.scope != "step" or ctx.algorithm not in check.algorithms:
            continue
        if before is not None:
            before(check)
        try:
            result.findings.extend(_run_step_check(check, ctx))
            result.ran.append(check.id)
        except Skip as skip:
            result.skipped[check.id] = str(skip)
        except (ValueError, RuntimeError, IndexError, KeyError, TypeError, ZeroDivisionError, TraceError) as err:
            log.debug("check %s crashed on %s", check.id, key.label, exc_info=True)
            result.findings.append(_crash(check, err, key))
        finally:
            if after is not None:
                after(check)
    return result


def step_conditions(ctx: StepContext) -> set[str]:
    """The conditions a step file meets that decide which bug classes apply to it
    (:mod:`tracer.checks.coverage`): ``kl`` (a reference-KL coefficient that is not 0, or none
    recorded) and ``engine`` (an inference engine sampled it)."""
    met = set()
    coef = ctx.hyper("kl_coef", None)
    coef = coef if coef is not None else ctx.hyper("beta", None)
    try:
        if coef is None or float(coef) != 0.0:
            met.add("kl")
    except (TypeError, ValueError):
        met.add("kl")
    if "sampler_logprobs" in ctx.data or ctx.flag("use_vllm") or ctx.hyper("rollout_engine", None):
        met.add("engine")
    return met


def run_checks(
    trace: Trace | str | Path,
    select: Iterable[str] | None = None,
    options: CheckOptions | None = None,
    steps: Iterable[StepKey] | None = None,
    reuse_guard: bool = True,
) -> list[Finding]:
    """Run the checks on every step file of ``trace`` (a Trace, a trace directory or a step file).

    Args:
        trace: what to check.
        select: check ids or family names; all checks when None.
        options: thresholds such as the sampler ratio bound C.
        steps: only these step files (``trace.steps()`` items), e.g. the one a UI page shows.
        reuse_guard: take a step file's step-check results from the live guard's findings file
            (``findings.rank_N.jsonl``, :mod:`tracer.checks.guard_records`) when the guard checked that
            very file (same size and modification time) with the same options; the checks whose result
            on it depended on other step files run again. False: check everything afresh. The trace
            checks always run. What was reused is logged (``tracer.checks.guard_records``) and kept in
            :data:`tracer.checks.guard_records.LAST_REUSE` for the command line to say.
    Returns:
        Findings: a ``trace.unfinished`` one first, then worst first. A check that cannot run for lack of a field or metadata key yields one
        ``skipped`` finding per reason (``details["steps"]`` lists the step files). A step file that
        cannot be read yields a ``trace.unreadable`` error naming the file and the reason, and the
        other step files are checked; an ignored manifest or token strings file a ``trace.files``
        warning; a trace whose manifest says ``running`` (writer not closed) a ``trace.unfinished``
        info finding.
    Raises:
        TraceError: unusable input (not a trace, no step file) or an unknown check name.
    """
    trace = trace if isinstance(trace, Trace) else Trace(trace)
    clear_check_memos(trace)
    options = options or CheckOptions()
    checks = select_checks(select)
    keys = trace.steps() if steps is None else list(steps)
    if not keys:
        why = list(trace.scan().values())[:3]
        unfinished = ("this trace is unfinished (its manifest says status 'running': the writer has not closed; "
                      "the run is still going, or it crashed or was killed before close()), and it "
                      if trace.status == "running" else "")
        raise TraceFormatError(f"{trace.path}: {unfinished}holds no step file: nothing to check"
                               + (f" (unreadable: {'; '.join(why)})" if why else ""))
    findings: list[Finding] = _file_notes(trace)
    skips: dict[tuple[str, str], list] = {}
    readable = []
    seen = _Coverage()
    reuse = GuardRecords(trace, options) if reuse_guard else None
    for key in keys:
        kept = reuse.step(key, checks) if reuse is not None else None
        if kept is not None:  # the live guard checked this very file with these checks and options
            found, ran, skipped, depends, fields, algorithm, conditions = kept
            result = StepResult(found, ran, skipped)
            if depends:  # their result read other step files, which may have changed since
                try:
                    again = check_step(StepContext(trace, key, options), [c for c in checks if c.id in depends])
                except TraceFormatError as err:
                    findings.append(_unreadable(key, err))
                    continue
                result.findings += again.findings
                result.ran += again.ran
                result.skipped.update(again.skipped)
        else:
            try:
                ctx = StepContext(trace, key, options)
            except TraceFormatError as err:
                findings.append(_unreadable(key, err))
                continue
            result = check_step(ctx, checks)
            fields, algorithm, conditions = set(ctx.data) - ctx.derived, ctx.algorithm, step_conditions(ctx)
        readable.append(key)
        seen.step(key, fields, algorithm, conditions)
        findings.extend(result.findings)
        for check_id in result.ran:
            seen.ran.setdefault(check_id, set()).add(key)
        for check_id, reason in result.skipped.items():
            skips.setdefault((check_id, reason), []).append(key)
            seen.skipped.setdefault(check_id, {})[key] = reason
    if reuse is not None:
        reuse.report()
    if not readable:
        raise TraceFormatError(f"{trace.path}: none of its {len(keys)} step file(s) can be read: "
                               + "; ".join(f.message for f in findings if f.check == "trace.unreadable")[:2000])
    algorithm = trace.algorithm or ""
    for check in checks:
        if check.scope == "trace" and algorithm in check.algorithms:
            try:
                findings.extend(check.run(trace, options, readable))
                seen.ran[check.id] = set(readable)
            except Skip as skip:
                skips.setdefault((check.id, str(skip)), []).extend(readable)
                seen.skipped[check.id] = {k: str(skip) for k in readable}
            except (ValueError, RuntimeError, IndexError, KeyError, TypeError, ZeroDivisionError, TraceError) as err:
                findings.append(_crash(check, err))
    for (check_id, reason), where in skips.items():
        first = where[0]
        others = ("" if len(where) == len(keys) else
                  " (the others: checked, skipped for another reason, or not applicable)")
        inapplicable = reason.startswith(NOT_APPLICABLE)
        head = f"not applicable on {len(where)} of {len(keys)} step files{others}: {reason[len(NOT_APPLICABLE):]}" \
            if inapplicable else f"skipped on {len(where)} of {len(keys)} step files{others}: {reason}"
        findings.append(Finding(check_id, SKIPPED, head,
                                step=first.step, inner_step=first.inner_step, micro_batch=first.micro_batch,
                                rank=first.rank, path=str(first.path),
                                details={"steps": [k.label for k in where[:50]],
                                         **({"not_applicable": True, "reason": reason[len(NOT_APPLICABLE):]}
                                            if inapplicable else {})}))
    findings.extend(seen.not_checked({c.id for c in checks}, readable))
    return sorted(_drop_covered(findings), key=_sort_key)


class _Coverage:
    """What each check did on each step file (ran, or skipped and why), and what each file records,
    for :func:`tracer.checks.coverage.not_checked`."""

    def __init__(self) -> None:
        self.ran: dict[str, set] = {}
        self.skipped: dict[str, dict] = {}
        self.fields: dict = {}
        self.algorithm: dict = {}
        self.conditions: dict = {}

    def step(self, key: StepKey, fields: set[str], algorithm: str, conditions: set[str]) -> None:
        self.fields[key] = set(fields)
        self.algorithm[key] = algorithm
        self.conditions[key] = set(conditions)

    def not_checked(self, selected: set[str], readable: list) -> list[Finding]:
        if any("engine" in met for met in self.conditions.values()):  # an engine sampled some step: all of them
            for met in self.conditions.values():
                met.add("engine")
        return not_checked(selected, self.ran, self.skipped, self.fields, readable, self.algorithm, self.conditions)


def _drop_covered(findings: list[Finding]) -> list[Finding]:
    """Without the ``health`` warnings whose every step already has an error or warning of the check
    that names their cause (``details["covered_by"]``: check id prefixes): one cause, one finding."""
    flagged: dict[str, set] = {}
    for f in findings:
        if f.severity in (ERROR, WARNING) and f.step is not None:
            flagged.setdefault(f.check, set()).add(f.step)
    kept = []
    for f in findings:
        prefixes = f.details.get("covered_by") if isinstance(f.details, dict) else None
        if prefixes and f.severity == WARNING:
            steps = set(f.details.get("steps") or [])
            covered = {s for check, at in flagged.items() if check.startswith(tuple(prefixes)) for s in at}
            if steps and steps <= covered:
                continue
        kept.append(f)
    return kept
