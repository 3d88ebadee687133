"""Write traces: one safetensors file per (step, inner step, micro-batch, rank), atomic, plus a
manifest and the token strings at the trace root (SPEC.md section 5; layout in :mod:`tracer.format.names`).

A step file is written to ``<name>.partial``, then renamed (flushed to the device first with
``fsync_steps=True``): readers never see a partial file. Where each checked step goes (the writer
thread, or the writer process) and the settings that choose it are :mod:`tracer.record.backends`.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch


from tracer.format.names import MANIFEST_NAME, STEPS_DIR, TOKENS_NAME, step_file_name, step_label
from tracer.format.files import lock_rank, refuse_existing_trace, save_atomic as _save_atomic, unlock_rank, write_json_atomic
from tracer.record.manifest import token_strings, tokenizer_identity
from tracer.format import summary as summary_format
from tracer.record.capture import BufferPool, CapturedStep, SamplingPolicy, cut_rows
from tracer.record.thread import MAX_BATCH, BackgroundWriter
from tracer.errors import SchemaError, TraceError
from tracer.errors import user_stacklevel
from tracer.record.manifest import MANIFEST_INTERVAL_S, ManifestBook, new_manifest
from tracer.format.run_index import IndexWriter
from tracer.record.validation import MAX_SIGNATURES, MetadataCache, SignatureCache, coordinate  # noqa: F401  (MAX_SIGNATURES re-exported)
from tracer.format.schema import ALGORITHMS
from tracer.format.metadata_codec import encode_metadata
from tracer.record.step_writer import StepWriter

from tracer.record.backends import WriterBackends, _OPEN_WRITERS, _distributed_rank, _stall_limit, _writer_mode

log = logging.getLogger(__name__)


# Step metadata keys the writer sets itself; a caller passing one would be silently overridden.
WRITER_KEYS = frozenset({"schema_version", "algorithm", "step", "inner_step", "micro_batch", "rank", "world_size",
                         "source_dtype", "content_sha256", "nonfinite_fields", "anomaly", summary_format.SUMMARY_KEY})
MAX_METADATA_BYTES = 4 * 2**20  # well under the reader's 16 MiB header cap


class TraceWriter(WriterBackends):
    """Writes the steps of one run into a trace directory, off the training thread.

    ``record`` validates shapes, stages the tensors (a host copy the loop cannot mutate) and
    returns; a background thread normalises, serialises and writes them (:mod:`tracer.record.capture`).
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
        sampling: which steps and sequences to write (:class:`tracer.record.capture.SamplingPolicy`).
        async_write: write on a background thread (default); False writes inside ``record``.
        max_queue_steps, max_queue_bytes: bound of the background queue (steps waiting to be written).
            The writer thread lingers for more steps until half the bound is queued, so the default 128
            lets it handle :data:`tracer.record.thread.MAX_BATCH` (64) small steps at a time.
        when_full: ``"block"`` (wait for room; nothing lost) or ``"drop"`` (drop and count: the
            count is kept in memory and written to the manifest by the writer thread, so ``record``
            never waits on the disk; the first drop warns, then one summary warning per 100 drops
            or 60 s: :meth:`tracer.record.manifest.ManifestBook.queue_full`).
        writer: where the background writing runs: ``"thread"`` (a thread of this process),
            ``"process"`` (a writer process fed through shared memory: :mod:`tracer.record.process.parent`;
            the training thread then shares the interpreter lock with nobody), or ``"auto"``: at the
            first step written, the process when every tensor is on the CPU, on Linux, with at least
            two usable cores per training process on the machine, else the thread
            (:func:`tracer.record.backends.auto_writer`); a trace closed while that process is still
            starting has its steps written by a thread instead, so a short run never waits for it.
            None (default): the ``TRACER_WRITER`` environment variable, else ``"auto"``. Ignored
            when ``async_write=False``. The manifest's ``capture.writer`` records which one wrote
            (``capture.writer_choice``: why, under ``"auto"``).
        writer_stall_s: with ``writer="process"``, how long (seconds, > 0; ``math.inf``: forever)
            ``flush``, ``close`` or a ``record`` waiting for room may hear nothing from the writer
            process before it is taken for stalled (stopped, hung): a warning names its pid, its
            state and the steps it holds, it is killed, and those steps are written by a thread of
            this process, as a dead one's are (strict mode: the same, then a TraceError from that
            call, or from ``record``'s next one). None (default): the ``TRACER_WRITER_STALL_S``
            environment variable, else 60 (:data:`tracer.record.process.lifecycle.STALL_S`; at least 120
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
    clip fractions, kept tokens, NaN counts; :mod:`tracer.format.summary`), computed by the writer thread
    as it writes the file (by ``record`` itself when ``async_write=False``), so that a run overview
    reads headers only; after each file the writer thread also queues one line for the run's
    summary index (``summary_index.rank_N.jsonl``, :mod:`tracer.format.run_index`: name, size and summary,
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
        self._metadata_size: tuple = (None, 0)  # (an encoded metadata dict, its header bytes with the hyperparameters')
        self._steps_dir = self.root / STEPS_DIR
        # a step file's path: a child made without parsing (as tracer.record.step_writer makes it)
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
        self._process = None  # tracer.record.process.parent.ProcessWriter
        self._auto = mode == "auto"  # the writer is chosen at the first step to write (_choose_writer)
        self._chosen = False  # that choice was made
        if mode in ("process", "auto"):
            # the rank's summary index starts again now, as the writer thread's does: a child that dies
            # before starting its own leaves this one to be resumed, not an older run's
            IndexWriter(self.root, self.rank).close()
        if mode == "process":
            self._start_process()
        elif not self._auto:
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

    def record_captured(self, captured: CapturedStep) -> None:
        """Record a step that a watcher or an integration captured (:class:`tracer.record.capture.CapturedStep`):
        the checks, sampling and hand-over of :meth:`record`, with the captured step's own tensors staged
        without a copy (``owned``) and its ``derive`` fields computed off the training thread. Returns
        nothing (making the step file's path costs the training thread time a watcher does not want).

        Raises:
            SchemaError, TraceError: as :meth:`record`.
        """
        self._record(captured.step, captured.tensors, captured.inner_step, captured.micro_batch, captured.metadata,
                     captured.owned, captured.derive, captured.signature, path_wanted=False)

    def _record(self, step: int, tensors: dict[str, torch.Tensor], inner_step: int = 0, micro_batch: int = 0,
                metadata: Mapping[str, Any] | None = None, owned: frozenset[str] | set[str] = frozenset(),
                derive: tuple[str, ...] = (), signature: tuple | None = None, path_wanted: bool = True) -> Path | None:
        """:meth:`record` and :meth:`record_captured`; ``owned``: names of CPU tensors made for this record
        alone (zero-edit capture's indexed rows and derived fields), staged without a copy; ``derive``: fields the
        writer derives from the recorded ones and records with them (zero-edit capture's ``ratio``,
        ``approx_kl_k2``, ``ref_kl_k3``: :func:`tracer.formulas.derived.derive_recorded`), off this thread;
        ``signature``: the tensors' field signature when the caller knows it
        (:meth:`tracer.record.validation.SignatureCache.check`); ``path_wanted=False``: the caller ignores
        the returned path, so a step handed to the writer process returns None without making it
        (a ``Path`` a step: about 15 us of the training thread's)."""
        if torch.is_inference_mode_enabled():
            # A record under inference_mode (a rollout): the staging buffers, the ring and its views made
            # here are written in place after the block, which an inference tensor refuses.
            with torch.inference_mode(False):
                return self._record(step, tensors, inner_step, micro_batch, metadata, owned, derive,
                                    signature, path_wanted)
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
        group_key = self._signatures.group_key  # the step's staging buffers: all on the CPU, or on one CUDA device
        coordinates = (step, inner_step, micro_batch)
        if coordinates in self._recorded:
            raise SchemaError(
                f"{step_label(step, inner_step, micro_batch)} was already recorded by this writer (its file would "
                "be replaced); record each (step, inner_step, micro_batch) once, e.g. pass micro_batch= for each "
                "micro-batch of a step")
        self._recorded.add(coordinates)
        sampled = self.sampling.sampled(step)
        if not sampled and not self.sampling.anomaly_ring:
            self._book.skipped()
            return None
        # a non-JSON metadata value raises here, on the caller's thread (hyperparameters were checked once)
        encoded = self._metadata.encoded(metadata) if metadata else {}
        if encoded is not self._metadata_size[0]:  # the cache gives the same dict for the same metadata
            self._metadata_size = (encoded, self._hyperparameter_bytes + sum(len(k) + len(v) for k, v in encoded.items()))
        size = self._metadata_size[1]
        if size > MAX_METADATA_BYTES:
            raise SchemaError(f"step metadata of {size} bytes exceeds {MAX_METADATA_BYTES} bytes; readers refuse "
                              "headers that large: keep metadata to hyperparameters and small values")
        rows = None
        if self.sampling.first_k_sequences is not None:  # the shapes kept depend on the signature alone
            tensors, rows = cut_rows(tensors, self.sampling.first_k_sequences, self.algorithm)
            group_key = group_key and (group_key, self.sampling.first_k_sequences)
        json_metadata = self._metadata.json_form(metadata) if metadata else None
        if rows is not None:  # the checks must know the step's scalar loss covers rows the file lacks
            json_metadata = {**(json_metadata or {}), "rows_before_cut": rows}  # a new dict: json_form's is cached
        if self._auto:
            self._choose_writer(tensors)
        if self._process is not None:
            handed = self._hand_over(coordinates, tensors, sampled, source_dtype, json_metadata, derive)
            if handed is not None:
                if handed and sampled and path_wanted:
                    return self._step_path(step_file_name(step, inner_step, micro_batch, self.rank))
                return None
            # the writer process was gone before it took the step: the writer thread now in its place writes it
        path = self._step_path(step_file_name(step, inner_step, micro_batch, self.rank))
        return self._stage(coordinates, tensors, json_metadata, source_dtype, sampled, owned, derive, group_key, path)

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
        if self._process is not None and self._chosen:
            self._cancel_start()  # writer="auto" chose a process that is still starting: a thread is quicker
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

    # -- private (the hand-over of steps: tracer.record.backends.WriterBackends) --------------

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

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise TraceError(
                f"tracer: this TraceWriter for {self.root} was created by process {self._pid} and inherited "
                f"through fork() by process {os.getpid()}, which cannot use it (its writer thread and file "
                "lock stayed in the parent, so records here would be lost or wait forever); create a new "
                "TraceWriter in the child (its own out_dir, or its own rank) or record only in the parent")


_MANIFEST_OWN_KEYS = frozenset({"schema_version", "algorithm", "status", "steps_written", "dropped_steps",
                                "skipped_steps", "drop_reasons", "tokenizer", "producer"})


Tracer = TraceWriter
"""The explicit tracing API for hand-written loops: ``tr = tracer.Tracer(out_dir, algorithm="ppo",
tokenizer=tok, hyperparameters={...})`` then ``tr.record(step=..., inner_step=..., **tensors)``."""
