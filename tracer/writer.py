"""Write traces: one safetensors file per (step, inner step, micro-batch, rank), atomic, plus a
manifest and the token strings at the trace root (SPEC.md section 5; layout in :mod:`tracer.layout`).

A step file is written to ``<name>.partial``, flushed to disk, then renamed: readers never see a
partial file.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Mapping

import torch

from tracer.layout import (  # noqa: F401  (re-exported: the writer's public names)
    FORMAT_NAME,
    MANIFEST_NAME,
    STEPS_DIR,
    TOKENS_NAME,
    content_sha256,
    producers,
    lock_rank,
    refuse_existing_trace,
    save_atomic as _save_atomic,
    step_file_name,
    token_strings,
    tokenizer_identity,
    unlock_rank,
    unshare as _unshare,
    write_json_atomic,
)
from tracer import step_bytes, summaries
from tracer.run_index import IndexWriter
from tracer.derived import derive_fields
from tracer.capture import (MAX_BATCH, BackgroundWriter, BufferPool, SamplingPolicy, StagedStep, first_k_sequences,
                            stage)
from tracer.errors import SchemaError, TraceError
from tracer.schema import (ALGORITHMS, BOOL, FIELDS, SCHEMA_VERSION, check_mask_field, check_tensors,
                           encode_metadata, jsonable, normalise_tensors)

log = logging.getLogger(__name__)


def _distributed_rank() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed, else from torchrun's RANK / WORLD_SIZE variables
    (a writer created before ``init_process_group`` still knows its rank), else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


# Step metadata keys the writer sets itself; a caller passing one would be silently overridden.
WRITER_KEYS = frozenset({"schema_version", "algorithm", "step", "inner_step", "micro_batch", "rank", "world_size",
                         "source_dtype", "content_sha256", "nonfinite_fields", "anomaly", summaries.SUMMARY_KEY})
MAX_METADATA_BYTES = 4 * 2**20  # well under the reader's 16 MiB header cap
MAX_SIGNATURES = 256  # field signatures (names, shapes, dtypes, devices) whose schema check is cached
MANIFEST_INTERVAL_S = 1.0  # the live manifest (steps_written, drops) is rewritten at most this often


def _coordinate(name: str, value: Any) -> int:
    """``step`` / ``inner_step`` / ``micro_batch`` as an int >= 0 (numpy and torch integers accepted)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if hasattr(value, "__index__") and not isinstance(value, bool):
        value = value.__index__()
        if 0 <= value < 2**62:
            return value
    raise SchemaError(f"{name} must be an integer in [0, 2**62), got {value!r:.40} ({type(value).__name__}); "
                      f"pass the {name.replace('_', ' ')} counter as an int")


