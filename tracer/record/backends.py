"""Where a :class:`tracer.record.writer.TraceWriter`'s checked steps go: a backend behind one small
interface (``submit / flush / close``, plus ``poll`` and ``dead`` for the one that can die):

* :class:`LocalBackend` writes in this process, inside ``record`` (``async_write=False``: "inline") or
  on the writer thread (:class:`tracer.record.thread.BackgroundWriter`: "thread");
* :class:`ProcessBackend` hands each step to the writer process through a shared ring
  (:mod:`tracer.record.process`: "process").

:class:`Backends` holds the one in use: chosen at the first step under ``writer="auto"``
(:func:`tracer.record.modes.auto_writer`), and replaced by a thread, with the steps it had not
written, when the writer process cannot start, dies or stalls.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from tracer.record.capture import BufferPool, StagedStep, stage
from tracer.format.names import step_file_name, step_label
from tracer.record.manifest import ManifestBook
from tracer.record.step_writer import StepWriter
from tracer.record.thread import BackgroundWriter
from tracer.errors import TraceError, user_stacklevel
from tracer.record.modes import auto_writer


log = logging.getLogger("tracer.record.writer")  # the writer's logger

@dataclass(slots=True)
class PendingStep:
    """A step that passed ``record``'s checks, on its way to a backend.

    Attributes:
        coordinates: ``(step, inner_step, micro_batch)``.
        tensors: the fields to write (any device), as ``record`` got them (or cut to the first k rows).
        json_metadata: the step metadata's JSON form at record time, or None.
        source_dtype: the floats' dtype before storing (``float32`` unless ``keep_source_dtype``).
        sampled: False for a step only kept in the anomaly ring.
        owned: names of CPU tensors made for this step alone, staged without a copy.
        derive: fields the write side derives and records (:func:`tracer.formulas.derived.derive_recorded`).
        group_key: the staging buffers' key (all on the CPU, or on one CUDA device), or None.
        signature: the field signature the writer process's ring layouts are keyed by, or None.
        counted: an unsampled step already counted as skipped (a step rescued from a dead writer process).
    """

    coordinates: tuple[int, int, int]
    tensors: dict[str, torch.Tensor]
    json_metadata: dict[str, Any] | None
    source_dtype: str
    sampled: bool
    owned: frozenset[str] | set[str] = frozenset()
    derive: tuple[str, ...] = ()
    group_key: tuple | None = None
    signature: tuple | None = None
    counted: bool = False


class LocalBackend:
    """Writes steps in this process: on the writer thread when ``background`` is given ("thread"), else
    inside ``record`` ("inline"). ``header(pending)`` makes a step's header values
    (:func:`tracer.record.step_writer.step_header`); ``update_manifest(force)`` is the writer's manifest
    update, which the inline backend calls after each step (this thread is then the writer thread)."""

    def __init__(self, steps: StepWriter, book: ManifestBook, pool: BufferPool, steps_dir: Path, rank: int,
                 header: Callable[[PendingStep], dict[str, Any]], update_manifest: Callable[[bool], None],
                 background: BackgroundWriter | None = None) -> None:
        self.steps, self.book, self.pool, self.background = steps, book, pool, background
        self._steps_dir, self._rank, self._header, self._update_manifest = steps_dir, rank, header, update_manifest
        self.name = "thread" if background is not None else "inline"
        self.dead = None  # a local backend never dies

    @property
    def peak_bytes(self) -> int:
        """Most bytes the writer thread's queue held at once (0 inline)."""
        return self.background.peak_bytes if self.background is not None else 0

    def submit(self, pending: PendingStep) -> bool:
        """Stage ``pending`` and queue it for the writer thread, or write it now (inline). True when its
        step file is (or will be) written; False when it was not: dropped (queue full, no memory for
        the copy, a failed write) or only kept in the anomaly ring. A strict failure raises."""
        header = self._header(pending)
        try:
            staged, event, pinned, nbytes = stage(pending.tensors, self.pool, pending.owned,
                                                  reuse=self.background is not None, group_key=pending.group_key)
        except (RuntimeError, MemoryError) as err:  # no memory for the copy: drop the step, not the run
            self.book.fail(f"{step_label(*pending.coordinates)}: staging the tensors failed: "
                           f"{type(err).__name__}: {err}", err)
            self.book.raise_pending()
            return False
        item = StagedStep(*pending.coordinates, staged, header, nbytes, pending.sampled, event, pinned,
                          derive=pending.derive)
        if self.background is not None:
            if not pending.sampled and not pending.counted:
                self.book.skipped()  # unless an anomaly brings it out of the ring
            return self.background.put(item) and pending.sampled
        item.wait()
        try:
            self.steps.normalise(item)
        except Exception as err:
            self.steps.on_normalise_error(item, err)
            self.book.raise_pending()
            return False
        self.steps.write(item, None)
        self._update_manifest(False)
        self.book.raise_pending()
        return (self._steps_dir / step_file_name(*pending.coordinates, self._rank)).exists()

    def poll(self, due_only: bool = False) -> None:
        """Nothing to collect: a local backend reports through the manifest book directly."""

    def flush(self) -> None:
        """Wait until the writer thread has written every queued step (inline: nothing is queued)."""
        if self.background is not None:
            self.background.flush()

    def close(self) -> None:
        """Flush, stop the writer thread and close the summary index."""
        if self.background is not None:
            self.background.stop()
        self.steps.index.close()
        self.steps.rollouts.close()

    def flush_index(self, force: bool) -> None:
        """Append the summary index's buffered lines (when due, or now with ``force``)."""
        self.steps.index.flush(due_only=not force)


