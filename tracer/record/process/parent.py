"""The writer process (``TraceWriter(writer="process")`` or ``TRACER_WRITER=process``): the write side
(:class:`tracer.record.step_writer.StepWriter`: stored form, checksum, summaries, step files, summary
index) runs in a child process, so the training process holds no writer thread that takes the
interpreter lock (GIL) from the training loop at every step.

How a step travels:

* ``record`` (training thread) checks the step as always, then copies its tensors straight into a
  shared-memory ring (an anonymous ``memfd`` mapped by both processes: nothing in ``/dev/shm`` to
  leak, whatever dies) and writes a descriptor of a few dozen bytes to the command pipe (a child
  lingering for more steps waits on a second pipe, the wake pipe, so this write wakes nobody: it
  costs the training thread half of a write that wakes the child; :meth:`ProcessWriter._wake_child`
  says when the wake pipe is written). The ring holds
  ``max_queue_bytes``; with ``max_queue_steps`` it bounds the steps in flight, and the
  ``when_full`` policy (block / drop and count) applies as with the thread. CUDA tensors are copied
  into the ring synchronously (the copy waits for the GPU's queued work; the thread writer keeps its
  asynchronous pinned path): correct by construction, and the reason ``writer="auto"`` (the
  default, :func:`tracer.record.modes.auto_writer`) gives GPU tensors the thread. A step larger than the ring goes through the pipe itself, once nothing else is in flight.
* The child (:mod:`tracer.record.process.child`) writes what arrives, and sends back one small result per
  batch (ring space freed, steps written, failures with their reason), which ``flush`` / ``close``
  and ``record`` (at most every :data:`RESULTS_EVERY_S`, or when the ring is full) read without
  blocking. The parent's
  :class:`~tracer.record.manifest.ManifestBook` mirrors the counts; drops and skips made in the
  parent travel to the child with the next message. The child rewrites the live manifest at most
  once a second; ``flush()`` and ``close()`` write it in the parent, as with the thread.

Start-up: the child is a fresh interpreter (``subprocess``, never a plain ``fork`` of a process that
may hold CUDA or threads); importing torch takes 1-2 s, during which ``record`` already stages into
the ring (the step bound is lifted to :data:`STARTUP_STEPS` until the child is ready, the byte bound
stays). Failures: a child that dies (killed, out of memory) is noticed within
:data:`RESULTS_EVERY_S` or at the next hand-over (the pipe's end); nothing it was handed is lost: the
steps it had not written are still in the ring (the child only reads it), so they are copied out
(:class:`~tracer.record.process.lifecycle.Orphan`) and written by the writer thread that takes over, with a
warning naming the child's exit status (a step too large for the ring, carried by the pipe, is
counted as dropped). A child that stalls (stopped by SIGSTOP, hung) is treated the same way, so
that the training script never waits forever: when ``flush``, ``close`` or a ``record`` waiting
for room has waited ``stall_s`` seconds (``TraceWriter(writer_stall_s=...)``,
``TRACER_WRITER_STALL_S``, default :data:`~tracer.record.process.lifecycle.STALL_S`; at least
:data:`~tracer.record.process.lifecycle.STARTUP_STALL_S` until the child's first batch) with no progress
from the child (no result, no byte taken from the command pipe, no CPU time used, not in the kernel's
uninterruptible sleep of its I/O), it warns naming
the child's pid, its state and the steps it holds, kills it and rescues those steps as a dead
child's (strict mode: then raises). The child ignores SIGINT (Ctrl-C reaches the whole process
group) and exits after writing what it was handed when the parent closes the writer, or dies: it
sees the pipe's end.

Here: the ring, the descriptors and the hand-over of each step (:class:`ProcessWriter`); the child's
start, the waits for it (stall detection), its stop and the rescue of its steps are its base,
:class:`tracer.record.process.lifecycle.ChildLifecycle`.
"""

from __future__ import annotations

import bisect
import collections
import os
import time
from typing import Any

import torch

