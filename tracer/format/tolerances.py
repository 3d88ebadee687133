"""Tolerances as the command line and the app write them: ``--atol ratio=1e-4``, ``--rtol 1e-3``.
Parsed here, in the format stage (it names fields), so that ``tracer diff`` refuses a malformed one
before it imports the diff engine (and torch): issue 49, every error for a bad argument answers at
once. :func:`tracer.diff.parse_tolerances` is this function.
"""

from __future__ import annotations

from typing import Iterable

from tracer.errors import TraceError


def parse_tolerances(values: Iterable[str], flag: str = "--atol") -> dict[str, float]:
    """``["1e-4", "ratio=1e-3"]`` -> ``{"*": 1e-4, "ratio": 1e-3}`` (the CLI's and the app's syntax;
    ``"*"`` = every other float field). Raises TraceError naming the bad item."""
    out = {}
    for text in values:
        text = text.strip()
        if not text:
            continue
        name, _, number = text.rpartition("=")
        try:
            out[name.strip() or "*"] = float(number)
        except ValueError:
            raise TraceError(f"{flag} {text!r}: expected FIELD=NUMBER or NUMBER, e.g. {flag} ratio=1e-4") from None
    return out
