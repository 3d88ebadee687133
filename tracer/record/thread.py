"""The writer thread: a bounded queue of staged steps (:class:`tracer.record.capture.StagedStep`) drained
by one daemon thread, which batches them (:class:`tracer.record.batches.BatchHandler`).

The queue is bounded by steps and by bytes. When it is full, ``when_full="block"`` makes the training
thread wait for room (no data lost), ``when_full="drop"`` drops the step and counts it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable

from tracer.record.batches import BatchHandler
from tracer.record.capture import PinnedPool, StagedStep
from tracer.format.names import step_label

log = logging.getLogger(__name__)
WRITER_NICENESS = 10  # added to the writer thread's nice value (lower CPU priority than training)
LINGER_S = 0.25  # the writer thread waits up to this long after a step arrives for more to batch with it
MAX_BATCH = 64  # steps handled together by the writer thread at most


class BackgroundWriter:
    """A bounded queue of :class:`StagedStep` drained by one daemon thread calling ``write_fn``.

    Args:
        write_fn: called on the writer thread with each step to write and a reason string (None,
            or why an anomaly forced it out); it handles its own I/O errors.
        normalise: turns a staged step's tensors into the tensors to write (writer thread).
        on_error: called with a step that is not written because ``normalise`` raised on it, or
            because handling its batch raised unexpectedly (a bug: logged; the steps of the batch
            already written or held by the anomaly ring are not concerned).
        max_steps, max_bytes: the bound: at most ``max_steps`` steps wait in the queue, and the
            bytes held (queued steps + the step being written) stay <= ``max_bytes``; a step larger
            than ``max_bytes`` is still accepted when nothing else is queued. The anomaly ring holds
            its N steps on top of this.
        when_full: ``"block"`` or ``"drop"``.
        on_drop: called with a reason when a step is dropped because the queue is full.
        ring: the anomaly ring's size (0 = off); ``kl_spike`` as in :class:`SamplingPolicy`.
        tick: called on the writer thread after each batch and every ``tick_interval`` seconds while
            idle (the writer updates the manifest's live counts there, off the training thread);
            its exceptions are logged, never raised.
        prepare: called on the writer thread with the normalised steps of a batch about to be
            written (the writer computes their summaries together there); exceptions are its own.
        linger_s, max_batch: after a step arrives the writer thread waits up to ``linger_s`` (default
            :data:`LINGER_S`) for
            more (at most ``max_batch``), unless a ``flush``, ``stop``, a queue half full or a step
            that found no room (waiting, or dropped under ``drop``) needs it now:
            a batch of small steps costs about the interpreter time of one (the writer thread
            shares the interpreter lock with the training loop). Files appear at most
            ``linger_s`` later than they would alone. Steps of CUDA tensors are not lingered for
            (when one is first in the queue; behind a CPU step, the linger that step started runs
            on), and a batch holds the first step (whose copies to host the writer thread waits for)
            and those behind it whose copies have already landed: the loop runs ahead of the GPU,
            so a lingering batch would gather the steps the GPU has not reached yet and write them
            all only after the last one's copy, a tail of several steps' writing at a flush or
            the run's end (9% of a 32 ms-step GPU loop's time before this: BENCHMARKS.md, GPU check).
    """

    def __init__(self, write_fn: Callable[[StagedStep, str | None], None], normalise: Callable[[StagedStep], None],
                 on_error: Callable[[StagedStep, Exception], None], on_drop: Callable[[str], None],
                 max_steps: int, max_bytes: int, when_full: str = "block",
                 ring: int = 0, kl_spike: float | None = None, pool: PinnedPool | None = None,
                 tick: Callable[[], None] | None = None, tick_interval: float = 1.0,
                 prepare: Callable[[list[StagedStep]], None] | None = None,
                 linger_s: float | None = None, max_batch: int = MAX_BATCH) -> None:
        if when_full not in ("block", "drop"):
            raise ValueError(f"when_full must be 'block' or 'drop', got {when_full!r}")
        self._on_drop = on_drop
        self.max_steps, self.max_bytes, self.when_full = max(1, max_steps), max(1, max_bytes), when_full
        self._pool = pool
        self._prepare = prepare
        self._handler = BatchHandler(write_fn, normalise, on_error, self._release, ring, kl_spike,
                                     (lambda items: self._prepare(items)) if prepare is not None else None)
        self._tick, self._tick_interval = tick, tick_interval
        self._max_batch = max(1, max_batch)
        self._linger_s = LINGER_S if linger_s is None else linger_s
        self._hurry = 0  # flush() calls and producers waiting for room: no lingering while > 0
        self._dropped = False  # a step was dropped for want of room since the last batch: no lingering
        self._queue: collections.deque[StagedStep | None] = collections.deque()
        self._bytes = 0
        self.peak_bytes = 0
        self._busy = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tracer-writer", daemon=True)
        self._thread.start()

    # -- training thread ----------------------------------------------------------------------

    def put(self, item: StagedStep) -> bool:
        """Enqueue; False when the step was dropped because the queue was full (``drop`` policy)."""
        with self._cond:
            while self._full(item.nbytes):
                if self.when_full == "drop":
                    label = step_label(item.step, item.inner_step, item.micro_batch)
                    self._on_drop(f"{label}: queue full ({len(self._queue)} steps, {self._bytes} bytes; "
                                  f"bounds {self.max_steps} steps, {self.max_bytes} bytes)")
                    self._release(item)
                    self._dropped = True  # the lingering writer thread takes what is queued now:
                    self._cond.notify_all()  # the next steps find room (a step of over half the bytes bound)
                    return False
                self._hurry += 1
                self._cond.notify_all()
                try:
                    self._cond.wait()
                finally:
                    self._hurry -= 1
            item.arrived = time.monotonic()
            wake = not self._queue  # the writer thread waits for a first step (else it is busy or lingering)
            self._queue.append(item)
            self._bytes += item.nbytes
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            if wake or len(self._queue) >= self._max_batch or not self._roomy():
                self._cond.notify_all()  # a lingering writer thread wakes by itself when its time is up
        return True

    def flush(self) -> None:
        """Block until every queued step has been written (or dropped)."""
        with self._cond:
            self._hurry += 1
            self._cond.notify_all()
            try:
                while self._queue or self._busy:
                    self._cond.wait()
            finally:
                self._hurry -= 1

    def stop(self) -> None:
        """Flush, then end the thread."""
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()
        self._thread.join()

    def on_writer_thread(self) -> bool:
        """True when called from this writer's thread."""
        return threading.current_thread() is self._thread

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def _roomy(self) -> bool:
        """Less than half the queue's bounds in use: lingering makes no step of up to half the bounds
        wait or drop (a larger one that finds no room ends the linger: :meth:`put`)."""
        return len(self._queue) < self.max_steps // 2 and self._bytes <= self.max_bytes // 2

    def _full(self, nbytes: int) -> bool:
        if not self._queue:  # one step alone always fits, however large (no deadlock)
            return False
        return len(self._queue) >= self.max_steps or self._bytes + nbytes > self.max_bytes

    # -- writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:  # Linux: a nice value per thread; the training threads keep the CPU when it is scarce
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError):
            pass
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if batch:
                try:
                    self._handler.handle(batch)
                except Exception as err:  # noqa: BLE001  (a bug here must not kill the thread: flush() would hang)
                    self._handler.lost(batch, err, log)  # not those written or held by the ring
                finally:
                    with self._cond:
                        self._bytes -= sum(item.nbytes for item in batch)
                        self._busy = False
                        self._cond.notify_all()
            if self._tick is not None:
                try:
                    self._tick()
                except Exception as err:  # the writer thread must survive a failing manifest update
                    log.warning("tracer: updating the manifest failed: %s", err)

    def _next_batch(self) -> list[StagedStep] | None:
        """The next steps to handle ([] when woken for a tick only; None when told to stop), after
        lingering for more while nobody waits (see the class docstring)."""
        with self._cond:
            if not self._queue:
                self._cond.wait(timeout=self._tick_interval if self._tick is not None else None)
            if not self._queue:
                return []
            while (len(self._queue) < self._max_batch and not self._hurry and not self._dropped
                   and None not in self._queue and self._roomy() and self._queue[0].event is None):
                left = self._queue[0].arrived + self._linger_s - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=left)
            batch: list[StagedStep] = []
            while self._queue and len(batch) < self._max_batch:
                if self._queue[0] is None:
                    if batch:
                        break
                    return None
                if batch and self._queue[0].copies_landed() is False:
                    break  # a GPU step whose copy is in flight: the next batch (class docstring). Unknown
                    # (a CUDA error) joins the batch: waiting on it raises and the handler counts it lost,
                    # where raising here would end the writer thread and leave flush() waiting forever.
                batch.append(self._queue.popleft())
            self._busy, self._dropped = True, False
            return batch

    def _release(self, item: StagedStep) -> None:
        """The step is done with: its buffers go back to the pool, unless a copy into them may still
        be in flight (a step dropped before the writer waited on its CUDA event): those are left to
        the CUDA host allocator, which frees them only once the copy has completed."""
        item.settled = True  # (also set by the batch handler, which calls this)
        if item.copies_landed() is not True:  # in flight, or unknown after a CUDA error: never reused
            item.pinned = []
        if item.pinned and self._pool is not None:
            self._pool.give(item.pinned)
            item.pinned = []
