"""Where a :class:`tracer.record.writer.TraceWriter`'s checked steps go, and the settings that choose it:
the writer (``writer=`` or ``TRACER_WRITER``: a thread of this process, a writer process,
:mod:`tracer.record.process.parent`, or ``"auto"``, the default: the process for a run of CPU tensors with
a core to spare, :func:`auto_writer`), the writer process's stall limit (``writer_stall_s=`` or
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
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch

from tracer.record.capture import StagedStep, stage
from tracer.errors import TraceError
from tracer.errors import user_stacklevel
from tracer.format.names import step_file_name, step_label
from tracer.format.files import unlock_rank
from tracer.format.metadata_codec import jsonable
from tracer.record.step_writer import step_header


log = logging.getLogger("tracer.record.writer")  # the writer's logger: these methods are TraceWriter's

WRITERS = ("auto", "thread", "process")
WRITER_ENV = "TRACER_WRITER"  # auto | thread | process: the writer of TraceWriters that do not name one
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
    """``writer`` or, when None, the ``TRACER_WRITER`` environment variable, else "auto"."""
    chosen = writer if writer is not None else (os.environ.get(WRITER_ENV) or "auto")
    if chosen not in WRITERS:
        named = f"writer={writer!r}" if writer is not None else f"{WRITER_ENV}={chosen!r}"
        raise TraceError(f"{named} is not one of {list(WRITERS)}; use 'auto' (the default: the writer process "
                         "for CPU tensors when a core is free, else the thread), 'thread' (a writer thread) "
                         "or 'process' (a writer process fed through shared memory)")
    return chosen


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else the count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_writer(cpu_only: bool, platform: str | None = None, cores: int | None = None,
                local_ranks: int | None = None) -> tuple[str, str]:
    """The writer ``writer="auto"`` takes at a trace's first recorded step, and why: ``("process",
    why)`` when every tensor of that step is on the CPU (``cpu_only``), the platform is Linux (the
    writer process's shared ring and its watch on the child read Linux's memfd and /proc) and this
    process may use at least two cores per training process on the machine (``local_ranks``:
    torchrun's ``LOCAL_WORLD_SIZE``, else 1): the training thread then shares the interpreter lock
    with no writer (BENCHMARKS.md, issue 16, tenth pass: a zero-edit PPO loop of a tiny model pays
    1.04x instead of 1.11x). Else ``("thread", why)``: GPU tensors keep the thread's asynchronous
    pinned-memory copy, and a machine with no core to spare gains nothing from a second process.
    ``platform``, ``cores``: ``sys.platform`` and :func:`usable_cores` unless given (tests)."""
    platform = sys.platform if platform is None else platform
    cores = usable_cores() if cores is None else cores
    if local_ranks is None:
        try:
            local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        except ValueError:
            local_ranks = 1
    if not cpu_only:
        return "thread", "auto: a tensor of the first step is not on the CPU"
    if not platform.startswith("linux"):
        return "thread", f"auto: the writer process runs on Linux only (this is {platform})"
    if cores < 2 * local_ranks:
        return "thread", f"auto: {cores} usable core(s) for {local_ranks} training process(es), none to spare"
    return "process", f"auto: CPU tensors, {cores} usable cores for {local_ranks} training process(es)"


def _stall_limit(seconds: float | None) -> float | None:
    """``writer_stall_s`` or, when None, the ``TRACER_WRITER_STALL_S`` environment variable, else
    None (:data:`tracer.record.process.lifecycle.STALL_S`); TraceError unless a number > 0."""
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


_OPEN_WRITERS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the open TraceWriters, closed at exit


@atexit.register
def _close_open_writers() -> None:
    """On normal interpreter exit, flush and close writers the program left open."""
    for writer in list(_OPEN_WRITERS):
        try:
            writer.close()
        except Exception as err:  # never turn a clean exit into a crash
            log.warning("tracer: closing %s at exit failed: %s", writer.root, err)


class WriterBackends:
    """:class:`tracer.record.writer.TraceWriter`'s side that hands each checked step to where it is written: the
    writer thread (``_stage``), or the writer process (``_hand_over``), and the fallback to a thread
    after a writer process that could not start, died or stalled; also which one writes now and the
    manifest's updates. The writer thread itself is started by ``TraceWriter._start_writing``, in
    :mod:`tracer.record.writer` (where the ``_save_atomic`` it calls is looked up)."""

    @property
    def peak_queued_bytes(self) -> int:
        """Most bytes the background queue held at once (0 when writing synchronously)."""
        backend = self._process or self._background
        return backend.peak_bytes if backend is not None else 0

    @property
    def writer(self) -> str:
        """Where steps are written now: ``"thread"``, ``"process"``, or ``"inline"`` (``async_write=False``);
        a writer whose process died goes on with ``"thread"``."""
        if self._auto:
            return "auto"  # nothing recorded yet: chosen at the first record (auto_writer)
        return "process" if self._process is not None else "thread" if self._background is not None else "inline"

    def _choose_writer(self, tensors: dict[str, torch.Tensor]) -> None:
        """``writer="auto"``, at the first step to write: start the writer :func:`auto_writer` picks
        for ``tensors``, and say which in the manifest (``capture.writer``, ``capture.writer_choice``)."""
        self._auto, self._chosen = False, True
        picked, why = auto_writer(all(t.device.type == "cpu" for t in tensors.values()))
        with self._book.lock:
            self._book.manifest["capture"] = {**self._book.manifest["capture"], "writer": picked, "writer_choice": why}
            self._book.dirty = True
        if picked == "process":
            self._start_process(chosen=True)
        else:
            self._start_writing(background=True)

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
        self._take_over()

    def _cancel_start(self) -> None:
        """``writer="auto"``, at ``close()``: a writer process still starting (a fresh interpreter
        importing torch: 1-3 s) is killed and what it was handed is written by a thread here, so that
        a short run does not wait for it (``capture.writer`` then reads "thread"). A process that is
        ready, or holds a step too large for its ring, is closed as usual."""
        if self._process.cancel_start():
            self._take_over(cancelled=True)

    def _take_over(self, cancelled: bool = False) -> None:
        """The writer process is gone (``cancelled``: stopped by :meth:`_cancel_start`, not dead): write
        on a thread from now on, starting with the steps it had not written (copied out of its ring)."""
        gone, self._process = self._process, None
        reason = gone.dead
        gone.stop()  # the child has exited: this releases the ring and the pipes
        rescued = gone.orphans  # unsampled ones go to this writer's anomaly ring, as they would have in the child's
        if cancelled:
            log.debug("tracer: %s; its %d step(s) are written by a thread", reason, len(rescued))
        else:
            warnings.warn(f"tracer: {reason}; the {len(rescued)} step(s) it had not written and all later steps are "
                          "written by a thread of this process. Training continues.", RuntimeWarning,
                          stacklevel=user_stacklevel())
        with self._book.lock:
            capture = self._book.manifest["capture"]
            if cancelled:
                capture = {**capture, "writer": "thread",
                           "writer_choice": f"{capture.get('writer_choice', 'auto')}; the trace closed while the "
                                            "writer process was starting, so a thread wrote its steps"}
            else:
                capture = {**capture, "writer": "process, then thread", "writer_process_exit": reason}
            self._book.manifest["capture"] = capture
            self._book.dirty = True
            if gone.stalled and self.strict:  # raised once the rescued steps are staged (nothing is lost)
                self._book.error = self._book.error or (f"{reason}; its steps were written by a thread instead",
                                                        TraceError(reason))
        # a cancelled child may not have started the run's index yet: an older run's would be resumed
        self._start_writing(background=True, resume_index=not cancelled)
        for orphan in rescued:
            self._stage(orphan.coordinates, orphan.tensors, orphan.metadata, orphan.source_dtype, orphan.sampled,
                        frozenset(orphan.tensors), orphan.derive, None,
                        self._steps_dir / step_file_name(*orphan.coordinates, self.rank), counted=True)

    def _start_process(self, chosen: bool = False) -> None:
        """Start the writer process; one that cannot start leaves a thread writing (strict: raises,
        unless ``chosen`` by ``writer="auto"``, which then takes the thread with a log line only)."""
        from tracer.record.process.parent import ProcessWriter  # imported only by those who use it

        max_queue_steps, max_queue_bytes, when_full = self._queue
        try:
            self._process = ProcessWriter(self._child_config(), self._book, max_queue_steps, max_queue_bytes,
                                          when_full, self._lock_fd, self._stall_s)
        except TraceError as err:
            if chosen:
                log.info("%s; writing on a thread instead", err)
            elif self.strict:
                unlock_rank(self._lock_fd)
                raise
            else:
                warnings.warn(f"{err}; writing on a thread instead. Training continues.", RuntimeWarning,
                              stacklevel=user_stacklevel())
            with self._book.lock:
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