class ProcessBackend:
    """Hands steps to the writer process (:class:`tracer.record.process.parent.ProcessWriter`) through its
    shared ring. ``dead`` is the reason the process is gone (died, stalled, or stopped while starting),
    else None; the writer then writes on a :class:`LocalBackend`, starting with the process's
    :attr:`orphans` (what it was handed and had not written)."""

    name = "process"

    def __init__(self, process: Any, book: ManifestBook, first_k_sequences: int | None) -> None:
        self.process, self.book, self._cut = process, book, first_k_sequences

    dead = property(lambda self: self.process.dead)
    peak_bytes = property(lambda self: self.process.peak_bytes)

    def submit(self, pending: PendingStep) -> bool | None:
        """Copy ``pending`` into the ring. True: handed over (and sampled); False: dropped, or handed
        only for the anomaly ring; None: the process was gone and did not take it (the caller writes
        it another way). Failures are counted in the book; the caller raises a pending strict one once
        a gone process's steps are rescued."""
        try:
            handed = self.process.submit(pending.coordinates, pending.tensors, pending.sampled, pending.source_dtype,
                                         pending.json_metadata, None if self._cut else pending.signature,
                                         pending.derive)
        except (RuntimeError, MemoryError) as err:  # a failed device copy: drop the step, not the run
            self.book.fail(f"{step_label(*pending.coordinates)}: staging the tensors failed: "
                           f"{type(err).__name__}: {err}", err)
            handed = False
        if handed is None:
            return None
        if handed and not pending.sampled:
            self.book.skipped()  # unless an anomaly brings it out of the ring
        return bool(handed) and pending.sampled

    def poll(self, due_only: bool = False) -> None:
        """Apply the writer process's results so far (``due_only``: only when they are due)."""
        self.process.poll_due() if due_only else self.process.poll()

    def flush(self) -> None:
        """Wait until the child has handled every step handed over (or died, or stalled)."""
        self.process.flush()

    def close(self) -> None:
        """Stop the child (it writes what it holds first)."""
        self.process.stop()

    def flush_index(self, force: bool) -> None:
        """The child appends its own summary index: nothing to do here."""

    def rescue(self, cancelled: bool, strict: bool) -> list[Any]:
        """The process is gone (``cancelled``: stopped while starting, at ``close()``): release its ring
        and pipes, say so (a warning, unless cancelled) and in the manifest's ``capture``, and return the
        steps it had not written (:class:`tracer.record.process.lifecycle.Orphan`, copied out of the ring)
        for the thread that takes over. A stalled process in ``strict`` mode leaves a TraceError pending,
        raised once those steps are staged (nothing is lost)."""
        gone, book = self.process, self.book
        reason = gone.dead
        gone.stop()  # the child has exited: this releases the ring and the pipes
        rescued = gone.orphans  # unsampled ones go to the thread's anomaly ring, as they would have in the child's
        if cancelled:
            log.debug("tracer: %s; its %d step(s) are written by a thread", reason, len(rescued))
        else:
            warnings.warn(f"tracer: {reason}; the {len(rescued)} step(s) it had not written and all later steps are "
                          "written by a thread of this process. Training continues.", RuntimeWarning,
                          stacklevel=user_stacklevel())
        with book.lock:
            capture = book.manifest["capture"]
            if cancelled:
                capture = {**capture, "writer": "thread",
                           "writer_choice": f"{capture.get('writer_choice', 'auto')}; the trace closed while the "
                                            "writer process was starting, so a thread wrote its steps"}
            else:
                capture = {**capture, "writer": "process, then thread", "writer_process_exit": reason}
            book.manifest["capture"] = capture
            book.dirty = True
            if gone.stalled and strict:
                book.error = book.error or (f"{reason}; its steps were written by a thread instead", TraceError(reason))
        return rescued


