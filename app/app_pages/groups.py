"""Groups (GRPO / CISPO / RLOO): the G completions of one prompt side by side with reward, reward
components, group mean / std and advantage; zero-variance groups marked; their share over steps."""

import streamlit as st

from app.components import trace_cache
from app.components import urls
from app.components.groups import (
    advantage_rule_text, group_label, group_rewards_figure, style_group_table, zero_variance_figure)
from app.components.sidebar import current_selection
from tracer.errors import TraceError
from tracer.views import GROUPED_ALGORITHMS, group_std_estimator
from tracer.views.common import EMPTY_STEP
from tracer.views.group_std import POPULATION, UNBIASED, GroupStd, group_std, restate_std


@st.cache_data(max_entries=64, show_spinner=False)
def _run_std(trace_path: str, step_path: str, identity) -> GroupStd:
    """The std this step file's advantages were divided by (recorded, inferred, or why neither);
    ``identity`` (the file's id) makes a rewritten file a new entry."""
    trace = trace_cache.open_trace(trace_path)
    return group_std(trace, trace_cache.step_key(trace, step_path))


selection = current_selection()
trace = trace_cache.open_trace(str(selection.trace_path))
st.title("Groups")
if trace.algorithm is not None and trace.algorithm not in GROUPED_ALGORITHMS:
    st.info("This page shows group-based runs (GRPO, CISPO, RLOO: G completions per prompt); the chosen "
            "run is not one. Its own view is in the navigation.")
    st.stop()
if selection.key is None:
    st.info("This trace has no step files yet. Press Reload in the sidebar when the trainer has written one.")
    st.stop()

trace_path, key = str(selection.trace_path), selection.key
step_path, identity = str(key.path), trace_cache.file_id(key.path)
if "rewards" not in trace_cache.step_fields(trace_path, step_path, identity):
    st.info("This step file has no rewards field: a group view needs rewards [B].")
    st.stop()
try:
    groups = trace_cache.group_frame(trace_path, step_path, identity)
except TraceError as err:
    st.info("The groups of this step file cannot be told apart.")
    st.text(str(err))
    st.stop()
meta = trace_cache.step_metadata(trace_path, step_path, identity)
column = group_std_estimator(meta)  # the std the view's reward_std / group_std columns hold
run_std = _run_std(trace_path, step_path, identity)
# the columns and the band show the std the run divided by, where the trace tells it
shown = run_std.estimator if run_std.estimator in (POPULATION, UNBIASED) else column
if shown != column:
    groups = groups.assign(reward_std=[restate_std(s, n, column, shown) for s, n in zip(groups["reward_std"],
                                                                                       groups["size"])])
zero = int(groups["zero_variance"].sum())
st.text(f"{key.label} · {len(groups)} groups · {zero} with zero variance")
st.text(advantage_rule_text(trace.algorithm, meta, run_std.estimator, run_std.source, shown))
if zero:
    st.warning(f"{zero} of {len(groups)} groups have zero reward variance: every completion got the same "
               "reward, every advantage is 0, and the group adds no policy gradient.", icon=":material/warning:")


def _show_group(groups) -> None:
    labels = {g["group"]: group_label(g) for _, g in groups.iterrows()}
    # The group of the sidebar's sequence (a finding's, or a URL's ?seq=), unless ?group= names one.
    of_sequence = next((g["group"] for _, g in groups.iterrows()
                        if str(selection.sequence) in str(g["sequences"]).split()), None)
    default = urls.page_param("group", list(labels), of_sequence if of_sequence in labels else next(iter(labels)))
    if st.session_state.get("_tracer_group_for") != (step_path, selection.sequence) or \
            st.session_state.get("group") not in labels:  # a new step or sequence: its group
        st.session_state["_tracer_group_for"] = (step_path, selection.sequence)
        st.session_state["group"] = default
    group = st.selectbox("Group", list(labels), format_func=labels.__getitem__, key="group")
    urls.set_page_param("group", group)
    completions = trace_cache.group_completions(trace_path, step_path, group, identity)
    if shown != column:
        completions = completions.assign(group_std=[restate_std(s, len(completions), column, shown)
                                                    for s in completions["group_std"]])
    st.header(f"Group {group}: {len(completions)} completions")
    prompt = trace_cache.prompt_text(trace_path, step_path, int(completions["sequence"].iloc[0]), identity)
    if prompt:
        st.subheader("Prompt")
        st.code(prompt, language=None, wrap_lines=True)
    if bool(completions["zero_variance"].iloc[0]):
        st.warning("Zero-variance group: all rewards are equal, so every advantage is 0.", icon=":material/block:")
    st.dataframe(style_group_table(completions), hide_index=True, width="stretch", column_config={
        "completion_text": st.column_config.TextColumn("completion", help="token strings shown literally; padding "
                                                       "and positions after EOS left out", width="large"),
        "advantage": st.column_config.NumberColumn("advantage", help="as recorded by the trainer")})
    st.plotly_chart(group_rewards_figure(completions), width="stretch")
    st.caption("Bars: reward of each completion; dashed line: group mean, band: ± one group std; diamonds: "
               "recorded advantage (right axis). Pick a row in the sidebar's Sequence to read its tokens.")

    with st.expander(f"All {len(groups)} groups of this step file"):
        st.dataframe(style_group_table(groups), hide_index=True, width="stretch")


if groups.empty:
    st.info(f"{EMPTY_STEP} It has no groups.")
else:
    _show_group(groups)

st.header("Share of zero-variance groups over steps")
shares = trace_cache.zero_variance_shares(trace_path, trace_cache.listing_token(trace))
st.plotly_chart(zero_variance_figure(shares), width="stretch")
with st.expander("Per-step table"):
    st.dataframe(shares, hide_index=True, width="stretch")
