"""tracer: a debugger for RL training of language models.

Attach to a trainer, write per-step safetensors traces of everything that decides an RL update
(old/policy/ref/sampler logprobs, masks, rewards, advantages, ratios, KL terms), then browse,
check and diff them. See README.md and SPEC.md.
"""

from __future__ import annotations

from typing import Any

from tracer.diff import DiffReport, diff
from tracer.errors import GuardStop, SchemaError, TraceError, TraceFormatError
from tracer.read import StepKey, Trace
from tracer.record import SamplingPolicy, Tracer, TraceWriter
from tracer.record.observer import register_factory
from tracer.zero_edit.watch import watch

__version__ = "0.1.0"
__all__ = ["Trace", "Tracer", "TraceWriter", "SamplingPolicy", "StepKey", "TraceError", "SchemaError",
           "TraceFormatError", "GuardStop", "attach", "diff", "DiffReport", "watch"]


def _make_guard(guard: Any, root: Any, rank: int) -> Any:
    """The writer's maker of live guards (:func:`tracer.guard.make_guard`), imported when a writer asks
    for a guard: the record stage knows the observer protocol only, and ``import tracer`` does not
    import the checks."""
    from tracer.guard import make_guard

    return make_guard(guard, root, rank)


register_factory(_make_guard)  # any import of a tracer module runs this package first


def attach(trainer: Any, out_dir: str, **kwargs: Any) -> Any:
    """Trace a TRL trainer; see :func:`tracer.integrations.trl.attach` (imported lazily so that
    ``import tracer`` does not import TRL)."""
    from tracer.integrations.trl import attach as _attach

    return _attach(trainer, out_dir, **kwargs)
