"""Step: every completion token of the chosen step (all sequences; every micro-batch and rank of
the step and inner step, or the sidebar's rank) in one table sorted and filtered by a per-token
quantity, each row linking to its sequence on the Tokens page; a sequence x position heatmap of
the quantity and histograms of ratio, k3, sampler mismatch and advantage."""

import streamlit as st

from app.components import trace_cache, urls
from app.components.sidebar import current_selection, run_param
from app.components.step_view import (
    ORDERS,
    filter_sort,
    heatmap_figure,
    histograms_figure,
    label,
    page_of,
    short_label,
)
from app.components.token_table import TOKEN_TEXT_HELP, table_height, visible_tokens
from tracer.views.common import hyperparameter
from tracer.views.step import neutral, present_quantities

PAGE_SIZE = 200

selection = current_selection()
trace = trace_cache.open_trace(str(selection.trace_path))
st.title("Step")
if selection.key is None:
    st.info("This trace has no step files yet. Press Reload in the sidebar when the trainer has written one.")
    st.stop()

key = selection.key
trace_path = str(selection.trace_path)
frame = trace_cache.step_tokens(trace_path, key.step, key.inner_step, selection.rank,
                                trace_cache.step_file_ids(trace, key.step, key.inner_step, selection.rank))
files = frame.attrs.get("files", [])
ranks = "all ranks" if selection.rank is None else f"rank {selection.rank}"
kept = int(frame["kept"].sum()) if "kept" in frame else 0
st.text(f"step {key.step} · inner {key.inner_step} · {len(files)} step file(s), {ranks} · "
        f"{frame[['rank', 'micro_batch', 'sequence']].drop_duplicates().shape[0] if len(frame) else 0} sequences · "
        f"{kept} kept of {len(frame)} completion positions")
quantities = present_quantities(frame)
if frame.empty or not quantities:
    st.info("This step has no completion tokens with per-token values (a DPO step holds chosen / rejected "
            "pairs: see the DPO pairs page).")
    st.stop()
derived = frame.attrs.get("derived", [])
if derived:
    st.caption(f"{', '.join(derived)}: derived by the reader from the recorded logprobs (tracer.formulas); "
               "the step files do not record them.")

# inner step 0 (fresh rollouts): policy = old, so the KL to the reference is the first thing to look at
preferred = ["abs_policy_old", "ratio"] if key.inner_step > 0 else ["ref_kl_k3", "advantages"]
default = next((q for q in preferred if q in quantities), quantities[0])
quantity = st.selectbox("Quantity", quantities, key="step_quantity",
                        index=quantities.index(urls.page_param("q", quantities, default)),
                        format_func=lambda q: label(q, derived),
                        help="sorts the table, colours the heatmap; neutral value 1 for the ratio, 0 for the others")
urls.set_page_param("q", quantity)

st.header("Tokens of the step")
left, middle, right = st.columns([2, 2, 1])
order = left.radio("Order", ORDERS, horizontal=True, key="step_order")
threshold = middle.number_input(f"only |value − {neutral(quantity):g}| ≥", min_value=0.0, value=0.0,
                                format="%.4g", key="step_threshold")
kept_only = right.toggle("kept tokens only", value=True, key="step_kept_only",
                         help="off: masked positions too (their values do not enter the loss)")
rows = filter_sort(frame, quantity, order, kept_only, threshold)
pages = max(1, -(-len(rows) // PAGE_SIZE))
page = st.columns(4)[0].number_input(f"page (of {pages}, {PAGE_SIZE} tokens each)", min_value=1, max_value=pages,
                                     value=1, key=f"step_page_{quantity}_{order}_{threshold}_{kept_only}") - 1
shown = page_of(rows, page, PAGE_SIZE).copy()
run = run_param(selection.root, selection.trace_path)
shown.insert(0, "open", [urls.link("tokens", {"run": run, "step": key.step, "inner": key.inner_step, "mb": mb,
                                              "rank": r, "seq": s, "token": p})
                         for r, mb, s, p in zip(shown["rank"], shown["micro_batch"], shown["sequence"], shown["position"])])
columns = ["open", "rank", "micro_batch", "sequence", "position", "token_text", "mask_reason",
           *[q for q in quantities if q != quantity and q in shown]]
columns.insert(6, quantity)
st.text(f"{len(rows)} tokens match; showing {len(shown)} ({order}, by {quantity})")
st.dataframe(visible_tokens(shown[columns]), hide_index=True, width="stretch", height=table_height(len(shown), 11),
             key="step_table", column_config={
    "open": st.column_config.LinkColumn("open", display_text="open", help="this token's sequence on the Tokens page"),
    "token_text": st.column_config.TextColumn("token text", help=TOKEN_TEXT_HELP),
    "micro_batch": st.column_config.NumberColumn("mb", width="small"),
    "rank": st.column_config.NumberColumn("rank", width="small"),
    "sequence": st.column_config.NumberColumn("seq", width="small"),
    "position": st.column_config.NumberColumn("pos", width="small"),
    **{q: st.column_config.NumberColumn(short_label(q, derived), format="%.4g", help=label(q, derived))
       for q in quantities},
})
st.caption("Sorted over the whole step; click a column header to sort this page. seq: row within its "
           "step file (rank, mb); pos: index in the completion" + ("; *: derived by the reader." if derived else "."))

st.header(f"Sequence × position: {label(quantity, derived)}")
st.plotly_chart(heatmap_figure(frame, quantity, derived), width="stretch", key="step_heatmap")
st.caption(f"Grey: masked positions (not in the loss); blank: positions a row does not have. Diverging scale "
           f"centred on {neutral(quantity):g} (white); "
           "long steps are binned, each bin showing its value farthest from the centre." +
           (" T1, T2…: where each assistant turn of a row starts (hover: its positions and roles; the grey cells "
            "inside a turn are its tool results and other masked tokens)."
            if "turn" in frame and len(frame) and frame["turn"].max() > 1 else ""))

st.header("Histograms over the kept tokens")
meta = trace_cache.step_metadata(trace_path, str(key.path), trace_cache.file_id(key.path))
low, high = hyperparameter(trace, meta, "clip_epsilon_low"), hyperparameter(trace, meta, "clip_epsilon_high")
clip = (1 - low, 1 + high) if low is not None and high is not None else None
st.plotly_chart(histograms_figure(frame, clip, derived), width="stretch", key="step_histograms")
if clip is not None:
    st.caption(f"Green band: the clip range [{clip[0]:g}, {clip[1]:g}] (1 − ε_low, 1 + ε_high). Dotted: neutral value.")
