"""Diff: two traces under the root compared by ``tracer.diff`` (verified checksums, mask-aware,
token-aligned, per-field tolerances): the verdict and the cause (the most upstream diverging field
at the earliest step) with what follows from it, a per-field summary table, the fields and
tolerances to compare (those ``tracer diff`` takes, with the equivalent command), and one sequence of
a step both traces have side by side, differing tokens marked with both values and positions that
are not compared greyed. Opens on the pair the URL names (``?a=RUN&b=RUN``, runs as ``run=`` names
them), else on a declared pair (a trace whose manifest names its ``diff_baseline``, like the bundled
``grpo-diff-*`` pair), else on a pair that can be compared; the pair chosen is written back to the
URL. The sidebar's run choosers are hidden here: the page names the two runs it compares."""

import streamlit as st

from app.components import trace_cache, urls
from app.components.diff_view import (cli_command, common_steps, declared_baseline, default_pair,
                                      side_by_side_frame, split_tolerances, style_side_by_side)
from app.components.safe_trace import OUTSIDE
from app.components.sidebar import current_selection, discover_traces, run_param
from app.components.token_table import TOKEN_TEXT_HELP
from tracer.diff import DiffInputError, parse_tolerances, step_label
from tracer.diff.causes import headline
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


def _baselines() -> dict:
    out = {}
    for path in traces:
        try:
            base = declared_baseline(path, trace_cache.open_trace(str(path)).manifest, traces)
        except TraceError:
            continue
        if base is not None:
            out[path] = base
    return out


baselines = _baselines()
index_a, index_b = default_pair(traces, selection.trace_path, baselines,
                                lambda x, y: trace_cache.comparable(str(x), str(y)))
names = [run_param(root, path) for path in traces]  # as ?a= and ?b= name them
for param, side in (("a", 0), ("b", 1)):
    wanted = urls.page_param(param, names)
    if wanted is not None:
        index_a, index_b = (names.index(wanted), index_b) if side == 0 else (index_a, names.index(wanted))
    elif param in st.query_params:  # shown until another trace is chosen (the choice rewrites the URL)
        st.warning(f"The URL's {param}= names no trace under the root; showing another trace as {param} "
                   "(named below the choosers).", icon=":material/warning:")
        st.text(f"{param}={st.query_params[param]}")  # the URL's text: plain text, never Markdown
left, right = st.columns(2)
a = left.selectbox("a: reference (baseline, expected)", traces, index=index_a, format_func=_label, key="diff_a")
b = right.selectbox("b: candidate (actual)", traces, index=index_b, format_func=_label, key="diff_b")
urls.set_page_param("a", names[traces.index(a)])
urls.set_page_param("b", names[traces.index(b)])
st.text(f"Comparing a = {_label(a)} with b = {_label(b)}.")  # run names: plain text, never Markdown
st.caption("The pair is in the URL (a=, b=); the sidebar's run, step file and sequence do not apply on this page.")
if a == b:
    st.info("Pick two different traces.")
    st.stop()
if baselines.get(b) == a:  # a declared pair: say what the variant changed (text from the manifest: plain text)
    change = (trace_cache.open_trace(str(b)).manifest.get("config") or {}).get("diff_change")
    st.text(f"{_label(b)} is a variant of {_label(a)}" + (f": {change}" if isinstance(change, str) else ""))

try:
    trace_a, trace_b = trace_cache.open_trace(str(a)), trace_cache.open_trace(str(b))
    for trace in (trace_a, trace_b):
        outside = [p for p, reason in trace.problems().items() if reason.startswith(OUTSIDE)]
        if outside:
            raise TraceError(f"{trace.path}: {len(outside)} step file(s) are links leaving the trace directory "
                             f"(first: {outside[0]}); refusing to diff it")
    names = sorted({n for t in (trace_a, trace_b) for k in t.steps()[:1] for n in t.fields(k)})
except TraceError as err:
    st.error("A trace cannot be read; nothing was diffed.", icon=":material/error:")
    st.text(str(err))
    st.stop()

with st.expander("Fields and tolerances (what `tracer diff` takes)", expanded=True):
    fields = st.multiselect("Compare only these fields (none chosen: every field)", names, key="diff_fields_pick",
                            help="--fields; masks and ids are still read to choose the positions compared")
    left, right = st.columns(2)
    atol_text = left.text_input("atol", key="diff_atol", placeholder="1e-4, ratio=1e-3",
                                help="--atol: NUMBER for every float field, FIELD=NUMBER for one; comma-separated")
    rtol_text = right.text_input("rtol", key="diff_rtol", placeholder="rewards=1e-2",
                                 help="--rtol (relative to |a|): NUMBER or FIELD=NUMBER; comma-separated")
    atol_items, rtol_items = split_tolerances(atol_text), split_tolerances(rtol_text)
    st.code(cli_command(a, b, fields, atol_items, rtol_items), language="bash", wrap_lines=True)

