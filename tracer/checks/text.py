"""Message wording the checks share: a count with its noun in the right number ("1 row", "2 rows")."""

from __future__ import annotations


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``noun`` for ``n == 1``, else ``many`` (default ``noun + "s"``); the noun alone, no number.
    Only the last word of ``noun`` takes the plural ("kept token" -> "kept tokens")."""
    return noun if n == 1 else (many if many is not None else noun + "s")


def count(n: int, noun: str, many: str | None = None) -> str:
    """``"1 row"``, ``"2 rows"``: ``n`` and :func:`plural` of ``noun``."""
    return f"{n} {plural(n, noun, many)}"
