"""PPO: the GAE picture of one rollout row (token_rewards, values, returns, advantages per token)
and the epochs x minibatches of its step (which ran, which stopped early on approx_kl_k2)."""

import streamlit as st

from app.components import trace_cache
from app.components.coloured_text import coloured_html
from app.components.ppo import (
    GAE_COLUMNS,
    early_stop_figure,
    early_stop_grid,
    gae_figure,
    gae_token_frame,
    style_minibatch_table,
)
from app.components.sidebar import current_selection
from app.components.token_table import TOKEN_TEXT_HELP, style_token_table

selection = current_selection()
trace = trace_cache.open_trace(str(selection.trace_path))
st.title("PPO: GAE and early stop")
if trace.algorithm not in ("ppo", None):
    st.info("This page shows PPO runs (per-token advantages from GAE, epochs and minibatches); the chosen "
            "run is not one. Its own view is in the navigation.")
    st.stop()
if selection.key is None:
    st.info("This trace has no step files yet. Press Reload in the sidebar when the trainer has written one.")
    st.stop()

trace_path, key = str(selection.trace_path), selection.key
files = trace_cache.step_files(trace)
step, epoch = key.step, key.inner_step
rows = trace_cache.rollout_rows(trace_path, step, epoch, files)
st.text(f"step {step} · epoch {epoch} (the sidebar's step file) · {len(rows)} rollout rows")

st.header("One sequence: where the reward lands, how the advantage flows back")
if not rows:
    st.info("No rollout row in this step and epoch.")
else:
    choice = st.selectbox(
        "Rollout row", range(len(rows)), key="rollout_row",
        format_func=lambda i: f"row {rows[i].row_id} · minibatch {rows[i].key.micro_batch} · "
                              f"rank {rows[i].key.rank} · row {rows[i].index} of its file",
        help="PPO files hold one minibatch each; row_ids map their rows back to the rollout batch")
    row = rows[choice]
    table = trace_cache.token_table(trace_path, str(row.key.path), row.index, trace_cache.file_id(row.key.path))
    st.text(f"shown from {row.key.label} · {row.key.path.name}, row {row.index}")
    if "section" in table and (table["section"] == "completion").any():
        # token by token, each boundary drawn (as on the Tokens page); hover: the token's GAE values
        st.html(coloured_html(table, None, [c for c in GAE_COLUMNS if c in table]))
    st.plotly_chart(gae_figure(table), width="stretch")
    st.caption("Bars: token_rewards (the sequence reward on the last kept token). Lines: values (critic), "
               "returns = advantages + values, advantages (GAE with the run's gamma and lam). "
               "Grey bands: positions that do not enter the loss.")
    st.dataframe(style_token_table(gae_token_frame(table)), hide_index=True, width="stretch",
                 column_config={"token_text": st.column_config.TextColumn("token text", help=TOKEN_TEXT_HELP)})

st.header(f"Epochs of step {step}: which ran before the early stop")
minibatches = trace_cache.ppo_minibatch_table(trace_path, step, files)
st.dataframe(early_stop_grid(minibatches), hide_index=True, width="stretch")
st.plotly_chart(early_stop_figure(minibatches), width="stretch")
st.caption("Each cell is one minibatch file. early stop: its metadata says early_stop = true (mean "
           "approx_kl_k2 over kept tokens above target_kl; MiniMind's train_ppo.py then does not apply that "
           "minibatch and ends the epochs); not run: after the early stop; no file: missing for another reason.")
with st.expander("Minibatch table"):
    st.dataframe(style_minibatch_table(minibatches), hide_index=True, width="stretch")
with st.expander("Early stops over all steps"):
    st.dataframe(trace_cache.ppo_early_stops(trace_path, files), hide_index=True, width="stretch")
