"""The writer process's lifecycle, the parent's side (:class:`ChildLifecycle`, the base of
:class:`tracer.record.process.parent.ProcessWriter`): starting the child (the ring's shared memory, the
pipes, a fresh interpreter), waiting for it (``flush``, ``close``, a ``record`` waiting for room)
while watching that it lives and makes progress (stall detection), stopping it, and rescuing what
a child that died or stalled had not written (:class:`Orphan`). The ring, the descriptors and the
hand-over of each step are :mod:`tracer.record.process.parent`'s; its module docstring tells the whole
design, failures included.
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tracer.errors import TraceError
from tracer.format.names import step_label
from tracer.record.process.pipe import RingLayout, frame, unframe

log = logging.getLogger("tracer.record.process.parent")  # the writer process's logger, shared with the parent side

PIPE_BYTES = 2**20  # asked of the kernel for the command pipe (Linux's default unprivileged maximum)
POLL_S = 0.2  # how long a wait for the child looks before checking that it lives
# A wait that hears nothing from the child for this long means the child stalled (tracer.record.process.parent's
# docstring): long enough for a batch of large step files on a slow disk (the child reports after each batch
# of MAX_BATCH).
STALL_S = 60.0
# Until the child has reported its first batch (a fresh interpreter importing torch, then what writing
# imports: 1-2 s, far more on a loaded machine) a wait may hear nothing for at least this long.
STARTUP_STALL_S = 120.0
_F_SETPIPE_SZ = 1031
# The child imports this very copy of tracer's write side, without the package's __init__ (which
# imports the reader, diff and pandas: half a second and tens of MB the writer never uses). Once its
# loop has returned (every file written, its descriptors closed or closing with it) it leaves with
# os._exit: the interpreter's teardown of torch took 0.5 s that close() waited for.
_CHILD_MAIN = ("import sys, types; package = types.ModuleType('tracer'); package.__path__ = [sys.argv[1]]; "
               "sys.modules['tracer'] = package; from tracer.record.process.child import main, leave; "
               "leave(main(sys.argv[2:]))")


def describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _state(pid: int) -> str:
    """A process's state as Linux's /proc tells it ("stopped (T)"), or "" where it cannot be read."""
    names = {"R": "running", "S": "sleeping", "D": "in uninterruptible sleep", "T": "stopped", "t": "stopped",
             "Z": "a zombie"}
    try:
        with open(f"/proc/{pid}/stat") as fh:
            code = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return f"{names.get(code, 'in state')} ({code})"


def _activity(pid: int) -> tuple[str, int] | None:
    """``(state code, CPU clock ticks used: user + system)`` of a process from Linux's /proc, None
    where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])  # state; utime, stime: fields 3, 14, 15 of proc(5)
    except (OSError, IndexError, ValueError):
        return None


