"""Diff: two traces under the root compared by ``tracer.diff`` (mask-aware, per-field tolerances):
the verdict, the first divergence, a per-field summary table, and one sequence of a step both
traces have side by side, differing tokens marked with both values and masked positions greyed."""

import streamlit as st

from app.components import trace_cache
from app.components.diff_view import common_steps, side_by_side_frame, style_side_by_side
from app.components.safe_trace import OUTSIDE
from app.components.sidebar import current_selection, discover_traces
from tracer.diff import DiffInputError
from tracer.diff.report import step_label
from tracer.errors import TraceError

selection = current_selection()
root = selection.root
st.title("Diff")
traces = discover_traces(root)
if len(traces) < 2:
    st.info("A diff needs two traces under the root; this root holds one. Start the app on a directory "
            "holding both traces (e.g. a baseline and a new run).")
    st.stop()


def _label(path):
    try:
        return str(path.relative_to(root)) if path != root else f"{path.name} (the root)"
    except ValueError:
        return str(path)


left, right = st.columns(2)
index_a = traces.index(selection.trace_path) if selection.trace_path in traces else 0
a = left.selectbox("a: reference (baseline, expected)", traces, index=index_a, format_func=_label, key="diff_a")
b = right.selectbox("b: candidate (actual)", traces, index=(index_a + 1) % len(traces), format_func=_label,
                    key="diff_b")
if a == b:
    st.info("Pick two different traces.")
    st.stop()

try:
    trace_a, trace_b = trace_cache.open_trace(str(a)), trace_cache.open_trace(str(b))
    for trace in (trace_a, trace_b):
        outside = [p for p, reason in trace.problems().items() if reason.startswith(OUTSIDE)]
        if outside:
            raise TraceError(f"{trace.path}: {len(outside)} step file(s) are links leaving the trace directory "
                             f"(first: {outside[0]}); refusing to diff it")
    report = trace_cache.diff_report(str(a), str(b), trace_cache.step_files(trace_a), trace_cache.step_files(trace_b))
except TraceError as err:
    kind = "These traces cannot be compared" if isinstance(err, DiffInputError) else "A trace cannot be read"
    st.error(f"{kind}; nothing was diffed.", icon=":material/error:")
    st.text(str(err))
    st.stop()

findings = report.findings()
if report.equal:
    st.success(f"equal within tolerance: {report.step_pairs} step pairs compared "
               f"({report.identical_by_checksum} identical by checksum).", icon=":material/check_circle:")
else:
    st.error(f"different: {len(findings)} finding(s) over {report.step_pairs} step pairs.", icon=":material/error:")
first = report.first_divergence
if first is not None:  # token text inside: plain text, never Markdown
    st.text(f"first divergence: {first[0]} at {first[1].where()} ({first[1].values()})")
if findings:
    st.code("\n".join(findings), language=None, wrap_lines=True)

st.subheader("Per-field summary")
st.dataframe(report.field_table(), hide_index=True, width="stretch", key="diff_fields", column_config={
    "max_abs_diff": st.column_config.NumberColumn(help="max |b - a| over compared positions = the smallest atol that passes"),
    "min_rtol": st.column_config.NumberColumn(help="the smallest rtol that passes at atol 0"),
    "first": st.column_config.TextColumn("first difference", help="step, sequence, token (text shown literally)")})
st.caption("Per-token fields are compared only where both traces keep the position (the field's mask); "
           "masks and ids exactly; floats within atol + rtol·|a|.")

st.header("Tokens side by side")
steps = common_steps(trace_a.steps(), trace_b.steps(), trace_a.path.is_file() and trace_b.path.is_file(),
                     selection.rank)
if not steps:
    st.info("The two traces share no step file" + (f" of rank {selection.rank}" if selection.rank is not None else "")
            + ".")
    st.stop()
default = steps.index(first[1].step) if first is not None and first[1].step in steps else 0
left, right = st.columns(2)
step = left.selectbox("Step (in both traces)", steps, index=default, format_func=step_label, key="diff_step")
key_a = next(k for k in trace_a.steps() if (k.step, k.inner_step, k.micro_batch, k.rank) == step)
key_b = trace_b.steps()[0] if trace_b.path.is_file() else next(
    k for k in trace_b.steps() if (k.step, k.inner_step, k.micro_batch, k.rank) == step)
try:
    seq_labels = trace_cache.sequence_labels(str(a), str(key_a.path), trace_cache.mtime_ns(key_a.path))
except TraceError as err:
    st.error("This step file of a cannot be read.", icon=":material/error:")
    st.text(str(err))
    st.stop()
if not seq_labels:
    st.info("This step file has no per-sequence field to show.")
    st.stop()
first_seq = first[1].sequence if first is not None and first[1].step == step else None
sequence = right.selectbox("Sequence", range(len(seq_labels)), format_func=seq_labels.__getitem__,
                           index=first_seq if first_seq is not None and first_seq < len(seq_labels) else 0,
                           key="diff_sequence")
try:
    table = trace_cache.token_diff(str(a), str(b), step, sequence,
                                   (trace_cache.mtime_ns(key_a.path), trace_cache.mtime_ns(key_b.path)))
except TraceError as err:
    st.error("The tokens of this step cannot be compared.", icon=":material/error:")
    st.text(str(err))
    st.stop()
if table.empty:
    st.info("This step has no completion tokens (DPO steps hold chosen / rejected pairs: see the summary above).")
    st.stop()
frame = side_by_side_frame(table)
differing = int((frame["differs"] != "").sum())
st.text(f"{step_label(step)} · sequence {sequence} · {differing} of {len(frame)} positions differ")
st.dataframe(style_side_by_side(frame, table), hide_index=True, width="stretch", height=480, key="diff_tokens",
             column_config={
                 "token_text_a": st.column_config.TextColumn("token a", help="shown literally"),
                 "token_text_b": st.column_config.TextColumn("token b", help="shown literally"),
                 "differs": st.column_config.TextColumn("differs", help="what differs beyond tolerance here")})
st.caption("Red cells: values that differ beyond the field's tolerance (both shown, a then b), token ids or "
           "masks that differ. Grey rows: positions not kept on both sides, where values are not compared.")