try:
    atol, rtol = parse_tolerances(atol_items, "atol"), parse_tolerances(rtol_items, "rtol")
except TraceError as err:
    st.error("A tolerance cannot be read; nothing was diffed.", icon=":material/error:")
    st.text(str(err))
    st.stop()
try:
    report = trace_cache.diff_report(str(a), str(b), trace_cache.step_files(trace_a), trace_cache.step_files(trace_b),
                                     tuple(fields) or None, tuple(sorted(atol.items())), tuple(sorted(rtol.items())))
except TraceError as err:
    kind = "These traces cannot be compared" if isinstance(err, DiffInputError) else "A trace cannot be read"
    st.error(f"{kind}; nothing was diffed.", icon=":material/error:")
    st.text(str(err))
    st.stop()

findings = report.findings()
if report.equal:
    st.success(f"equal within tolerance: {report.step_pairs} step pairs compared "
               f"({report.identical_by_checksum} identical, {report.verified_files} files verified by checksum).",
               icon=":material/check_circle:")
else:
    st.error(f"different: {len(findings)} finding(s) over {report.step_pairs} step pairs.", icon=":material/error:")
first = report.first_divergence
if report.cause is not None:  # field names and token text inside: plain text, never Markdown
    update = report.update_cause  # every input of an update equal, the next policy not: the update is the cause
    if update is not None:
        st.text(f"cause: {headline(report)}")
    if first:
        st.text(f"first divergence: {first[0]} at {first[1].where()} ({first[1].values()})")
    elif update is None:
        st.text(f"cause: {headline(report)}")
    follows = [f.name for f in report.downstream]
    if follows:
        st.text(f"follows from {update.name() if update is not None else report.cause.name}: {', '.join(follows)}")
for tokens in report.token_alignment.values():
    if tokens.differing_tokens or tokens.prompt_rows_differing:
        st.text(tokens.summary())
if findings:
    with st.expander("The report as `tracer diff` prints it"):
        st.code(report.format(), language=None, wrap_lines=True)
        st.code(report.format(verbose=True), language=None, wrap_lines=True)

st.subheader("Per-field summary")
st.dataframe(report.field_table(), hide_index=True, width="stretch", key="diff_fields", column_config={
    "role": st.column_config.TextColumn(help="cause: the most upstream diverging field at the earliest step; "
                                             "follows: diverges downstream of it or later"),
    "max_abs_diff": st.column_config.NumberColumn(help="max |b - a| over compared positions = the smallest atol that passes"),
    "min_rtol": st.column_config.NumberColumn(help="the smallest rtol that passes at atol 0"),
    "first": st.column_config.TextColumn("first difference", help="step, sequence, token (text shown literally)")})
st.caption("Every step file is verified against its recorded checksum first. Per-token fields are compared "
           "only where both traces keep the position (the field's mask) and, for logprobs and what is computed "
           "from them, only where the prompt and the tokens so far agree; masks and ids exactly; floats within "
           "atol + rtol·|a|.")

st.header("Tokens side by side")
steps = common_steps(trace_a.steps(), trace_b.steps(), trace_a.path.is_file() and trace_b.path.is_file())
if not steps:
    st.info("The two traces share no step file.")
    st.stop()
default = steps.index(first[1].step) if first is not None and first[1].step in steps else 0
left, right = st.columns(2)
step = left.selectbox("Step (in both traces)", steps, index=default, format_func=step_label, key="diff_step")
key_a = next(k for k in trace_a.steps() if (k.step, k.inner_step, k.micro_batch, k.rank) == step)
key_b = trace_b.steps()[0] if trace_b.path.is_file() else next(
    k for k in trace_b.steps() if (k.step, k.inner_step, k.micro_batch, k.rank) == step)
try:
    seq_labels = trace_cache.sequence_labels(str(a), str(key_a.path), trace_cache.file_id(key_a.path))
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
                                   (trace_cache.file_id(key_a.path), trace_cache.file_id(key_b.path)))
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
                 "token_text_a": st.column_config.TextColumn("token a", help=TOKEN_TEXT_HELP),
                 "token_text_b": st.column_config.TextColumn("token b", help=TOKEN_TEXT_HELP),
                 "differs": st.column_config.TextColumn("differs", help="what differs beyond tolerance here")})
st.caption("Red cells: values that differ beyond the field's tolerance (both shown, a then b), token ids or "
           "masks that differ. Grey rows: positions whose values are not compared (not kept on both sides, or "
           "after a token or prompt that differs).")
