"""Write traces: one safetensors file per (step, inner step, micro-batch, rank), atomic, plus a
manifest and the token strings at the trace root (SPEC.md section 5; layout in :mod:`tracer.layout`).

A step file is written to ``<name>.partial``, then renamed (flushed to the device first with
``fsync_steps=True``): readers never see a partial file.
"""

from __future__ import annotations

import atexit
import logging
import os
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
    step_label,
    token_strings,
    tokenizer_identity,
    unlock_rank,
    unshare as _unshare,
    write_json_atomic,
)
from tracer import summaries
from tracer.capture import MAX_BATCH, BackgroundWriter, BufferPool, SamplingPolicy, StagedStep, first_k_sequences, stage
from tracer.errors import SchemaError, TraceError
from tracer.frame_lookup import user_stacklevel
from tracer.manifest_book import MANIFEST_INTERVAL_S, ManifestBook, new_manifest
from tracer.record_checks import MAX_SIGNATURES, MetadataCache, SignatureCache, coordinate  # noqa: F401  (MAX_SIGNATURES re-exported)
from tracer.schema import ALGORITHMS, SCHEMA_VERSION, encode_metadata, jsonable
from tracer.step_writer import StepWriter, step_header

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
WRITERS = ("thread", "process")
WRITER_ENV = "TRACER_WRITER"  # thread | process: the writer of TraceWriters that do not name one
STALL_ENV = "TRACER_WRITER_STALL_S"  # seconds: the writer process's stall limit of TraceWriters that do not set one


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
            The writer thread lingers for more steps until half the bound is queued, so the default 128
            lets it handle :data:`tracer.capture.MAX_BATCH` (64) small steps at a time.
        when_full: ``"block"`` (wait for room; nothing lost) or ``"drop"`` (drop and count: the
            count is kept in memory and written to the manifest by the writer thread, so ``record``
            never waits on the disk; the first drop warns, then one summary warning per 100 drops
            or 60 s: :meth:`tracer.manifest_book.ManifestBook.queue_full`).
        writer: where the background writing runs: ``"thread"`` (a thread of this process) or
            ``"process"`` (a writer process fed through shared memory: :mod:`tracer.writer_process`;
            the training thread then shares the interpreter lock with nobody). None (default): the
            ``TRACER_WRITER`` environment variable, else ``"thread"``. Ignored when
            ``async_write=False``. The manifest's ``capture.writer`` records which one wrote.
        writer_stall_s: with ``writer="process"``, how long (seconds, > 0; ``math.inf``: forever)
            ``flush``, ``close`` or a ``record`` waiting for room may hear nothing from the writer
            process before it is taken for stalled (stopped, hung): a warning names its pid, its
            state and the steps it holds, it is killed, and those steps are written by a thread of
            this process, as a dead one's are (strict mode: the same, then a TraceError from that
            call, or from ``record``'s next one). None (default): the ``TRACER_WRITER_STALL_S``
            environment variable, else 60 (:data:`tracer.writer_process.STALL_S`; at least 120
            until the child has written its first steps: its start-up).
        fsync_steps: flush each step file to the device before renaming it into place (survives a
            power loss or an OS crash once renamed). Default False: a step file is still complete or
            absent for every reader, and survives a crash or kill of the training process (the
            kernel holds its bytes and writes them back within seconds); only an OS crash or power
            loss may lose the last seconds of step files (such a file is absent or empty, and
            readers report it unreadable instead of using it). An fsync per step file
            costs the loop several percent at small steps on virtualised disks, even from the writer
            process (BENCHMARKS.md, "fsync"). The manifest is always fsync'd.

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
        TraceError: unknown algorithm or writer, or ``out_dir`` already holds a trace.
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
        max_queue_steps: int = 128,
        max_queue_bytes: int = 512 * 2**20,
        when_full: str = "block",
        writer: str | None = None,
        fsync_steps: bool = False,
        writer_stall_s: float | None = None,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise TraceError(f"algorithm {algorithm!r} is not one of {list(ALGORITHMS)}")
        if sampling is not None and sampling.anomaly_ring and not async_write:
            raise TraceError("the anomaly ring (sampling.anomaly_ring > 0) holds steps on the writer thread; "
                             "use async_write=True (the default) with it")
        mode = _writer_mode(writer) if async_write else "inline"
        self._stall_s = _stall_limit(writer_stall_s)
        self.root = Path(out_dir)
        self.algorithm = algorithm
        self.strict = strict
        self.keep_source_dtype = keep_source_dtype
        self.fsync_steps = fsync_steps
        self.hyperparameters = dict(hyperparameters or {})
        self.sampling = sampling or SamplingPolicy()
        self.rank, self.world_size = _distributed_rank()
        self._closed = False
        self._pid = os.getpid()  # a forked child must not close (or unlock) its parent's trace
        # a non-JSON hyperparameter raises SchemaError now, naming it
        self._hyperparameter_bytes = sum(len(k) + len(v) for k, v in encode_metadata(self.hyperparameters).items())
        self._recorded: set[tuple[int, int, int]] = set()
        self._signatures = SignatureCache(algorithm)  # field signatures checked once
        self._metadata = MetadataCache()  # the last step metadata and its encodings
        self._steps_dir = self.root / STEPS_DIR
        # a step file's path: a child made without parsing (as tracer.step_writer makes it)
        self._step_path = getattr(self._steps_dir, "_make_child_relpath", self._steps_dir.joinpath)
        refuse_existing_trace(self.root, self.rank)
        self._steps_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_rank(self.root, self.rank)  # one writer per (trace, rank), across processes
        manifest = new_manifest(algorithm, self.world_size, self.hyperparameters, config, self.sampling,
                                {"async_write": async_write, "max_queue_steps": max_queue_steps,
                                 "max_queue_bytes": max_queue_bytes, "when_full": when_full, "writer": mode,
                                 "fsync_steps": fsync_steps})
        self._book = ManifestBook(self.root, self.rank, manifest, strict, lambda path, data: write_json_atomic(path, data))
        if tokenizer is not None:
            manifest["tokenizer"] = tokenizer_identity(tokenizer)
            if self.rank == 0:
                try:
                    write_json_atomic(self.root / TOKENS_NAME, {"tokens": token_strings(tokenizer)})
                except OSError as err:  # the trace stays usable: ids show as <id N>
                    if strict:
                        unlock_rank(self._lock_fd)
                        raise TraceError(f"could not write {self.root / TOKENS_NAME}: {err}") from err
                    warnings.warn(f"tracer: could not write {self.root / TOKENS_NAME} ({err}); token ids "
                                  "will show without text. Training continues.", RuntimeWarning,
                                  stacklevel=user_stacklevel())
        try:
            self._book.write()
        except OSError as err:
            if strict:
                unlock_rank(self._lock_fd)
                raise TraceError(f"could not write {self.root / MANIFEST_NAME}: {err}") from err
            log.warning("tracer: could not write the manifest of %s: %s", self.root, err)
        self._queue = (max_queue_steps, max_queue_bytes, when_full)
        self._pool = BufferPool(per_key=max(4, 2 * min(max_queue_steps, MAX_BATCH)))
        self._steps: StepWriter | None = None  # the write side, when it runs in this process
        self._background: BackgroundWriter | None = None
        self._process = None  # tracer.writer_process.ProcessWriter
        if mode == "process":
            self._start_process()
        else:
            self._start_writing(background=async_write)
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
                metadata: Mapping[str, Any] | None = None, owned: frozenset[str] | set[str] = frozenset(),
                derive: tuple[str, ...] = (), signature: tuple | None = None) -> Path | None:
        """:meth:`record`; ``owned``: names of CPU tensors made for this record alone (zero-edit
        capture's indexed rows and derived fields), staged without a copy; ``derive``: fields the
        writer derives from the recorded ones and records with them (zero-edit capture's ``ratio``,
        ``approx_kl_k2``, ``ref_kl_k3``: :func:`tracer.derived.derive_recorded`), off this thread;
        ``signature``: the tensors' field signature when the caller knows it
        (:meth:`tracer.record_checks.SignatureCache.check`)."""
        self._check_process()
        if self._process is not None:
            self._poll_process(due_only=True)  # the writer process's results so far (a strict failure raises next)
        self._book.raise_pending()
        if self._closed:
            raise TraceError(f"trace writer for {self.root} is closed; open a new TraceWriter")
        if not tensors:
            raise TraceError(f"record(step={step}) got no tensors; pass canonical fields such as policy_logprobs=...")
        step, inner_step, micro_batch = (coordinate("step", step), coordinate("inner_step", inner_step),
                                         coordinate("micro_batch", micro_batch))
        reserved = WRITER_KEYS.intersection(metadata or {})
        if reserved:
            raise SchemaError(f"metadata keys {sorted(reserved)} are set by the writer; pass step=, inner_step=, "
                              "micro_batch= as arguments and leave the others out")
        source_dtype = self._signatures.check(tensors, signature)
        group_key = self._signatures.cpu_key  # the key of the step's staging buffers (CPU tensors only)
        coordinates = (step, inner_step, micro_batch)
        if coordinates in self._recorded:
            raise SchemaError(
                f"step {step}, inner step {inner_step}, micro-batch {micro_batch} was already recorded by this "
                "writer (its file would be replaced); record each (step, inner_step, micro_batch) once, e.g. pass "
                "micro_batch= for each micro-batch of a step")
        self._recorded.add(coordinates)
        sampled = self.sampling.sampled(step)
        if not sampled and not self.sampling.anomaly_ring:
            self._book.skipped()
            return None
        # a non-JSON metadata value raises here, on the caller's thread (hyperparameters were checked once)
        encoded = self._metadata.encoded(metadata) if metadata else {}
        size = self._hyperparameter_bytes + sum(len(k) + len(v) for k, v in encoded.items())
        if size > MAX_METADATA_BYTES:
            raise SchemaError(f"step metadata of {size} bytes exceeds {MAX_METADATA_BYTES} bytes; readers refuse "
                              "headers that large: keep metadata to hyperparameters and small values")
        if self.sampling.first_k_sequences is not None:  # the shapes kept depend on the signature alone
            tensors = first_k_sequences(tensors, self.sampling.first_k_sequences, self.algorithm)
            group_key = group_key and (group_key, self.sampling.first_k_sequences)
        path = self._step_path(step_file_name(step, inner_step, micro_batch, self.rank))
        json_metadata = self._metadata.json_form(metadata) if metadata else None
        if self._process is not None:
            handed = self._hand_over(coordinates, tensors, sampled, source_dtype, json_metadata, derive)
            if handed is not None:
                return path if handed and sampled else None
            # the writer process was gone before it took the step: the writer thread now in its place writes it
        return self._stage(coordinates, tensors, json_metadata, source_dtype, sampled, owned, derive, group_key, path)

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

    def flush(self) -> None:
        """Wait until every recorded step is on disk (or dropped). Raises TraceError in strict mode
        when a write failed, or when the writer was inherited through fork(). The manifest's live
        counts are brought up to date."""
        self._check_process()
        if self._process is not None:
            self._process.flush()
            self._poll_process()
        if self._process is None and self._background is not None:  # also what a dead process's rescue staged
            self._background.flush()
        self._update_manifest(force=True)
        self._book.raise_pending()

    def close(self) -> None:
        """Flush, stop the writer thread (or process) and mark the trace finished in the manifest
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _OPEN_WRITERS.discard(self)
        if os.getpid() != self._pid:  # inherited through fork: the parent owns the files and the lock
            return
        if self._process is not None:
            self._process.stop()
            if self._process.dead is not None:  # it died before writing all it was handed: a thread writes the rest
                self._poll_process()
        if self._background is not None:
            self._background.stop()
        if self._steps is not None:
            self._steps.index.close()
        with self._book.lock:
            self._book.manifest["status"] = "finished"
        try:
            self._book.write()
        except OSError as err:
            self._book.manifest_failed(err)
        unlock_rank(self._lock_fd, self.root, self.rank)
        self._lock_fd = None
        self._book.raise_pending()

    def count_drop(self, reason: str) -> None:
        """Count a step lost outside the writer (e.g. an integration failed to capture it). Raises
        TraceError in a process that inherited the writer through fork()."""
        self._check_process()
        self._book.count_drop(reason, warn=False)

    def annotate_manifest(self, key: str, value: Any) -> None:
        """Keep ``value`` (JSON-able) under ``key`` in the manifest; written at the next manifest update
        (at the latest by :meth:`close`). Used for the capture report of zero-edit tracing.
        Raises TraceError for a key the writer owns."""
        if key in _MANIFEST_OWN_KEYS:
            raise TraceError(f"manifest key {key!r} is written by the trace writer itself; choose another key")
        self._book.annotate(key, value)

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

    steps_written = property(lambda self: self._book.steps_written, doc="Step files written so far.")
    skipped_steps = property(lambda self: self._book.skipped_steps, doc="Steps the sampling policy left out.")
    drop_reasons = property(lambda self: self._book.drop_reasons, doc="The first 20 drops' reasons (the live list).")

    @property
    def dropped_steps(self) -> int:
        """Steps lost (every cause), counted. Prefer :meth:`count_drop` to setting it."""
        return self._book.dropped_steps

    @dropped_steps.setter
    def dropped_steps(self, value: int) -> None:
        with self._book.lock:
            self._book.dropped_steps, self._book.dirty = value, True

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- private: training thread -------------------------------------------------------------

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

    def _start_writing(self, background: bool, resume_index: bool = False) -> None:
        """Write in this process: on a background thread, or inside ``record`` (``resume_index``:
        append to the summary index a dead writer process left)."""
        self._steps = StepWriter(self.root, self.rank, self.algorithm, self.keep_source_dtype, self.hyperparameters,
                                 self._book, lambda *args: _save_atomic(*args),  # looked up at call time
                                 fsync_steps=self.fsync_steps, resume_index=resume_index)
        if not background:
            return
        max_queue_steps, max_queue_bytes, when_full = self._queue
        self._background = BackgroundWriter(
            self._steps.write, self._steps.normalise, self._steps.on_normalise_error, self._book.queue_full,
            max_queue_steps, max_queue_bytes, when_full, self.sampling.anomaly_ring, self.sampling.kl_spike,
            self._pool, tick=self._update_manifest, tick_interval=MANIFEST_INTERVAL_S, prepare=self._steps.summarise)
        self._book.on_writer_thread = self._background.on_writer_thread

    def _child_config(self) -> dict[str, Any]:
        """What the writer process needs to write this trace's steps (JSON)."""
        return {"root": os.fspath(self.root), "rank": self.rank, "world_size": self.world_size,
                "algorithm": self.algorithm, "keep_source_dtype": self.keep_source_dtype,
                "fsync_steps": self.fsync_steps,
                "hyperparameters": jsonable(self.hyperparameters), "manifest": self._book.manifest,
                "anomaly_ring": self.sampling.anomaly_ring, "kl_spike": self.sampling.kl_spike,
                "max_queue_steps": self._queue[0], "max_queue_bytes": self._queue[1]}

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise TraceError(
                f"tracer: this TraceWriter for {self.root} was created by process {self._pid} and inherited "
                f"through fork() by process {os.getpid()}, which cannot use it (its writer thread and file "
                "lock stayed in the parent, so records here would be lost or wait forever); create a new "
                "TraceWriter in the child (its own out_dir, or its own rank) or record only in the parent")

    def _update_manifest(self, force: bool = False) -> None:
        """Rewrite the manifest when its counts changed, at most every MANIFEST_INTERVAL_S seconds
        unless ``force`` (the writer thread's tick, ``flush``). A failure is logged (strict: kept
        to raise from the next call), never raised here. Also appends the summary index's lines
        (when the index is written in this process)."""
        if self._steps is not None:
            self._steps.index.flush(due_only=not force)
        self._book.update(force)


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
    None (:data:`tracer.writer_process.STALL_S`); TraceError unless a number > 0."""
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
