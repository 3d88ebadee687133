"""Human-readable report of findings for ``tracer check``: the bug classes that could not be checked
first, then grouped by check, worst check first, one entry per cause (findings that differ only in
their numbers, such as the same bug at every step, shown once with the steps they occur on); a summary
line of counts. Builds rich renderables; the CLI prints them. ``--json`` keeps every finding.
"""

from __future__ import annotations

import re
from itertools import groupby

from rich.console import Group
from rich.markup import escape
from rich.text import Text

from tracer.checks.coverage import NOT_CHECKED
from tracer.checks.text import steps_text
from tracer.checks.finding import SEVERITIES, SEVERITY_RANK, SKIPPED, Finding, is_not_applicable
from tracer.checks.runner import UNFINISHED, description

STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan", "skipped": "dim"}


def location_text(f: Finding) -> str:
    """``step 3 · inner 1 · mb 0 · rank 0 · seq 2 · token 5 (id 17 'the')``, the parts that are known;
    the file's name (``manifest.json``) for a finding about a file of the trace with no step location."""
    parts = []
    for label, value in (("step", f.step), ("inner", f.inner_step), ("mb", f.micro_batch), ("rank", f.rank),
                         ("seq", f.sequence), ("token", f.token)):
        if value is not None:
            parts.append(f"{label} {value}")
    text = " · ".join(parts)
    if not text and f.path:  # a finding about a file of the trace (its manifest): the file's name
        text = f.path.replace("\\", "/").rsplit("/", 1)[-1]
    if f.token_id is not None:
        shown = f" {f.token_text!r}" if f.token_text is not None else ""
        text += f" (id {f.token_id}{shown})"
    return text


def same_message(items: list[Finding]) -> list[tuple[Finding, list[Finding]]]:
    """``(first finding, the later ones)`` per distinct (severity, message) of one check's findings, in
    the order each first appears: a finding that says the same thing of every step file (a check
    skipped for want of a field, a sampler note) is shown once with its other locations."""
    entries: dict[tuple[str, str], tuple[Finding, list[Finding]]] = {}
    for f in items:
        entry = entries.setdefault((f.severity, f.message), (f, []))
        if entry[0] is not f:
            entry[1].append(f)
    return list(entries.values())


# a number standing alone (not inside a name such as k3 or fp16): 3, -0.25, 1e-05, 79%, 0x1f
_NUMBER = re.compile(r"(?<![A-Za-z_\d])[-+]?(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)%?")


def cause_key(f: Finding) -> str:
    """What makes two findings of one check the same cause: ``details["cause"]`` where the check sets
    one, else the message with every number masked (per-step values, rows and tokens differ; the
    words that name the cause do not)."""
    cause = f.details.get("cause") if isinstance(f.details, dict) else None
    return f"cause:{cause}" if isinstance(cause, str) and cause else _NUMBER.sub("#", f.message)


def same_cause(items: list[Finding]) -> list[tuple[Finding, list[Finding]]]:
    """``(first finding, the later ones)`` per (severity, :func:`cause_key`) of one check's findings, in
    the order each first appears: the same bug found at every step (its numbers differ per step) is one
    entry."""
    entries: dict[tuple[str, str], tuple[Finding, list[Finding]]] = {}
    for f in items:
        entry = entries.setdefault((f.severity, cause_key(f)), (f, []))
        if entry[0] is not f:
            entry[1].append(f)
    return list(entries.values())


def others_text(first: Finding, others: list[Finding], shown: int = 3) -> str:
    """Where else an entry's cause was found: ``(the same at N more: <locations>)`` when every message is
    the same, else ``(the same with other numbers at steps 1, 2, 5 and 3 more)``."""
    if all(o.message == first.message for o in others):
        listed = ", ".join(location_text(o) for o in others[:shown]) + (", …" if len(others) > shown else "")
        return f"(the same at {len(others)} more: {listed})"
    steps = sorted({o.step for o in others if o.step is not None} - {first.step})
    if not steps:
        return f"(the same with other numbers at {len(others)} more locations of this step)"
    listed = steps_text(steps[:8]) + (f" and {len(steps) - 8} more" if len(steps) > 8 else "")
    return (f"(the same with other numbers at step{'s' if len(steps) > 1 else ''} {listed}: "
            f"{len(others)} more finding{'s' if len(others) > 1 else ''}, --json lists each)")


