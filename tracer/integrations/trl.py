"""``tracer.attach``: trace a Hugging Face TRL trainer (written against TRL 1.16).

Usage::

    trainer = GRPOTrainer(...)   # or RLOOTrainer(...), DPOTrainer(...)
    tracer.attach(trainer, "runs/my-trace")
    trainer.train()

One hook per trainer, each in its own module, all built on :mod:`tracer.integrations.trl_base`:

- ``GRPOTrainer`` -> :class:`~tracer.integrations.trl_grpo.GRPOTraceHook` (algorithm ``grpo``, or
  ``cispo`` for ``loss_type="cispo"``);
- ``RLOOTrainer`` -> :class:`~tracer.integrations.trl_rloo.RLOOTraceHook` (algorithm ``rloo``);
- ``DPOTrainer`` -> :class:`~tracer.integrations.trl_dpo.DPOTraceHook` (algorithm ``dpo``).

A trainer of another class is traced like a GRPOTrainer when it has GRPOTrainer's methods (a
subclass, a fork); otherwise :class:`~tracer.errors.TraceError` says what is missing.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from tracer.integrations.trl_base import TrainerTraceHook
from tracer.integrations.trl_dpo import DPOTraceHook
from tracer.integrations.trl_grpo import ROW_ID_KEY, GRPOTraceHook
from tracer.integrations.trl_metadata import LOSS_REDUCTION_BY_LOSS_TYPE
from tracer.integrations.trl_rloo import RLOOTraceHook

__all__ = ["attach", "hook_class_for", "TrainerTraceHook", "GRPOTraceHook", "RLOOTraceHook", "DPOTraceHook",
           "LOSS_REDUCTION_BY_LOSS_TYPE", "ROW_ID_KEY"]


def _class_names(trainer: Any) -> set[str]:
    return {cls.__name__ for cls in type(trainer).__mro__}


def hook_class_for(trainer: Any) -> type[TrainerTraceHook]:
    """The hook class that traces ``trainer``: chosen by the trainer's class and its bases
    (``RLOOTrainer``, ``DPOTrainer``), else the GRPO hook (which checks the methods it wraps)."""
    names = _class_names(trainer)
    if "RLOOTrainer" in names:
        return RLOOTraceHook
    if "DPOTrainer" in names:
        return DPOTraceHook
    return GRPOTraceHook


def attach(trainer: Any, out_dir: str | os.PathLike, strict: bool = False, keep_source_dtype: bool = False,
           config: Mapping[str, Any] | None = None, **writer_options: Any) -> TrainerTraceHook:
    """Trace a TRL trainer into ``out_dir``; call before ``trainer.train()``.

    Args:
        trainer: a ``trl.GRPOTrainer``, ``trl.RLOOTrainer`` or ``trl.DPOTrainer`` (TRL 1.x), already
            constructed.
        out_dir: the trace directory (must not already hold a trace).
        strict: raise :class:`~tracer.errors.TraceError` when a step cannot be captured or written,
            instead of warning, counting it in the manifest and training on.
        keep_source_dtype: store logprobs in the trainer's dtype instead of float32.
        config: extra run facts for the manifest's ``config`` (e.g. how the model was built).
        **writer_options: passed to :class:`~tracer.record.writer.TraceWriter`: ``sampling`` (e.g.
            ``SamplingPolicy(every_n_steps=10)``), ``max_queue_steps``, ``max_queue_bytes``,
            ``when_full``, ``writer``, ``writer_stall_s``, ``fsync_steps``, ``guard`` (the live guard:
            with ``"stop"``, the first error a check finds ends training through the trainer's
            ``control.should_training_stop`` after the step under way; ``hook.guard_stop`` is its finding).

    Returns:
        The hook (:class:`GRPOTraceHook`, :class:`RLOOTraceHook` or :class:`DPOTraceHook`); the trace is
        closed at train end (a ``TrainerCallback``); ``hook.detach()`` restores the trainer's methods.

    Raises:
        TraceError: ``trainer`` lacks the methods tracer wraps, or ``out_dir`` already holds a trace.
        TypeError: a writer option TraceWriter does not take.
    """
    hook_class = hook_class_for(trainer)
    return hook_class(trainer, out_dir, strict=strict, keep_source_dtype=keep_source_dtype, config=config,
                      **writer_options)
