"""Where a finding points (a step file, a sequence, a token): what the Health page hands to the
Tokens page for the jump (:mod:`app.components.token_jump`). No Streamlit, no checks: the Tokens
page imports it without importing ``tracer.checks``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FindingTarget:
    """Where a finding points: a step file of a trace, a sequence (row) and, when the finding is
    about one token, its position in the completion."""

    trace_path: str
    step_path: str
    sequence: int
    token: int | None
    check: str

    def caption(self) -> str:
        """``finding: masks.after_eos at token 4`` (``in sequence 2`` without a token)."""
        where = f"at token {self.token}" if self.token is not None else f"in sequence {self.sequence}"
        return f"finding: {self.check} {where}"
