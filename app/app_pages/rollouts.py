"""Rollouts: every completion of every step file of the run, one row each (step, inner step, row,
group, reward and its components, length, advantage, mean ratio, k3, |old − sampler|, findings of
``tracer check``, text), filtered, searched, sorted over the whole run and sent to the browser one
page at a time. A row opens its tokens. The page's state lives in the URL
(:class:`app.components.rollouts.RolloutQuery`)."""

from dataclasses import replace
from pathlib import Path

import streamlit as st

from app.components import runs, trace_cache, urls
from app.components.rollouts import (
    COLUMN_HELP, FINDINGS, PAGE_SIZE, PARAMS, TOKENS_LINK, RolloutQuery, RolloutStore,
    display_rows, page_count, page_rows, pass_count, row_finding_counts, select_rollouts, shown_columns,
    size_text, summary_text, tokens_params)
from app.components.safe_trace import resolve_request
from app.components.sidebar import current_selection, hide_step_choosers, run_param, stop_without_step_files
from tracer.errors import TraceError
from tracer.read.rollouts import rollout_frame

_WRITTEN = "_tracer_rollouts_url"  # the page parameters this page last wrote into the URL
_FILTERS = "_tracer_rollouts_filters"  # the filters of the last run (a change goes back to page 1)
_HANDLED = "_tracer_rollouts_handled"  # the table selection already acted on
FILE_ORDER = "file order"
ROW_PIXELS, VISIBLE_ROWS = 35, 20  # the table's height: up to 20 rows in view, the page's others scroll


@st.cache_resource(show_spinner=False)
def _store() -> RolloutStore:
    """The process-wide store of rollout frames (one per run and listing, a few runs)."""
    return RolloutStore()


def _frame(trace, trace_path: str, listing: str):
    """The run's rollout frame, read once per run and listing (a progress bar while step files are read)."""
    key = (trace_path, listing, trace_cache.manifest_mtime(trace_path))
    frame = _store().get(key)
    if frame is None:
        bar = st.progress(0.0, text="Reading the rollouts…")

        def progress(done: int, total: int) -> None:
            bar.progress(done / max(total, 1), text=f"Reading the rollouts: step file {done:,} of {total:,}")

        frame = rollout_frame(trace, progress=progress)
        _store().put(key, frame)
        bar.empty()
    return frame


def _apply_url(sortable: list[str]) -> None:
    """Set the widgets from the URL's page parameters when they differ from what the page last
    wrote (a pasted link, the first run); before the widgets are drawn."""
    now = {name: st.query_params.get(name) for name in PARAMS}
    if now == st.session_state.get(_WRITTEN):
        return
    query = RolloutQuery.from_params({k: v for k, v in now.items() if v is not None})
    st.session_state.update(
        ro_search=query.search, ro_sort=query.sort if query.sort in sortable else FILE_ORDER,
        ro_descending=query.descending, ro_step_min=query.step_min, ro_step_max=query.step_max,
        ro_reward_min=query.reward_min, ro_reward_max=query.reward_max, ro_group=query.group,
        ro_flagged=query.flagged, ro_first_pass=query.first_pass, ro_page=query.page)
    st.session_state[_FILTERS] = (str(current_selection().trace_path), query.filters())


def _write_url(query: RolloutQuery) -> None:
    for name, value in query.to_params().items():
        urls.set_page_param(name, value)
    st.session_state[_WRITTEN] = {name: st.query_params.get(name) for name in PARAMS}


def _url_names_the_run(root, trace_path) -> bool:
    """Whether the URL's ``run=`` (when there is one) names the run the sidebar shows: False when
    the sidebar refused it (not a trace under the root, outside the root) and fell back on another run."""
    requested = st.query_params.get("run")
    if requested is None:
        return True
    try:
        return resolve_request(root, requested) == Path(trace_path).resolve()
    except TraceError:
        return False


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


hide_step_choosers()  # the page lists every step file and row: the Step file and Sequence choosers do nothing
selection = current_selection()
trace_path = str(selection.trace_path)
trace = trace_cache.open_trace(trace_path)
run_label = run_param(selection.root, selection.trace_path)
st.title("Rollouts")
if not _url_names_the_run(selection.root, selection.trace_path):
    # the sidebar said why it refused the URL's run=; another run's rows under that URL would mislead
    st.info("Pick a run in the sidebar, or list the one it shows now.")
    if st.button(f"List the rollouts of {run_label}", key="ro_open_shown_run"):  # the label: plain text
        st.query_params["run"] = run_label
        st.rerun()
    st.stop()
if trace.algorithm == "dpo":
    st.info("This page lists completions (PPO, GRPO, CISPO, RLOO); a DPO run has chosen / rejected pairs: "
            "see the DPO pairs page.")
    st.stop()
keys = trace.steps()
if not keys:
    stop_without_step_files(trace)
listing = trace_cache.listing_token(trace)
frame = _frame(trace, trace_path, listing)
# the files the listing set aside (header unreadable) and those the reader could not read meanwhile
unread = {**{path.name: why for path, why in trace.problems().items()}, **(frame.attrs.get("problems") or {})}
if unread:  # file names and reasons: plain text, never Markdown
    st.warning(f"{len(unread)} step file(s) could not be read: their rows are not listed; the others are.",
               icon=":material/warning:")
    with st.expander("Step files left out"):
        st.text("\n\n".join(f"{name}\n{why}" for name, why in unread.items()))

