"""Tokens: one sequence of one step, its prompt and completion as text, the token table with
masked positions greyed (and the token of a finding chosen on the Health page marked), and the
per-token values against position."""

import streamlit as st

from app.components import token_jump, trace_cache, urls
from app.components.coloured_text import MAX_COLOURED_TOKENS, coloured_html, legend_html
from app.components.figures import MAX_TOKEN_TICKS, token_values_figure
from app.components.sidebar import current_selection, stop_without_step_files
from app.components.token_table import (
    TOKEN_TEXT_HELP,
    VALUE_COLUMNS,
    WHITESPACE_NOTE,
    highlighted_rows,
    legend_frame,
    reason_counts,
    section_text,
    style_token_table,
    table_height,
    token_display_frame,
    value_column_config,
)
from tracer.read.tables import TOKEN_VALUE_FIELDS
from tracer.views.common import EMPTY_STEP, is_empty_step

KEY_VALUES = ("ratio", "advantages", "ref_kl_k3", "approx_kl_k2", "entropy", "values", "returns", "token_rewards",
              "per_token_loss", "policy_logprobs", "old_logprobs", "ref_logprobs", "sampler_logprobs")

selection = current_selection()
st.title("Tokens")
if selection.key is None:
    stop_without_step_files(trace_cache.open_trace(str(selection.trace_path)))
if selection.sequence is None:
    fields = trace_cache.step_fields(str(selection.trace_path), str(selection.key.path),
                                     trace_cache.file_id(selection.key.path))
    st.info(EMPTY_STEP if is_empty_step(fields) else
            "This step file has no per-sequence field (no completion_ids, prompt_ids or rewards) to show.")
    st.stop()

key = selection.key
table = trace_cache.token_table(str(selection.trace_path), str(key.path), selection.sequence,
                                trace_cache.file_id(key.path))
st.text(f"{key.label} · sequence {selection.sequence} · {key.path.name}")
if table.empty:
    fields = trace_cache.step_fields(str(selection.trace_path), str(key.path), trace_cache.file_id(key.path))
    if "chosen_ids" in fields:
        st.info("A DPO step holds chosen / rejected pairs rather than completions: the pair view shows their "
                "tokens side by side with policy and reference logprobs.")
        st.page_link("app_pages/dpo.py", label="Open the DPO pairs page", icon=":material/compare_arrows:")
    else:
        st.info("This step file has neither prompt_ids nor completion_ids: no tokens to show.")
    st.stop()