def _close_quietly(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _ring_file() -> int:
    """A file descriptor of anonymous shared memory: a memfd (Linux), else a file in /dev/shm (or
    the temporary folder) removed at once; either way nothing is left when both processes end."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("tracer-ring", os.MFD_CLOEXEC)
    import tempfile

    fd, path = tempfile.mkstemp(prefix="tracer-ring-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.unlink(path)
    return fd


@dataclass
class Orphan:
    """A step handed to a writer process that died before writing it, copied out of the ring:
    what ``TraceWriter`` needs to write it on its writer thread instead."""

    coordinates: tuple[int, int, int]
    tensors: dict[str, torch.Tensor]
    sampled: bool
    source_dtype: str
    metadata: dict[str, Any] | None
    derive: tuple[str, ...]


class ChildLifecycle:
    """:class:`tracer.record.process.parent.ProcessWriter`'s start, waits (stall detection), stop and rescue
    (the module docstring); the ring, the pipes and what travels through them are that class's."""

    def _start(self, config: dict[str, Any], lock_fd: int | None) -> None:
        self._ring_fd = _ring_file()
        os.ftruncate(self._ring_fd, self.size)
        self._mm = mmap.mmap(self._ring_fd, self.size)
        self._ring = torch.frombuffer(self._mm, dtype=torch.uint8)
        child_ends: list[int] = []  # the child's ends, ours to close once it has them or when a pipe fails
        try:
            cmd_r, self._cmd = os.pipe()
            child_ends.append(cmd_r)
            self._res, res_w = os.pipe()
            child_ends.append(res_w)
            wake_r, self._wake = os.pipe()
            child_ends.append(wake_r)
            try:
                import fcntl

                fcntl.fcntl(self._cmd, _F_SETPIPE_SZ, PIPE_BYTES)
            except (ImportError, OSError):
                pass
            fds = [cmd_r, res_w, self._ring_fd, wake_r] + ([lock_fd] if lock_fd is not None else [])
            self._child = subprocess.Popen(
                [sys.executable, "-c", _CHILD_MAIN, str(Path(__file__).resolve().parent), str(cmd_r), str(res_w),
                 str(self._ring_fd), str(wake_r)],
                pass_fds=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)
        finally:
            _close_quietly(*child_ends)
        self.pid = self._child.pid
        # a writer dropped without close(): the pipes' ends tell the child to finish and exit (it writes
        # what it was handed without a reader of its results); the ring's descriptor goes with them
        self._hang_up = weakref.finalize(self, _close_quietly, self._cmd, self._wake, self._res, self._ring_fd)
        os.set_blocking(self._cmd, False)
        os.set_blocking(self._wake, False)
        os.set_blocking(self._res, False)
        self._send(frame({"k": "config", **config, "ring_bytes": self.size}))

    def flush(self) -> None:
        """Wait until the child has handled every step handed over (or died, or stalled)."""
        if self.dead is not None:
            return
        self._token += 1
        self._send_forward()
        self._send(frame({"k": "flush", "t": self._token}))
        self._wake_child()
        since = time.monotonic()
        while self.dead is None and self._acked < self._token:
            self._wait(since, "flush()")

    def stop(self) -> None:
        """Hand over the rest, tell the child to finish, wait for it to exit; release the ring
        (idempotent)."""
        if self._ring_fd is None:
            return
        if self.dead is None:
            self._send_forward()
            self._send(frame({"k": "close"}))
            self._wake_child()
            since = time.monotonic()
            while self.dead is None and not self._closed_ack:
                self._wait(since, "close()")
        try:
            self._child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._end_child()
        self._hang_up()  # the pipes and the ring's descriptor (its mapping holds one of its own)
        self._views.clear()
        self._ring = None
        try:
            self._mm.close()
        except BufferError:  # a view still exported: the mapping goes with the last one
            pass
        self._ring_fd = None

    def cancel_start(self) -> bool:
        """Kill a child that has not yet said it is ready (it is still importing) and rescue what it
        was handed into :attr:`orphans`, as a dead child's; False, doing nothing, when the child is
        ready or gone, or holds a step that travelled through the pipe (larger than the ring: it
        could not be rescued)."""
        self.poll()
        if self.dead is not None or self._ready or any(entry[5] is None for entry in self._inflight):
            return False
        self._end_child()
        self._gone("was still starting when the trace was closed")
        return True

    def _wait(self, since: float, waiting: str) -> None:
        """Wait up to POLL_S for a result (or for the pipe to take more), then read results; notice
        a child that died, or one that stalled: no progress from it (no result, no byte taken from
        the pipe, no CPU time used) for :attr:`stall_s` (at least :data:`STARTUP_STALL_S` before its
        first batch) of this wait, begun at ``since`` by ``waiting`` (what waits, for the warning)."""
        writable = [self._cmd] if self._outbox else []
        try:
            select.select([self._res], writable, [], POLL_S)
        except InterruptedError:
            pass
        self.poll()
        if self.dead is None and self._child.poll() is not None:
            self.poll()  # its last results first
            if self.dead is None and not self._closed_ack:  # a child that said "closed" has ended as asked
                self._gone()
        limit = self.stall_s if self._wrote else max(self.stall_s, STARTUP_STALL_S)
        activity = _activity(self.pid)
        cpu = activity and activity[1]
        if cpu != self._cpu or (activity and activity[0] == "D"):
            # busy, not stalled: it computes (imports, summaries), or the kernel does its I/O (uninterruptible
            # sleep: an fsync on a slow disk, an NFS server that may recover; SIGKILL would wait for it too,
            # and a thread taking over would write to the same disk)
            self._cpu, self._heard_at = cpu, time.monotonic()
        quiet = time.monotonic() - max(since, self._heard_at)
        if self.dead is None and quiet >= limit:
            self._stall(waiting, quiet)

    def _stall(self, waiting: str, quiet: float) -> None:
        """The child stalled: say what it holds, kill it, rescue its steps as a dead child's (:meth:`_gone`)."""
        held = [coordinates[0] for *_, coordinates, _ in self._inflight]
        steps = f"step {held[0]}" if len(held) == 1 else f"steps {held[0]} to {held[-1]}" if held else ""
        what = (f"holding {len(held)} step(s) not yet written ({steps}, {self._bytes} bytes)" if held
                else "holding no step")
        state = _state(self.pid)
        self.stalled = True
        self._end_child()
        self._gone(f"made no progress for {quiet:.1f} s while {waiting} waited for it ({state or 'state unknown'}; "
                   f"{what}; stall limit {self.stall_s:g} s, TraceWriter(writer_stall_s=...)) and was killed")

    def _end_child(self) -> None:
        """Kill the child and reap it (a child stuck in the kernel is left to be reaped later)."""
        self._child.kill()
        try:
            self._child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("tracer: the writer process (pid %d) did not end within 10 s of SIGKILL", self.pid)

    def _read_last_results(self) -> None:
        """The results the dead child sent before it died (the pipe keeps them after its end closed)."""
        while True:
            try:
                data = os.read(self._res, 1 << 16)
            except OSError:  # BlockingIOError: nothing more now; any other: nothing more at all
                return
            if not data:
                return
            self._inbox += data
            for message in unframe(self._inbox):
                self._apply(message)

    def _copy_out(self, layout: "RingLayout", start: int) -> dict[str, torch.Tensor]:
        """A step's tensors, copied out of the ring at ``start``."""
        return {name: self._ring[start + at:start + at + nbytes].view(dtype).view(shape).clone() if nbytes
                else torch.empty(shape, dtype=dtype) for name, dtype, shape, at, nbytes in layout.fields}

    def _gone(self, why: str | None = None) -> None:
        """The child is gone: its last results are read, and every step it had not written is
        copied out of the ring into :attr:`orphans` (the caller writes them another way); a step
        that travelled through the pipe is counted as dropped, with the child's exit as the reason."""
        if self.dead is not None:
            return
        deadline = time.monotonic() + 2.0
        while self._child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._child.poll() is None:
            self._end_child()
        self._read_last_results()
        reason = f"the writer process (pid {self.pid}) {why or describe_exit(self._child.poll())}"
        self.dead = reason
        for _, start, _, _, coordinates, rescue in self._inflight:
            if rescue is None:
                self.book.fail(f"{step_label(*coordinates)}: not written: {reason}", TraceError(reason), forward=False)
            else:
                coordinates, layout, sampled, metadata = rescue
                self.orphans.append(Orphan(coordinates, self._copy_out(layout, start), sampled,
                                           layout.source_dtype, metadata, layout.derive))
        self._inflight.clear()
        self._regions.clear()
        self._bytes = 0
        self._outbox.clear()
        self.book.forward = None
