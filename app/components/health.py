"""The Health page's tables: findings of ``tracer.checks.run_checks`` as a frame, filtered by
severity, check and rank, counted per step file, and the place a finding points at (step file,
sequence, token) for the jump to the Tokens page. Pure pandas, no Streamlit: tests call it.

The checks themselves (and every number in a message) come from ``tracer.checks``; nothing is
recomputed here.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from app.components.finding_target import FindingTarget
from app.components.token_table import visible_tokens
from tracer.checks import ERROR, SEVERITIES, WARNING, Finding, description

LOCATION_COLUMNS = ("step", "inner_step", "micro_batch", "rank", "sequence", "token", "token_id")
# Columns of the findings table, in display order (``path`` stays last: it is long).
FINDING_COLUMNS = ("severity", "check", *LOCATION_COLUMNS, "token_text", "field", "message", "path")
SEVERITY_BACKGROUND = {ERROR: "#f8d0d0", WARNING: "#fbe9c2"}
NO_PROBLEMS = "no errors or warnings"
# Columns in the order the findings table shows them: the message early (it says what is wrong).
DISPLAY_ORDER = ("severity", "check", "step", "inner_step", "rank", "sequence", "token", "token_text", "message",
                 "field", "micro_batch", "token_id", "path")
# Checks about a whole group of completions (GRPO / CISPO / RLOO): their finding opens the Groups page.
GROUP_CHECKS = frozenset({"advantages.group_size", "advantages.group_sum", "advantages.zero_variance",
                          "advantages.z_bound", "recompute.advantages"})
MAX_STYLED_ROWS = 5_000


def findings_frame(findings: Iterable[Finding]) -> pd.DataFrame:
    """One row per finding with the columns of :data:`FINDING_COLUMNS`, in ``run_checks`` order
    (worst first). Location columns are nullable integers (empty for a trace-level finding)."""
    records = [{name: getattr(f, name) for name in FINDING_COLUMNS} for f in findings]
    frame = pd.DataFrame.from_records(records, columns=list(FINDING_COLUMNS))
    for name in LOCATION_COLUMNS:
        frame[name] = frame[name].astype("Int64")
    for name in ("severity", "check", "token_text", "field", "message", "path"):
        frame[name] = frame[name].astype("string")
    return frame


def severity_counts(frame: pd.DataFrame) -> dict[str, int]:
    """``{"error": n, "warning": n, "info": n, "skipped": n}`` over the frame."""
    counts = frame["severity"].value_counts() if not frame.empty else pd.Series(dtype=int)
    return {s: int(counts.get(s, 0)) for s in SEVERITIES}


def verdict(frame: pd.DataFrame) -> str:
    """:data:`NO_PROBLEMS` when no finding is an error or a warning, else ``2 errors, 1 warning``."""
    counts = severity_counts(frame)
    if not counts[ERROR] and not counts[WARNING]:
        return NO_PROBLEMS
    parts = [f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}" for s in (ERROR, WARNING) if counts[s]]
    return ", ".join(parts)


def filter_findings(frame: pd.DataFrame, severities: Iterable[str] | None = None,
                    checks: Iterable[str] | None = None, rank: int | None = None) -> pd.DataFrame:
    """The findings of the given severities and checks (all when None) and of ``rank`` (trace-level
    findings, which have no rank, are kept), index reset."""
    keep = pd.Series(True, index=frame.index)
    if severities is not None:
        keep &= frame["severity"].isin(list(severities))
    if checks is not None:
        keep &= frame["check"].isin(list(checks))
    if rank is not None:
        keep &= frame["rank"].isna() | (frame["rank"] == rank)
    return frame[keep.astype(bool)].reset_index(drop=True)


def per_step_counts(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per step file with findings: ``step, inner_step, micro_batch, rank`` and one count
    column per severity, sorted by step; trace-level findings (no step) are left out."""
    keys = ["step", "inner_step", "micro_batch", "rank"]
    located = frame.dropna(subset=["step"])
    columns = keys + list(SEVERITIES)
    if located.empty:
        return pd.DataFrame(columns=columns)
    counts = (located.groupby(keys + ["severity"], dropna=False).size()
              .unstack("severity", fill_value=0).reindex(columns=list(SEVERITIES), fill_value=0))
    return counts.reset_index().sort_values(keys, kind="stable").reset_index(drop=True)[columns]


def per_check_counts(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per check with findings, worst first: ``check``, one count column per severity,
    and the check's rule (``description`` from the registry)."""
    columns = ["check", *SEVERITIES, "description"]
    if frame.empty:
        return pd.DataFrame(columns=columns)
    counts = (frame.groupby(["check", "severity"]).size().unstack("severity", fill_value=0)
              .reindex(columns=list(SEVERITIES), fill_value=0))
    counts = counts.sort_values(list(SEVERITIES), ascending=False, kind="stable").reset_index()
    counts["description"] = [description(c) for c in counts["check"]]
    return counts[columns]


def target_of(frame: pd.DataFrame, row: int, trace_path: str) -> FindingTarget | None:
    """Where row ``row`` of ``frame`` points, or None when it names no step file and sequence."""
    finding = frame.iloc[row]
    if pd.isna(finding["path"]) or pd.isna(finding["sequence"]):
        return None
    token = None if pd.isna(finding["token"]) else int(finding["token"])
    return FindingTarget(trace_path, str(finding["path"]), int(finding["sequence"]), token, str(finding["check"]))


def opens_groups(frame: pd.DataFrame, row: int, grouped: bool) -> bool:
    """Whether row ``row`` is about a group (a :data:`GROUP_CHECKS` finding on a sequence, no token)
    of a group-based run (``grouped``): it opens the Groups page rather than the Tokens page."""
    finding = frame.iloc[row]
    return grouped and str(finding["check"]) in GROUP_CHECKS and pd.isna(finding["token"])


def style_findings(frame: pd.DataFrame):
    """Rows coloured by severity (errors red, warnings amber); info and skipped stay white. Past
    :data:`MAX_STYLED_ROWS` rows the frame is returned unstyled (the severity column says it all).
    ``token_text`` goes through ``token_table.visible_tokens`` (a space token reads ``␣``)."""
    if len(frame) > MAX_STYLED_ROWS:
        return visible_tokens(frame)

    def row_style(row: pd.Series) -> list[str]:
        colour = SEVERITY_BACKGROUND.get(str(row["severity"]))
        return [f"background-color: {colour}" if colour else ""] * len(row)

    return visible_tokens(frame).style.apply(row_style, axis=1)
