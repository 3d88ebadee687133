"""Overview: manifest facts (algorithm, status, producers, hyperparameters, config) and the
fields of the chosen step file with their shape and dtype."""

import streamlit as st

from app.components import trace_cache
from app.components.overview import fields_table, key_value_frame, manifest_facts
from app.components.sidebar import current_selection

selection = current_selection()
trace = trace_cache.open_trace(str(selection.trace_path))
manifest = trace.manifest
st.title("Run overview")
st.text(str(selection.trace_path))

left, right = st.columns(2)
with left:
    st.subheader("Run")
    st.dataframe(manifest_facts(manifest, len(trace.steps())), hide_index=True, width="stretch")
    st.subheader("Producers")
    st.dataframe(key_value_frame(manifest.get("producers")), hide_index=True, width="stretch")
with right:
    st.subheader("Hyperparameters")
    st.dataframe(key_value_frame(manifest.get("hyperparameters"), describe=True), hide_index=True, width="stretch")
    st.subheader("Config")
    st.dataframe(key_value_frame(manifest.get("config")), hide_index=True, width="stretch")

if selection.key is not None:
    key = selection.key
    identity = trace_cache.file_id(key.path)
    st.subheader("Fields of the chosen step file")
    st.text(f"{key.label} · {key.path.name}")
    st.dataframe(fields_table(trace_cache.step_fields(str(selection.trace_path), str(key.path), identity),
                              trace.algorithm), hide_index=True, width="stretch")
    derived = trace.derived_fields(key)
    if derived:
        st.caption(f"Not recorded, derived by the reader from the recorded logprobs (tracer.formulas) wherever "
                   f"they show: {', '.join(derived)}.")
    st.subheader("Step metadata")
    st.dataframe(key_value_frame(trace_cache.step_metadata(str(selection.trace_path), str(key.path), identity),
                                 describe=True), hide_index=True, width="stretch")