# -- findings of tracer check, per row ------------------------------------------------------------------
# One rule and one cache with the Runs page, the sidebar and the Health page: a run of at most
# step files within runs.MAX_CHECKED_BYTES is checked on its own, a larger one once the user asks.
files = tuple(k.path.name for k in keys)
cost = runs.check_cost(trace_path)
checked = runs.known_status(trace_path) is not None
if checked:
    findings = trace_cache.findings(trace_path, files)
    frame = frame.assign(**{FINDINGS: row_finding_counts(frame, findings)})
else:
    frame = frame.assign(**{FINDINGS: float("nan")})

sortable = [c for c in shown_columns(frame) if c != "text" and (c != FINDINGS or checked)]
_apply_url(sortable)
if st.session_state.get("ro_sort") not in (FILE_ORDER, *sortable):  # a column of the run shown before
    st.session_state.ro_sort = FILE_ORDER

# -- filters, search, sort -------------------------------------------------------------------------------
st.text_input("Search the text", key="ro_search", placeholder="a word or phrase of the completions (any case)",
              help="rows whose decoded completion text contains this text, ignoring case (literal, not a pattern)")
c1, c2, c3, c4, c5, c6 = st.columns([2, 1, 1, 1, 1, 1])
c1.selectbox("Sort by", [FILE_ORDER, *sortable], key="ro_sort",
             help="sorts every row of the run (a click on a column header sorts only the page shown)")
c2.toggle("Descending", key="ro_descending")
c3.number_input("Step from", value=None, step=1, key="ro_step_min")
c4.number_input("Step to", value=None, step=1, key="ro_step_max")
c5.number_input("Reward from", value=None, format="%g", key="ro_reward_min")
c6.number_input("Reward to", value=None, format="%g", key="ro_reward_max")
g1, g2, g4, g3 = st.columns([1, 2, 2, 3])
groups_recorded = "group" in frame and bool((frame["group"] >= 0).any())
g1.number_input("Group", value=None, step=1, key="ro_group", disabled=not groups_recorded,
                help="only the completions of this group id")
g2.toggle("Only rows with findings", key="ro_flagged", disabled=not checked,
          help="rows where tracer check names an error or a warning")
passes = pass_count(frame)
g4.toggle("First pass only", key="ro_first_pass", disabled=passes <= 1,
          help=(f"rows of the first inner step only: this run trains on each batch of rollouts {passes} times "
                "(PPO epochs / GRPO iterations) and records its completions at every inner step" if passes > 1 else
                "this run records one inner step: each completion is listed once already"))
if not checked:
    g3.caption(f"Findings: not checked. tracer check reads every step file: this run has {cost.files:,} "
               f"({size_text(cost.bytes)}); {runs.budget_text()}.")
    if g3.button(f"Run tracer check on {len(files):,} step files", icon=":material/health_and_safety:"):
        runs.request_check(trace_path)
        st.rerun()

state = st.session_state
query = RolloutQuery(
    sort=None if state.ro_sort == FILE_ORDER else state.ro_sort, descending=bool(state.ro_descending),
    search=state.ro_search or "", step_min=_optional_int(state.ro_step_min),
    step_max=_optional_int(state.ro_step_max), reward_min=state.ro_reward_min, reward_max=state.ro_reward_max,
    group=_optional_int(state.ro_group), flagged=bool(state.ro_flagged) and checked,
    first_pass=bool(state.get("ro_first_pass")) and passes > 1, page=int(state.get("ro_page") or 1))
if (trace_path, query.filters()) != state.get(_FILTERS):  # other rows (or another run): back to page 1
    state[_FILTERS] = (trace_path, query.filters())
    state.ro_page = 1
    query = replace(query, page=1)
shown = select_rollouts(frame, query)
pages = page_count(len(shown))
rows, page = page_rows(shown, query.page)
if page != query.page:
    state.ro_page = page
query = replace(query, page=page)
_write_url(query)

# -- the table -------------------------------------------------------------------------------------------
columns = shown_columns(frame)
table = display_rows(rows, columns, run_label, checked)
st.text(summary_text(len(shown), len(frame), page, pages))
if passes > 1 and not query.first_pass:
    st.caption(f"Each completion is listed once per inner step ({passes} inner steps): "
               "“First pass only” lists each once.")
event = st.dataframe(
    table, hide_index=True, width="stretch", on_select="rerun", selection_mode="single-row",
    height=ROW_PIXELS * (min(len(table), VISIBLE_ROWS) + 1) + 3,
    key=f"ro_table_{page}_{hash(query)}",
    column_config={
        **{name: st.column_config.Column(help=text) for name, text in COLUMN_HELP.items() if name in table},
        "inner_step": st.column_config.NumberColumn("inner", help=COLUMN_HELP["inner_step"]),
        "micro_batch": st.column_config.NumberColumn("mb", help=COLUMN_HELP["micro_batch"]),
        "text": st.column_config.TextColumn("text", width="large", help=COLUMN_HELP["text"]),
        TOKENS_LINK: st.column_config.LinkColumn("tokens", display_text="open", help="open this row on the Tokens page"),
    })
st.columns([1, 3])[0].number_input(f"Page (of {pages:,}, {PAGE_SIZE} rows each)", min_value=1, max_value=pages,
                                   step=1, key="ro_page")
st.caption("Select a row (the box at its left) to open its tokens here, or follow its link. Text: token strings "
           "of the kept completion tokens joined without a mark between them, possibly truncated; the search "
           "reads that text. Where one token ends: the row's tokens on the Tokens page.")

picked = list(event.selection.rows)
if picked != state.get(_HANDLED):
    state[_HANDLED] = picked
    if picked:
        row = rows.iloc[picked[0]]
        st.switch_page("app_pages/tokens.py", query_params=tokens_params(run_label, row))
