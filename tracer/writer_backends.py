"""Where a :class:`tracer.writer.TraceWriter`'s checked steps go, and the settings that choose it:
the writer (``writer=`` or ``TRACER_WRITER``: a thread of this process, or a writer process,
:mod:`tracer.writer_process`), the writer process's stall limit (``writer_stall_s=`` or
``TRACER_WRITER_STALL_S``), the rank (torch.distributed, else torchrun's variables); then the staging
of a step for the writer thread (or its writing inside ``record``), its hand-over to the writer
process, that process's start and, when it dies or stalls, the thread that takes over with the steps
it had not written (:class:`WriterBackends`, a base of ``TraceWriter``). Also the close, at
interpreter exit, of the writers a program left open.
"""

from __future__ import annotations

import atexit
import logging
import os
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tracer.capture import StagedStep, stage
from tracer.errors import TraceError
from tracer.frame_lookup import user_stacklevel
from tracer.layout import step_file_name, step_label, unlock_rank
from tracer.schema import jsonable
from tracer.step_writer import step_header

if TYPE_CHECKING:
    from tracer.writer import TraceWriter

log = logging.getLogger("tracer.writer")  # the writer's logger (this module was split off tracer.writer)

WRITERS = ("thread", "process")
WRITER_ENV = "TRACER_WRITER"  # thread | process: the writer of TraceWriters that do not name one
STALL_ENV = "TRACER_WRITER_STALL_S"  # seconds: the writer process's stall limit of TraceWriters that do not set one


def _distributed_rank() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed, else from torchrun's RANK / WORLD_SIZE variables
    (a writer created before ``init_process_group`` still knows its rank), else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


def _writer_mode(writer: str | None) -> str:
    """``writer`` or, when None, the ``TRACER_WRITER`` environment variable, else "thread"."""
    chosen = writer if writer is not None else (os.environ.get(WRITER_ENV) or "thread")
    if chosen not in WRITERS:
        named = f"writer={writer!r}" if writer is not None else f"{WRITER_ENV}={chosen!r}"
        raise TraceError(f"{named} is not one of {list(WRITERS)}; use 'thread' (a writer thread, the default) "
                         "or 'process' (a writer process fed through shared memory)")
    return chosen


def _stall_limit(seconds: float | None) -> float | None:
    """``writer_stall_s`` or, when None, the ``TRACER_WRITER_STALL_S`` environment variable, else
    None (:data:`tracer.writer_lifecycle.STALL_S`); TraceError unless a number > 0."""
    named = f"writer_stall_s={seconds!r}" if seconds is not None else f"{STALL_ENV}={os.environ.get(STALL_ENV)!r}"
    value: Any = seconds if seconds is not None else os.environ.get(STALL_ENV)
    if value is None or value == "":
        return None  # the writer process's own default
    try:
        value = float(value)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:
        raise TraceError(f"{named} is not a number of seconds > 0; it is how long a wait for the writer process "
                         "may hear nothing from it before it is taken for stalled (e.g. 60; inf: wait forever)")
    return value


_OPEN_WRITERS: "weakref.WeakSet[TraceWriter]" = weakref.WeakSet()


@atexit.register
def _close_open_writers() -> None:
    """On normal interpreter exit, flush and close writers the program left open."""
    for writer in list(_OPEN_WRITERS):
        try:
            writer.close()
        except Exception as err:  # never turn a clean exit into a crash
            log.warning("tracer: closing %s at exit failed: %s", writer.root, err)


