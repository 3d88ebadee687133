"""The writer process's side of :mod:`tracer.record.process.parent` (``python -m tracer.record.process.child CMD RES
RING WAKE``: the command pipe to read, the result pipe to write, the shared ring's memfd, the wake
pipe; all four inherited from the training process, which starts it).

It runs the same write side as the writer thread (:class:`tracer.record.step_writer.StepWriter` through
:class:`tracer.record.batches.BatchHandler`): the steps read from the pipe in one go are handled as one
batch (their summaries computed together). Like the writer thread it lingers for more
(:data:`CHILD_LINGER_S`, the thread's :data:`tracer.record.thread.LINGER_S`, or until ``MAX_BATCH`` steps,
half the steps bound or half the ring's room are in hand: :meth:`Child._lingering`): a batch's cold
start (the interpreter's data evicted by the training step in between) is most of a small step's
cost, 0.8-2 ms of CPU per step file handled alone against about 0.3 ms in batches (``python -m
bench.writer_cost --writer process``), CPU taken from the training process wherever it uses the
other cores. It does not linger when told to hurry: a ``flush()``, a ``close()``, a ``record()``
that found no room in the ring (``hurry``: it waits for room, or under ``when_full="drop"`` dropped
its step), or the training process gone, so nobody waits for the linger. While it lingers it waits
on the wake pipe alone, not on the command pipe: the parent writes a byte there for a flush, a
close, a hurry, and when the steps it has handed over since the child's last result reach a
batch, half the steps bound or half the ring (what the child would count if it read them), so a
step handed over meanwhile costs the training thread a pipe write that wakes nobody. After each batch (of at
most ``MAX_BATCH`` steps) it sends one result message (ring space freed up to a step, steps written,
failures with their reason): a parent that waits and hears nothing for long takes the child for
stalled (:mod:`tracer.record.process.parent`).
Steps the anomaly ring holds are copied out of shared memory first, so their ring space is freed at once.

It ignores SIGINT (a Ctrl-C in the terminal reaches the whole process group: the training process
decides), and it ends after a ``close`` message or when the command pipe reaches its end (the
training process died, or closed the pipe), in both cases after writing every step it was handed.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tracer.record.batches import BatchHandler
from tracer.record.capture import StagedStep
from tracer.record.thread import LINGER_S, MAX_BATCH
from tracer.format.names import MANIFEST_NAME
from tracer.format.files import save_atomic, write_json_atomic
from tracer.record.manifest import MANIFEST_INTERVAL_S, ManifestBook
from tracer.record.step_writer import StepWriter, step_header
from tracer.record.observer import LockedSend, build_in_child
from tracer.record.process.pipe import FRAME, frame, parse_body

log = logging.getLogger("tracer.record.process.child")
# Added to the writer process's nice value. Less than the writer thread's 10: a process at nice 10
# gets about a tenth of a core against ordinary load, falls behind, and the training process then
# waits for room in the ring (BENCHMARKS.md, "Writer throughput and CPU").
WRITER_PROCESS_NICENESS = 5
CHILD_LINGER_S = LINGER_S  # the child waits up to this long for more steps to batch with (module docstring)
MAX_VIEWS = 4096  # (layout, ring offset) pairs whose tensor views are kept (cleared when full)
PREFAULT_BYTES = 8 * 2**20  # of the ring faulted in at the start (shared memory the ring would touch anyway)


class _ChildBook(ManifestBook):
    """The child's counts (for its live manifest), and the report of each batch for the parent."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.report: dict[str, Any] = {"w": 0, "u": 0, "f": []}

    def written(self, sampled: bool = True) -> None:
        super().written(sampled)
        self.report["w" if sampled else "u"] += 1

    def fail(self, reason: str, err: BaseException, forward: bool = True) -> None:
        self.count_drop(reason, warn=False)  # the parent warns (or raises, strict) when it reads the report
        self.report["f"].append(reason)

    def take_report(self) -> dict[str, Any]:
        report, self.report = self.report, {"w": 0, "u": 0, "f": []}
        return report


