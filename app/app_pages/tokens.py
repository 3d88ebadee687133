"""Tokens: one sequence of one step, its prompt and completion as text, the token table with
masked positions greyed (and the token of a finding chosen on the Health page marked), and the
per-token values against position."""

import streamlit as st

from app.components import token_jump, trace_cache
from app.components.figures import token_values_figure
from app.components.sidebar import current_selection
from tracer.views.common import EMPTY_STEP, is_empty_step
from app.components.token_table import (
    highlighted_rows, legend_frame, reason_counts, section_text, style_token_table, token_display_frame)

selection = current_selection()
st.title("Tokens")
if selection.key is None:
    st.info("This trace has no step files yet. Press Reload in the sidebar when the trainer has written one.")
    st.stop()
if selection.sequence is None:
    fields = trace_cache.step_fields(str(selection.trace_path), str(selection.key.path),
                                     trace_cache.mtime_ns(selection.key.path))
    st.info(EMPTY_STEP if is_empty_step(fields) else
            "This step file has no per-sequence field (no completion_ids, prompt_ids or rewards) to show.")
    st.stop()

key = selection.key
table = trace_cache.token_table(str(selection.trace_path), str(key.path), selection.sequence,
                                trace_cache.mtime_ns(key.path))
st.text(f"{key.label} · sequence {selection.sequence} · {key.path.name}")
if table.empty:
    fields = trace_cache.step_fields(str(selection.trace_path), str(key.path), trace_cache.mtime_ns(key.path))
    if "chosen_ids" in fields:
        st.info("A DPO step holds chosen / rejected pairs rather than completions: the pair view shows their "
                "tokens side by side with policy and reference logprobs.")
        st.page_link("app_pages/dpo.py", label="Open the DPO pairs page", icon=":material/compare_arrows:")
    else:
        st.info("This step file has neither prompt_ids nor completion_ids: no tokens to show.")
    st.stop()

if "section" in table and (table["section"] == "prompt").any():
    st.subheader("Prompt")
    st.code(section_text(table, "prompt"), language=None, wrap_lines=True)
if "section" in table and (table["section"] == "completion").any():
    st.subheader("Completion")
    st.code(section_text(table, "completion"), language=None, wrap_lines=True)
st.caption("⟪N × reason⟫ stands for N filler tokens (prompt padding, padding, after EOS); "
           "the table below lists them one by one.")

st.subheader("Token table")
counts = reason_counts(table)
st.text(" · ".join(f"{reason}: {n}" for reason, n in counts.items()))
target = token_jump.highlight_for(selection.trace_path, key, selection.sequence)
if target is not None:
    left, right = st.columns([4, 1])
    left.caption(target.caption())  # a check id and a number: no token text in Markdown
    if right.button("Clear highlight", key="clear_highlight"):
        token_jump.clear_highlight()
        st.rerun()
include_prompt = st.toggle("Show prompt rows", value=True)
frame = token_display_frame(table, include_prompt=include_prompt)
highlight = target.token if target is not None else None
hits = frame.index[highlighted_rows(frame, highlight)]
if len(hits):  # the marked row with 3 neighbours each side, for sequences longer than the table's height
    near = frame.iloc[max(hits[0] - 3, 0): hits[0] + 4]
    st.dataframe(style_token_table(near, highlight=highlight), hide_index=True, width="stretch",
                 key="finding_context")
st.dataframe(
    style_token_table(frame, highlight=highlight), hide_index=True, width="stretch", height=480, key="token_table",
    column_config={
        "token_text": st.column_config.TextColumn("token text", help="the token's string, shown literally"),
        "mask_reason": st.column_config.TextColumn("mask_reason", help="why the position is (not) in the loss"),
    },
)
with st.expander("Legend: mask_reason (grey rows do not enter the loss)", expanded=False):
    st.dataframe(style_token_table(legend_frame()), hide_index=True, width="stretch")

st.subheader("Per-token values")
st.plotly_chart(token_values_figure(table), width="stretch")
st.caption("Grey bands: completion positions that do not enter the loss (completion_mask = False).")
