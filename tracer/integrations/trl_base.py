"""What every TRL trainer hook shares: the trace writer, wrapping methods on the trainer *instance*
(the class is left untouched), closing the trace at train end, and the rule that tracing never
stops training.

An exception while capturing is caught, counted in the manifest's ``dropped_steps`` /
``drop_reasons`` and reported with ``warnings.warn``; ``strict=True`` raises
:class:`tracer.errors.TraceError` instead. The one exception is the live guard's stop
(``tracer.attach(..., guard="stop")``): when the writer reports that a check found an error, the
hook's callback sets ``control.should_training_stop`` (Transformers' own way to end training: the
loop breaks after the current micro-batch, ``on_train_end`` closes the trace), so ``trainer.train()``
returns normally. The writer is told not to raise :class:`~tracer.errors.GuardStop` from ``record``
(``writer.guard_raises = False``): every micro-batch the trainer trains on is recorded, up to the
last. The trainer-specific hooks live in ``trl_grpo.py``
(GRPO, and RLOO through ``trl_rloo.py``) and ``trl_dpo.py``; :func:`tracer.integrations.trl.attach`
picks one.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import warnings
from typing import Any, Callable, Iterable, Mapping

from tracer.errors import TraceError
from tracer.record.writer import TraceWriter

log = logging.getLogger(__name__)


def require_methods(trainer: Any, names: Iterable[str], expected: str) -> None:
    """Raise TraceError naming the methods ``trainer`` lacks (the ones the hook wraps)."""
    missing = [name for name in names if not callable(getattr(trainer, name, None))]
    if missing:
        raise TraceError(
            f"cannot trace a {type(trainer).__name__}: it lacks {missing}, which tracer wraps on TRL's {expected} "
            f"(TRL >= 1.0); pass a trl.{expected} (tracer.attach also knows GRPOTrainer, RLOOTrainer and "
            "DPOTrainer), or record steps with TraceWriter yourself")


class TrainerTraceHook:
    """Base of the TRL hooks: owns the :class:`~tracer.record.writer.TraceWriter` and the wrapped methods.

    Attributes:
        trainer: the traced trainer.
        writer: the :class:`~tracer.record.writer.TraceWriter` (``writer.root`` is the trace directory).
        capture_failures: exceptions caught while capturing (each also counts as a dropped step).
    """

    def __init__(self, trainer: Any, out_dir: str | os.PathLike, algorithm: str, hyperparameters: Mapping[str, Any],
                 run_config: Mapping[str, Any], tokenizer: Any = None, strict: bool = False,
                 keep_source_dtype: bool = False, **writer_options: Any) -> None:
        self.trainer = trainer
        self.strict = strict
        self.capture_failures = 0
        self.writer = TraceWriter(out_dir, algorithm, tokenizer=tokenizer, config=run_config,
                                  hyperparameters=hyperparameters, strict=strict, keep_source_dtype=keep_source_dtype,
                                  **writer_options)
        self.writer.guard_raises = False  # the guard stops the trainer through its control (_stop_if_guarded)
        self._originals: dict[str, Callable] = {}
        self._loss_calls = 0

    # -- public verbs -------------------------------------------------------------------------

    @property
    def guard_stop(self) -> Any:
        """The finding that made the live guard stop training (a :class:`~tracer.checks.finding.Finding`),
        or None while it has not (or runs without ``guard="stop"``)."""
        return self.writer.guard_stop

    def close(self) -> None:
        """Finish the trace (manifest status ``finished``); idempotent. Called at train end."""
        self.writer.close()

    def detach(self) -> None:
        """Restore the trainer's own methods (the trace stays open until :meth:`close`)."""
        for name in self._originals:
            if getattr(self.trainer.__dict__.get(name), "__tracer_wrapper__", False):
                del self.trainer.__dict__[name]
        self._originals.clear()

    # -- installing ---------------------------------------------------------------------------

    def _close_at_train_end(self) -> None:
        from transformers import TrainerCallback

        hook = self

        class _CloseTrace(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                hook.log_scalars(state, logs)

            def on_step_end(self, args, state, control, **kwargs):
                hook._stop_if_guarded(control)

            def on_substep_end(self, args, state, control, **kwargs):
                hook._stop_if_guarded(control)

            def on_train_end(self, args, state, control, **kwargs):
                hook.close()

        self.trainer.add_callback(_CloseTrace())

    def log_scalars(self, state: Any, logs: Mapping[str, Any] | None) -> None:
        """Keep the numbers of one of the trainer's logs (``on_log``: ``loss``, ``grad_norm``,
        ``learning_rate``, ``entropy``, ``rewards/<func>/mean``, ``completions/mean_length``, ...) as
        logged scalars of the optimizer step they close (:meth:`tracer.record.writer.TraceWriter.log_scalars`).

        Transformers' ``Trainer`` logs after ``state.global_step`` was incremented, and a log with
        ``logging_steps = k`` averages the k steps up to it: its values go to step ``global_step - 1``,
        the step this integration recorded under that number. The end-of-training summary (the log
        holding ``train_runtime``) is not a step's and is left out; so are values that are not
        finite numbers or NaN. Never raises (a failure is logged)."""
        step = int(getattr(state, "global_step", 0) or 0) - 1
        if not logs or step < 0 or "train_runtime" in logs:
            return
        values = {k: float(v) for k, v in logs.items() if isinstance(k, str) and 0 < len(k) <= 100
                  and isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isinf(v)}
        try:
            self.writer.log_scalars(step, values)
        except TraceError as err:
            log.warning("tracer: the trainer's log of step %d was not kept (%s)", step, err)

    def _stop_if_guarded(self, control: Any) -> None:
        """Ask the trainer to stop (``control.should_training_stop``) once the guard has stopped: the
        loop checks it after every micro-batch, so the step under way completes and no other starts."""
        if self.writer.guard_stop is not None:
            control.should_training_stop = True

    def _wrap(self, name: str, after: Callable[[Any], None]) -> None:
        """Replace ``trainer.<name>`` by a wrapper that calls the original, then ``after(result)``
        under :meth:`_guard`."""
        original = getattr(self.trainer, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            self._guard(after, result)
            return result

        self._install(name, wrapper)

    def _install(self, name: str, wrapper: Callable) -> None:
        """Set ``trainer.<name> = wrapper`` (an instance attribute, undone by :meth:`detach`)."""
        self._originals[name] = getattr(self.trainer, name)
        wrapper.__tracer_wrapper__ = True
        setattr(self.trainer, name, wrapper)

    def _training(self) -> bool:
        return bool(getattr(self.trainer.model, "training", True))

    # -- failures -----------------------------------------------------------------------------

    def _guard(self, fn: Callable[[Any], None], value: Any) -> None:
        try:
            fn(value)
        except Exception as err:  # tracing must never stop training
            if self.strict:
                if isinstance(err, TraceError):
                    raise
                raise TraceError(f"tracer: capture failed in {fn.__name__}: {type(err).__name__}: {err}") from err
            self._count_failure(fn.__name__, err)

    def _count_failure(self, where: str, err: Exception) -> None:
        self.capture_failures += 1
        reason = f"capture in {where}: {type(err).__name__}: {err}"
        self.writer.count_drop(reason)  # counted in the manifest (and by a writer process)
        log.debug("tracer capture failure", exc_info=err)
        warnings.warn(
            f"tracer: could not record a step ({self.capture_failures} capture failures so far): {reason}. "
            "Training continues; pass strict=True to tracer.attach to raise instead.",
            RuntimeWarning, stacklevel=2)

    # -- step bookkeeping ---------------------------------------------------------------------

    def _optimizer_step(self) -> int:
        return int(self.trainer.state.global_step)  # optimizer steps completed = the one being computed

    def _accumulation_steps(self) -> int:
        return int(getattr(self.trainer, "current_gradient_accumulation_steps", 0)
                   or self.trainer.args.gradient_accumulation_steps or 1)
