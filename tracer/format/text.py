"""Text from a trace made safe to print, tabulate and render.

JSON can carry a lone surrogate (``"\\ud800"``): Python parses it into a ``str`` that cannot be
encoded as UTF-8, so printing it, handing it to pyarrow (Streamlit's tables) or to the browser
fails. Every JSON text the reader parses (manifest, ``tokens.json``, step metadata) goes through
:func:`clean_text`.
"""

from __future__ import annotations

import re
from typing import Any

REPLACEMENT = "\ufffd"
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a surrogate can appear in JSON text


def may_hold_surrogates(raw: bytes | str) -> bool:
    """True when JSON text ``raw`` has a ``\\uD800``-``\\uDFFF`` escape (a valid pair or a lone
    surrogate); UTF-8 bytes themselves cannot encode a surrogate."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    return _SURROGATE_ESCAPE.search(data) is not None


def clean_str(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD (a no-op for valid text)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join(REPLACEMENT if "\ud800" <= ch <= "\udfff" else ch for ch in text)


def clean_text(value: Any) -> Any:
    """``value`` (parsed JSON) with every string, keys included, passed through :func:`clean_str`.
    Raises RecursionError for nesting deeper than the interpreter's limit."""
    if isinstance(value, str):
        return clean_str(value)
    if isinstance(value, list):
        return [clean_text(v) for v in value]
    if isinstance(value, dict):
        return {clean_text(k): clean_text(v) for k, v in value.items()}
    return value


MAX_TOKEN_TEXT = 256  # characters of one token's text shown; real tokens hold < 100


def shown_token(text: str, cap: int = MAX_TOKEN_TEXT) -> str:
    """One token's text as tables and views show it: at most ``cap`` characters, the rest elided
    with its length named (``"xxx…(+1048320 chars)"``), so a hostile ``tokens.json`` entry of 1 MB costs a
    table a few hundred bytes per row, not a megabyte."""
    return text if len(text) <= cap else f"{text[:cap]}…(+{len(text) - cap} chars)"