# Why "auto" takes the thread under guard="stop": the stop judges each step file as it is written (its
# promise: a GuardStop by the record of step n + 2), and a writer process starts in 1-3 s (a fresh
# interpreter importing torch), during which steps wait unwritten and unchecked; a short loop closed
# before it started was written by a thread at close() and never stopped.
GUARD_STOP_CHOICE = ("auto: guard='stop' checks each step as it is written; a writer process would keep the first "
                     "steps waiting while it starts (1-3 s)")


class Backends:
    """The backend a :class:`tracer.record.writer.TraceWriter` writes through now, behind ``submit /
    flush / close``: started for its mode (``"inline"``, ``"thread"``, ``"process"``), chosen at the
    first step under ``"auto"`` (:func:`auto_writer`), and replaced by a thread, with the steps it had
    not written, when the writer process cannot start, dies or stalls.

    Args:
        mode: ``"inline" | "thread" | "process" | "auto"``.
        make_local: ``(background, resume_index) -> LocalBackend``: the writer's own write side.
        make_process: ``() -> ProcessWriter``; raises TraceError when the process cannot start.
        book: the writer's manifest book; strict: the writer's ``strict``.
        first_k_sequences: the sampling policy's row cut (the ring then keys no layouts by signature).
        guard_stops: the writer's live guard is ``"stop"``: ``"auto"`` then takes the thread (see
            :data:`GUARD_STOP_CHOICE`).
    Raises:
        TraceError: ``mode="process"`` in strict mode, and the process could not start.
    """

    def __init__(self, mode: str, make_local: Callable[[bool, bool], LocalBackend], make_process: Callable[[], Any],
                 book: ManifestBook, strict: bool, first_k_sequences: int | None, guard_stops: bool = False) -> None:
        self._make_local, self._make_process, self._book, self._strict = make_local, make_process, book, strict
        self._guard_stops = guard_stops
        self._cut = first_k_sequences
        self.current: LocalBackend | ProcessBackend | None = None  # None: "auto", not chosen yet
        self._chosen = False  # "auto" chose at the first step to write
        if mode == "process":
            self._start_process(chosen=False)
        elif mode != "auto":
            self.current = make_local(mode == "thread", False)

    @property
    def name(self) -> str:
        """``"inline" | "thread" | "process"``, or ``"auto"`` until the first step chooses."""
        return "auto" if self.current is None else self.current.name

    peak_bytes = property(lambda self: self.current.peak_bytes if self.current is not None else 0)
    background = property(lambda self: getattr(self.current, "background", None))
    process = property(lambda self: getattr(self.current, "process", None))

    def submit(self, pending: PendingStep) -> bool:
        """Hand ``pending`` to the backend in use (chosen now under ``"auto"``). True when its step file
        is (or will be) written. A step the writer process no longer took is written by the thread that
        replaces it; a pending strict failure raises once nothing is left unstaged."""
        if self.current is None:
            self._choose(pending.tensors)
        written = self.current.submit(pending)
        if isinstance(self.current, ProcessBackend):
            if self.current.dead is not None:
                self.poll()  # gone: a thread writes from now on, starting with what the process had not written
            if written is None:  # the process was gone before it took the step: the thread now writes it
                return self.current.submit(pending)
            self._book.raise_pending()
        return bool(written)

    def poll(self, due_only: bool = False) -> None:
        """Apply the writer process's results (``due_only``: when due); when it is gone, write on a
        thread from now on, starting with the steps it had not written (nothing handed over is lost)."""
        if isinstance(self.current, ProcessBackend):
            self.current.poll(due_only)
            if self.current.dead is not None:
                self._take_over(cancelled=False)

    def flush(self) -> None:
        """Wait until every step handed over is written (or dropped)."""
        if isinstance(self.current, ProcessBackend):
            self.current.flush()
            self.poll()
        if isinstance(self.current, LocalBackend):  # also what a dead process's rescue staged
            self.current.flush()

    def close(self) -> None:
        """Flush and stop. Under ``"auto"``, a writer process still starting (a fresh interpreter
        importing torch: 1-3 s) is stopped and a thread writes what it was handed, so a short run does
        not wait for it."""
        if isinstance(self.current, ProcessBackend) and self._chosen and self.current.process.cancel_start():
            self._take_over(cancelled=True)
        if isinstance(self.current, ProcessBackend):
            self.current.close()
            if self.current.dead is not None:  # it died before writing all it was handed: a thread writes the rest
                self.poll()
        if isinstance(self.current, LocalBackend):
            self.current.close()

    def flush_index(self, force: bool) -> None:
        """Append the summary index's buffered lines, where this process writes the index."""
        if self.current is not None:
            self.current.flush_index(force)

    def _choose(self, tensors: dict[str, torch.Tensor]) -> None:
        """``"auto"``, at the first step to write: start the writer :func:`auto_writer` picks for
        ``tensors``, and say which in the manifest (``capture.writer``, ``capture.writer_choice``)."""
        self._chosen = True
        picked, why = auto_writer(all(t.device.type == "cpu" for t in tensors.values()))
        if picked == "process" and self._guard_stops:
            picked, why = "thread", GUARD_STOP_CHOICE
        with self._book.lock:
            self._book.manifest["capture"] = {**self._book.manifest["capture"], "writer": picked, "writer_choice": why}
            self._book.dirty = True
        if picked == "process":
            self._start_process(chosen=True)
        else:
            self.current = self._make_local(True, False)

    def _start_process(self, chosen: bool) -> None:
        """Start the writer process; one that cannot start leaves a thread writing (strict: raises,
        unless ``chosen`` by ``"auto"``, which then takes the thread with a log line only)."""
        try:
            self.current = ProcessBackend(self._make_process(), self._book, self._cut)
            return
        except TraceError as err:
            if chosen:
                log.info("%s; writing on a thread instead", err)
            elif self._strict:
                raise
            else:
                warnings.warn(f"{err}; writing on a thread instead. Training continues.", RuntimeWarning,
                              stacklevel=user_stacklevel())
        with self._book.lock:
            self._book.manifest["capture"]["writer"] = "thread"
        self.current = self._make_local(True, False)

    def _take_over(self, cancelled: bool) -> None:
        """The writer process is gone (``cancelled``: stopped while starting, not dead): write on a
        thread from now on, starting with the steps it had not written (copied out of its ring)."""
        rescued = self.current.rescue(cancelled, self._strict)
        # a cancelled child may not have started the run's index yet: an older run's would be resumed
        self.current = self._make_local(True, not cancelled)
        for orphan in rescued:
            self.current.submit(PendingStep(orphan.coordinates, orphan.tensors, orphan.metadata, orphan.source_dtype,
                                            orphan.sampled, frozenset(orphan.tensors), orphan.derive, counted=True))
