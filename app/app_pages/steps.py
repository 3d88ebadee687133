"""Steps: per-step curves over every step file of the run (masked means from the reader), one line
per inner step and rank; the sidebar's rank filter keeps one rank."""

import streamlit as st

from app.components import trace_cache
from app.components.figures import step_curves_figure
from app.components.sidebar import current_selection

selection = current_selection()
trace = trace_cache.open_trace(str(selection.trace_path))
keys = trace.steps()
st.title("Steps")
st.text(f"{selection.trace_path} · {trace.algorithm or 'unknown algorithm'} · {len(keys)} step files")
if not keys:
    st.info("This trace has no step files yet. Press Reload in the sidebar when the trainer has written one.")
    st.stop()

summary = trace_cache.step_summary(str(selection.trace_path), tuple(k.path.name for k in keys))
if selection.rank is not None:
    summary = summary[summary["rank"] == selection.rank].reset_index(drop=True)
    st.text(f"rank {selection.rank} (the sidebar's rank filter)")
elif summary["rank"].nunique() > 1:
    st.text(f"ranks {', '.join(map(str, sorted(summary['rank'].unique())))}: one line per inner step and rank")
st.plotly_chart(step_curves_figure(summary), width="stretch")
st.caption("Means over kept tokens (completion_mask), computed by tracer.reader.Trace.step_summary; "
           "clip fraction counts the clip only on the side the advantage's sign makes it bind.")
with st.expander("Per-step table"):
    st.dataframe(summary, hide_index=True, width="stretch")