derived = table.attrs.get("derived", [])
values = [c for c in dict.fromkeys([*VALUE_COLUMNS, *TOKEN_VALUE_FIELDS]) if c in table and table[c].notna().any()]
if "section" in table and (table["section"] == "completion").any():
    st.subheader("Completion")
    kept_rows = table[table["mask_reason"] == "kept"]  # a quantity that varies over the kept tokens first
    preferred = sorted([c for c in ("ratio", "ref_kl_k3", "advantages") if c in values],
                       key=lambda c: kept_rows[c].nunique() <= 1) or values or [None]
    colour_by = st.selectbox("Colour tokens by", values or [None], key="colour_by",
                             index=(values or [None]).index(urls.page_param("colour", values, preferred[0])),
                             format_func=lambda c: "—" if c is None else c + (" (derived)" if c in derived else ""),
                             help="diverging scale centred on 1 for the ratio, 0 for the others, over the values "
                                  "the quantity can take (from 0 for k3, k2 and the ratio; up to 0 for logprobs); "
                                  "hover a token for all its values and its mask reason")
    urls.set_page_param("colour", colour_by)
    completion = int((table["section"] == "completion").sum())
    window = None
    if completion > MAX_COLOURED_TOKENS:
        marked = token_jump.highlight_for(selection.trace_path, key, selection.sequence)
        linked_at = urls.page_param("token", list(table["position"].unique()))
        at = marked.token if marked is not None else linked_at
        first = int(table.loc[table["section"] == "completion", "position"].min())
        default = max(0, min(int(at) - first - MAX_COLOURED_TOKENS // 2, completion - MAX_COLOURED_TOKENS)) \
            if at is not None else 0
        start = st.number_input("Colour from token", min_value=0, max_value=completion - 1, value=default,
                                step=MAX_COLOURED_TOKENS, key=f"colour_from_{key.path.name}_{selection.sequence}",
                                help=f"the coloured text shows {MAX_COLOURED_TOKENS:,} of the completion's tokens at "
                                     "a time, from this one (0 = the first; it opens around a marked token)")
        window = (int(start), min(int(start) + MAX_COLOURED_TOKENS, completion))
        st.caption(f"Tokens {window[0]:,}-{window[1] - 1:,} of {completion:,} coloured, on the scale of all of them "
                   f"(at most {MAX_COLOURED_TOKENS:,} at once: a browser draws more slowly); the plain text, the "
                   "token table and the chart below hold every token.")
    st.html(coloured_html(table, colour_by, values, window))
    st.html(legend_html(colour_by, table))
    with st.expander("Completion as plain text"):
        st.code(section_text(table, "completion"), language=None, wrap_lines=True)
if "section" in table and (table["section"] == "prompt").any():
    with st.expander("Prompt"):
        st.code(section_text(table, "prompt"), language=None, wrap_lines=True)
st.caption("A thin line ends each token; tokens with no colour alternate white and blue-grey. "
           "⟪N × reason⟫ stands for N filler tokens (prompt padding, padding, after EOS); "
           "the table below lists them one by one. Struck through: after EOS; dotted: padding; hatched: "
           f"masked for another reason. In the coloured text and the table, {WHITESPACE_NOTE}; hover a coloured "
           "token for its real string.")
if derived:
    st.caption(f"{', '.join(derived)}: derived by the reader from the recorded logprobs (tracer.formulas); "
               "the step file does not record them.")

st.subheader("Token table")
counts = reason_counts(table)
st.text(" · ".join(f"{reason}: {n}" for reason, n in counts.items()))
target = token_jump.highlight_for(selection.trace_path, key, selection.sequence)
# the token a link marks (token=, kept in the URL by Health and Mismatch): a reload marks it again
linked = urls.page_param("token", list(table["position"].unique()) if "position" in table else [])
if target is not None or linked is not None:
    left, right = st.columns([4, 1])
    # a check id and a number: no token text in Markdown
    left.caption(target.caption() if target is not None else f"marked by the link: token {linked}")
    if right.button("Clear highlight", key="clear_highlight"):
        token_jump.clear_highlight()
        urls.set_page_param("token", None)  # else a reload, or the copied link, marks it again
        st.rerun()
include_prompt = st.toggle("Show prompt rows", value=False, key="show_prompt", help="listed after the completion rows")
frame = token_display_frame(table, include_prompt=include_prompt)
url_token = urls.page_param("token", list(frame["position"].unique()) if "position" in frame else [])
highlight = target.token if target is not None else url_token
hits = frame.index[highlighted_rows(frame, highlight)]
config = {
    "token_text": st.column_config.TextColumn("token text",
                                              help=f"{TOKEN_TEXT_HELP}; hover a coloured token for its real string"),
    "mask_reason": st.column_config.TextColumn("mask_reason", help="why the position is (not) in the loss"),
    "section": st.column_config.TextColumn("section", width="small"),
    "position": st.column_config.NumberColumn("position", width="small"),
    "token_id": st.column_config.NumberColumn("token_id", width="small"),
    **value_column_config(values, derived),  # full labels, each column wide enough for its header
}
only_near = len(hits) and st.toggle("Only the marked token and its neighbours", value=True,
                                     help="off: every token of the sequence")
shown = frame.iloc[max(hits[0] - 3, 0): hits[0] + 4] if only_near else frame
if only_near:
    st.caption(f"Position {int(frame.loc[hits[0], 'position'])} (marked) with 3 neighbours each side.")
# Key columns first so that they stay on screen; the section and token id last.
order = ["position", "token_text", "mask_reason", *[c for c in KEY_VALUES if c in shown],
         *[c for c in shown.columns if c not in KEY_VALUES and c not in ("position", "token_text", "mask_reason",
                                                                        "section", "token_id")],
         *[c for c in ("section", "token_id") if c in shown]]
st.dataframe(style_token_table(shown, highlight=highlight), hide_index=True, width="stretch",
             height=table_height(len(shown)), key="token_table", column_config=config, column_order=order)
with st.expander("Legend: mask_reason (grey rows do not enter the loss)", expanded=False):
    st.dataframe(style_token_table(legend_frame()), hide_index=True, width="stretch")

st.subheader("Per-token values")
st.plotly_chart(token_values_figure(table), width="stretch")
st.caption("Grey bands: completion positions that do not enter the loss (completion_mask = False). Under the "
           f"axis, each token's text over its position (up to {MAX_TOKEN_TICKS} tokens; past that, positions, and "
           "the text in the hover).")
