"""Steps: any per-step quantity of the run over its steps (every numeric column of the per-step
summary: ratio, KL, clip, reward and advantage means and quantiles, loss, entropy, length, reward
components, user and TRL scalars ``scalars/<name>``; margin, accuracy, loss and logps for DPO), one
panel each, one line per inner step and rank; other runs overlaid quantity by quantity; smoothing,
log scale, step or wall-clock x-axis. Every choice is in the URL
(``?overlay=…&y=…&smooth=…&log=…&x=…``). Clicking a point opens that step on the Step page (the
DPO pairs page for a DPO run)."""

import streamlit as st

from app.components import figures, trace_cache, urls
from app.components.sidebar import current_selection, discover_traces, run_param, stop_without_step_files
from app.components.step_curves import (
    X_AXES,
    Layout,
    clicked_step,
    default_columns,
    derived_fields,
    scalar_columns,
    split_names,
    step_curves_figure,
    title_of,
    with_step_columns,
)

OVERLAY_PARAM = "overlay"  # ?overlay=run_b,run_c
Y_PARAM, SMOOTH_PARAM, LOG_PARAM, X_PARAM = "y", "smooth", "log", "x"  # ?y=mean_ratio,scalars/grad_norm&smooth=0.6…
MAX_SMOOTHING = 0.99

selection = current_selection()
trace = trace_cache.open_trace(str(selection.trace_path))
count = trace.step_count()  # from the listing's arrays: no key per step file
st.title("Steps")
st.text(f"{selection.trace_path} · {trace.algorithm or 'unknown algorithm'} · {count} step files")
if not count:
    stop_without_step_files(trace)


def summary_of(path):
    """One run's per-step summary: DPO runs get their own (with the step summary's scalars)."""
    run = trace_cache.open_trace(str(path))
    files = trace_cache.listing_token(run)
    frame = trace_cache.step_summary(str(path), files)
    if run.algorithm == "dpo":
        return with_step_columns(trace_cache.dpo_step_summary(str(path), files), frame)
    if selection.rank is not None and "rank" in frame:
        frame = frame[frame["rank"] == selection.rank].reset_index(drop=True)
    return frame


def url_smoothing() -> float:
    try:
        value = float(st.query_params.get(SMOOTH_PARAM) or 0.0)
    except ValueError:
        return 0.0
    return value if 0.0 <= value <= MAX_SMOOTHING else 0.0


root = selection.root
others = [p for p in discover_traces(root) if p != selection.trace_path]
labels = {p: run_param(root, p) for p in others}
by_label = {label: p for p, label in labels.items()}
wanted = [by_label[label] for label in split_names(st.query_params.get(OVERLAY_PARAM), list(by_label))[0]]
left, right = st.columns(2)
overlay = left.multiselect("Overlay runs", others, default=wanted, format_func=labels.__getitem__, key="overlay",
                           help="draw other runs of the root on the same axes (one colour per run)")
urls.set_page_param(OVERLAY_PARAM, ",".join(labels[p] for p in overlay) or None)

summary = summary_of(selection.trace_path)
runs = {run_param(root, selection.trace_path): summary} | {labels[p]: summary_of(p) for p in overlay}
algorithms = {run_param(root, selection.trace_path): trace.algorithm} | \
             {labels[p]: trace_cache.open_trace(str(p)).algorithm for p in overlay}
options = list(dict.fromkeys(c for frame in runs.values() for c in scalar_columns(frame)))
asked, unknown = split_names(st.query_params.get(Y_PARAM), options)
main_label = run_param(root, selection.trace_path)
switched = st.session_state.get("_steps_columns_for", main_label) != main_label  # another run in the sidebar
if switched or "step_columns" not in st.session_state:  # the link's quantities, else the run's defaults
    st.session_state["_steps_columns_for"] = main_label
    st.session_state["step_columns"] = asked or default_columns(summary, trace.algorithm)
chosen = right.multiselect(
    "Quantities", options, format_func=title_of, key="step_columns",
    help="per-step columns of the summary, one panel each: recorded or derived means and quantiles, "
         "reward components, the loss, and the scalars the trainer logged (scalars/…)")
