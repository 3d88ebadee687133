"""What a check returns: a :class:`Finding` with a severity and a location, and the registry of
named checks (id, family, what it needs).

A finding's location is the step file (step, inner step, micro-batch, rank) plus, when the rule
breaks at one place, the sequence (row of the step) and the token position in the completion, with
the token's id and text. ``token_text`` is filled only when the trace stores token strings.
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass
from dataclasses import field as dataclass_field
from typing import Any, Callable, Iterable

ERROR, WARNING, INFO, SKIPPED = "error", "warning", "info", "skipped"
SEVERITIES = (ERROR, WARNING, INFO, SKIPPED)  # worst first
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass
class Finding:
    """One result of one check at one place.

    Attributes:
        check: the check id, ``family.name`` (e.g. ``"masks.after_eos"``).
        severity: ``error`` (a bug that corrupts the update), ``warning`` (likely wrong or wasted),
            ``info`` (a measured fact, nothing wrong), ``skipped`` (the check could not run: the
            message says which field or metadata key is missing).
        message: the value found, the rule, why it matters and the likely fix.
        step, inner_step, micro_batch, rank: the step file; None for a trace-level finding.
        sequence: row of the step (0-based), None when the finding is about the whole step.
        token: position in the completion (0-based, the T axis), None when not about one token.
        token_id, token_text: the token at that position (text only when the trace stores strings).
        field: the tensor the finding is about, when it is about one.
        path: the step file.
        details: numbers behind the message (JSON-able), e.g. the worst tokens.
    """

    check: str
    severity: str
    message: str
    step: int | None = None
    inner_step: int | None = None
    micro_batch: int | None = None
    rank: int | None = None
    sequence: int | None = None
    token: int | None = None
    token_id: int | None = None
    token_text: str | None = None
    field: str | None = None
    path: str | None = None
    details: dict[str, Any] = dataclass_field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.check.split(".", 1)[0]

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON-able dict with every attribute plus ``family``; non-finite floats in
        ``details`` become the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
        out = asdict(self)
        out["family"] = self.family
        out["details"] = _finite_json(out["details"])
        return out


def _finite_json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value


class Skip(Exception):
    """Raised inside a check when it cannot run; the message is the reason (missing field or key)."""


# How a skip's reason starts when the check does not apply to the run (nothing of what it tests exists
# there), as opposed to a check that cannot run for lack of a field: see :func:`not_applicable`.
NOT_APPLICABLE = "not applicable: "


def not_applicable(why: str) -> Skip:
    """The Skip a check raises when what it tests does not exist in this run, by the run's own
    recorded configuration or data: the KL penalty of a token-reward check when the run puts it in the
    loss, a sampler mismatch when no inference engine sampled (the policy generated its rollouts).
    Its reason is ``not applicable: <why>``. Unlike a missing field, it is no gap: ``tracer check``
    does not list it under ``not checked`` (it says it once, dimmed, at the end) and the coverage of
    :mod:`tracer.checks.coverage` does not count it as a class left unjudged. ``why`` names the
    recorded setting or data that rules the check out."""
    return Skip(f"{NOT_APPLICABLE}{why}")


def is_not_applicable(finding: Finding) -> bool:
    """Whether ``finding`` is the ``skipped`` finding of a check that does not apply to the run
    (:func:`not_applicable`), not one that could not run."""
    return finding.severity == SKIPPED and bool(finding.details.get("not_applicable"))


@dataclass(frozen=True)
class Check:
    """A named check.

    Attributes:
        id: ``family.name``.
        description: the rule in one line.
        run: ``run(ctx) -> Iterable[Finding]`` for a step check (ctx is a StepContext), or
            ``run(trace, options) -> Iterable[Finding]`` for a trace check.
        algorithms: algorithms the check applies to; it is silently not run on others.
        scope: ``"step"`` or ``"trace"`` (runs once over all step files).
    """

    id: str
    description: str
    run: Callable[..., Iterable[Finding]]
    algorithms: frozenset[str]
    scope: str = "step"

    @property
    def family(self) -> str:
        return self.id.split(".", 1)[0]


CHECKS: dict[str, Check] = {}
FAMILIES = ("fields", "identity", "alignment", "masks", "kl", "logprobs", "nonfinite", "advantages", "sampler",
            "recompute", "integrity", "turns", "dpo", "health")
ALL_ALGORITHMS = frozenset({"ppo", "grpo", "cispo", "rloo", "dpo", ""})
RL_ALGORITHMS = frozenset({"ppo", "grpo", "cispo", "rloo", ""})  # "" = unknown algorithm


def register(check_id: str, description: str, algorithms: Iterable[str] = ALL_ALGORITHMS, scope: str = "step"):
    """Decorator adding a check function to :data:`CHECKS` under ``check_id``."""
    family = check_id.split(".", 1)[0]
    assert family in FAMILIES, f"unknown check family {family!r}"

    def decorate(fn):
        CHECKS[check_id] = Check(check_id, description, fn, frozenset(algorithms), scope)
        return fn

    return decorate
