"""Entry of the web UI: the shared sidebar and the navigation; the pages live in app_pages/.

    streamlit run app/streamlit_app.py -- --root DIR      (or TRACER_ROOT=DIR, default sample_traces/)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import streamlit as st

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `streamlit run` puts app/ on sys.path, not the repository root
    sys.path.insert(0, str(_REPO))

from app.components import trace_cache, urls  # noqa: E402
from app.components.navigation import (  # noqa: E402
    PAGES, RUN_FREE_PAGES, RUNS_PAGE, hidden_pages_note, not_offered_reason, pages_for)
from app.components.not_offered import not_offered_page  # noqa: E402
from app.components.sidebar import (  # noqa: E402
    keep_choices, no_trace_message, render_sidebar, render_sidebar_header, resolve_root, store_selection)
from tracer.errors import TraceError  # noqa: E402

# A local icon: otherwise the browser tab shows the page's Material icon, fetched from fonts.gstatic.com
# (the app makes no request beyond 127.0.0.1).
st.set_page_config(page_title="tracer", page_icon=str(_REPO / "app" / "assets" / "icon.png"), layout="wide")

trace_cache.freeze_startup_objects()  # once per process (cheaper full garbage collections on big runs)
root = resolve_root(sys.argv[1:], os.environ)
hidden_slot = st.sidebar.container()  # first in the sidebar: right under the page list
traces = render_sidebar_header(root)
choosers = st.sidebar.empty()  # the run choosers: emptied on a page where they have no effect
selection = render_sidebar(root, traces, choosers)
if selection is None:
    st.title("No trace to open")
    st.warning(no_trace_message(root))
    st.stop()
store_selection(selection)


def cannot_open(error: str):
    """A run's page when the sidebar's run is not a readable trace (the Runs page still lists every run)."""
    def page() -> None:
        st.title("Cannot open this run")
        st.error("The chosen run is not a readable trace. Pick another run in the sidebar, or fix the file "
                 "named below and press Reload.", icon=":material/error:")
        st.text(error)
    return page


runs_page = st.Page(RUNS_PAGE.path, title=RUNS_PAGE.title, icon=RUNS_PAGE.icon, default=True)
if selection.error is not None:
    algorithm, recorded, offered = None, None, []
    page = st.navigation([runs_page, *[st.Page(cannot_open(selection.error), title=spec.title, icon=spec.icon,
                                               url_path=spec.url_path, visibility="hidden") for spec in PAGES]])
else:
    trace = trace_cache.open_trace(str(selection.trace_path))
    table = trace.step_table()  # the first step file's key only, not one per step file
    first_and_selected = [k for k in ([table.key(0)] if len(table) else []) + [selection.key] if k is not None]
    algorithm, recorded = trace.algorithm, trace_cache.recorded_fields(str(selection.trace_path), first_and_selected)
    offered = pages_for(algorithm, recorded)
    page = st.navigation([runs_page, *[st.Page(spec.path, title=spec.title, icon=spec.icon, url_path=spec.url_path)
                                       for spec in offered],
                          # a link to a page this run is not offered (/groups of a PPO run) says why, and links on
                          *[st.Page(not_offered_page(spec, not_offered_reason(spec, algorithm, recorded), offered),
                                    title=spec.title, icon=spec.icon, url_path=spec.url_path, visibility="hidden")
                            for spec in PAGES if spec not in offered]])
urls.drop_other_pages_params(page.url_path)
# Runs lists every run and Diff picks its own two: the sidebar's run choosers have no effect there
run_free = page.url_path in RUN_FREE_PAGES or page.url_path == runs_page.url_path
if run_free:  # drawn, then taken away: the next page gets the choice back
    choosers.empty()
    keep_choices()
# (not on a page without the run choosers: "this run" would name a run the sidebar no longer shows)
note = hidden_pages_note(algorithm, recorded) if selection.error is None and not run_free else None
if note:  # once, collapsed, under the page list (not a note on every page)
    with hidden_slot.expander(f"{len(PAGES) - len(offered)} page(s) not offered for this run",
                              icon=":material/visibility_off:"):
        st.text(note)
try:
    page.run()
except TraceError as err:  # a step file whose header opened but whose data cannot be used
    st.error("This view could not read a step file of the run; the other step files and pages still work. "
             "Pick another step in the sidebar, or fix the file named below and press Reload.",
             icon=":material/error:")
    st.text(str(err))
