"""Capture off the critical path: stage tensors on the training thread, write them on a background
thread (the recipe of PyTorch's async checkpointing: stage, then serialise and write elsewhere).

Staging:
    * CPU tensors are copied (``clone``): the loop may mutate them in place right after ``record``.
    * CUDA tensors are copied into reusable pinned host buffers on a side stream; a CUDA event is
      recorded after the copies and the writer thread waits on it before touching the data. The
      source tensor is marked with ``record_stream`` so the allocator cannot reuse its memory while
      the copy is in flight. No non-blocking copy is ever read without that synchronisation.

The queue is bounded by steps and by bytes. When it is full, ``when_full="block"`` makes the training
thread wait for room (no data lost), ``when_full="drop"`` drops the step and counts it.

Sampling (:class:`SamplingPolicy`): every N steps, the first K sequences of a step, and an anomaly
ring that keeps the last N unsampled steps in memory and writes them when a step shows NaN/Inf or a
KL spike, so the steps before a blow-up reach the disk.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tracer.batches import BatchHandler, anomaly_reason, nonfinite_fields  # noqa: F401  (re-exported)
from tracer.layout import step_label
from tracer.schema import FIELDS


log = logging.getLogger(__name__)
_IDLE = object()  # the writer thread woke without a step (time for a tick)
WRITER_NICENESS = 10  # added to the writer thread's nice value (lower CPU priority than training)
LINGER_S = 0.25  # the writer thread waits up to this long after a step arrives for more to batch with it
MAX_BATCH = 64  # steps handled together by the writer thread at most


@dataclass(frozen=True)
class SamplingPolicy:
    """Which steps and sequences reach the disk.

    Attributes:
        every_n_steps: write steps whose ``step % every_n_steps == 0`` (1 = every step).
        first_k_sequences: keep only the first K rows of every ``[B, ...]`` field (None = all).
        anomaly_ring: hold the last N unsampled steps in memory; write them when a step shows
            NaN/Inf in a float field or a KL spike (0 = off).
        kl_spike: a step whose masked mean ``ref_kl_k3`` or ``approx_kl_k2`` exceeds this (nats) is
            an anomaly (None = only NaN/Inf count). A KL field the step does not record is derived
            from the recorded logprobs as readers derive it (``approx_kl_k2`` from policy/old,
            ``ref_kl_k3`` from policy/ref: :func:`tracer.batches.anomaly_reason`).
    """

    every_n_steps: int = 1
    first_k_sequences: int | None = None
    anomaly_ring: int = 0
    kl_spike: float | None = None

    def __post_init__(self) -> None:
        if self.every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {self.every_n_steps}")
        if self.first_k_sequences is not None and self.first_k_sequences < 1:
            raise ValueError(f"first_k_sequences must be >= 1 or None, got {self.first_k_sequences}")
        if self.anomaly_ring < 0:
            raise ValueError(f"anomaly_ring must be >= 0, got {self.anomaly_ring}")

    def sampled(self, step: int) -> bool:
        return step % self.every_n_steps == 0


@dataclass
class StagedStep:
    """One step's tensors, staged on the host, waiting for the writer thread."""

    step: int
    inner_step: int
    micro_batch: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    nbytes: int
    sampled: bool = True  # False: only kept in the anomaly ring
    event: Any = None  # torch.cuda.Event to wait on before reading the tensors
    pinned: list[tuple[torch.Tensor, bool]] = field(default_factory=list)  # (buffer, pinned) to hand back to the pool
    arrived: float = 0.0  # time.monotonic() when it was queued
    specs: Any = None  # safetensors pointer specs made with its checksum (tracer.step_bytes)
    summarised: bool = False  # its summary was computed (or tried) with its batch
    settled: bool = False  # written, lost or held by the anomaly ring: a batch's error handler leaves it alone
    derive: tuple[str, ...] = ()  # fields the writer derives and records (tracer.derived.derive_recorded)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def first_k_sequences(tensors: dict[str, torch.Tensor], k: int, algorithm: str | None) -> dict[str, torch.Tensor]:
    """Keep the first ``k`` rows of every field whose first dim is B (other tensors as they are)."""
    out = {}
    for name, t in tensors.items():
        spec = FIELDS.get(name)
        dims = spec.dims_for(algorithm) if spec else ()
        out[name] = t[:k] if dims[:1] == ("B",) else t
    return out


