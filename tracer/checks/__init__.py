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

Shared by several families: ``context`` (what a check sees), ``finding`` (findings, ``register``),
``registry`` (:data:`CHECKS`, which imports the check modules on its first read),
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

from typing import TYPE_CHECKING

from tracer.checks import finding as _finding
from tracer.checks.finding import (
    ERROR,
    FAMILIES,
    INFO,
    SEVERITIES,
    SKIPPED,
    WARNING,
    Check,
    Finding,
    Skip,
    register,
)
from tracer.checks.registry import CheckRegistry
from tracer.record.lazy_exports import lazy_exports

if TYPE_CHECKING:  # the lazily imported names, for type checkers and IDEs
    from tracer.checks.context import TOLERANCES, CheckOptions, StepContext, Tolerance
    from tracer.checks.runner import description, run_checks, select_checks

# The registry, filled by the check modules (which import torch) on its first read, not here: this package
# and its light names (severities, Finding, FAMILIES) import without torch. It replaces finding's empty
# dict before any check module registers into it (importing one runs this package first).
CHECKS: CheckRegistry = CheckRegistry(_finding.CHECKS)
_finding.CHECKS = CHECKS  # type: ignore[assignment]  (register() writes to finding.CHECKS)


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

# public name -> the module that defines it, imported when the name is first looked up (torch)
_LAZY = {**dict.fromkeys(("TOLERANCES", "CheckOptions", "StepContext", "Tolerance"), "tracer.checks.context"),
         **dict.fromkeys(("description", "run_checks", "select_checks"), "tracer.checks.runner")}
__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
