"""Human-readable report of findings for ``tracer check``: grouped by check, worst check first, each
finding with its location; a summary line of counts. Builds rich renderables; the CLI prints them.
"""

from __future__ import annotations

from itertools import groupby

from rich.console import Group
from rich.markup import escape
from rich.text import Text

from tracer.checks.finding import SEVERITIES, SEVERITY_RANK, SKIPPED, Finding
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


def not_checked_lines(skipped: list[Finding]) -> list[Text]:
    """The block that opens a report when checks could not run: ``not checked: N checks`` and, per
    check, the steps and the reason (the missing field or key), so a skip never reads as a pass."""
    if not skipped:
        return []
    lines = [Text(f"not checked: {len(skipped)} check{'s' if len(skipped) != 1 else ''} could not run (a missing "
                  "field or metadata key; what they test is unknown, not passed)", style="bold yellow")]
    lines.extend(Text(f"  {f.check}: {f.message}", style="yellow") for f in skipped)
    if any("completion_ids" in f.message for f in skipped):
        lines.append(Text("  fix: record the sampled token ids as completion_ids [B, T], aligned with the per-token "
                          "logprobs (tracer run: map them in a name map passed with --map, e.g. completion_ids = "
                          "[\"input_ids[:, 1:]\"] when the logprobs score input_ids[:, 1:])", style="yellow"))
    return lines


def render_findings(findings: list[Finding], title: str = "", max_per_check: int = 10) -> Group:
    """A rich Group: first a ``trace.unfinished`` finding (the run is still going or was killed: what
    follows covers only the step files on disk), then the checks that could not run
    (:func:`not_checked_lines`), then one block per check (worst severity first), its findings of one
    message shown once with their other locations (:func:`same_message`; ``max_per_check`` such
    entries), then a summary of counts."""
    worst = {}
    for f in findings:
        worst[f.check] = min(worst.get(f.check, 99), SEVERITY_RANK[f.severity])
    ordered = sorted((f for f in findings if f.severity != SKIPPED),
                     key=lambda f: (f.check != UNFINISHED, worst[f.check], f.check, SEVERITY_RANK[f.severity]))
    blocks: list = [Text(title, style="bold")] if title else []
    skipped = not_checked_lines([f for f in findings if f.severity == SKIPPED])
    if not any(f.check == UNFINISHED for f in ordered):
        blocks.extend(skipped)
    for check_id, group in groupby(ordered, key=lambda f: f.check):
        blocks.extend(_check_block(check_id, list(group), SEVERITIES[worst[check_id]], max_per_check))
        if check_id == UNFINISHED:  # said first; then what could not run
            blocks.extend(skipped)
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    verdict = ("FAIL" if counts["error"] else "PASS", "bold red" if counts["error"] else "bold green")
    blocks.append(Text.assemble(verdict, f"  {summary}"))
    return Group(*blocks)


def _check_block(check_id: str, items: list[Finding], severity: str, max_per_check: int) -> list:
    """One check's lines: its head (severity, id, count, what it checks), then each message once."""
    about = description(check_id)
    head = Text.assemble((f"{severity.upper():8}", STYLE[severity]), (check_id, "bold"),
                         (f"  {len(items)} finding{'s' if len(items) != 1 else ''}", "dim"),
                         (f"  — {about}" if about else "", "dim"))
    blocks: list = [head]
    entries = same_message(items)
    for f, others in entries[:max_per_check]:
        where = location_text(f)
        if others:
            shown = ", ".join(location_text(o) for o in others[:3]) + (", …" if len(others) > 3 else "")
            where += f" (the same at {len(others)} more: {shown})"
        blocks.append(Text.from_markup(f"  [{STYLE[f.severity]}]{f.severity}[/] [dim]{escape(where)}[/]"))
        blocks.append(Text("    " + f.message))
    if len(entries) > max_per_check:
        blocks.append(Text(f"    … {len(entries) - max_per_check} more (use --json for all)", style="dim"))
    return blocks
