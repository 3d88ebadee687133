"""What the write side does with a batch of staged steps, wherever it runs (the writer thread of
:class:`tracer.record.thread.BackgroundWriter`, or the writer process of :mod:`tracer.record.process.child`):
normalise each step, route it through the anomaly ring when one is on, compute the batch's
summaries together, write the steps in order, and hand each step's buffers back.

The anomaly ring keeps the last N unsampled steps in memory and writes them when a step shows
NaN/Inf or a KL spike, so the steps before a blow-up reach the disk. A KL field the step does not
record is derived from its inputs for the test, exactly as readers derive it (:mod:`tracer.formulas.derived`).
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING, Callable

import torch

from tracer import formulas
from tracer.formulas import derived
from tracer.record import step_bytes

if TYPE_CHECKING:
    from tracer.record.capture import StagedStep


def nonfinite_fields(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the float tensors holding a NaN or an infinity, in order (:func:`tracer.record.step_bytes.nonfinite`
    for contiguous CPU tensors, torch for any other)."""
    if all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values()):
        return step_bytes.nonfinite(tensors)
    return [n for n, t in tensors.items() if t.is_floating_point() and t.numel() and not step_bytes.all_finite(t)]


KL_FIELDS = ("ref_kl_k3", "approx_kl_k2")  # the fields a KL spike is measured on, in this order


def anomaly_reason(tensors: dict[str, torch.Tensor], kl_spike: float | None,
                   nonfinite: list[str] | None = None, metadata: dict | None = None) -> str | None:
    """Why a (normalised, CPU) step is an anomaly: non-finite float fields or a KL spike; else None.

    A KL spike: the masked mean (over ``completion_mask``) of ``ref_kl_k3`` or ``approx_kl_k2``
    exceeds ``kl_spike`` nats. A field not recorded is derived from the recorded inputs, as readers
    derive it (:func:`tracer.formulas.derived.derive_fields`: k3 from ref/policy, k2 from policy/old; the
    step's ``metadata`` tells when old is the detached policy). ``nonfinite``: the step's non-finite
    fields when already known (the writer found them while checksumming the step), else they are
    scanned here."""
    bad = nonfinite_fields(tensors) if nonfinite is None else nonfinite
    if bad:
        return f"non-finite values in {bad}"
    mask = tensors.get("completion_mask")
    if kl_spike is not None and mask is not None:
        meta = metadata or {}
        kl = {name: tensors[name] for name in KL_FIELDS if name in tensors}
        kl.update(derived.derive_fields(tensors, meta, wanted=KL_FIELDS))
        for name in KL_FIELDS:
            if name in kl:
                value = float(formulas.masked_mean(kl[name], mask))
                if value > kl_spike or math.isnan(value):
                    inputs = derived.derivation_inputs(tensors, meta, [name])
                    how = "" if name in tensors else f" (derived from {', '.join(inputs)})"
                    return f"{name}{how} masked mean {value:.4g} > kl_spike {kl_spike:g}"
    return None


class BatchHandler:
    """Handles batches of staged steps in order.

    Args:
        write_fn: writes one normalised step, with a reason string when an anomaly forced it out;
            handles its own I/O errors.
        normalise: puts a staged step in stored form (raises for a refused tensor).
        on_error: called with a step that is not written because ``normalise`` raised on it, or
            because handling its batch raised (:meth:`lost`).
        release: called once with each step that is done with (written, lost, or out of the ring).
        ring, kl_spike: the anomaly ring's size (0 = off) and KL threshold
            (:class:`tracer.record.capture.SamplingPolicy`).
        prepare: called with the normalised steps of a batch about to be written (the summaries).
        hold: called with a step the ring keeps (the writer process copies it out of shared memory).
    """

    def __init__(self, write_fn: Callable[["StagedStep", str | None], None],
                 normalise: Callable[["StagedStep"], None], on_error: Callable[["StagedStep", Exception], None],
                 release: Callable[["StagedStep"], None], ring: int = 0, kl_spike: float | None = None,
                 prepare: Callable[[list["StagedStep"]], None] | None = None,
                 hold: Callable[["StagedStep"], None] | None = None) -> None:
        self._write_fn, self._normalise, self._on_error, self._release = write_fn, normalise, on_error, release
        self._ring: collections.deque["StagedStep"] = collections.deque(maxlen=ring)
        self._kl_spike, self._prepare, self._hold = kl_spike, prepare, hold

    def handle(self, batch: list["StagedStep"]) -> None:
        """Write the steps of ``batch`` (or hold them in the ring). Raises only on a bug: then the
        caller passes the batch to :meth:`lost`."""
        ready = []
        for item in batch:
            try:
                item.wait()  # raises on a CUDA error left by the loop: this step is lost, not the batch
                self._normalise(item)
            except Exception as err:  # a refused tensor (e.g. a CUDA float mask holding 0.5), a CUDA error
                self._on_error(item, err)
                self.release(item)
                continue
            ready.append(item)
        if self._ring.maxlen:  # the anomaly ring decides step by step, in order
            for item in ready:
                self._route(item)
            return
        if self._prepare is not None and ready:
            self._prepare(ready)
        for item in ready:
            self._write_fn(item, None)
            self.release(item)

    def lost(self, batch: list["StagedStep"], err: Exception, log) -> None:
        """Handling ``batch`` raised ``err``: the steps not yet written or held are lost (counted)."""
        lost = [item for item in batch if not item.settled]
        log.error("tracer: the writer failed on steps %s: %s: %s", [item.step for item in lost], type(err).__name__, err)
        for item in lost:
            try:
                self._on_error(item, err)  # counted; strict mode raises it from the next call
            except Exception as again:  # noqa: BLE001  (the writer must live on)
                log.error("tracer: reporting the loss of step %s failed: %s", item.step, again)
            self.release(item)

    def release(self, item: "StagedStep") -> None:
        item.settled = True
        self._release(item)

    def _route(self, item: "StagedStep") -> None:
        """With the anomaly ring on: write the step (and the ring before it) or hold it."""
        known = item.metadata.get("nonfinite_fields", []) if "content_sha256" in item.metadata else None
        reason = anomaly_reason(item.tensors, self._kl_spike, known, item.metadata)
        if reason is not None:
            while self._ring:
                before = self._ring.popleft()
                self._write_fn(before, f"before anomaly at step {item.step}: {reason}")
                self.release(before)
            self._write_fn(item, reason)
        elif item.sampled:
            self._write_fn(item, None)
        else:  # held in memory; its buffers are released when it leaves the ring
            if len(self._ring) == self._ring.maxlen:
                self.release(self._ring.popleft())
            if self._hold is not None:
                self._hold(item)
            self._ring.append(item)
            item.settled = True
            return
        self.release(item)
