"""Conversation: one sequence of one step as an episode, turn by turn: role labels, tool calls and
tool results as blocks of their own, trained tokens coloured by a chosen quantity, what was not
trained and why; one row per turn with the means over its trained tokens; a token opened in the
Tokens page's table. A single-turn sequence is an episode of one assistant turn."""

import streamlit as st

from app.components import trace_cache, urls
from app.components.coloured_text import legend_html
from app.components.conversation import (
    TURN_HEADERS, TURNS_PER_PAGE, chat_html, page_count, spans_frame, trained_positions, turn_display_frame,
    turns_on_page)
from app.components.sidebar import current_selection, run_param
from app.components.token_table import TOKEN_TEXT_HELP, visible_token, visible_tokens
from tracer.views.common import EMPTY_STEP, is_empty_step

COLOURS = ("ratio", "ref_kl_k3", "advantages", "abs_old_sampler", "approx_kl_k2", "entropy", "policy_logprobs",
           "old_logprobs", "sampler_logprobs", "per_token_loss")
HOVER = ("ratio", "ref_kl_k3", "approx_kl_k2", "abs_old_sampler", "advantages", "policy_logprobs", "old_logprobs",
         "sampler_logprobs", "entropy")

selection = current_selection()
st.title("Conversation")
if selection.key is None:
    st.info("This trace has no step files yet. Press Reload in the sidebar when the trainer has written one.")
    st.stop()
key = selection.key
fields = trace_cache.step_fields(str(selection.trace_path), str(key.path), trace_cache.file_id(key.path))
if selection.sequence is None or "completion_ids" not in fields:
    st.info(EMPTY_STEP if is_empty_step(fields) else
            "This step file has no completion_ids: no conversation to show (the Tokens page shows what it has).")
    st.stop()

episode = trace_cache.conversation(str(selection.trace_path), str(key.path), selection.sequence,
                                   trace_cache.file_id(key.path))
tokens = episode.tokens
reward = "not recorded" if episode.reward is None else f"{episode.reward:.4g}"
st.text(f"{key.label} · sequence {selection.sequence} · {episode.assistant_turns} assistant turn(s) · "
        f"{int(tokens['kept'].sum())} trained of {len(tokens)} positions · reward {reward}")
recorded = [f for f in ("turn_ids", "token_roles", "mask_reasons") if f in fields]
st.caption(("Turns, roles and reasons as recorded (" + ", ".join(recorded) + ")." if recorded else
            "No turn_ids / token_roles recorded: turns are read from the mask (each run of trained tokens after "
            "a masked gap opens a turn), the masked gaps between them shown as environment."))

values = [c for c in COLOURS if c in tokens and tokens.loc[tokens["kept"].astype(bool), c].notna().any()]
default = next((c for c in ("ratio", "ref_kl_k3", "advantages") if c in values and
                tokens.loc[tokens["kept"].astype(bool), c].nunique() > 1), values[0] if values else None)
colour_by = st.selectbox("Colour trained tokens by", values or [None], key="conversation_colour",
                         index=(values or [None]).index(urls.page_param("colour", values, default)),
                         format_func=lambda c: "—" if c is None else c,
                         help="diverging scale centred on 1 for the ratio, 0 for the others, one scale for the "
                              "whole episode; hover a token for its values and mask reason")
urls.set_page_param("colour", colour_by)

pages = page_count(episode)
page = 0
if pages > 1:
    options = list(range(1, pages + 1))
    chosen = st.selectbox(f"Turns ({TURNS_PER_PAGE} a page)", options, key="conversation_turns",
                          index=options.index(urls.page_param("turns", options, 1)),
                          format_func=lambda p: f"turns {(p - 1) * TURNS_PER_PAGE + 1}–"
                                                f"{min(p * TURNS_PER_PAGE, episode.assistant_turns)}")
    urls.set_page_param("turns", None if chosen == 1 else chosen)
    page = chosen - 1
foreign = episode.trained_not_written
if foreign:
    st.error(f"{sum(s.kept for s in foreign)} tokens of {len(foreign)} tool result / environment block(s) are in the "
             f"loss, though the model did not write them (first: turn {foreign[0].turn}, positions "
             f"{foreign[0].start}..{foreign[0].end - 1}). `tracer check` names it turns.tool_output_trained; the "
             "Health page lists the findings.", icon=":material/error:")
hover = [c for c in HOVER if c in tokens]
st.html(chat_html(episode, colour_by, hover, turns_on_page(episode, page)))
st.html(legend_html(colour_by, tokens))

st.subheader("Turns")
run = run_param(selection.root, selection.trace_path)
where = urls.selection_params(run, key, selection.sequence)
turns = turn_display_frame(episode)
turns.insert(0, "open", [urls.link("tokens", {**where, "token": p}) if p is not None and p == p else None
                         for p in turns.pop("first_trained").astype(object).where(turns["trained_tokens"] > 0, None)])
st.dataframe(turns, hide_index=True, width="stretch", key="conversation_turns_table", column_config={
    "open": st.column_config.LinkColumn("open", display_text="open", help="the turn's first trained token on the "
                                                                          "Tokens page"),
    **{c: st.column_config.NumberColumn(TURN_HEADERS[c], format="%.4g") for c in
       ("mean_ratio", "mean_ref_kl_k3", "mean_abs_old_sampler", "advantage", "reward") if c in turns},
    "trained_tokens": st.column_config.NumberColumn("trained", help="tokens of the turn in the loss"),
})
st.caption("Means over each turn's trained tokens only (the tokens the loss keeps"
           + (": here tool results too, the bug above" if foreign else "; tool results, prompt and padding are not") +
           "); the reward is the sequence's, shown on its last turn.")

st.subheader("Open a token in the token table")
positions = trained_positions(episode)
if positions:
    position = st.number_input("Position in the completion", min_value=0, max_value=len(tokens) - 1,
                               value=positions[0], step=1, key="conversation_token")
    row = tokens.iloc[int(position)]
    st.text(f"position {int(position)} · turn {int(row['turn'])} · {row['role'] or 'prompt'} · {row['mask_reason']} · "
            f"token {visible_token(row['token_text'])!r}")
    st.page_link("app_pages/tokens.py", label=f"Open position {int(position)} on the Tokens page",
                 icon=":material/table_rows:", query_params={**where, "token": str(int(position))})
with st.expander("Spans"):
    st.dataframe(visible_tokens(spans_frame(episode).rename(columns={"text": "token_text"})), hide_index=True,
                 width="stretch", column_config={"token_text": st.column_config.TextColumn("text", help=TOKEN_TEXT_HELP)})
