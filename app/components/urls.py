"""The selection in the URL: ``?run=…&step=…&inner=…&mb=…&rank=…&seq=…`` (and a page's own
parameters), so that a copied link reopens the same view.

Every run of the app the sidebar calls :func:`pending` before drawing its choosers: when the URL's
selection differs from the one the app last wrote (a pasted link, a link clicked in a table, a
``st.switch_page`` with ``query_params``), its values are applied to the choosers; then
:func:`write` puts the chosen selection back into the URL. Pure helpers (:func:`parse`,
:func:`selection_params`, :func:`link`) take and give plain dicts; tests call them.
"""

from __future__ import annotations

from typing import Mapping
from urllib.parse import urlencode

import streamlit as st

# The selection's parameters, in URL order; ``run`` is relative to the root.
SELECTION_PARAMS = ("run", "step", "inner", "mb", "rank", "seq")
_INT_PARAMS = ("step", "inner", "mb", "rank", "seq")
_SYNCED_STATE = "_tracer_url_synced"  # the selection parameters the app last wrote
_PAGE_STATE = "_tracer_url_page"  # the URL path of the page the last run showed
# Each page's own parameters, by URL path ("" is the root, the Runs page).
PAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "": (), "tokens": ("colour", "token"), "step": ("q",), "conversation": ("colour", "turns"), "groups": ("group",),
    "rollouts": ("sort", "dir", "search", "page", "step_min", "step_max", "reward_min", "reward_max", "group_id",
                 "flagged", "first_pass"),
    "steps": ("overlay", "y", "smooth", "log", "x"), "diff": ("a", "b")}
# Page parameters that name a place in the selected sequence: dropped when the selection moves.
_SEQUENCE_PARAMS = ("token",)


def parse(params: Mapping[str, str]) -> dict[str, int]:
    """The integer selection parameters of ``params`` that parse (``step``, ``inner``, ``mb``,
    ``rank``, ``seq``); a missing or malformed one is left out."""
    out = {}
    for name in _INT_PARAMS:
        value = params.get(name)
        try:
            number = int(str(value)) if value is not None else None
        except ValueError:
            number = None
        if number is not None and number >= 0:
            out[name] = number
    return out


def selection_params(run_label: str, key, sequence: int | None) -> dict[str, str]:
    """``{run, step, inner, mb, rank, seq}`` of a selection (a :class:`tracer.read.reader.StepKey` or None)."""
    out = {"run": run_label}
    if key is not None:
        out.update(step=str(key.step), inner=str(key.inner_step), mb=str(key.micro_batch), rank=str(key.rank))
        if sequence is not None:
            out["seq"] = str(sequence)
    return out


def link(page: str, params: Mapping[str, object]) -> str:
    """A relative link to ``page`` (``tokens``, ``step``…) with ``params`` as its query string."""
    return f"{page}?{urlencode({k: str(v) for k, v in params.items() if v is not None})}"


def current() -> dict[str, str]:
    """The URL's selection parameters now (only those present)."""
    return {name: st.query_params[name] for name in SELECTION_PARAMS if name in st.query_params}


def pending() -> dict[str, str] | None:
    """The URL's selection when it differs from what the app last wrote (to apply), else None. An
    empty URL (a page switched in the navigation) is nothing to apply."""
    now = current()
    if not now or now == st.session_state.get(_SYNCED_STATE):
        return None
    return now


def write(params: Mapping[str, str], keep: tuple[str, ...] = ()) -> None:
    """Put the selection into the URL (other parameters, and those named in ``keep``, stay) and
    remember it as written. When a selection parameter the URL names changes value (another run,
    step file or sequence was chosen), the page parameters that point into the old sequence
    (``token``) go: they name a place in a sequence no longer shown."""
    if any(name in st.query_params and st.query_params[name] != params.get(name)
           for name in SELECTION_PARAMS if name not in keep):
        drop_sequence_params()
    for name in SELECTION_PARAMS:
        if name in keep:
            continue
        if name in params:
            if st.query_params.get(name) != params[name]:
                st.query_params[name] = params[name]
        elif name in st.query_params:
            del st.query_params[name]
    st.session_state[_SYNCED_STATE] = current()


def drop_sequence_params() -> None:
    """Remove the page parameters that name a place in the shown sequence (``token``): another run,
    step file or sequence is being chosen."""
    for name in _SEQUENCE_PARAMS:
        if name in st.query_params:
            del st.query_params[name]


def page_param(name: str, options: list, default=None):
    """A page's own URL parameter ``name`` as one of ``options`` (compared as text), else ``default``."""
    value = st.query_params.get(name)
    for option in options:
        if str(option) == value:
            return option
    return default


def set_page_param(name: str, value) -> None:
    """Write a page's own parameter into the URL (None removes it)."""
    if value is None:
        if name in st.query_params:
            del st.query_params[name]
    elif st.query_params.get(name) != str(value):
        st.query_params[name] = str(value)


def drop_other_pages_params(url_path: str) -> None:
    """When the page changed since the last run, remove from the URL the parameters of pages other
    than the one at ``url_path`` (left over from the page shown before), so that a copied link
    names only what this page shows. The first run of a session keeps the URL as it came."""
    previous = st.session_state.get(_PAGE_STATE)
    st.session_state[_PAGE_STATE] = url_path
    if previous is None or previous == url_path:
        return
    mine = PAGE_PARAMS.get(url_path, ())
    for name in {n for names in PAGE_PARAMS.values() for n in names} - set(mine):
        if name in st.query_params:
            del st.query_params[name]