class BufferPool:
    """Reusable host buffers keyed by (shape, dtype, pinned): pinned ones for the CUDA staging path,
    plain ones for CPU staging. At most ``pinned_per_key`` idle pinned buffers per key and
    ``max_idle_pinned_bytes`` of them in all; at most ``per_key`` idle plain buffers per key and
    ``max_idle_bytes`` of them in all (a run whose shapes change every step keeps a bounded amount
    of memory idle). A staged copy into a buffer used before is a copy into warm memory; a
    fresh allocation of the same size also pays its page faults (about twice the copy at 0.3 MB per
    step: BENCHMARKS.md, blocked time)."""

    def __init__(self, per_key: int = 4, max_idle_bytes: int = 64 * 2**20, pinned_per_key: int = 4,
                 max_idle_pinned_bytes: int = 256 * 2**20) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._per_key = {False: per_key, True: pinned_per_key}
        self._max_idle = {False: max_idle_bytes, True: max_idle_pinned_bytes}
        self._idle_bytes = {False: 0, True: 0}

    def _pop_idle(self, key: tuple, pinned: bool) -> Any:
        """An idle buffer (or group) kept under ``key``, taken out of the pool; None when there is none."""
        with self._lock:
            free = self._free.get(key)
            if not free:
                return None
            buf = free.pop()
            self._idle_bytes[pinned] -= buf.nbytes
            if not free:
                del self._free[key]
            return buf

    def take(self, shape: torch.Size, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        buf = self._pop_idle((tuple(shape), dtype, pinned), pinned)
        return buf if buf is not None else torch.empty(shape, dtype=dtype, pin_memory=pinned)

    def take_group(self, key: tuple, tensors: list[torch.Tensor]) -> "BufferGroup":
        """Plain buffers shaped like ``tensors``, as one :class:`BufferGroup` kept under ``key`` (the
        step's field signature: the same key always means the same shapes and dtypes): one lookup
        per step instead of one per tensor."""
        group = self._pop_idle(key, False)
        return group if group is not None else BufferGroup(key, [torch.empty(t.shape, dtype=t.dtype) for t in tensors])

    def give(self, buffers: list[tuple[torch.Tensor, bool]]) -> None:
        """Hand back ``(buffer, pinned)`` pairs (a buffer may be a :class:`BufferGroup`) that hold
        nothing anyone reads (or writes) any more."""
        with self._lock:
            for buf, pinned in buffers:
                key = buf.key if isinstance(buf, BufferGroup) else (tuple(buf.shape), buf.dtype, pinned)
                free = self._free.get(key, [])
                idle = self._idle_bytes[pinned] + buf.nbytes
                if len(free) < self._per_key[pinned] and idle <= self._max_idle[pinned]:
                    free.append(buf)
                    self._free[key] = free
                    self._idle_bytes[pinned] += buf.nbytes


PinnedPool = BufferPool  # the name it had when it held pinned buffers only


def _kept(name: str, t: torch.Tensor, owned: frozenset[str] | set[str]) -> bool:
    """True for a CPU tensor ``stage`` keeps without a copy: made for this record alone (``owned``)
    and, as such, its own (no view), detached and contiguous."""
    return name in owned and t._base is None and not t.requires_grad and t.is_contiguous()


def _stage_group(tensors: dict[str, torch.Tensor], pool: "BufferPool", owned: frozenset[str] | set[str],
                 group_key: tuple) -> tuple[dict, Any, list, int]:
    """:func:`stage` of CPU tensors whose field signature is ``group_key``: the ``owned`` ones kept
    (:func:`_kept`), the others copied into one group of buffers in one ``torch._foreach_copy_``."""
    kept = tuple(name for name, t in tensors.items() if _kept(name, t, owned)) if owned else ()
    sources = [t for name, t in tensors.items() if name not in kept] if kept else list(tensors.values())
    group = pool.take_group((group_key, kept) if kept else group_key, sources)
    if sources:
        grad = torch.is_grad_enabled()  # no graph to the buffers; cheaper than a no_grad() context per step
        torch._C._set_grad_enabled(False)
        try:  # one call; as copy_ (any strides in, contiguous out)
            torch._foreach_copy_(list(group), sources)  # a plain list: a tensor subclass's dispatch rebuilds its type
        finally:
            torch._C._set_grad_enabled(grad)
    if not kept:
        return dict(zip(tensors, group)), None, [(group, False)], group.nbytes
    copies = iter(group)
    staged = {name: t if name in kept else next(copies) for name, t in tensors.items()}
    return staged, None, [(group, False)], group.nbytes + sum(tensors[name].nbytes for name in kept)


class BufferGroup(list):
    """The plain staging buffers of one step's fields, in field order, reused together
    (:meth:`BufferPool.take_group`); ``key`` is the field signature they were made for."""

    def __init__(self, key: tuple, buffers: list[torch.Tensor]) -> None:
        super().__init__(buffers)
        self.key = key
        self.nbytes = sum(b.nbytes for b in buffers)


def stage(tensors: dict[str, torch.Tensor], pool: PinnedPool | None = None,
          owned: frozenset[str] | set[str] = frozenset(), reuse: bool = False,
          group_key: tuple | None = None) -> tuple[dict, Any, list, int]:
    """Copy ``tensors`` to host memory the caller cannot mutate; returns (staged, event, buffers, nbytes).

    CPU tensors (and those of devices other than CUDA) are copied (contiguous, to host memory) into
    buffers from ``pool`` when ``reuse`` (given back once written, so later steps copy into warm
    memory) or cloned, except those named in ``owned`` (made for this record alone,
    e.g. rows indexed out of a batch: nobody else holds them), which are kept, detached and
    contiguous, without a copy. CUDA tensors go to pinned buffers (``pool``) through a side stream;
    ``event`` must be waited on before the staged tensors are read. ``buffers``: the ``(buffer,
    pinned)`` pairs to give back (:meth:`BufferPool.give`) once the step is written.

    ``group_key``: the field signature of ``tensors`` when the caller knows every one is a CPU
    tensor (with ``reuse`` and a ``pool``): the copies then go into one :class:`BufferGroup` in a
    single ``torch._foreach_copy_`` (the training thread's Python per step no longer grows with the
    number of fields), the ``owned`` ones kept being left out of it (the group's key then names them).
    """
    if group_key is not None and reuse and pool is not None:
        return _stage_group(tensors, pool, owned, group_key)
    staged, pinned, nbytes, cuda = {}, [], 0, []
    grad = torch.is_grad_enabled()  # no graph to the copies: as a no_grad() context, for less
    torch._C._set_grad_enabled(False)
    try:
        for name, t in tensors.items():
            if t.is_cuda:
                cuda.append((name, t))
                continue
            nbytes += t.nbytes
            if name in owned and t._base is None and not t.requires_grad and t.is_cpu and t.is_contiguous():
                staged[name] = t  # host memory only: an MPS/XPU tensor is copied like any other
            elif reuse and pool is not None and t.numel():
                buf = pool.take(t.shape, t.dtype, pinned=False)
                staged[name] = buf.copy_(t)
                pinned.append((buf, False))
            elif t.is_cpu:
                staged[name] = t.clone(memory_format=torch.contiguous_format)
            else:  # MPS, XPU...: staged tensors are host memory (the writer thread reads their bytes)
                staged[name] = t.to("cpu", memory_format=torch.contiguous_format)
    finally:
        torch._C._set_grad_enabled(grad)
    event = None
    if cuda:
        pool = pool or BufferPool()
        device = cuda[0][1].device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))  # the values are final when the copy starts
        with torch.cuda.stream(side):
            for name, t in cuda:
                src = t.detach().contiguous()
                buf = pool.take(src.shape, src.dtype)
                buf.copy_(src, non_blocking=True)
                src.record_stream(side)
                staged[name], nbytes = buf, nbytes + buf.numel() * buf.element_size()
                pinned.append((buf, True))
            event = torch.cuda.Event()
            event.record(side)
    return staged, event, pinned, nbytes


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
            ``linger_s`` later than they would alone.
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
                   and None not in self._queue and self._roomy()):
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
                batch.append(self._queue.popleft())
            self._busy, self._dropped = True, False
            return batch

    def _release(self, item: StagedStep) -> None:
        """The step is done with: its buffers go back to the pool, unless a copy into them may still
        be in flight (a step dropped before the writer waited on its CUDA event): those are left to
        the CUDA host allocator, which frees them only once the copy has completed."""
        item.settled = True  # (also set by the batch handler, which calls this)
        if item.event is not None and not item.event.query():
            item.pinned = []
        if item.pinned and self._pool is not None:
            self._pool.give(item.pinned)
            item.pinned = []