urls.set_page_param(Y_PARAM, ",".join(chosen))
smooth_box, log_box, x_box = st.columns([1, 2, 2])
smoothing = smooth_box.slider("Smoothing", 0.0, MAX_SMOOTHING, url_smoothing(), 0.01, key="step_smoothing",
                              help="exponential moving average, debiased as TensorBoard does (0 = raw values)")
urls.set_page_param(SMOOTH_PARAM, f"{smoothing:g}" if smoothing else None)
log_columns = log_box.multiselect("Log scale", chosen, default=split_names(st.query_params.get(LOG_PARAM), chosen)[0],
                                  format_func=title_of, key="step_log", help="panels drawn on a log y-axis")
urls.set_page_param(LOG_PARAM, ",".join(log_columns) or None)
x_axis = x_box.radio("x-axis", list(X_AXES), index=list(X_AXES).index(urls.page_param(X_PARAM, list(X_AXES), "step")),
                     format_func=X_AXES.__getitem__, horizontal=True, key="step_x")
urls.set_page_param(X_PARAM, None if x_axis == "step" else x_axis)

figure, notes = step_curves_figure(runs, Layout(chosen, smoothing, log_columns, x_axis))
event = st.plotly_chart(figure, width="stretch", on_select="rerun", selection_mode="points", key="step_curves")
for text in [notes.x, *notes.log.values()]:
    if text:
        st.info(text, icon=":material/info:")
if unknown and not switched:  # after a switch the URL still names the previous run's quantities
    st.caption(f"Named in the link but not recorded by {' or '.join(runs)}: {', '.join(unknown)}.")
for label, missing in notes.missing.items():
    if len(runs) == 1:
        st.caption(f"No values in this run: {', '.join(map(title_of, missing))}.")
    elif len(missing) < len(chosen):
        st.caption(f"Not in {label} (a {algorithms[label]} run): {', '.join(map(title_of, missing))}.")
    else:
        own = [title_of(c) for c in scalar_columns(runs[label])]
        st.caption(f"{label} (a {algorithms[label]} run) records none of the chosen quantities; its own: "
                   f"{', '.join(own) or 'none'}.")
for label, frame in runs.items():
    if derived := derived_fields(frame):  # curves over fields the reader derived (tracer.formulas.derived)
        st.caption(f"{label + ': ' if len(runs) > 1 else ''}{', '.join(sorted(derived))}: derived by the reader "
                   "from the recorded logprobs (tracer.formulas).")
if smoothing:
    st.caption(f"Smoothed: exponential moving average of weight {smoothing:g} over each line's steps, debiased "
               "as TensorBoard does; the faint lines are the raw values.")
if trace.algorithm == "dpo":
    st.caption("Over the step's pairs (tracer.views.dpo_step_summary): margin = mean chosen_rewards − "
               "rejected_rewards; preference accuracy = share of pairs with chosen_rewards > rejected_rewards; "
               "logps: the policy's summed logprob of each side. Click a point to open that step's pairs.")
else:
    st.caption("Means over kept tokens (completion_mask), computed by tracer.read.reader.Trace.step_summary; "
               "clip fraction counts the clip only on the side the advantage's sign makes it bind. "
               "Click a point to open that step.")

points = list((event or {}).get("selection", {}).get("points", []))  # a PlotlyState is a dict too
if points:
    step, inner, run_index = clicked_step(figure, points[0])
    run_label = list(runs)[run_index]
    target = "app_pages/dpo.py" if algorithms[run_label] == "dpo" else "app_pages/step.py"
    st.switch_page(target, query_params={"run": run_label, "step": str(step), "inner": str(inner)})

with st.expander("Per-step table"):
    # a long run's table (10,000 rows x ~45 columns: ~3 MB to the browser) is sent when asked for
    if len(summary) <= figures.STEP_TABLE_ROWS or st.toggle(f"Show all {len(summary)} rows", key="step_table",
                                                help="the per-step summary of every step file, as a table"):
        st.dataframe(summary, hide_index=True, width="stretch")