class WriterBackends:
    """:class:`tracer.writer.TraceWriter`'s side that hands each checked step to where it is written: the
    writer thread (``_stage``), or the writer process (``_hand_over``), and the fallback to a thread
    after a writer process that could not start, died or stalled; also which one writes now and the
    manifest's updates. The writer thread itself is started by ``TraceWriter._start_writing``, in
    :mod:`tracer.writer` (where the ``_save_atomic`` it calls is looked up)."""

    @property
    def peak_queued_bytes(self) -> int:
        """Most bytes the background queue held at once (0 when writing synchronously)."""
        backend = self._process or self._background
        return backend.peak_bytes if backend is not None else 0

    @property
    def writer(self) -> str:
        """Where steps are written now: ``"thread"``, ``"process"``, or ``"inline"`` (``async_write=False``);
        a writer whose process died goes on with ``"thread"``."""
        return "process" if self._process is not None else "thread" if self._background is not None else "inline"

    def _stage(self, coordinates: tuple[int, int, int], tensors: dict[str, torch.Tensor],
               json_metadata: dict[str, Any] | None, source_dtype: str, sampled: bool, owned, derive: tuple[str, ...],
               group_key: tuple | None, path: Path, counted: bool = False) -> Path | None:
        """Stage a checked step for the writer thread (or write it here, ``async_write=False``).
        ``json_metadata``: the step metadata's JSON form at record time (a list the loop changes
        later is not this step's); ``counted``: an unsampled step already counted as skipped (one a
        dead writer process was handed)."""
        step, inner_step, micro_batch = coordinates
        header = step_header(self.hyperparameters, json_metadata, self.algorithm, step, inner_step, micro_batch,
                             self.rank, self.world_size, source_dtype)
        try:
            staged, event, pinned, nbytes = stage(tensors, self._pool, owned, reuse=self._background is not None,
                                                  group_key=group_key)
        except (RuntimeError, MemoryError) as err:  # no memory for the copy: drop the step, not the run
            self._book.fail(f"{step_label(*coordinates)}: staging the tensors failed: {type(err).__name__}: {err}", err)
            self._book.raise_pending()
            return None
        item = StagedStep(step, inner_step, micro_batch, staged, header, nbytes, sampled, event, pinned,
                          derive=derive)
        if self._background is None:
            item.wait()
            try:
                self._steps.normalise(item)
            except Exception as err:
                self._steps.on_normalise_error(item, err)
                self._book.raise_pending()
                return None
            self._steps.write(item, None)
            self._update_manifest()  # writing synchronously: this thread is the writer thread
            self._book.raise_pending()
            return path if path.exists() else None
        if not sampled and not counted:
            self._book.skipped()  # unless an anomaly brings it out of the ring
        return path if self._background.put(item) and sampled else None

    def _hand_over(self, coordinates, tensors, sampled, source_dtype, json_form, derive) -> bool | None:
        """Process mode: copy the step into the writer process's shared ring. True: handed over;
        False: dropped; None: the process was gone and did not take it (the thread now writes it)."""
        try:
            handed = self._process.submit(coordinates, tensors, sampled, source_dtype, json_form,
                                          None if self.sampling.first_k_sequences else self._signatures.last, derive)
        except (RuntimeError, MemoryError) as err:  # a failed device copy: drop the step, not the run
            self._book.fail(f"{step_label(*coordinates)}: staging the tensors failed: {type(err).__name__}: {err}", err)
            handed = False
        if self._process.dead is not None:
            self._poll_process()  # the writer thread from now on
        if handed is None:  # not taken: _record stages it for the thread, and what is pending raises next
            return None
        self._book.raise_pending()
        if handed and not sampled:
            self._book.skipped()  # unless an anomaly brings it out of the ring
        return handed

    def _poll_process(self, due_only: bool = False) -> None:
        """Apply the writer process's results (``due_only``: when due, ``ProcessWriter.poll_due``);
        when it is gone, write on a thread from now on, starting with the steps it had not written
        (copied out of its ring: nothing handed over is lost)."""
        self._process.poll_due() if due_only else self._process.poll()
        if self._process.dead is None:
            return
        gone, self._process = self._process, None
        reason = gone.dead
        gone.stop()  # the child has exited: this releases the ring and the pipes
        rescued = gone.orphans  # unsampled ones go to this writer's anomaly ring, as they would have in the child's
        warnings.warn(f"tracer: {reason}; the {len(rescued)} step(s) it had not written and all later steps are "
                      "written by a thread of this process. Training continues.", RuntimeWarning,
                      stacklevel=user_stacklevel())
        with self._book.lock:
            self._book.manifest["capture"] = {**self._book.manifest["capture"], "writer": "process, then thread",
                                              "writer_process_exit": reason}
            if gone.stalled and self.strict:  # raised once the rescued steps are staged (nothing is lost)
                self._book.error = self._book.error or (f"{reason}; its steps were written by a thread instead",
                                                        TraceError(reason))
        self._start_writing(background=True, resume_index=True)
        for orphan in rescued:
            self._stage(orphan.coordinates, orphan.tensors, orphan.metadata, orphan.source_dtype, orphan.sampled,
                        frozenset(orphan.tensors), orphan.derive, None,
                        self._steps_dir / step_file_name(*orphan.coordinates, self.rank), counted=True)

    def _start_process(self) -> None:
        """Start the writer process; one that cannot start leaves a thread writing (strict: raises)."""
        from tracer.writer_process import ProcessWriter  # imported only by those who use it

        max_queue_steps, max_queue_bytes, when_full = self._queue
        try:
            self._process = ProcessWriter(self._child_config(), self._book, max_queue_steps, max_queue_bytes,
                                          when_full, self._lock_fd, self._stall_s)
        except TraceError as err:
            if self.strict:
                unlock_rank(self._lock_fd)
                raise
            warnings.warn(f"{err}; writing on a thread instead. Training continues.", RuntimeWarning,
                          stacklevel=user_stacklevel())
            self._book.manifest["capture"]["writer"] = "thread"
            self._start_writing(background=True)

    def _child_config(self) -> dict[str, Any]:
        """What the writer process needs to write this trace's steps (JSON)."""
        return {"root": os.fspath(self.root), "rank": self.rank, "world_size": self.world_size,
                "algorithm": self.algorithm, "keep_source_dtype": self.keep_source_dtype,
                "fsync_steps": self.fsync_steps,
                "hyperparameters": jsonable(self.hyperparameters), "manifest": self._book.manifest,
                "anomaly_ring": self.sampling.anomaly_ring, "kl_spike": self.sampling.kl_spike,
                "max_queue_steps": self._queue[0], "max_queue_bytes": self._queue[1]}

    def _update_manifest(self, force: bool = False) -> None:
        """Rewrite the manifest when its counts changed, at most every MANIFEST_INTERVAL_S seconds
        unless ``force`` (the writer thread's tick, ``flush``). A failure is logged (strict: kept
        to raise from the next call), never raised here. Also appends the summary index's lines
        (when the index is written in this process)."""
        if self._steps is not None:
            self._steps.index.flush(due_only=not force)
        self._book.update(force)
