"""Mismatch: the inference engine's logprobs (``sampler_logprobs``, e.g. vLLM) against the trainer's
for the same tokens, token by token. Per step file: the ``sampler.mismatch`` verdict, histograms of
``trainer − sampler`` (log space) and ``|p_trainer − p_sampler|`` (probability space), the worst
tokens (selecting one opens it on the Tokens page), the mismatch against position in the completion
and against the token's entropy; the importance-sampling correction (the ``sampler.is_weights``
verdict, per token the raw ratio before any cap against the weight applied, the tokens or sequences
it truncated or masked, recorded or derived weights marked); per row the policy lag (the
``sampler.policy_lag`` verdict); over steps, the mean / max mismatch, the share the correction cut and
the mean lag."""

import hashlib

import streamlit as st

from app.components import mismatch, token_jump, trace_cache, urls
from app.components.health import FindingTarget
from app.components.sidebar import current_selection, run_param
from app.components.token_table import TOKEN_TEXT_HELP
from tracer.views.mismatch import correction_settings

_HANDLED_STATE = "_tracer_mismatch_handled"  # the worst-tokens selection already acted on

selection = current_selection()
trace_path = str(selection.trace_path)
trace = trace_cache.open_trace(trace_path)
st.title("Sampler vs trainer")
if selection.key is None:
    st.info("This trace has no step files yet. Press Reload in the sidebar when the trainer has written one.")
    st.stop()
key = selection.key
step_path, identity = str(key.path), trace_cache.file_id(key.path)
frame = mismatch.tokens(trace_path, step_path, identity)
if frame.empty:
    st.info("This step file has no sampler_logprobs (the logprobs an inference engine such as vLLM reported "
            "for the sampled tokens) next to old or policy logprobs: nothing to compare. A run sampled by "
            "TRL with use_vllm=True records them.")
    st.stop()

trainer = frame.attrs.get("trainer_field", "old_logprobs")
settings = correction_settings(trace_cache.step_metadata(trace_path, step_path, identity))
st.text(f"{key.label} · {len(frame)} kept tokens · trainer side: {trainer}")
st.text(mismatch.settings_text(settings))

found = trace_cache.findings(trace_path, (key.path.name,))
verdicts = found[found["check"] == "sampler.mismatch"]
for _, row in verdicts.iterrows():  # the message goes to st.text: it quotes settings, never Markdown
    severity = str(row["severity"])
    if severity == "error":
        st.error("sampler.mismatch: error — a systematic sampler/trainer mismatch.", icon=":material/error:")
    elif severity == "warning":
        st.warning("sampler.mismatch: warning — beyond the noise bounds.", icon=":material/warning:")
    else:
        st.success(f"sampler.mismatch: {severity} — noise-level differences.", icon=":material/check_circle:")
    st.text(str(row["message"]))

sequence_mode = bool(frame["raw_sequence_ratio"].notna().any())
cut_total = int(frame.drop_duplicates("sequence")["cut"].sum() if sequence_mode else frame["cut"].sum())
has_weights = bool(frame["is_weight"].notna().any())
has_lag = bool(frame["policy_lag"].notna().any())
# three a row, the unit said once above them: five in a row cut their values off at common window widths
st.caption("Log space: the trainer's minus the sampler's logprob of each kept token, in nats.")
log_space = st.columns(3)
log_space[0].metric("mean trainer − sampler", f"{frame['log_diff'].mean():+.4f}")
log_space[1].metric("mean |trainer − sampler|", f"{frame['abs_log_diff'].mean():.4f}")
log_space[2].metric("max |trainer − sampler|", f"{frame['abs_log_diff'].max():.4f}")
probability, cut, lag = st.columns(3)
probability.metric("mean |p_trainer − p_sampler|", f"{frame['prob_diff'].mean():.4f}")
unit = "sequences" if sequence_mode else "tokens"
units = frame["sequence"].nunique() if sequence_mode else len(frame)
cut.metric(f"{unit} cut by the IS correction", f"{cut_total} of {units}" if has_weights else "n/a")
rows_lag = frame.drop_duplicates("sequence")["policy_lag"]
lag.metric("policy lag (mean over rows)", f"{rows_lag.mean():.2f}" if has_lag else "n/a")

left, right = st.columns(2)
left.plotly_chart(mismatch.histogram_figure(frame["log_diff"], "log space: trainer − sampler", "nats"),
                  width="stretch")
right.plotly_chart(mismatch.histogram_figure(frame["prob_diff"], "probability space: |p_trainer − p_sampler|",
                                             "probability"), width="stretch")

st.subheader("Worst tokens")
st.caption("Largest |trainer − sampler| first. Select a row to open its sequence on the Tokens page with the "
           "token marked. token: position in the completion; sequence: row of the step file.")