def not_checked_lines(skipped: list[Finding]) -> list[Text]:
    """The block that opens a report when checks could not run: first each common bug class none of
    whose checks ran (``not checked: <class> — record <fields>``, :mod:`tracer.checks.coverage`), then
    ``not checked: N checks`` and, per check, the steps and the reason (the missing field or key), so a
    skip never reads as a pass."""
    classes = [f for f in skipped if f.check == NOT_CHECKED]
    skipped = [f for f in skipped if f.check != NOT_CHECKED]
    lines = [Text(f.message, style="bold yellow") for f in classes]
    if not skipped:
        return lines
    lines += [Text(f"not checked: {len(skipped)} check{'s' if len(skipped) != 1 else ''} could not run (a missing "
                  "field or metadata key; what they test is unknown, not passed)", style="bold yellow")]
    lines.extend(Text(f"  {f.check}: {f.message}", style="yellow") for f in skipped)
    if any("completion_ids" in f.message for f in skipped):
        lines.append(Text("  fix: record the sampled token ids as completion_ids [B, T], aligned with the per-token "
                          "logprobs (tracer run: map them in a name map passed with --map, e.g. completion_ids = "
                          "[\"input_ids[:, 1:]\"] when the logprobs score input_ids[:, 1:])", style="yellow"))
    return lines


def not_applicable_lines(inapplicable: list[Finding]) -> list[Text]:
    """The dimmed lines, just above the summary, of the checks that do not apply to the run
    (:func:`tracer.checks.finding.not_applicable`: what they test does not exist there, by the run's
    recorded configuration): said once, with why, and never among what could not be checked."""
    if not inapplicable:
        return []
    by_reason: dict[str, list[str]] = {}
    for f in inapplicable:
        checks = by_reason.setdefault(f.details.get("reason", f.message), [])
        if f.check not in checks:
            checks.append(f.check)
    return [Text(f"not applicable to this run: {len(inapplicable)} check{'s' if len(inapplicable) != 1 else ''} "
                 "(nothing of what they test exists here)", style="dim"),
            *(Text(f"  {', '.join(checks)}: {reason}", style="dim") for reason, checks in by_reason.items())]


def render_findings(findings: list[Finding], title: str = "", max_per_check: int = 10) -> Group:
    """A rich Group: first a ``trace.unfinished`` finding (the run is still going or was killed: what
    follows covers only the step files on disk), then the checks that could not run
    (:func:`not_checked_lines`), then one block per check (worst severity first), its findings of one
    cause shown once with the steps they occur on (:func:`same_cause`; ``max_per_check`` such entries),
    then the checks that do not apply to the run (:func:`not_applicable_lines`), then a summary of
    counts (``skipped`` counts only the checks that could not run)."""
    worst = {}
    for f in findings:
        worst[f.check] = min(worst.get(f.check, 99), SEVERITY_RANK[f.severity])
    ordered = sorted((f for f in findings if f.severity != SKIPPED),
                     key=lambda f: (f.check != UNFINISHED, worst[f.check], f.check, SEVERITY_RANK[f.severity]))
    blocks: list = [Text(title, style="bold")] if title else []
    inapplicable = [f for f in findings if is_not_applicable(f)]
    skipped = not_checked_lines([f for f in findings if f.severity == SKIPPED and not is_not_applicable(f)])
    if not any(f.check == UNFINISHED for f in ordered):
        blocks.extend(skipped)
    for check_id, group in groupby(ordered, key=lambda f: f.check):
        blocks.extend(_check_block(check_id, list(group), SEVERITIES[worst[check_id]], max_per_check))
        if check_id == UNFINISHED:  # said first; then what could not run
            blocks.extend(skipped)
    blocks.extend(not_applicable_lines(inapplicable))
    counts = {s: sum(f.severity == s and not is_not_applicable(f) for f in findings) for s in SEVERITIES}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items()) + (
        f", {len(inapplicable)} not applicable" if inapplicable else "")
    verdict = ("FAIL" if counts["error"] else "PASS", "bold red" if counts["error"] else "bold green")
    classes = sum(f.check == NOT_CHECKED for f in findings)
    unchecked = (f"  (not checked: {classes} bug class{'es' if classes > 1 else ''}, named at the top)"
                 if classes else "")
    blocks.append(Text.assemble(verdict, f"  {summary}", (unchecked, "yellow")))
    return Group(*blocks)


def _check_block(check_id: str, items: list[Finding], severity: str, max_per_check: int) -> list:
    """One check's lines: its head (severity, id, count, what it checks), then each message once."""
    about = description(check_id)
    head = Text.assemble((f"{severity.upper():8}", STYLE[severity]), (check_id, "bold"),
                         (f"  {len(items)} finding{'s' if len(items) != 1 else ''}", "dim"),
                         (f"  — {about}" if about else "", "dim"))
    blocks: list = [head]
    entries = same_cause(items)
    for f, others in entries[:max_per_check]:
        where = location_text(f)
        if others:
            where += " " + others_text(f, others)
        blocks.append(Text.from_markup(f"  [{STYLE[f.severity]}]{f.severity}[/] [dim]{escape(where)}[/]"))
        blocks.append(Text("    " + f.message))
    if len(entries) > max_per_check:
        blocks.append(Text(f"    … {len(entries) - max_per_check} more (use --json for all)", style="dim"))
    return blocks
