"""Steps: per-step curves over every step file of the run (masked means from the reader; margin,
accuracy, loss and logps for DPO), one line per inner step and rank; other runs overlaid on the
same axes; the sidebar's rank filter keeps one rank. Clicking a point opens that step on the Step
page (the DPO pairs page for DPO)."""

import streamlit as st

from app.components import figures, trace_cache, urls
from app.components.figures import DPO_STEP_PANELS, STEP_PANELS, clicked_step, step_curves_figure
from app.components.sidebar import current_selection, discover_traces, run_param

OVERLAY_PARAM = "overlay"  # ?overlay=run_b,run_c

selection = current_selection()
trace = trace_cache.open_trace(str(selection.trace_path))
count = trace.step_count()  # from the listing's arrays: no key per step file
st.title("Steps")
st.text(f"{selection.trace_path} · {trace.algorithm or 'unknown algorithm'} · {count} step files")
if not count:
    st.info("This trace has no step files yet. Press Reload in the sidebar when the trainer has written one.")
    st.stop()


def summary_of(path) -> "tuple":
    """(summary frame, panels) of one run: DPO runs get their own per-step summary."""
    run = trace_cache.open_trace(str(path))
    files = trace_cache.listing_token(run)
    if run.algorithm == "dpo":
        return trace_cache.dpo_step_summary(str(path), files), DPO_STEP_PANELS
    frame = trace_cache.step_summary(str(path), files)
    if selection.rank is not None and "rank" in frame:
        frame = frame[frame["rank"] == selection.rank].reset_index(drop=True)
    return frame, STEP_PANELS


root = selection.root
others = [p for p in discover_traces(root) if p != selection.trace_path]
labels = {p: run_param(root, p) for p in others}
wanted = [p for p in others if labels[p] in (st.query_params.get(OVERLAY_PARAM) or "").split(",")]
overlay = st.multiselect("Overlay runs", others, default=wanted, format_func=labels.__getitem__, key="overlay",
                         help="draw other runs of the root on the same axes (one colour per run)")
urls.set_page_param(OVERLAY_PARAM, ",".join(labels[p] for p in overlay) or None)

summary, panels = summary_of(selection.trace_path)
if selection.rank is not None:
    st.text(f"rank {selection.rank} (the sidebar's rank filter)")
elif "rank" in summary and summary["rank"].nunique() > 1:
    st.text(f"ranks {', '.join(map(str, sorted(summary['rank'].unique())))}: one line per inner step and rank")
derived = {name for text in (summary["derived"].unique() if "derived" in summary else ())  # a few distinct texts
           if isinstance(text, str) for name in text.split(", ") if name}
if derived:  # curves over fields the reader derived (tracer.formulas.derived): say so in their titles
    uses = {"mean_ratio": "ratio", "clip_fraction": "ratio", "mean_ref_kl_k3": "ref_kl_k3",
            "mean_approx_kl_k2": "approx_kl_k2"}
    panels = tuple((col, title + (" (derived)" if uses.get(col) in derived else "")) for col, title in panels)
    st.caption(f"{', '.join(sorted(derived))}: derived by the reader from the recorded logprobs (tracer.formulas).")
runs = {run_param(root, selection.trace_path): summary}
for path in overlay:
    other, other_panels = summary_of(path)
    if other_panels != panels:
        st.caption(f"{labels[path]} is a {trace_cache.open_trace(str(path)).algorithm} run: its curves differ; "
                   "not overlaid.")
        continue
    runs[labels[path]] = other
figure = step_curves_figure(runs if len(runs) > 1 else summary, panels)
event = st.plotly_chart(figure, width="stretch", on_select="rerun", selection_mode="points", key="step_curves")
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
    target = "app_pages/dpo.py" if trace.algorithm == "dpo" else "app_pages/step.py"
    st.switch_page(target, query_params={"run": run_label, "step": str(step), "inner": str(inner)})

with st.expander("Per-step table"):
    # a long run's table (10,000 rows x ~45 columns: ~3 MB to the browser) is sent when asked for
    if len(summary) <= figures.STEP_TABLE_ROWS or st.toggle(f"Show all {len(summary)} rows", key="step_table",
                                                help="the per-step summary of every step file, as a table"):
        st.dataframe(summary, hide_index=True, width="stretch")
