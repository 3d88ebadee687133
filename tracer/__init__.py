"""tracer: a debugger for RL training of language models.

Attach to a trainer, write per-step safetensors traces of everything that decides an RL update
(old/policy/ref/sampler logprobs, masks, rewards, advantages, ratios, KL terms), then browse,
check and diff them. See README.md and SPEC.md.

The public names are imported on first use (PEP 562 ``__getattr__``): ``import tracer``,
``python -m tracer --help``, ``tracer info`` and the read and format stages do not import torch
(seconds of start-up); ``tracer.Tracer`` imports the writer, ``tracer.diff(a, b)`` the diff engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tracer.errors import GuardStop, SchemaError, TraceError, TraceFormatError
from tracer.record.lazy_exports import lazy_exports
from tracer.record.observer import register_factory

if TYPE_CHECKING:  # the lazily imported names, for type checkers and IDEs
    from tracer.diff import DiffReport
    from tracer.read import StepKey, Trace
    from tracer.record import SamplingPolicy, Tracer, TraceWriter
    from tracer.zero_edit.watch import watch

__version__ = "0.1.0"
__all__ = ["Trace", "Tracer", "TraceWriter", "SamplingPolicy", "StepKey", "TraceError", "SchemaError",
           "TraceFormatError", "GuardStop", "attach", "diff", "DiffReport", "watch"]

# public name -> the module that defines it, imported when the name is first looked up
_LAZY = {"Trace": "tracer.read", "StepKey": "tracer.read", "Tracer": "tracer.record",
         "TraceWriter": "tracer.record", "SamplingPolicy": "tracer.record", "DiffReport": "tracer.diff",
         "watch": "tracer.zero_edit.watch"}


def diff(a: Any, b: Any, **kwargs: Any) -> Any:
    """Compare two traces: :func:`tracer.diff.diff` (same arguments, returns its
    :class:`~tracer.diff.DiffReport`), imported on first call so that ``import tracer`` does not
    import the diff engine and torch."""
    from tracer.diff import diff as _diff

    return _diff(a, b, **kwargs)


def _make_guard(guard: Any, root: Any, rank: int) -> Any:
    """The writer's maker of live guards (:func:`tracer.guard.make_guard`), imported when a writer asks
    for a guard: the record stage knows the observer protocol only, and ``import tracer`` does not
    import the checks."""
    from tracer.guard import make_guard

    return make_guard(guard, root, rank)


register_factory(_make_guard)  # any import of a tracer module runs this package first
# the lazy names; importing the subpackage tracer.diff keeps the function diff defined above
__getattr__, __dir__ = lazy_exports(globals(), _LAZY)


def attach(trainer: Any, out_dir: str, **kwargs: Any) -> Any:
    """Trace a TRL trainer; see :func:`tracer.integrations.trl.attach` (imported lazily so that
    ``import tracer`` does not import TRL)."""
    from tracer.integrations.trl import attach as _attach

    return _attach(trainer, out_dir, **kwargs)