from tracer.record.thread import MAX_BATCH
from tracer.errors import TraceError
from tracer.format.names import step_label
from tracer.record.manifest import ManifestBook
from tracer.record.process.lifecycle import STALL_S, ChildLifecycle, Orphan, _close_quietly
from tracer.record.process.pipe import ALIGN, RingLayout, align, frame, step_frame, unframe

STARTUP_STEPS = 1024  # steps that may wait in the ring before the child is ready (its import of torch)
# record() reads the child's results at most this often (ProcessWriter.poll_due): a read of the result pipe
# costs the training thread 40-90 us on a VM (its syscall and the results' bookkeeping); 0.05 s made it a
# third of the backwards of a MiniMind-style PPO loop (BENCHMARKS.md, "Small, realistic and zero-edit loops"). A full
# ring or steps bound reads them at once, so the bounds hold whatever this is.
RESULTS_EVERY_S = 0.2
MAX_LAYOUTS = 4096  # layouts (fields' names, dtypes, shapes) kept; past it each new one reuses the next id


class ProcessWriter(ChildLifecycle):
    """The parent's side: the ring, the pipes and the child (see the module docstring).

    Args:
        config: what the child needs (:meth:`tracer.record.writer.TraceWriter._child_config`).
        book: the parent's counts; results from the child are applied to it.
        max_steps, max_bytes, when_full: the queue's bounds and policy (``max_bytes`` sizes the ring).
        lock_fd: the trace's rank lock, held by the child too while it writes.
        stall_s: seconds a wait for the child may hear nothing from it before the child is declared
            stalled, killed and its steps rescued (module docstring); ``math.inf``: wait forever;
            None: :data:`STALL_S`.
    Raises:
        TraceError: the ring or the child could not be made (no memfd, no memory, no interpreter).
    """

    on_guard = None  # called with each "guard" message of the child's observer (TraceWriter sets it)

    def __init__(self, config: dict[str, Any], book: ManifestBook, max_steps: int, max_bytes: int,
                 when_full: str, lock_fd: int | None = None, stall_s: float | None = None) -> None:
        if when_full not in ("block", "drop"):
            raise ValueError(f"when_full must be 'block' or 'drop', got {when_full!r}")
        self.stall_s = STALL_S if stall_s is None else stall_s
        self.stalled = False  # the child was killed because it stalled (its reason is in dead)
        self._heard_at = time.monotonic()  # when the child last showed progress (a result, a byte taken, CPU time)
        self._cpu = None  # the child's CPU time when last looked at (_activity)
        self.book, self.max_steps, self.when_full = book, max(1, max_steps), when_full
        self.size = align(max(max_bytes, ALIGN))
        self.dead: str | None = None  # why the child is gone
        self.peak_bytes = self._bytes = 0
        # seq, start, end, nbytes, coordinates (step, inner step, micro-batch), and (coordinates, layout,
        # sampled, metadata) of a step in the ring
        self._inflight: collections.deque[tuple] = collections.deque()
        self.orphans: list[Orphan] = []  # the steps a dead child had not written, copied out of the ring
        self._polled_at = 0.0
        self._regions: list[tuple[int, int]] = []  # (start, end) of the ring regions in flight, sorted
        self._seq = 0
        self._layouts: dict[tuple, RingLayout] = {}
        self._last_layout: tuple = (None, None, None, None)  # (key given, source_dtype, derive, layout) of the last step
        self._views: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._ready = False
        self._wrote = False  # the child has reported a batch (its start-up, lazy imports included, is over)
        self._hurried = False  # a "hurry" was sent since the child's last result (_room)
        self._pipe_full = False  # a write found the command pipe full; the next that goes in wakes the child (_pump)
        self._woken = False  # a wake byte was sent for the steps held since the child's last result (submit)
        self._held = 0  # ring bytes the steps in flight hold (their layouts' sizes, padding included)
        # steps in flight at which the lingering child is woken to count them (writer_child.Child._lingering)
        self._wake_at = max(1, min(MAX_BATCH, self.max_steps // 2))
        self._outbox = bytearray()
        self._inbox = bytearray()
        self._acked = self._token = 0
        self._closed_ack = False
        self._ring_fd = None
        try:
            self._start(config, lock_fd)
        except (OSError, ValueError) as err:
            for fd in (self._ring_fd, getattr(self, "_cmd", None), getattr(self, "_res", None),
                       getattr(self, "_wake", None)):
                if fd is not None:
                    _close_quietly(fd)
            raise TraceError(f"tracer: could not start the writer process for {config['root']}: "
                             f"{type(err).__name__}: {err}") from err
        book.forward = {}

    # -- training thread ----------------------------------------------------------------------

    def submit(self, coordinates: tuple[int, int, int], tensors: dict[str, torch.Tensor], sampled: bool,
               source_dtype: str, metadata: dict[str, Any] | None, signature: tuple | None = None,
               derive: tuple[str, ...] = ()) -> bool:
        """Copy one checked step into the ring and hand it over; False when it was dropped (queue
        full under ``when_full="drop"``), None when the child is gone (:attr:`dead`) and the step
        was not taken (the caller writes it another way). A step handed over to a child that turns
        out to be dead is kept for rescue (:attr:`orphans`). ``signature``: a key
        of the tensors' names, dtypes and shapes when the caller has one; ``derive``: fields the
        child derives and records (``TraceWriter._record``), part of the layout. Raises RuntimeError
        when a device copy fails."""
        layout = self._layout(tensors, signature, source_dtype, derive)
        start = self._room(layout.size, coordinates)
        if start is None:
            return None if self.dead is not None else False
        seq, self._seq = self._seq, self._seq + 1
        nbytes = layout.nbytes
        self._bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        if start < 0:  # larger than the ring: through the pipe, once nothing else is in flight
            buffer = bytearray(layout.size)
            self._copy(torch.frombuffer(buffer, dtype=torch.uint8), layout, 0, tensors, cache=False)
            self._inflight.append((seq, 0, 0, nbytes, coordinates, None))
            message = {"k": "step", "q": seq, "c": coordinates, "p": sampled, "l": layout.ident,
                       "inline": layout.size, **({"x": metadata} if metadata else {})}
            self._send(frame(message), payload=buffer, wait=True)
        else:
            self._copy(self._ring, layout, start, tensors)
            self._inflight.append((seq, start, start + layout.size, nbytes, coordinates,
                                   (coordinates, layout, sampled, metadata)))
            bisect.insort(self._regions, (start, start + layout.size))
            self._held += layout.size
            self._send(step_frame(seq, coordinates, sampled, layout.ident, start, metadata))
            if not self._woken and self._holds_half():
                # a lingering child counts its steps only when it reads: once per result read. A count
                # that includes steps of a result not read yet may wake it early; it then lingers on,
                # and the next step after that result is read wakes it again
                self._wake_child()
                self._woken = True
        return True

    def _holds_half(self) -> bool:
        """The steps in flight are enough to end the child's linger (:meth:`tracer.record.process.child.Child._lingering`):
        a batch, half the steps bound, or over half the ring's room."""
        return len(self._inflight) >= self._wake_at or self._held > self.size // 2

    def _wake_child(self) -> None:
        """End a lingering child's wait: one byte on the wake pipe, which a lingering child watches
        instead of the command pipe (so that a step handed over while it lingers costs the training
        thread a write to a pipe nobody waits on, not a wake-up of the child: about half the cost,
        measured in BENCHMARKS.md). A full wake pipe already holds a wake."""
        try:
            os.write(self._wake, b"w")
        except OSError:  # BlockingIOError: it is full; EPIPE: the child is gone (the command pipe says so)
            pass

    def poll_due(self) -> None:
        """:meth:`poll` when :data:`RESULTS_EVERY_S` has passed since the last one or the pipe holds
        what is still to be written: a record need not pay a read of the result pipe (a syscall)
        each time. A child that died meanwhile loses nothing: what it had not written stays in the
        ring (:attr:`orphans`), and a step that finds no room polls at once, so the bounds hold."""
        if self._outbox or time.monotonic() - self._polled_at >= RESULTS_EVERY_S:
            self.poll()

    def poll(self) -> None:
        """Read and apply the child's results so far, without waiting; notice a child that died."""
        if self.dead is not None:
            return
        self._polled_at = time.monotonic()
        self._pump()
        while True:
            try:
                data = os.read(self._res, 1 << 16)
            except BlockingIOError:
                return
            except OSError as err:
                self._gone(f"its result pipe failed ({err})")
                return
            if not data:  # the child's end closed: it died, unless it said "closed" first (it ended as asked)
                if not self._closed_ack:
                    self._gone()
                return
            self._heard_at = time.monotonic()
            self._inbox += data
            for message in unframe(self._inbox):
                self._apply(message)

    def on_writer_thread(self) -> bool:
        return False

    # -- private ------------------------------------------------------------------------------

    def _layout(self, tensors: dict[str, torch.Tensor], key: tuple | None, source_dtype: str,
                derive: tuple[str, ...] = ()) -> RingLayout:
        """The layout of ``tensors`` (sent to the child when new). ``key``: their signature when the
        caller has one; the very tuple given for the last step (a call-site plan's own,
        :mod:`tracer.zero_edit.site_plans`) with the same ``source_dtype`` and ``derive`` is that step's layout,
        without hashing the signature again (19 fields: about 10 us a step)."""
        last = self._last_layout
        if key is not None and key is last[0] and source_dtype == last[1] and derive == last[2]:
            return last[3]
        given = key
        key = (key or tuple((name, t.dtype, t.shape) for name, t in tensors.items()), source_dtype, derive)
        layout = self._layouts.get(key)
        if layout is None:
            layout = RingLayout(len(self._layouts), tensors, source_dtype, derive)
            if len(self._layouts) < MAX_LAYOUTS:
                self._layouts[key] = layout
            else:  # the id is given again (each time, to another layout): no views of it may be reused
                self._views.clear()
            self._send(frame(layout.message()))
        self._last_layout = (given, source_dtype, derive, layout)  # a new layout always replaces it
        return layout

    def _copy(self, ring: torch.Tensor, layout: RingLayout, start: int, tensors: dict[str, torch.Tensor],
              cache: bool = True) -> None:
        """Copy ``tensors`` into their places at ``start``; the views of a (layout, start) are kept."""
        views = self._views.get((layout.ident, start)) if cache else None
        if views is None:
            views = [ring[start + at:start + at + nbytes].view(dtype).view(shape) if nbytes else None
                     for _, dtype, shape, at, nbytes in layout.fields]
            if cache:
                if len(self._views) >= 4096:
                    self._views.clear()
                self._views[(layout.ident, start)] = views
        if layout.dense:  # every field has a view (no empty tensor): the lists as they are
            sources = list(tensors.values())
        else:
            pairs = [(v, t) for v, t in zip(views, tensors.values()) if v is not None]
            views, sources = [v for v, _ in pairs], [t for _, t in pairs]
        grad = torch.is_grad_enabled()  # no graph to the ring; cheaper than a no_grad() context per step
        torch._C._set_grad_enabled(False)
        try:
            if sources and all(t.is_cpu for t in sources):  # one call for the step (usual on CPU)
                torch._foreach_copy_(views, sources)
            else:
                for view, t in zip(views, sources):
                    view.copy_(t)  # CUDA: a synchronous copy to host memory (module docstring)
        finally:
            torch._C._set_grad_enabled(grad)

    def _room(self, size: int, coordinates: tuple[int, int, int]) -> int | None:
        """Where a step of ``size`` bytes goes in the ring (-1: through the pipe), waiting for room
        under ``block``; None when dropped."""
        start = self._place(size) if self.dead is None else None
        since = time.monotonic()
        while start is None:
            self.poll()  # results free room
            if self.dead is not None:
                return None  # the caller writes the step another way
            start = self._place(size)
            if start is not None:
                break
            if not self._hurried:  # a lingering child writes what it holds now (tracer.record.process.child)
                self._send(frame({"k": "hurry"}))  # also when this step drops: so that the next ones do not
                self._wake_child()
                self._hurried = True  # until the child's next result (not one message per dropped step)
            if self.when_full == "drop":
                self.book.queue_full(f"{step_label(*coordinates)}: queue full ({len(self._inflight)} steps, "
                                     f"{self._bytes} bytes; bounds {self.max_steps} steps, {self.size} bytes)")
                return None
            self._wait(since, f"record() of {step_label(*coordinates)}, for room in the ring")
        return start

    def _place(self, size: int) -> int | None:
        """The lowest start of a free stretch of ``size`` bytes (first fit: the ring's start stays warm
        and its views known), -1 for a step larger than the ring when nothing is in flight, None when
        there is no room (or the steps bound is reached)."""
        if not self._inflight:
            return 0 if size <= self.size else -1
        bound = self.max_steps if self._ready else max(self.max_steps, STARTUP_STEPS)
        if len(self._inflight) >= bound or size > self.size or self._outbox:
            return None
        cursor = 0
        for start, end in self._regions:
            if start - cursor >= size:
                return cursor
            cursor = max(cursor, end)
        return cursor if self.size - cursor >= size else None

    def _send_forward(self) -> None:
        forward = self.book.take_forward()
        if forward:
            self._outbox += frame({"k": "counts", **forward})

    def _send(self, data: bytes, payload: bytes | bytearray | None = None, wait: bool = False) -> None:
        """Queue ``data`` (a frame) for the child, after the counts it must hear of first, and write
        what the pipe takes now (``wait``: all of it, and ``payload`` after the frame)."""
        if self.book.forward:
            self._send_forward()  # drops and skips before this message reach the child first
        self._outbox += data
        if payload is not None:
            self._outbox += payload
        self._pump()
        since = time.monotonic()
        while wait and self._outbox and self.dead is None:
            self._wait(since, "record(), for the pipe to take a step larger than the ring")

    def _pump(self) -> None:
        """Write what the command pipe takes now (never blocks). A write that follows one which found
        the pipe full wakes the child again: woken by that one, it may have read the pipe and gone
        back to lingering before these bytes (a flush's, a close's, a hurry's frame among them) went
        in, and a lingering child does not watch the command pipe."""
        wrote = False
        while self._outbox and self.dead is None:
            try:
                written = os.write(self._cmd, self._outbox)
            except BlockingIOError:
                self._wake_child()  # the pipe is full: a lingering child reads it now
                self._pipe_full = True
                return
            except OSError:  # EPIPE: the child is gone
                self._gone()
                return
            if written:
                self._heard_at = time.monotonic()  # the child reads: it makes progress
                wrote = True
            del self._outbox[:written]
        if wrote and self._pipe_full:
            self._pipe_full = False
            self._wake_child()

    def _apply(self, message: dict[str, Any]) -> None:
        kind = message.get("k")
        if kind == "done":
            self._wrote, self._hurried, self._woken = True, False, False
            freed = message["freed"]
            while self._inflight and self._inflight[0][0] <= freed:
                _, start, end, nbytes, _, _ = self._inflight.popleft()
                self._bytes -= nbytes
                self._held -= end - start
                if end > start:
                    del self._regions[bisect.bisect_left(self._regions, (start, end))]
            for _ in range(message.get("w", 0)):
                self.book.written(True)
            for _ in range(message.get("u", 0)):
                self.book.written(False)
            for reason in message.get("f", []):
                self.book.fail(reason, TraceError(reason), forward=False)
        elif kind == "ready":
            self._ready = True
        elif kind == "ack":
            self._acked = max(self._acked, message["t"])
        elif kind == "closed":
            self._closed_ack = True
        elif kind == "guard" and self.on_guard is not None:  # the live guard's report (tracer.record.observer)
            self.on_guard(message)
