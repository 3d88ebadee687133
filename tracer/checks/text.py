"""Message wording the checks share: a count with its noun in the right number ("1 row", "2 rows"),
step numbers as ranges ("1..3, 5")."""

from __future__ import annotations


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``noun`` for ``n == 1``, else ``many`` (default ``noun + "s"``); the noun alone, no number.
    Only the last word of ``noun`` takes the plural ("kept token" -> "kept tokens")."""
    return noun if n == 1 else (many if many is not None else noun + "s")


def count(n: int, noun: str, many: str | None = None) -> str:
    """``"1 row"``, ``"2 rows"``: ``n`` and :func:`plural` of ``noun``."""
    return f"{n} {plural(n, noun, many)}"


def steps_text(steps: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1..3, 5"``: runs of consecutive step numbers as ranges."""
    runs: list[list[int]] = []
    for s in sorted(set(steps)):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}..{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)