worst = mismatch.worst_tokens(frame)
digest = hashlib.sha1(repr((trace_path, step_path)).encode()).hexdigest()[:12]
event = st.dataframe(worst, hide_index=True, width="stretch", on_select="rerun", selection_mode="single-row",
                     key=f"mismatch_worst_{digest}", column_config={
                         "token_text": st.column_config.TextColumn("token text", help=TOKEN_TEXT_HELP),
                         "log_diff": st.column_config.NumberColumn("trainer − sampler", format="%+.4f"),
                         "prob_diff": st.column_config.NumberColumn("|Δp|", format="%.4f"),
                         "raw_ratio": st.column_config.NumberColumn("raw ratio", format="%.4f"),
                         "is_weight": st.column_config.NumberColumn("weight applied", format="%.4f"),
                         "cut": st.column_config.CheckboxColumn("cut by the correction"),
                         "policy_lag": st.column_config.NumberColumn("policy lag", format="%d")})
rows = list(event.selection.rows)
if rows != st.session_state.get(_HANDLED_STATE):
    st.session_state[_HANDLED_STATE] = rows
    if rows:
        picked = worst.iloc[rows[0]]
        token_jump.request(FindingTarget(trace_path, step_path, int(picked["sequence"]), int(picked["token"]),
                                         "sampler.mismatch"))
        # the token in the URL as Health puts it there: a reload or a copied link marks it again
        params = urls.selection_params(run_param(selection.root, selection.trace_path), key, int(picked["sequence"]))
        st.switch_page("app_pages/tokens.py", query_params={**params, "token": str(int(picked["token"]))})

left, right = st.columns(2)
left.plotly_chart(mismatch.scatter_figure(frame, "token", "position in the completion", "against position"),
                  width="stretch")
right.plotly_chart(mismatch.scatter_figure(frame, "entropy", "policy entropy (nats)", "against entropy"),
                   width="stretch")

st.subheader("Importance-sampling correction")
for _, row in found[found["check"] == "sampler.is_weights"].iterrows():
    (st.error if str(row["severity"]) == "error" else st.success)(
        f"sampler.is_weights: {row['severity']}", icon=":material/error:" if str(row["severity"]) == "error"
        else ":material/check_circle:")
    st.text(str(row["message"]))
if has_weights:
    source = frame.attrs.get("weights_source")
    st.caption(f"Correction: {frame.attrs.get('correction') or 'settings not recorded'}. Weights "
               + ("as the trainer recorded them" if source == "recorded" else
                  "derived by tracer from old and sampler logprobs and the declared settings (the trainer records "
                  "none)") + f"; {cut_total} of {units} {unit} truncated or masked (red).")
    st.plotly_chart(mismatch.weights_figure(frame), width="stretch")
    cut_rows = mismatch.cut_tokens(frame)
    if not cut_rows.empty:
        st.caption("Tokens the correction truncated or masked: raw ratio before the cap, weight applied.")
        st.dataframe(cut_rows, hide_index=True, width="stretch", column_config={
            "token_text": st.column_config.TextColumn("token text", help=TOKEN_TEXT_HELP),
            "raw_ratio": st.column_config.NumberColumn("raw ratio", format="%.4f"),
            "is_weight": st.column_config.NumberColumn("weight applied", format="%.4f"),
            "cut": st.column_config.CheckboxColumn("cut by the correction")})
else:
    st.info("This step file records no importance-sampling weights (is_weights / sequence_is_weights / "
            "rollout_is_weights) and declares no correction (is_mode, or verl's rollout_is) to derive them from.")

st.subheader("Rows and policy lag")
for _, row in found[found["check"] == "sampler.policy_lag"].iterrows():
    (st.error if str(row["severity"]) == "error" else st.warning if str(row["severity"]) == "warning"
     else st.success)(f"sampler.policy_lag: {row['severity']}", icon=":material/schedule:")
    st.text(str(row["message"]))
if not has_lag:
    st.caption("No policy lag recorded (policy_version per row and metadata trainer_version): the rows are "
               "taken as sampled by the trainer's current policy.")
st.dataframe(mismatch.rows_table(frame), hide_index=True, width="stretch", column_config={
    "policy_lag": st.column_config.NumberColumn("policy lag (updates)", format="%d"),
    "raw_sequence_ratio": st.column_config.NumberColumn("raw sequence ratio", format="%.4f"),
    "is_weight": st.column_config.NumberColumn("weight applied (mean)", format="%.4f"),
    "cut": st.column_config.CheckboxColumn("cut by the correction")})

st.header("Over steps")
summary = mismatch.steps(trace_path, trace_cache.step_files(trace))
st.plotly_chart(mismatch.steps_figure(summary), width="stretch")
with st.expander("Per-step table"):
    st.dataframe(summary.drop(columns=["path"]), hide_index=True, width="stretch")
