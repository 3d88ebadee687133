"""Health: the findings of ``tracer.checks`` for the chosen run, counted per check and per step
file, filtered by severity and check (and the sidebar's rank); selecting a finding opens its
sequence on the Tokens page with its token marked, the token in the URL (``token=``) so that the
link reopens it. A run checked by the live guard while it went on says so (and what stopped it)."""

import hashlib

import pandas as pd
import streamlit as st

from app.components import token_jump, trace_cache, urls
from app.components.guard import report_of
from app.components.health import (
    DISPLAY_ORDER, NO_PROBLEMS, filter_findings, opens_groups, per_check_counts, per_step_counts, severity_counts,
    style_findings, target_of, verdict)
from app.components.sidebar import current_selection, run_param
from app.components.token_table import TOKEN_TEXT_HELP
from tracer.checks import SEVERITIES, SKIPPED
from tracer.views import GROUPED_ALGORITHMS

# Above this many step files the page checks only the sidebar's step file unless asked for all.
MAX_DEFAULT_FILES = 200
ALL_FILES, CHOSEN_FILE = "every step file", "the sidebar's step file"
_HANDLED_STATE = "_tracer_health_handled"  # the findings-table selection already acted on

selection = current_selection()
trace_path = str(selection.trace_path)
trace = trace_cache.open_trace(trace_path)
keys = trace.steps()
st.title("Health")
st.text(f"{trace_path} · {trace.algorithm or 'unknown algorithm'} · {len(keys)} step files")
guard = report_of(trace_path)
if guard is not None and guard.stop is not None:
    where = " · ".join(f"{k} {guard.stop[k]}" for k in ("step", "inner_step", "sequence", "token")
                       if guard.stop.get(k) is not None)
    st.error(f"The live guard stopped this run at the first error: {guard.stop.get('check')} at {where}.",
             icon=":material/front_hand:")
    st.text(str(guard.stop.get("message", "")))  # plain text: a message may quote token text
if guard is not None:
    st.caption(f"Live guard ({guard.mode}): {guard.checked} step file(s) checked while the run went on, "
               f"{guard.errors} error and {guard.warnings} warning finding(s) in its findings file; the "
               "findings below reuse its results for the files it checked and check the others.")
    for note in guard.notes[-3:]:
        st.text(f"guard: {note}")
problems = trace.problems()
if problems:
    st.error(f"{len(problems)} step file(s) could not be read and are not checked; the others are.",
             icon=":material/error:")
    st.dataframe(pd.DataFrame({"step file": [p.name for p in problems], "reason": list(problems.values())}),
                 hide_index=True, width="stretch")
if not keys or selection.key is None:
    st.info("This trace has no readable step files yet. Press Reload in the sidebar when the trainer has written one.")
    st.stop()

scope = st.radio("Check", [ALL_FILES, CHOSEN_FILE], horizontal=True,
                 index=0 if len(keys) <= MAX_DEFAULT_FILES else 1,
                 help="every step file of the run (trace-level checks included), or only the one chosen in the sidebar")
checked = keys if scope == ALL_FILES else [selection.key]
frame = trace_cache.findings(trace_path, tuple(k.path.name for k in checked))

counts = severity_counts(frame)
for column, severity in zip(st.columns(len(SEVERITIES)), SEVERITIES):
    column.metric(severity, counts[severity])
summary = verdict(frame)
if summary == NO_PROBLEMS:
    st.success(f"{len(checked)} step file(s) checked: {NO_PROBLEMS}.", icon=":material/check_circle:")
else:
    st.error(f"{len(checked)} step file(s) checked: {summary}.", icon=":material/error:")
if frame.empty:
    st.stop()

left, right = st.columns(2)
present = [s for s in SEVERITIES if counts[s]]
severities = left.multiselect("Severity", present, default=[s for s in present if s != SKIPPED] or present)
check_ids = sorted(frame["check"].unique())
checks = right.multiselect("Check", check_ids, default=check_ids)
shown = filter_findings(frame, severities, checks, selection.rank)
if selection.rank is not None:
    st.caption(f"Findings of rank {selection.rank} (the sidebar's rank) and of the whole trace.")

st.subheader("By check")
st.dataframe(per_check_counts(shown), hide_index=True, width="stretch")
st.subheader("By step file")
st.dataframe(per_step_counts(shown), hide_index=True, width="stretch")

st.subheader(f"Findings ({len(shown)})")
st.caption("Select a row to open its sequence on the Tokens page with the token marked (a finding about a "
           "group opens the Groups page). token: position in the completion; sequence: row of the step file.")
digest = hashlib.sha1(repr((trace_path, scope, severities, checks, selection.rank)).encode()).hexdigest()[:12]
event = st.dataframe(
    style_findings(shown), hide_index=True, width="stretch", on_select="rerun", selection_mode="single-row",
    key=f"health_findings_{digest}", column_order=[c for c in DISPLAY_ORDER if c in shown],
    column_config={
        "token_text": st.column_config.TextColumn("token text", help=TOKEN_TEXT_HELP),
        "message": st.column_config.TextColumn("message", width="large", help="the whole message is below the table"),
        "inner_step": st.column_config.NumberColumn("inner", width="small"),
        "rank": st.column_config.NumberColumn("rank", width="small"),
        "sequence": st.column_config.NumberColumn("seq", width="small"),
        "token": st.column_config.NumberColumn("token", width="small"),
        "path": st.column_config.TextColumn("step file path"),
    })
rows = list(event.selection.rows)
if rows != st.session_state.get(_HANDLED_STATE):
    st.session_state[_HANDLED_STATE] = rows
    target = target_of(shown, rows[0], trace_path) if rows else None
    if target is not None:
        token_jump.request(target)
        to_groups = opens_groups(shown, rows[0], trace.algorithm in GROUPED_ALGORITHMS)
        key = next((k for k in keys if str(k.path) == target.step_path), None)  # None: the jump alone selects
        params = urls.selection_params(run_param(selection.root, selection.trace_path), key, target.sequence)
        if target.token is not None and key is not None and not to_groups:
            params["token"] = str(target.token)
        st.switch_page("app_pages/groups.py" if to_groups else "app_pages/tokens.py", query_params=params)
    elif rows:
        st.info("This finding is about a whole step file or the whole trace: it names no sequence to open.")


def _where(finding) -> str:
    parts = [f"{name} {int(finding[name])}" for name in ("step", "inner_step", "rank", "sequence", "token")
             if pd.notna(finding[name])]
    return " · ".join(parts) or "whole trace"


with st.expander(f"Messages in full ({min(len(shown), 200)} of {len(shown)})"):  # plain text, never Markdown
    st.code("\n\n".join(f"{f['severity']} {f['check']} · {_where(f)}\n{f['message']}"
                          for _, f in shown.head(200).iterrows()) or "no findings", language=None, wrap_lines=True)
