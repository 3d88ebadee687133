"""The web UI as a Streamlit ASGI app (``st.App``) whose start-up imports what a run's first page
draws, while the browser is still loading Streamlit's own code.

    streamlit run app/server.py -- --root DIR      (serves app/streamlit_app.py, as `streamlit run` of it does)

Streamlit runs the entry script (:mod:`app.streamlit_app`) only when a browser session connects; its
first run then imports pandas, the pandas Styler (jinja2), pyarrow and Plotly's figure classes and
validators (~0.7 s on this project's 2-core machine, half the script's first run), and the browser
waits. Between the server's start and that first session the server is idle for as long as the
browser takes to fetch and start Streamlit's JavaScript (~0.5 s). The ``lifespan`` hook below
starts a daemon thread at server start-up that imports those modules and builds one small
per-token figure (Plotly loads the validators of the properties a figure uses on first use), so
that the first script run finds them loaded, then freezes the objects alive (``gc.freeze``, which
the entry script's first run would otherwise do). Nothing is read from a trace there and no state
of the app is kept: the thread only fills ``sys.modules`` and Plotly's own lazy caches. A failure
in it is ignored (the page imports the module itself and shows the error as it would have).
"""

from __future__ import annotations

import gc
import inspect
import logging
import sys
import threading
from contextlib import asynccontextmanager
from pathlib import Path

import streamlit as st

_HERE = Path(__file__).resolve().parent
_LOG = logging.getLogger(__name__)


def import_first_page_modules() -> None:
    """Import the third-party modules the Tokens page draws with, build one tiny per-token figure
    and its JSON (as ``st.plotly_chart`` does) so Plotly's lazily loaded validators are there, then
    freeze the objects alive (``gc.freeze``, as the entry script's first run does)."""
    if str(_HERE.parent) not in sys.path:  # the repository root (uvicorn puts app/ on sys.path)
        sys.path.insert(0, str(_HERE.parent))
    import pandas as pd
    import pandas.io.formats.style  # the token table's Styler (jinja2)
    import plotly.io
    import pyarrow  # noqa: F401  (st.dataframe's serialisation)

    from app.components import coloured_text  # noqa: F401  (plotly.colors)
    from app.components.figures import token_values_figure

    tiny = pd.DataFrame({"section": "completion", "position": [0, 1, 2], "token_text": ["a", "b", "c"],
                         "kept": [True, True, False], "mask_reason": ["kept", "kept", "after_eos"],
                         "old_logprobs": [-1.0, -0.5, 0.0], "ratio": [1.0, 1.0, 1.0]})
    plotly.io.to_json(token_values_figure(tiny), validate=False)
    # Streamlit's first element of a process calls inspect.stack() (streamlit.env_util.is_repl, for
    # its "use streamlit run" warning), whose first call resolves the file of every module loaded:
    # ~0.2 s once pandas and Plotly are; the call here fills inspect's cache of module files first
    inspect.stack()
    # what app.components.trace_cache.freeze_startup_objects does on the first script run (collect,
    # then move the objects alive out of the collector's generations), done here first: that run's
    # own collection then walks the few objects made since (~0.1 s less)
    gc.collect()
    gc.freeze()


def _import_quietly() -> None:
    try:
        import_first_page_modules()
    except Exception:  # noqa: BLE001  (whatever fails: the page imports it itself and shows the error there)
        _LOG.debug("start-up imports failed", exc_info=True)


@asynccontextmanager
async def lifespan(_app):
    """Start :func:`import_first_page_modules` in a daemon thread; the server serves meanwhile."""
    threading.Thread(target=_import_quietly, name="tracer-start-up-imports", daemon=True).start()
    yield


app = st.App(str(_HERE / "streamlit_app.py"), lifespan=lifespan)
