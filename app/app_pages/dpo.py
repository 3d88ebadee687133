"""DPO pairs: chosen and rejected tokens side by side with policy and reference logprobs and masks,
the per-side sums, logits, loss and implicit rewards; margin and preference accuracy over steps."""

import streamlit as st

from app.components import trace_cache
from app.components.dpo import dpo_curves_figure, pair_logprobs_figure, side_text, style_pair_table
from app.components.sidebar import current_selection
from app.components.token_table import TOKEN_TEXT_HELP

selection = current_selection()
trace = trace_cache.open_trace(str(selection.trace_path))
st.title("DPO pairs")
if trace.algorithm not in ("dpo", None):
    st.info("This page shows DPO runs (chosen / rejected pairs); the chosen run is not one. Its own view is "
            "in the navigation.")
    st.stop()
if selection.key is None or selection.sequence is None:
    st.info("This trace has no step files with pairs yet. Press Reload in the sidebar when the trainer has "
            "written one.")
    st.stop()

trace_path, key, pair = str(selection.trace_path), selection.key, selection.sequence
step_path, identity = str(key.path), trace_cache.file_id(key.path)
tokens = trace_cache.dpo_pair_tokens(trace_path, step_path, pair, identity)
if tokens.empty:
    st.info("This step file has no chosen_ids / rejected_ids.")
    st.stop()
terms = trace_cache.dpo_pair_terms(trace_path, step_path, pair, identity).set_index("quantity")
st.text(f"{key.label} · pair {pair} (the sidebar's Sequence) · {key.path.name}")

recorded = terms["recorded"]
columns = st.columns(5)
for column, name in zip(columns, ("dpo_logits", "dpo_loss", "chosen_rewards", "rejected_rewards", "margin")):
    value = recorded[name] if recorded[name] == recorded[name] else terms.loc[name, "recomputed"]
    column.metric(name, "—" if value != value else f"{value:.4g}")
st.caption("As recorded in the step file (recomputed from the per-token fields where the file lacks them).")
st.dataframe(terms.reset_index(), hide_index=True, width="stretch", column_config={
    "recorded": st.column_config.NumberColumn(format="%.6g", help="what the step file holds"),
    "recomputed": st.column_config.NumberColumn(
        format="%.6g", help="tracer.formulas on the recorded logprobs and masks, beta from the metadata")})

left, right = st.columns(2)
for column, side in ((left, "chosen"), (right, "rejected")):
    column.subheader(side.capitalize())
    column.code(side_text(tokens, side), language=None, wrap_lines=True)
st.caption("The kept tokens of each side (the mask's True positions): what the sums run over.")
st.dataframe(style_pair_table(tokens), hide_index=True, width="stretch", column_config={
    "chosen_token_text": st.column_config.TextColumn("chosen token", help=TOKEN_TEXT_HELP),
    "rejected_token_text": st.column_config.TextColumn("rejected token", help=TOKEN_TEXT_HELP)})
st.plotly_chart(pair_logprobs_figure(tokens), width="stretch")
st.caption("Grey: positions the side's mask drops (chosen_mask / rejected_mask = False).")

st.header("Margin and preference accuracy over steps")
summary = trace_cache.dpo_step_summary(trace_path, trace_cache.listing_token(trace))
st.plotly_chart(dpo_curves_figure(summary), width="stretch")
st.caption("margin: mean of chosen_rewards − rejected_rewards over the step's pairs; preference accuracy: "
           "share of pairs with chosen_rewards > rejected_rewards (a tie counts as wrong).")
with st.expander("Per-step table"):
    st.dataframe(summary, hide_index=True, width="stretch")
