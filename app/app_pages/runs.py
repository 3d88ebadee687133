"""Runs (the app's root URL, ``/``): every trace under the root with its algorithm, how it ended (the
manifest's status: :mod:`tracer.read.run_status`), steps, rows per step, last mean reward and check status
(``tracer check``'s findings, cached per run), a link to each; selecting a row opens the run at its most
informative step (:mod:`app.components.runs`). The sidebar's run choosers are not drawn here."""

import pandas as pd
import streamlit as st

from app.components import runs
from app.components.sidebar import current_selection, discover_traces, run_param
from tracer.errors import TraceError

_OPEN_STATE = "_tracer_runs_open"  # (run label, page file) chosen in the table, opened on the next run
_HANDLED_STATE = "_tracer_runs_handled"  # the table selection already acted on
NOT_RECORDED = "—"  # a cell of a value the run does not record

selection = current_selection()
root = selection.root
traces = discover_traces(root)
pending = st.session_state.pop(_OPEN_STATE, None)
if pending is not None and run_param(root, selection.trace_path) == pending[0]:
    # the sidebar now shows the chosen run, so its pages are registered: open the page on it
    st.switch_page(pending[1], query_params={"run": pending[0]})

st.title("Runs")
st.text(f"{len(traces)} run(s) under {root}")

# First the table from what is on disk without running anything (each run's summaries, the header of
# its last step, the guard's findings), then tracer check on the runs small enough to check without
# asking, each row's check cell filled in as its run is checked.
labels = [run_param(root, path) for path in traces]
rows, to_check = [], []
for path, label in zip(traces, labels):
    row = runs.run_row(str(path), label, None)
    if row["algorithm"] is not None and runs.checked_now(str(path)):  # None: the row says why it cannot open
        row["check"] = runs.CHECKING
        to_check.append(len(rows))
    rows.append(row)
COLUMN_CONFIG = {
    "run": st.column_config.TextColumn("run", help="the trace's path under the root (the URL's run=)"),
    "open": st.column_config.LinkColumn("open", display_text="open", help="a link to the run (opens a new tab)"),
    "status": st.column_config.TextColumn("status", help="how the run ended, from its manifest: finished; crashed "
                                                        "or interrupted, with the exception and the last step "
                                                        "recorded; unfinished: the writer has not closed (still "
                                                        "running, or killed)"),
    "steps": st.column_config.NumberColumn("steps", help="distinct step numbers"),
    "step files": st.column_config.NumberColumn("step files", help="one per step, inner step, micro-batch, rank"),
    "rows": st.column_config.NumberColumn("rows", help="sequences (DPO: pairs) in the last step, from its "
                                                    "step files' headers"),
    "last mean reward": st.column_config.NumberColumn("last mean reward",
                                                      help="mean reward of the last step; —: not recorded (DPO)"),
    "check": st.column_config.TextColumn("check", help="pass, or the counts of error and warning findings"),
    "guard": st.column_config.TextColumn("guard", help="the live guard (guard=warn|stop): what it found in the "
                                                      "step files it checked while the run went on, or where "
                                                      "it stopped the run; empty: no guard ran"),
}


def styled(table: pd.DataFrame):
    """The table as shown: a run without a recorded reward (DPO) or that cannot be opened: "—", not
    the grid's "None"."""
    return table.style.format("{:.4g}", subset=["last mean reward"], na_rep=NOT_RECORDED)


st.caption("Select a row to open the run at its most informative step: the first step file with an error, "
           "else the last step. check: the findings of `tracer check` (errors and warnings; info findings "
           f"are not problems); {runs.budget_text()}, a larger run when asked.")
slot = st.empty()
if to_check:  # shown while the checks run (not selectable yet)
    slot.dataframe(styled(pd.DataFrame(rows, columns=runs.COLUMNS)), hide_index=True, width="stretch",
                   column_config=COLUMN_CONFIG)
    progress = st.progress(0.0, text="Checking the runs…")
    for done, i in enumerate(to_check, start=1):
        try:
            status = runs.known_status(str(traces[i]))
        except (TraceError, UnicodeEncodeError):
            status = None
        rows[i]["check"] = status.text() if status is not None else runs.NOT_CHECKED
        progress.progress(done / len(to_check), text=f"Checked {done} of {len(to_check)} run(s)")  # (not Markdown)
    progress.empty()
frame = pd.DataFrame(rows, columns=runs.COLUMNS)
event = slot.dataframe(styled(frame), hide_index=True, width="stretch", on_select="rerun",
                       selection_mode="single-row", key="runs_table", column_config=COLUMN_CONFIG)
rows_chosen = list(event.selection.rows)
if rows_chosen != st.session_state.get(_HANDLED_STATE):
    st.session_state[_HANDLED_STATE] = rows_chosen
    if rows_chosen and frame["algorithm"].iloc[rows_chosen[0]] is not None:  # None: the run cannot be opened
        # first the sidebar moves to the run (its pages get registered), then the next run opens the page
        label = frame["run"].iloc[rows_chosen[0]]
        st.session_state[_OPEN_STATE] = (label, runs.open_page(frame["algorithm"].iloc[rows_chosen[0]]))
        st.query_params.clear()  # run= alone: the sidebar opens the run at its most informative step
        st.query_params["run"] = label
        st.rerun()

for path, check in zip(traces, frame["check"]):
    if check != runs.NOT_CHECKED:
        continue
    label = run_param(root, path)
    if st.button(f"Check {label}", key=f"check_{label}", help="run every check on every step file of this run"):
        runs.request_check(str(path))
        st.rerun()
