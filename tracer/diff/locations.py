"""Where a diff finding is: step ids (``(step, inner_step, micro_batch, rank)``) and their labels,
tolerances, and one differing position (:class:`Location`) with its token text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

StepId = tuple[int, int, int, int]  # (step, inner_step, micro_batch, rank)
FLOAT, EXACT, MASK = "float", "exact", "mask"  # how a field is compared
_SHOWN_STEPS = 10


def step_label(step: StepId) -> str:
    """``step 3`` plus ``inner``/``mb``/``rank`` when they are not 0: ``step 3, inner 1``."""
    s, inner, mb, rank = step
    extra = [f"{n} {v}" for n, v in (("inner", inner), ("mb", mb), ("rank", rank)) if v]
    return ", ".join([f"step {s}", *extra])


def short_step(step: StepId) -> str:
    """``3``, ``3/inner 1``, ``3/inner 1/mb 2/rank 1`` (no comma inside: for lists of steps)."""
    return "/".join([str(step[0]), *(f"{n} {v}" for n, v in zip(("inner", "mb", "rank"), step[1:]) if v)])


def step_list(steps: list[StepId], shown: int = _SHOWN_STEPS) -> str:
    """``(6 step files, steps 1-3): 1, 1/inner 1, 2, … and 3 more``: the count, the range of step
    numbers, the first ``shown`` (``short_step``) and how many more."""
    n = len(steps)
    numbers = sorted({s[0] for s in steps})
    span = f", steps {numbers[0]}-{numbers[-1]}" if len(numbers) > 1 else ""
    more = f", … and {n - shown} more" if n > shown else ""
    return f"({n} step file{'s' * (n != 1)}{span}): {', '.join(short_step(s) for s in steps[:shown])}{more}"


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.7g}"
    return str(v)


@dataclass(frozen=True)
class Tolerance:
    """A position passes when ``|b - a| <= atol + rtol * |a|`` (both finite), or a and b are equal
    (NaN equals NaN, inf equals inf of the same sign)."""

    atol: float
    rtol: float

    def at(self, a: float) -> float:
        """The allowed ``|b - a|`` at reference value ``a``."""
        return self.atol + self.rtol * abs(a)


@dataclass
class Location:
    """One differing position of one field.

    Attributes:
        step: ``(step, inner_step, micro_batch, rank)`` of the step pair.
        index: position in the tensor, e.g. ``(sequence, token)`` for a ``[B, T]`` field.
        dims: the dimension names of ``index`` (``("B", "T")``); ``"?"`` for fields outside the schema.
        a, b: the two values (float, int or bool).
        abs_diff: ``|b - a|`` (inf when exactly one side is NaN/inf).
        row_differing: differing positions in the same sequence of the same step pair.
        token_text: text of the token at this position in ``a`` (None for non-token fields).
        token_text_b: text of the token in ``b`` when its id differs from ``a``'s.
    """

    step: StepId
    index: tuple[int, ...]
    dims: tuple[str, ...]
    a: Any
    b: Any
    abs_diff: float
    row_differing: int = 1
    token_text: str | None = None
    token_text_b: str | None = None

    @property
    def sequence(self) -> int | None:
        return self.index[0] if self.dims[:1] == ("B",) else None

    @property
    def token(self) -> int | None:
        return self.index[1] if len(self.dims) > 1 and self.dims[1] in ("T", "L") else None

    def position(self) -> str:
        """``seq 3, tok 17 'cat'`` (prompt tokens: ``prompt tok``; ``[B, F]``: ``component``)."""
        if not self.index:
            return ""
        if self.dims[0] != "B":
            return f"index {self.index}"
        parts = [f"seq {self.index[0]}"]
        if len(self.index) > 1:
            name = {"T": "tok", "L": "prompt tok", "F": "component"}.get(self.dims[1], "index")
            parts.append(f"{name} {', '.join(map(str, self.index[1:]))}")
        text = f" {self.token_text!r}" if self.token_text is not None else ""
        return ", ".join(parts) + text

    def where(self) -> str:
        """``step 12, seq 3, tok 17 'cat'``."""
        pos = self.position()
        return step_label(self.step) + (f", {pos}" if pos else "")

    def values(self) -> str:
        """``a=-0.25, b=0.25`` (with both token texts when token ids differ)."""
        a, b = _value(self.a), _value(self.b)
        if self.token_text_b is not None:
            a, b = f"{a} {self.token_text!r}", f"{b} {self.token_text_b!r}"
        return f"a={a}, b={b}"