class _Channel:
    """Framed messages in (a step too large for the ring carries its bytes after its frame), out; and
    the wake pipe (``wake``: None once its end is reached), whose bytes only end a linger."""

    def __init__(self, cmd: int, res: int, wake: int | None = None) -> None:
        self.cmd, self.res, self.wake, self.eof = cmd, res, wake, False
        if wake is not None:
            os.set_blocking(wake, False)
        self._buffer = bytearray()
        self.parent_alive = True
        self.carried: list[dict[str, Any]] = []  # read with the config, handled after it

    def read(self, timeout: float, lingering: bool = False) -> list[dict[str, Any]]:
        """The messages complete after waiting up to ``timeout`` s for more bytes, or (``lingering``)
        for a wake byte only: the steps handed over meanwhile wait in the command pipe, unread (a
        write to a pipe a reader waits on costs the writer a wake-up of the reader, twice the cost of
        the write alone: BENCHMARKS.md, "Writer throughput and CPU"), and are read when the wait ends."""
        if not self.eof:
            watch = [self.cmd] if self.wake is None else [self.wake] if lingering else [self.cmd, self.wake]
            ready, _, _ = select.select(watch, [], [], max(0.0, timeout))
            if self.wake is not None and self.wake in ready:
                self._drain_wake()
            ready, _, _ = select.select([self.cmd], [], [], 0)
            while ready:
                data = os.read(self.cmd, 1 << 20)
                if not data:
                    self.eof = True
                    break
                self._buffer += data
                ready, _, _ = select.select([self.cmd], [], [], 0)
        carried, self.carried = self.carried, []
        return carried + self._messages()

    def _messages(self) -> list[dict[str, Any]]:
        out, at, buf = [], 0, self._buffer
        while len(buf) - at >= 4:
            (size,) = FRAME.unpack_from(buf, at)
            if len(buf) - at - 4 < size:
                break
            message = parse_body(bytes(buf[at + 4:at + 4 + size]))
            end = at + 4 + size + message.get("inline", 0)
            if len(buf) < end:
                if self.eof:  # a torn last step: the parent died while handing it over
                    break
                self._read_exactly(end - len(buf))
                buf = self._buffer
                if len(buf) < end:
                    break
            if "inline" in message:
                message["payload"] = bytearray(buf[at + 4 + size:end])
            out.append(message)
            at = end
        del self._buffer[:at]
        return out

    def _drain_wake(self) -> None:
        """Read the wake bytes there are; at the pipe's end (the training process gone, or its writer
        dropped) stop watching it: the command pipe's end follows."""
        while True:
            try:
                data = os.read(self.wake, 4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                os.close(self.wake)
                self.wake = None
                return

    def _read_exactly(self, missing: int) -> None:
        while missing > 0:
            data = os.read(self.cmd, missing)
            if not data:
                self.eof = True
                return
            self._buffer += data
            missing -= len(data)

    def send(self, message: dict[str, Any]) -> None:
        if not self.parent_alive:
            return
        data = frame(message)
        try:
            while data:
                data = data[os.write(self.res, data):]
        except OSError:  # the parent is gone: write what was handed over all the same
            self.parent_alive = False


class Child:
    """Writes the steps the training process hands over (module docstring)."""

    def __init__(self, config: dict[str, Any], ring_fd: int, channel: _Channel) -> None:
        self.channel = channel
        self.root = Path(config["root"])
        self.rank, self.world_size, self.algorithm = config["rank"], config["world_size"], config["algorithm"]
        self.hyperparameters = config["hyperparameters"]
        self.max_steps, self.ring_bytes = max(1, config["max_queue_steps"]), config["ring_bytes"]
        self.ring = mmap.mmap(ring_fd, config["ring_bytes"])
        _populate(self.ring, min(config["ring_bytes"], PREFAULT_BYTES))
        tmp_name = f".{MANIFEST_NAME}.writer-{os.getpid()}.partial"  # never the parent's temporary name
        self.book = _ChildBook(self.root, self.rank, config["manifest"], False,
                               lambda path, data: write_json_atomic(path, data, tmp_name))
        self.observer = None  # the live guard's checks, in this process (tracer.record.observer)
        if config.get("observer"):
            channel.send = LockedSend(channel.send)  # its thread reports beside this loop's results
            try:
                self.observer = build_in_child(config["observer"], self.root, self.rank, channel.send)
            except Exception as err:  # noqa: BLE001  (no guard is no reason to stop writing)
                log.warning("the guard could not start here: %s: %s", type(err).__name__, err)
        self.steps = StepWriter(self.root, self.rank, self.algorithm, config["keep_source_dtype"],
                                self.hyperparameters, self.book, save_atomic, config.get("fsync_steps", False),
                                observer=self.observer)
        self.handler = BatchHandler(self.steps.write, self.steps.normalise, self.steps.on_normalise_error,
                                    lambda item: None, config["anomaly_ring"], config["kl_spike"],
                                    self.steps.summarise, hold=_own_copy)
        self.layouts: dict[int, dict[str, Any]] = {}
        self._views: dict[tuple[int, int], tuple[dict[str, torch.Tensor], int]] = {}  # (layout, offset): views
        self.pending: list[tuple[int, StagedStep]] = []
        self.pending_room = 0  # ring bytes the pending steps hold: their layouts' sizes, padding included
        self.first_at: float | None = None
        self.linger_s = float(config.get("linger_s", CHILD_LINGER_S))  # tests set it

    def run(self, parent: int) -> int:
        self.channel.send({"k": "ready", "pid": os.getpid()})
        while True:
            now = time.monotonic()
            timeout = (self.first_at + self.linger_s - now) if self.pending else MANIFEST_INTERVAL_S
            flushes, close, hurry = [], False, False
            for message in self.channel.read(timeout, lingering=bool(self.pending)):
                kind = message["k"]
                if kind == "step":
                    self._arrive(message)
                elif kind == "layout":
                    if message["id"] in self.layouts:  # an id given again (the parent keeps 4096 layouts)
                        self._views.clear()
                    self.layouts[message["id"]] = message
                elif kind == "counts":
                    self._counts(message)
                elif kind == "flush":
                    flushes.append(message["t"])
                elif kind == "close":
                    close = True
                elif kind == "hurry":  # a record found no room in the ring (it waits, or dropped its step)
                    hurry = True
            gone = self.channel.eof or os.getppid() != parent
            if self.pending and (flushes or close or hurry or gone or not self._lingering()):
                self._write_pending()
            self.steps.index.flush(due_only=True)
            self.book.update()
            if flushes:
                self.steps.index.flush()
                self.channel.send({"k": "ack", "t": max(flushes)})
            if close or gone:
                if self.observer is not None:
                    try:
                        self.observer.close()  # its last checks and reports, before "closed"
                    except Exception as err:  # noqa: BLE001
                        log.warning("closing the guard failed: %s: %s", type(err).__name__, err)
                self.steps.index.close()
                self.steps.rollouts.close()
                if not close:  # the training process died: nobody else will write the counts
                    self.book.update(force=True)
                self.channel.send({"k": "closed"})
                return 0

    def _lingering(self) -> bool:
        """Wait for more steps to batch with: fewer than a batch, room to spare, time left. The room
        is the ring's the pending steps hold, each field on its 64-byte boundary (a step of many small
        fields holds several times its bytes; one carried by the pipe, more than the ring): with at
        most half of it held, a step of up to half the ring finds room without waiting for the linger."""
        roomy = len(self.pending) < self.max_steps // 2 and self.pending_room <= self.ring_bytes // 2
        return (len(self.pending) < MAX_BATCH and roomy
                and time.monotonic() < self.first_at + self.linger_s)

    def _arrive(self, message: dict[str, Any]) -> None:
        layout = self.layouts[message["l"]]
        if "inline" in message:
            tensors, nbytes = _views_of(layout, message["payload"], 0)
        else:  # the ring: first-fit placement puts a loop's steps at the same few offsets again and again
            key = (message["l"], message["o"])
            views = self._views.get(key)
            if views is None:
                if len(self._views) >= MAX_VIEWS:
                    self._views.clear()
                views = self._views[key] = _views_of(layout, self.ring, message["o"])
            tensors, nbytes = dict(views[0]), views[1]  # a dict of its own: a step's fields get replaced
        step, inner_step, micro_batch = message["c"]
        header = step_header(self.hyperparameters, message.get("x"), self.algorithm, step, inner_step, micro_batch,
                             self.rank, self.world_size, layout["d"])
        self.pending.append((message["q"], StagedStep(step, inner_step, micro_batch, tensors, header, nbytes,
                                                      message["p"], derive=tuple(layout.get("v", ())))))
        self.pending_room += layout["size"]
        if self.first_at is None:
            self.first_at = time.monotonic()

    def _counts(self, message: dict[str, Any]) -> None:
        if message.get("drops"):
            self.book.add_drops(message["drops"], message.get("reasons", []))
        if message.get("skipped"):
            self.book.skipped(message["skipped"])
        for key, value in message.get("notes", {}).items():
            self.book.annotate(key, value)

    def _write_pending(self) -> None:
        batch, self.pending, self.pending_room, self.first_at = self.pending, [], 0, None
        for at in range(0, len(batch), MAX_BATCH):
            chunk = [item for _, item in batch[at:at + MAX_BATCH]]
            try:
                self.handler.handle(chunk)
            except Exception as err:  # noqa: BLE001  (a bug here must not end the writer: the parent would wait)
                self.handler.lost(chunk, err, log)
            # after each chunk: ring space back sooner, and the parent hears progress (its stall rule)
            self.channel.send({"k": "done", "freed": batch[at:at + MAX_BATCH][-1][0], **self.book.take_report()})


def _views_of(layout: dict[str, Any], buffer: Any, base: int) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors of a step laid out by ``layout`` at ``base`` in ``buffer`` (views, no copy; an
    empty tensor has no bytes in the ring), and their bytes."""
    tensors, nbytes = {}, 0
    for name, dtype_name, shape, at, size in layout["fields"]:
        dtype = getattr(torch, dtype_name)
        if size:
            tensors[name] = torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape), offset=base + at).view(shape)
        else:
            tensors[name] = torch.empty(shape, dtype=dtype)
        nbytes += size
    return tensors, nbytes


def _populate(ring: mmap.mmap, nbytes: int) -> None:
    """Fault in the ring's first ``nbytes`` (where first-fit placement puts the steps of a writer
    that keeps up) without touching their contents: the training process's copies then meet
    mapped pages instead of a page fault per 4 KiB (Linux's MADV_POPULATE_WRITE; elsewhere
    nothing)."""
    try:
        ring.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), 0, nbytes)
    except (OSError, ValueError, AttributeError):
        pass


def _own_copy(item: StagedStep) -> None:
    """A step the anomaly ring holds leaves shared memory (its ring space is reused at once)."""
    item.tensors = {name: t.clone() for name, t in item.tensors.items()}
    item.specs = None  # they pointed into the ring; save_atomic makes new ones


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cmd, res, ring_fd = (int(arg) for arg in argv[:3])
    wake = int(argv[3]) if len(argv) > 3 else None
    parent = os.getppid()
    try:
        os.nice(WRITER_PROCESS_NICENESS)
    except OSError:
        pass
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="tracer writer process: %(message)s")
    channel = _Channel(cmd, res, wake)
    config = None
    while config is None:
        messages = channel.read(MANIFEST_INTERVAL_S)
        if messages:
            config, channel.carried = messages[0], messages[1:]
        elif channel.eof:
            return 0
    return Child(config, ring_fd, channel).run(parent)


def leave(code: int) -> None:
    """End the child with ``code`` once :func:`main` has returned: its logs and standard streams
    flushed, then ``os._exit`` (every step file is renamed into place and the index closed by then;
    what the interpreter's own exit would add is the teardown of torch's modules, 0.5 s here)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