class TraceWriter:
    """Writes the steps of one run into a trace directory, off the training thread.

    ``record`` validates shapes, stages the tensors (a host copy the loop cannot mutate) and
    returns; a background thread normalises, serialises and writes them (:mod:`tracer.capture`).
    ``flush()`` waits for the queue to drain; ``close()`` (or leaving a ``with`` block, or normal
    interpreter exit) flushes and marks the trace finished.

    Args:
        out_dir: the trace directory; created when missing. A directory that already holds a trace
            with steps is refused (nothing the user had is overwritten).
        algorithm: one of ``ppo | grpo | cispo | rloo | dpo``.
        tokenizer: optional; its token strings are stored once in ``tokens.json``.
        config: run configuration (JSON-able dict) kept in the manifest.
        hyperparameters: step metadata written into every step file (``num_generations``, ``beta``,
            ``clip_epsilon_low``... SPEC section 4 keys).
        strict: when True, a failed write raises TraceError (from the next ``record``, ``flush`` or
            ``close`` when writing in the background: the first pending failure, with the count of
            all failures since the last one raised); otherwise a warning is issued and training goes
            on. Either way every failed write is counted in the manifest's ``dropped_steps``.
        keep_source_dtype: store floats in their source dtype instead of float32.
        sampling: which steps and sequences to write (:class:`tracer.capture.SamplingPolicy`).
        async_write: write on a background thread (default); False writes inside ``record``.
        max_queue_steps, max_queue_bytes: bound of the background queue (steps waiting to be written).
        when_full: ``"block"`` (wait for room; nothing lost) or ``"drop"`` (drop and count: the
            count is kept in memory and written to the manifest by the writer thread, so ``record``
            never waits on the disk).

    Each step file's header also holds the step's summary (``summary``: masked means, quantiles,
    clip fractions, kept tokens, NaN counts; :mod:`tracer.summaries`), computed by the writer thread
    as it writes the file (by ``record`` itself when ``async_write=False``), so that a run overview
    reads headers only; after each file the writer thread also queues one line for the run's
    summary index (``summary_index.rank_N.jsonl``, :mod:`tracer.run_index`: name, size and summary,
    appended at most every second and at ``flush()`` / ``close()``, never fsync'd), so that an
    overview of many steps reads one file. ``record`` checks the schema once per field signature (names, shapes,
    dtypes, devices); later records with that signature check only the values of non-bool masks.

    The manifest's live fields (``steps_written``, ``dropped_steps``, ``drop_reasons``) are rewritten
    by the writer thread at most every :data:`MANIFEST_INTERVAL_S` seconds, by ``flush()``, and at
    ``close()``. A writer belongs to the process that created it: a child made by ``fork()`` that
    calls ``record``, ``flush`` or ``count_drop`` on an inherited writer gets a TraceError at once
    (the writer thread and the file lock stayed in the parent); create a new writer in the child.

    Raises:
        TraceError: unknown algorithm, or ``out_dir`` already holds a trace.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        algorithm: str,
        tokenizer: Any = None,
        config: Mapping[str, Any] | None = None,
        hyperparameters: Mapping[str, Any] | None = None,
        strict: bool = False,
        keep_source_dtype: bool = False,
        sampling: SamplingPolicy | None = None,
        async_write: bool = True,
        max_queue_steps: int = 16,
        max_queue_bytes: int = 512 * 2**20,
        when_full: str = "block",
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise TraceError(f"algorithm {algorithm!r} is not one of {list(ALGORITHMS)}")
        if sampling is not None and sampling.anomaly_ring and not async_write:
            raise TraceError("the anomaly ring (sampling.anomaly_ring > 0) holds steps on the writer thread; "
                             "use async_write=True (the default) with it")
        self.root = Path(out_dir)
        self.algorithm = algorithm
        self.strict = strict
        self.keep_source_dtype = keep_source_dtype
        self.hyperparameters = dict(hyperparameters or {})
        self.sampling = sampling or SamplingPolicy()
        self.rank, self.world_size = _distributed_rank()
        self.steps_written = 0
        self.dropped_steps = 0
        self.skipped_steps = 0  # not selected by the sampling policy (not an error)
        self.drop_reasons: list[str] = []
        self._error: tuple[str, BaseException] | None = None  # strict mode: the first failure not yet raised
        self._failures_pending = 0  # strict mode: failures since the last one raised
        self._lock = threading.Lock()  # counts; held briefly, never during I/O
        self._manifest_lock = threading.Lock()  # one manifest write at a time (writer thread, flush, close)
        self._dirty = False  # counts changed since the manifest was last written
        self._manifest_written_at = 0.0
        self._closed = False
        self._pid = os.getpid()  # a forked child must not close (or unlock) its parent's trace
        # a non-JSON hyperparameter raises SchemaError now, naming it
        self._hyperparameters_encoded = encode_metadata(self.hyperparameters)  # once, not per step
        self._hyperparameter_bytes = sum(len(k) + len(v) for k, v in self._hyperparameters_encoded.items())
        self._recorded: set[tuple[int, int, int]] = set()
        self._signatures: dict[tuple, tuple[str, tuple[str, ...]]] = {}  # checked field signatures
        self._plans: dict[tuple, step_bytes.StepPlan] = {}  # signatures already in stored form, planned
        self._steps_dir = self.root / STEPS_DIR
        refuse_existing_trace(self.root, self.rank)
        steps_dir = self.root / STEPS_DIR
        steps_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_rank(self.root, self.rank)  # one writer per (trace, rank), across processes
        self._manifest: dict[str, Any] = {
            "format": FORMAT_NAME,
            "schema_version": SCHEMA_VERSION,
            "algorithm": algorithm,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "producers": producers(),
            "world_size": self.world_size,
            "hyperparameters": jsonable(self.hyperparameters),
            "config": jsonable(dict(config or {})),
            "sampling": dataclasses.asdict(self.sampling),
            "capture": {"async_write": async_write, "max_queue_steps": max_queue_steps,
                        "max_queue_bytes": max_queue_bytes, "when_full": when_full},
            "status": "running",
        }
        if tokenizer is not None:
            self._manifest["tokenizer"] = tokenizer_identity(tokenizer)
            if self.rank == 0:
                try:
                    write_json_atomic(self.root / TOKENS_NAME, {"tokens": token_strings(tokenizer)})
                except OSError as err:  # the trace stays usable: ids show as <id N>
                    if strict:
                        unlock_rank(self._lock_fd)
                        raise TraceError(f"could not write {self.root / TOKENS_NAME}: {err}") from err
                    warnings.warn(f"tracer: could not write {self.root / TOKENS_NAME} ({err}); token ids "
                                  "will show without text. Training continues.", RuntimeWarning, stacklevel=2)
        try:
            self._write_manifest()
        except OSError as err:
            if strict:
                unlock_rank(self._lock_fd)
                raise TraceError(f"could not write {self.root / MANIFEST_NAME}: {err}") from err
            log.warning("tracer: could not write the manifest of %s: %s", self.root, err)
        self._index = IndexWriter(self.root, self.rank)  # the run's summary index (tracer.run_index)
        self._pool = BufferPool(per_key=max(4, 2 * min(max_queue_steps, MAX_BATCH)))
        self._background = BackgroundWriter(
            self._write_staged, self._normalise_staged, self._on_normalise_error, self._count_drop,
            max_queue_steps, max_queue_bytes, when_full, self.sampling.anomaly_ring, self.sampling.kl_spike,
            self._pool, tick=self._update_manifest, tick_interval=MANIFEST_INTERVAL_S,
            prepare=self._summarise) if async_write else None
        _OPEN_WRITERS.add(self)

    # -- public verbs -------------------------------------------------------------------------

    def record(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor] | None = None,
        inner_step: int = 0,
        micro_batch: int = 0,
        metadata: Mapping[str, Any] | None = None,
        **named_tensors: torch.Tensor,
    ) -> Path | None:
        """Validate and stage one step; returns the path its file will have, or None when the step
        is not written (not sampled, or dropped because the queue was full).

        Both call styles work: ``record(3, {"policy_logprobs": lp, ...})`` and
        ``record(step=3, inner_step=1, policy_logprobs=lp, ...)``. Tensors may be on any device,
        of any float dtype, with bool or 0/1 masks; they are copied, so the loop may reuse them.

        Args:
            step: optimizer step (≥ 0).
            tensors: canonical fields (SPEC section 4) and any extra tensors.
            inner_step: PPO epoch / GRPO iteration, 0 on fresh rollouts.
            micro_batch: micro-batch index within the step.
            metadata: extra step metadata (JSON-able); overrides the writer's hyperparameters.
            **named_tensors: more tensors by keyword (merged with ``tensors``).

        Raises:
            SchemaError: a tensor disagrees with the schema, or metadata is not JSON (the caller's
                mistake: raised whatever ``strict`` says).
            TraceError: the writer is closed or was inherited through fork(); in strict mode, an
                earlier write failed.
        """
        return self._record(step, {**dict(tensors or {}), **named_tensors}, inner_step, micro_batch, metadata)

    def _record(self, step: int, tensors: dict[str, torch.Tensor], inner_step: int = 0, micro_batch: int = 0,
                metadata: Mapping[str, Any] | None = None, owned: frozenset[str] | set[str] = frozenset()) -> Path | None:
        """:meth:`record`; ``owned``: names of CPU tensors made for this record alone (zero-edit
        capture's indexed rows and derived fields), staged without a copy."""
        self._check_process()
        self._raise_pending()
        if self._closed:
            raise TraceError(f"trace writer for {self.root} is closed; open a new TraceWriter")
        if not tensors:
            raise TraceError(f"record(step={step}) got no tensors; pass canonical fields such as policy_logprobs=...")
        step, inner_step, micro_batch = (_coordinate("step", step), _coordinate("inner_step", inner_step),
                                         _coordinate("micro_batch", micro_batch))
        reserved = WRITER_KEYS.intersection(metadata or {})
        if reserved:
            raise SchemaError(f"metadata keys {sorted(reserved)} are set by the writer; pass step=, inner_step=, "
                              "micro_batch= as arguments and leave the others out")
        source_dtype, group_key = self._checked_signature(tensors)
        coordinates = (step, inner_step, micro_batch)
        if coordinates in self._recorded:
            raise SchemaError(
                f"step {step}, inner step {inner_step}, micro-batch {micro_batch} was already recorded by this "
                "writer (its file would be replaced); record each (step, inner_step, micro_batch) once, e.g. pass "
                "micro_batch= for each micro-batch of a step")
        self._recorded.add(coordinates)
        sampled = self.sampling.sampled(step)
        if not sampled and not self.sampling.anomaly_ring:
            self.skipped_steps += 1
            return None
        header = self._header(step, inner_step, micro_batch, metadata, source_dtype)
        # a non-JSON metadata value raises here, on the caller's thread (hyperparameters were checked once)
        encoded = encode_metadata(metadata) if metadata else {}
        size = self._hyperparameter_bytes + sum(len(k) + len(v) for k, v in encoded.items())
        if size > MAX_METADATA_BYTES:
            raise SchemaError(f"step metadata of {size} bytes exceeds {MAX_METADATA_BYTES} bytes; readers refuse "
                              "headers that large: keep metadata to hyperparameters and small values")
        if self.sampling.first_k_sequences is not None:  # the shapes kept depend on the signature alone
            tensors = first_k_sequences(tensors, self.sampling.first_k_sequences, self.algorithm)
            group_key = group_key and (group_key, self.sampling.first_k_sequences)
        try:
            staged, event, pinned, nbytes = stage(tensors, self._pool, owned, reuse=self._background is not None,
                                                  group_key=group_key)
        except (RuntimeError, MemoryError) as err:  # no memory for the copy: drop the step, not the run
            self._fail(f"step {step}: staging the tensors failed: {type(err).__name__}: {err}", err)
            self._raise_pending()
            return None
        item = StagedStep(step, inner_step, micro_batch, staged, header, nbytes, sampled, event, pinned)
        path = self._steps_dir / step_file_name(step, inner_step, micro_batch, self.rank)
        if self._background is None:
            item.wait()
            try:
                self._normalise_staged(item)
            except Exception as err:
                self._on_normalise_error(item, err)
                self._raise_pending()
                return None
            self._write_staged(item, None)
            self._update_manifest()  # writing synchronously: this thread is the writer thread
            self._raise_pending()
            return path if path.exists() else None
        if not sampled:
            self.skipped_steps += 1  # unless an anomaly brings it out of the ring
        return path if self._background.put(item) and sampled else None

    def flush(self) -> None:
        """Wait until every recorded step is on disk (or dropped). Raises TraceError in strict mode
        when a write failed, or when the writer was inherited through fork(). The manifest's live
        counts are brought up to date."""
        self._check_process()
        if self._background is not None:
            self._background.flush()
        self._update_manifest(force=True)
        self._raise_pending()

    def close(self) -> None:
        """Flush, stop the writer thread and mark the trace finished in the manifest (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _OPEN_WRITERS.discard(self)
        if os.getpid() != self._pid:  # inherited through fork: the parent owns the files and the lock
            return
        if self._background is not None:
            self._background.stop()
        self._index.close()
        with self._lock:
            self._manifest["status"] = "finished"
        try:
            self._write_manifest()
        except OSError as err:
            self._manifest_failed(err)
        unlock_rank(self._lock_fd, self.root, self.rank)
        self._lock_fd = None
        self._raise_pending()

    def count_drop(self, reason: str) -> None:
        """Count a step lost outside the writer (e.g. an integration failed to capture it). Raises
        TraceError in a process that inherited the writer through fork()."""
        self._check_process()
        self._count_drop(reason, warn=False)

    def annotate_manifest(self, key: str, value: Any) -> None:
        """Keep ``value`` (JSON-able) under ``key`` in the manifest; written at the next manifest update
        (at the latest by :meth:`close`). Used for the capture report of zero-edit tracing.
        Raises TraceError for a key the writer owns."""
        if key in _MANIFEST_OWN_KEYS:
            raise TraceError(f"manifest key {key!r} is written by the trace writer itself; choose another key")
        with self._lock:
            self._manifest[key] = value

    @property
    def peak_queued_bytes(self) -> int:
        """Most bytes the background queue held at once (0 when writing synchronously)."""
        return self._background.peak_bytes if self._background is not None else 0

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- private: training thread -------------------------------------------------------------

    def _checked_signature(self, tensors: dict[str, Any]) -> tuple[str, tuple | None]:
        """Check ``tensors`` against the schema (:func:`tracer.schema.check_tensors`) once per
        signature (names, shapes, dtypes, devices); a signature seen before costs one tuple and a
        set lookup. Data-dependent checks (the values of a float or integer mask on the CPU) run
        every time. Returns the ``source_dtype`` metadata of the signature and, when every tensor is
        on the CPU and the signature is cached, the signature itself (the key of the step's staging
        buffers, :meth:`tracer.capture.BufferPool.take_group`), else None. Raises SchemaError."""
        try:
            signature = tuple([(name, t.shape, t.dtype, t.device) for name, t in tensors.items()])  # device: cheaper than .type
            cached = self._signatures.get(signature)
        except (AttributeError, TypeError):  # a non-tensor value or an unhashable name: the full check names it
            cached, signature = None, None
        if cached is None:
            check_tensors(tensors, self.algorithm)
            source = ",".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()
                                      if t.is_floating_point()}))
            value_checked = tuple(name for name, t in tensors.items() if name in FIELDS and FIELDS[name].kind == BOOL
                                  and t.dtype != torch.bool and t.device.type == "cpu")
            on_cpu = all(t.device.type == "cpu" for t in tensors.values())
            cached = (source, value_checked, on_cpu)
            if signature is not None and len(self._signatures) < MAX_SIGNATURES:
                self._signatures[signature] = cached
                return source, signature if on_cpu else None
            return source, None
        for name in cached[1]:  # 0/1 values of a non-bool mask: read from the data, so checked every step
            check_mask_field(name, tensors[name])
        return cached[0], signature if cached[2] else None

    def _header(self, step, inner_step, micro_batch, metadata, source_dtype: str) -> dict[str, Any]:
        return {
            **self.hyperparameters,
            **dict(metadata or {}),
            "schema_version": SCHEMA_VERSION,
            "algorithm": self.algorithm,
            "step": int(step),
            "inner_step": int(inner_step),
            "micro_batch": int(micro_batch),
            "rank": self.rank,
            "world_size": self.world_size,
            "source_dtype": source_dtype,
        }

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise TraceError(
                f"tracer: this TraceWriter for {self.root} was created by process {self._pid} and inherited "
                f"through fork() by process {os.getpid()}, which cannot use it (its writer thread and file "
                "lock stayed in the parent, so records here would be lost or wait forever); create a new "
                "TraceWriter in the child (its own out_dir, or its own rank) or record only in the parent")

    def _raise_pending(self) -> None:
        if self._error is None or not self.strict:
            return
        with self._lock:
            (reason, err), self._error = self._error, None
            count, self._failures_pending = self._failures_pending, 0
        more = (f" ({count} writes failed since the last error raised; all are counted in the manifest's "
                "dropped_steps)") if count > 1 else ""
        raise TraceError(f"tracer: writing {self.root} failed: {reason}{more}") from err

    # -- private: writer thread ---------------------------------------------------------------

    def _normalise_staged(self, item: StagedStep) -> None:
        """Stored form, non-finite fields and checksum of a staged step (writer thread). Staged tensors
        are contiguous CPU copies, each its own; a signature already in stored form skips the
        conversion pass, and its :class:`tracer.step_bytes.StepPlan` is remembered."""
        staged = step_bytes.signature(item.tensors)
        plan = self._plans.get(staged)
        if plan is None:
            item.tensors = _unshare(normalise_tensors(item.tensors, self.algorithm, self.keep_source_dtype))
            plan = step_bytes.make_plan(item.tensors)
            # same signature out as in: nothing was converted (a 0/1 float mask always is, so never lands here)
            if step_bytes.signature(item.tensors) == staged and len(self._plans) < step_bytes.MAX_PLANS:
                self._plans[staged] = plan
        described = step_bytes.describe(item.tensors, plan)
        if described.nonfinite:
            item.metadata["nonfinite_fields"] = described.nonfinite
        item.metadata["content_sha256"] = described.content_sha256
        item.specs = described.specs

    def _on_normalise_error(self, item: StagedStep, err: Exception) -> None:
        self._fail(f"step {item.step}: {type(err).__name__}: {err}", err)

    def _write_staged(self, item: StagedStep, anomaly: str | None) -> None:
        if anomaly is not None:
            item.metadata["anomaly"] = anomaly
        path = self.root / STEPS_DIR / step_file_name(item.step, item.inner_step, item.micro_batch, self.rank)
        if not item.summarised:  # written alone (synchronously, or through the anomaly ring)
            self._summarise([item])
        try:
            encoded = self._encoded_metadata(item.metadata)
            _save_atomic(path, item.tensors, encoded, item.specs)
        except Exception as err:  # disk full, directory gone, serialiser refusal: never kill training
            self._fail(f"{path.name}: {type(err).__name__}: {err}", err)
            return
        with self._lock:
            self.steps_written += 1
            if not item.sampled:
                self.skipped_steps -= 1
            self._dirty = True
        self._index.add(path, item.tensors, encoded, item.metadata)  # never raises

    def _summarise(self, items: list[StagedStep]) -> None:
        """Put each step's summary (:mod:`tracer.summaries`, steps of one batch computed together)
        into its metadata. A failure leaves it out of the steps it concerns (readers then summarise
        those files from their tensors) and never costs a step."""
        for item in items:
            item.summarised = True
        try:
            batch = [({**it.tensors, **derive_fields(it.tensors, it.metadata)}, it.metadata) for it in items]
            for item, summary in zip(items, summaries.compute_summaries(batch)):  # ratio/KL derived from inputs
                item.metadata[summaries.SUMMARY_KEY] = summaries.header_value(summary)
        except Exception as err:  # noqa: BLE001  (a summary is an optimisation, never a reason to drop data)
            if len(items) > 1:  # find the step that fails; the others keep theirs
                for item in items:
                    self._summarise([item])
                return
            log.warning("tracer: step %s: no summary in its header (%s: %s)", items[0].step, type(err).__name__, err)

    def _encoded_metadata(self, metadata: dict[str, Any]) -> dict[str, str]:
        """``encode_metadata(metadata)``, reusing the hyperparameters' encoding made once (the header
        holds them unchanged unless the step's metadata overrode one)."""
        hyper = self.hyperparameters
        own = {k: v for k, v in metadata.items() if k not in hyper or v is not hyper[k]}
        return {**{k: v for k, v in self._hyperparameters_encoded.items() if k not in own}, **encode_metadata(own)}

    def _fail(self, reason: str, err: Exception) -> None:
        """A write (or staging) failed: counted in every mode; strict mode keeps it to raise."""
        if self.strict:
            with self._lock:
                self._error = self._error or (reason, err)
                self._failures_pending += 1
        self._count_drop(reason, warn=not self.strict)

    def _manifest_failed(self, err: OSError) -> None:
        """The manifest could not be rewritten: strict mode raises it from the next call."""
        if not self.strict:
            log.warning("tracer: could not update the manifest of %s: %s", self.root, err)
            return
        with self._lock:
            self._error = self._error or (f"{MANIFEST_NAME}: {type(err).__name__}: {err}", err)
            self._failures_pending += 1

    def _count_drop(self, reason: str, warn: bool = True) -> None:
        """Count a dropped step in memory (any thread; no I/O: the writer thread writes the count)."""
        with self._lock:
            self.dropped_steps += 1
            if len(self.drop_reasons) < 20:
                self.drop_reasons.append(reason)
            dropped = self.dropped_steps
            self._dirty = True
        if not warn:
            return
        message = (f"tracer: dropped a step ({dropped} so far): {reason}. "
                   "Training continues; pass strict=True to raise instead.")
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        except Warning:  # warnings made errors (-W error): raised on the caller's thread, never on the writer thread
            background = getattr(self, "_background", None)
            if background is None or not background.on_writer_thread():
                raise
            log.error("%s", message)  # the drop is counted; the writer thread goes on (or flush would hang)

    def _update_manifest(self, force: bool = False) -> None:
        """Rewrite the manifest when its counts changed, at most every MANIFEST_INTERVAL_S seconds
        unless ``force`` (the writer thread's tick, ``flush``). A failure is logged (strict: kept
        to raise from the next call), never raised here. Also appends the summary index's lines."""
        self._index.flush(due_only=not force)
        if not self._dirty or (not force and time.monotonic() - self._manifest_written_at < MANIFEST_INTERVAL_S):
            return
        try:
            self._write_manifest()
        except OSError as err:
            self._manifest_failed(err)

    def _write_manifest(self) -> None:
        """Write the manifest with the current counts (rank 0 only). Raises OSError."""
        if self.rank != 0:
            return
        with self._manifest_lock:
            with self._lock:
                self._manifest.update(steps_written=self.steps_written, dropped_steps=self.dropped_steps,
                                      skipped_steps=self.skipped_steps, drop_reasons=list(self.drop_reasons))
                payload, self._dirty = dict(self._manifest), False
            try:
                write_json_atomic(self.root / MANIFEST_NAME, payload)
            except OSError:
                self._dirty = True
                raise
            finally:
                self._manifest_written_at = time.monotonic()


_OPEN_WRITERS: "weakref.WeakSet[TraceWriter]" = weakref.WeakSet()
_MANIFEST_OWN_KEYS = frozenset({"schema_version", "algorithm", "status", "steps_written", "dropped_steps",
                                "skipped_steps", "drop_reasons", "tokenizer", "producer"})


@atexit.register
def _close_open_writers() -> None:
    """On normal interpreter exit, flush and close writers the program left open."""
    for writer in list(_OPEN_WRITERS):
        try:
            writer.close()
        except Exception as err:  # never turn a clean exit into a crash
            log.warning("tracer: closing %s at exit failed: %s", writer.root, err)


Tracer = TraceWriter
"""The explicit tracing API for hand-written loops: ``tr = tracer.Tracer(out_dir, algorithm="ppo",
tokenizer=tok, hyperparameters={...})`` then ``tr.record(step=..., inner_step=..., **tensors)``."""
