"""Which fields the reader derives, and from what: the registry of derived fields (names and the
recorded fields each is computed from), without the maths. When a step file records the inputs of
``ratio``, ``ref_kl_k3`` or ``approx_kl_k2`` but not the field itself (the README's hand-written
loop records only policy and old logprobs), the reader adds it, computed by
:func:`tracer.formulas.derived.derive_fields` (the maths' one home, :mod:`tracer.formulas`).

The registry lives in the format stage so that listing a step's derivable fields (the reader, the
diff, ``tracer info``, the viewer's headers) imports no torch; register a new derived field here
and its formula in :mod:`tracer.formulas.derived`.
"""

from __future__ import annotations

from typing import Any, Iterable

# Fields the reader derives when a step file records their inputs but not them: name -> (inputs, formula).
DERIVED_FIELDS: dict[str, tuple[tuple[str, ...], str]] = {
    "ratio": (("policy_logprobs", "old_logprobs"), "tracer.formulas.ratio"),
    "ref_kl_k3": (("policy_logprobs", "ref_logprobs"), "tracer.formulas.ref_kl_k3"),
    "approx_kl_k2": (("policy_logprobs", "old_logprobs"), "tracer.formulas.approx_kl_k2"),
}


def derivation_sources(name: str, meta: dict[str, Any]) -> tuple[str, ...]:
    """The recorded fields ``name`` is derived from; old = policy when the metadata says old is
    the detached policy (``old_logprobs_source = policy_detached``)."""
    inputs = DERIVED_FIELDS[name][0]
    if "old_logprobs" in inputs and meta.get("old_logprobs_source") == "policy_detached":
        inputs = tuple(dict.fromkeys("policy_logprobs" if f == "old_logprobs" else f for f in inputs))
    return inputs


def derivable(present: Iterable[str], meta: dict[str, Any]) -> list[str]:
    """The names of :data:`DERIVED_FIELDS` absent from ``present`` whose inputs are all present. The
    ratio is per token only: none when ``importance_sampling_level`` is not ``token``."""
    present = set(present)
    out = []
    for name in DERIVED_FIELDS:
        if name == "ratio" and meta.get("importance_sampling_level", "token") != "token":
            continue
        if name not in present and all(f in present for f in derivation_sources(name, meta)):
            out.append(name)
    return out


def derivation_inputs(present: Iterable[str], meta: dict[str, Any], wanted: Iterable[str]) -> list[str]:
    """The recorded fields needed to derive those of ``wanted`` that can be derived."""
    names = [n for n in derivable(present, meta) if n in set(wanted)]
    return list(dict.fromkeys(f for n in names for f in derivation_sources(n, meta)))
