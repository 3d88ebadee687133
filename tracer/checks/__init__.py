"""``tracer check``: the invariants of SPEC section 6 as named checks that return located findings.

Families (the check id's prefix), by module: ``fields`` (required fields), ``identity`` (first-step
identity, old aliasing policy; ``micro_batches``: a micro-batch's position), ``alignment`` (logprob
shift, completion start), ``masks`` (after EOS, padding, empty rows, DPO mask rule), ``kl`` (k3 sign,
ref - policy gap, negative k1 in one step or persistently), ``logprobs`` (no kept logprob above 0),
``nonfinite`` (NaN/Inf by dependency order), ``advantages`` (group sum, zero-variance groups, z-score
bound, masked positions, PPO reward placement), ``sampler`` (sampler vs trainer logprobs;
``probability``: sampler vs trainer probabilities), ``integrity`` (bytes vs recorded checksum) and
``recompute`` (``recompute``: ratio, KL, advantages, token rewards, clip fractions, DPO terms;
``per_token_loss``: the per-token loss; ``reduction``: the loss reduction).

Shared by several families: ``context`` (what a check sees), ``finding`` (findings, the registry),
``comparison`` (recorded vs recomputed), ``advantage_rules`` (groups, advantage rules),
``kl_placement`` (KL penalty in the rewards or the loss), ``runner`` and ``report`` (running the
checks, rendering findings).

Public API::

    findings = run_checks("runs/r1")                  # list[Finding], worst first
    findings = run_checks(trace, select=["masks"])    # a family or check ids
    has_errors(findings)                              # what `tracer check` turns into exit code 1
    CHECKS["masks.after_eos"].description             # the registry
"""

from __future__ import annotations

# importing a module registers its checks, in this order (the order of CHECKS, in which they run)
from tracer.checks import (  # noqa: F401
    advantages, alignment, fields, identity, integrity, kl, logprobs, masks, nonfinite, recompute, per_token_loss,
    reduction, sampler,
)
from tracer.checks import micro_batches, probability  # noqa: F401  (checks of verl's micro-batches and sampler)
from tracer.checks import turns  # noqa: F401  (multi-turn and agentic rows)
from tracer.checks import effective_config  # noqa: F401  (the configuration in effect vs the declared)
from tracer.checks import dpo  # noqa: F401  (DPO's reference: aliasing the policy)
from tracer.checks import health  # noqa: F401  (warnings of a drifting run, with overridable thresholds)
from tracer.checks.context import TOLERANCES, CheckOptions, StepContext, Tolerance
from tracer.checks.finding import (
    CHECKS, ERROR, FAMILIES, INFO, SEVERITIES, SKIPPED, WARNING, Check, Finding, Skip, register,
)
from tracer.checks.runner import description, run_checks, select_checks


def has_errors(findings: list[Finding]) -> bool:
    """True when any finding is an error (``tracer check`` then exits with 1)."""
    return any(f.severity == ERROR for f in findings)


def count_by_severity(findings: list[Finding]) -> dict[str, int]:
    """``{"error": n, "warning": n, "info": n, "skipped": n}``."""
    return {s: sum(f.severity == s for f in findings) for s in SEVERITIES}


__all__ = [
    "CHECKS", "ERROR", "FAMILIES", "INFO", "SEVERITIES", "SKIPPED", "TOLERANCES", "WARNING", "Check",
    "CheckOptions", "Finding", "Skip", "StepContext", "Tolerance", "count_by_severity", "description", "has_errors",
    "register", "run_checks", "select_checks",
]
