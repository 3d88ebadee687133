"""Capture off the critical path: stage tensors on the training thread, to be written elsewhere (the
recipe of PyTorch's async checkpointing: stage, then serialise and write elsewhere): by the writer
thread (:mod:`tracer.record.thread`) or the writer process (:mod:`tracer.record.process.parent`).

Staging:
    * CPU tensors are copied (``clone``): the loop may mutate them in place right after ``record``.
    * CUDA tensors are copied into reusable pinned host buffers, asynchronously, on the stream that
      is current on their device at ``record`` (the stream the loop computes on): the copy runs after
      the work queued on that stream before ``record`` and before anything the loop queues on it
      next, so a loop that overwrites a tensor right after ``record`` (``zero_()``, a reused
      buffer) cannot change what is written. Values still being produced on another stream (an
      asynchronous collective not yet waited for) must be synchronised with the current stream
      before ``record``, as for any use of them on it. No GPU memory is taken, except a temporary
      contiguous copy of a non-contiguous tensor. A step whose tensors are all on one CUDA device
      goes into one group of pinned buffers per field signature, in one ``torch._foreach_copy_``
      (a third of the training thread's time of one copy per tensor: BENCHMARKS.md, GPU check,
      second run). The cost: the loop's next kernels wait for the
      device-to-host copy of the step's bytes (tens of microseconds a megabyte over PCIe). A side
      stream would overlap that copy, but it was measured to race with such an overwrite
      (BENCHMARKS.md, GPU check). A CUDA event is recorded after the copies on each device and the
      writer thread waits on it before touching the data: no non-blocking copy is ever read
      without that synchronisation.

Sampling (:class:`SamplingPolicy`): every N steps, the first K sequences of a step, and an anomaly
ring that keeps the last N unsampled steps in memory and writes them when a step shows NaN/Inf or a
KL spike, so the steps before a blow-up reach the disk.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from tracer.format.schema import FIELDS


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
            ``ref_kl_k3`` from policy/ref: :func:`tracer.record.batches.anomaly_reason`).
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


@dataclass(slots=True)
class CapturedStep:
    """One step already captured by code that is not the training loop's own ``record`` call: a
    zero-edit watcher (:mod:`tracer.zero_edit.watch`) or an integration, handed to
    :meth:`tracer.record.writer.TraceWriter.record_captured`.

    Attributes:
        step, inner_step, micro_batch: the step's coordinates (ints >= 0).
        tensors: canonical fields (SPEC.md section 4), any device and float dtype, as for ``record``.
        metadata: the step's own metadata (JSON-able), or None.
        owned: names of CPU tensors made for this step alone (indexed rows, derived fields) that the
            caller will not touch again: staged without a copy.
        derive: fields the writer derives from the recorded ones and records with them, off the training
            thread (``ratio``, ``approx_kl_k2``, ``ref_kl_k3``: :func:`tracer.formulas.derived.derive_recorded`).
        signature: the tensors' field signature (a tuple of ``(name, shape, dtype, device)`` per tensor, in
            order) when the caller built it already, e.g. a call-site plan whose guards checked each
            tensor; a signature checked before skips the schema check, so the device is trusted (the
            names, shapes and dtypes are compared). None: built here.
    """

    step: int
    tensors: dict[str, torch.Tensor]
    inner_step: int = 0
    micro_batch: int = 0
    metadata: dict[str, Any] | None = None
    owned: frozenset[str] | set[str] = frozenset()
    derive: tuple[str, ...] = ()
    signature: tuple | None = None


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
    event: Any = None  # CopiesDone (CUDA events) to wait on before reading the tensors
    pinned: list[tuple[torch.Tensor, bool]] = field(default_factory=list)  # (buffer, pinned) to hand back to the pool
    arrived: float = 0.0  # time.monotonic() when it was queued
    specs: Any = None  # safetensors pointer specs made with its checksum (tracer.record.step_bytes)
    summarised: bool = False  # its summary was computed (or tried) with its batch
    settled: bool = False  # written, lost or held by the anomaly ring: a batch's error handler leaves it alone
    derive: tuple[str, ...] = ()  # fields the writer derives and records (tracer.formulas.derived.derive_recorded)
    rows: Any = None  # its per-row statistics and texts for the rollout summaries (tracer.record.step_writer)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def copies_landed(self) -> bool | None:
        """Whether the step's tensors are in host memory, asked without blocking: True for a CPU step
        or a CUDA step whose copies completed, False while they run, None when the event cannot say
        (it raises: a CUDA error left by the training loop, a device-side assert or an illegal
        address; :meth:`wait` then raises too, and the writer counts the step lost)."""
        if self.event is None:
            return True
        try:
            return self.event.query()
        except Exception:  # noqa: BLE001  (any CUDA error: the caller decides what unknown means)
            return None


def first_k_sequences(tensors: dict[str, torch.Tensor], k: int, algorithm: str | None) -> dict[str, torch.Tensor]:
    """Keep the first ``k`` rows of every field whose first dim is B (other tensors as they are):
    :func:`cut_rows` without the batch size."""
    return cut_rows(tensors, k, algorithm)[0]


def cut_rows(tensors: dict[str, torch.Tensor], k: int,
             algorithm: str | None) -> tuple[dict[str, torch.Tensor], int | None]:
    """Keep the first ``k`` rows of every field whose first dim is B (other tensors as they are): the
    canonical fields SPEC.md gives a B dimension, and any other field (a trainer's own, e.g. TRL
    RLOO's ``sequence_ratio``) whose first dimension is the B of those. A step without a canonical
    [B, ...] field has no known B: only its canonical fields would be cut, and it has none.
    Returns the tensors and B when rows were dropped (B > k), else None (the writer records it as
    metadata ``rows_before_cut``: the checks then know the scalar loss covers rows the file lacks)."""
    out, batch = {}, None
    for name, t in tensors.items():
        spec = FIELDS.get(name)
        if spec is not None and spec.dims_for(algorithm)[:1] == ("B",) and t.dim():
            batch = t.shape[0]
            break
    for name, t in tensors.items():
        spec = FIELDS.get(name)
        if spec is not None:
            out[name] = t[:k] if spec.dims_for(algorithm)[:1] == ("B",) else t
        else:
            out[name] = t[:k] if batch is not None and t.dim() and t.shape[0] == batch else t
    return out, (batch if batch is not None and batch > k else None)


class BufferPool:
    """Reusable host buffers, one at a time keyed by (shape, dtype, pinned) or a step's at a time as a
    :class:`BufferGroup` keyed by (field signature, pinned): pinned ones for the CUDA staging path,
    plain ones for CPU staging. A group counts under the limits of its kind as one buffer of its
    total size (a pinned group over ``max_idle_pinned_bytes`` is not kept: the CUDA host allocator's
    own cache then reuses its memory). At most ``pinned_per_key`` idle pinned buffers per key and
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

    def take_group(self, key: tuple, tensors: list[torch.Tensor], pinned: bool = False) -> "BufferGroup":
        """Host buffers shaped like ``tensors`` (pinned ones when ``pinned``), as one
        :class:`BufferGroup` kept under ``key`` (the step's field signature: the same key always
        means the same shapes, dtypes and devices): one lookup per step instead of one per tensor.
        Pinned and plain groups are kept apart (the pool's key is ``(key, pinned)``)."""
        group = self._pop_idle((key, pinned), pinned)
        if group is not None:
            return group
        return BufferGroup((key, pinned), [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors])

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


def _stage_cuda_group(tensors: dict[str, torch.Tensor], pool: "BufferPool", group_key: tuple) -> tuple[dict, Any, list, int]:
    """:func:`stage` of tensors all on one CUDA device whose field signature is ``group_key``: one
    group of pinned buffers, filled by one ``torch._foreach_copy_(..., non_blocking=True)`` on the
    device's current stream, and one event after the copies (the training thread's Python per step
    no longer grows with the number of fields: BENCHMARKS.md, GPU check)."""
    sources = list(tensors.values())
    group = pool.take_group(group_key, sources, pinned=True)
    grad = torch.is_grad_enabled()  # no graph to the buffers
    torch._C._set_grad_enabled(False)
    try:  # queued on the current stream: after the loop's work so far, before what it queues next
        torch._foreach_copy_(list(group), sources, non_blocking=True)
    finally:
        torch._C._set_grad_enabled(grad)
    stream = torch.cuda.current_stream(sources[0].device)
    for src in sources:  # a source made on another stream and freed after record(): not reused until the copy ran
        src.record_stream(stream)
    return dict(zip(tensors, group)), CopiesDone(streams=[stream]), [(group, True)], group.nbytes


class BufferGroup(list):
    """The staging buffers of one step's fields (plain, or pinned for CUDA steps), in field order,
    reused together (:meth:`BufferPool.take_group`); ``key`` is ``(field signature, pinned)``."""

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
    contiguous, without a copy. CUDA tensors go to pinned buffers (``pool``) on their device's current
    stream (module docstring); ``event`` (a :class:`CopiesDone`) must be waited on before the staged
    tensors are read. ``buffers``: the ``(buffer,
    pinned)`` pairs to give back (:meth:`BufferPool.give`) once the step is written.

    ``group_key``: the field signature of ``tensors`` when the caller knows every one is a CPU
    tensor (with ``reuse`` and a ``pool``), or every one is on one CUDA device (with a ``pool``):
    the copies then go into one :class:`BufferGroup` in a single ``torch._foreach_copy_`` (the
    training thread's Python per step no longer grows with the number of fields); CPU tensors named
    in ``owned`` are kept and left out of the group (the group's key then names them).
    """
    if group_key is not None and pool is not None:
        if next(iter(tensors.values())).is_cuda:
            return _stage_cuda_group(tensors, pool, group_key)
        if reuse:
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
        devices = []
        for name, t in cuda:
            # On the source's current stream (a non-blocking copy_ is queued there): ordered after the
            # work queued on it before record() and before whatever the loop queues next (module docstring).
            src = t.detach().contiguous()
            buf = pool.take(src.shape, src.dtype)
            buf.copy_(src, non_blocking=True)
            # A tensor made on another stream and freed by the loop after record() could be reused
            # there while the copy runs: the allocator waits for this stream's work first.
            src.record_stream(torch.cuda.current_stream(src.device))
            staged[name], nbytes = buf, nbytes + buf.numel() * buf.element_size()
            pinned.append((buf, True))
            if src.device not in devices:
                devices.append(src.device)
        event = CopiesDone(devices)
    return staged, event, pinned, nbytes


class CopiesDone:
    """Events recorded after a step's device-to-host copies, one on the current stream of each CUDA
    device they came from; the same two methods as a ``torch.cuda.Event``."""

    def __init__(self, devices: list[torch.device] = (), streams: list[Any] = ()) -> None:
        """One event on the current stream of each of ``devices``, or on each of ``streams``."""
        self._events = []
        for stream in [*streams, *(torch.cuda.current_stream(device) for device in devices)]:
            event = torch.cuda.Event()
            event.record(stream)
            self._events.append(event)

    def synchronize(self) -> None:
        """Block until every copy has landed in host memory."""
        for event in self._events:
            event.synchronize()

    def query(self) -> bool:
        """True when every copy has completed (without blocking)."""
        return all(event.query() for event in self._events)
