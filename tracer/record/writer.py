"""Write traces: one safetensors file per (step, inner step, micro-batch, rank), atomic, plus a
manifest and the token strings at the trace root (SPEC.md section 5; names in :mod:`tracer.format.names`).

:class:`TraceWriter` checks each step on the training thread (:mod:`tracer.record.validation`), applies
the sampling policy, and hands it to a backend (:mod:`tracer.record.backends`: inline, the writer
thread, or the writer process), which writes ``<name>.partial`` and renames it: readers never see a
partial file. When a writer process dies or stalls, a thread takes over with the steps it had not written.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from tracer.errors import GuardStop, TraceError, user_stacklevel
from tracer.format.counts import COUNTS_NAME, reserve_counts
from tracer.format.findings_log import start_findings
from tracer.format.files import lock_rank, refuse_existing_trace, save_atomic as _save_atomic, unlock_rank, write_json_atomic
from tracer.format.metadata_codec import jsonable
from tracer.format.names import MANIFEST_NAME, STEPS_DIR, TOKENS_NAME, step_file_name
from tracer.format.rollout_store import RolloutWriter
from tracer.format.run_end import ENDED_KEY, ended_entry
from tracer.format.run_index import IndexWriter
from tracer.format.schema import ALGORITHMS
from tracer.record import exit_hooks
from tracer.record.backends import Backends, LocalBackend, PendingStep
from tracer.record.modes import distributed_rank, stall_limit, writer_mode
from tracer.record.observer import StepObserver, make_observer
from tracer.record.capture import BufferPool, CapturedStep, SamplingPolicy, cut_rows
from tracer.record.manifest import (MANIFEST_INTERVAL_S, ManifestBook, new_manifest, token_strings,
                                    tokenizer_identity, vocabulary_strings)
from tracer.record.step_writer import StepWriter, step_header
from tracer.record.thread import MAX_BATCH, BackgroundWriter
from tracer.record.validation import RecordChecks, check_captured, check_scalars, coordinate
from tracer.format.scalar_log import ScalarLog
from tracer.format.summary import RECORDED_KEY, SCALAR_PREFIX

log = logging.getLogger(__name__)

_MANIFEST_OWN_KEYS = frozenset({"schema_version", "algorithm", "status", "steps_written", "dropped_steps",
                                "skipped_steps", "drop_reasons", "tokenizer", "producer", "revision", ENDED_KEY})


class TraceWriter:
    """Writes the steps of one run into a trace directory, off the training thread.

    ``record`` checks shapes, stages the tensors (a host copy the loop cannot mutate) and returns; a
    backend normalises, summarises (the header's ``summary``: :mod:`tracer.format.summary`), serialises
    and writes them, and appends each file's line to the run's summary index
    (:mod:`tracer.format.run_index`). ``flush()`` waits for the queue to drain; ``close()`` (or leaving
    a ``with`` block, or interpreter exit) flushes and records how the run ended in the manifest's ``status``
    and ``ended`` entry (:mod:`tracer.format.run_end`): ``finished``, or ``crashed`` / ``interrupted`` with
    the exception and the last step recorded when an uncaught exception ended the thread that recorded
    (heard through ``sys.excepthook`` / ``threading.excepthook``, :mod:`tracer.record.exit_hooks`, which
    still call the hooks they wrap) or left the ``with`` block. The options in full, with their costs:
    docs/capture.md.

    Args:
        out_dir: the trace directory; created when missing. One that already holds step files is
            refused (nothing the user had is overwritten).
        algorithm: one of ``ppo | grpo | cispo | rloo | dpo``.
        tokenizer: optional; its token strings are stored once in ``tokens.json``.
        vocabulary: the token strings without an HF tokenizer (instead of ``tokenizer``): a list of
            strings (id = index), or a dict ``{id: text}`` (int keys) or ``{text: id}`` (int values,
            a tokenizer's ``get_vocab()``); stored in ``tokens.json`` as a tokenizer's would be (an id
            the dict lacks shows as ``<id N>``). Checked by
            :func:`tracer.record.manifest.vocabulary_strings` (SchemaError for a bad one).
        config: run configuration (JSON-able dict) kept in the manifest.
        hyperparameters: step metadata written into every step file (SPEC.md section 4 keys).
        strict: a failed write raises TraceError (from the next ``record``, ``flush`` or ``close``);
            otherwise it warns and training goes on. Every failed write is counted in the manifest's
            ``dropped_steps`` either way.
        keep_source_dtype: store floats in their source dtype instead of float32.
        sampling: which steps and sequences to write (:class:`tracer.record.capture.SamplingPolicy`).
        async_write: write off the training thread (default); False writes inside ``record``.
        max_queue_steps, max_queue_bytes: bound of the queue of steps waiting to be written.
        when_full: ``"block"`` (wait for room; nothing lost) or ``"drop"`` (drop and count; warned
            once, then every 100 drops or 60 s).
        writer: ``"thread"``, ``"process"`` (a writer process fed through shared memory) or ``"auto"``
            (the process for CPU tensors on Linux with a core to spare:
            :func:`tracer.record.modes.auto_writer`); None: ``TRACER_WRITER``, else ``"auto"``.
            The manifest's ``capture.writer`` says which one wrote.
        writer_stall_s: seconds a wait for the writer process may hear nothing from it before it is
            killed and a thread writes its steps; None: ``TRACER_WRITER_STALL_S``, else 60.
        fsync_steps: flush each step file to the device before its rename (survives a power loss);
            default False (a crash or kill of the process loses nothing written). The manifest is
            always fsync'd.
        guard: the live guard (:mod:`tracer.guard`): ``tracer check``'s step checks run on each step file
            once written, off the training thread (a checker process forked beside the writer thread,
            :mod:`tracer.guard.process`, or the writer process), into ``findings.rank_N.jsonl``. ``"warn"`` prints the first error or warning of each check;
            ``"stop"`` also ends the run at the first error: the next ``record`` flushes, writes the
            manifest's ``guard`` entry and raises :class:`tracer.errors.GuardStop`; a callable gets each
            error and warning Finding; ``"off"``: none; an object with the protocol of
            :class:`tracer.record.observer.StepObserver` is used as it is. None: ``TRACER_GUARD``, else
            ``"warn"`` (:data:`tracer.record.observer.DEFAULT_GUARD`). The manifest's ``guard.mode`` says which ran.

    The manifest's live fields (``steps_written``, ``dropped_steps``, ``drop_reasons``) are rewritten
    at most every :data:`tracer.record.manifest.MANIFEST_INTERVAL_S` seconds, at ``flush()`` and at
    ``close()``. A child made by ``fork()`` that uses an inherited writer gets a TraceError: create a
    new writer in the child.

    Raises:
        TraceError: unknown algorithm or writer, or ``out_dir`` already holds a trace; both
            ``tokenizer`` and ``vocabulary`` given.
        SchemaError: ``vocabulary`` is not a list of strings or an id/text dict.
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
        vocabulary: Sequence[str] | Mapping[Any, Any] | None = None,
        guard: Any = None,
    ) -> None:
        if tokenizer is not None and vocabulary is not None:
            raise TraceError("pass tokenizer= or vocabulary=, not both: both would write tokens.json")
        vocabulary_tokens = vocabulary_strings(vocabulary) if vocabulary is not None else None
        if algorithm not in ALGORITHMS:
            raise TraceError(f"algorithm {algorithm!r} is not one of {list(ALGORITHMS)}")
        if sampling is not None and sampling.anomaly_ring and not async_write:
            raise TraceError("the anomaly ring (sampling.anomaly_ring > 0) holds steps on the writer thread; "
                             "use async_write=True (the default) with it")
        if when_full not in ("block", "drop"):
            raise TraceError(f"when_full={when_full!r} is not 'block' (wait for room: nothing lost) or 'drop' "
                             "(drop the step and count it)")
        mode = writer_mode(writer) if async_write else "inline"
        self._stall_s = stall_limit(writer_stall_s)
        self.root = Path(out_dir)
        self.algorithm = algorithm
        self.strict = strict
        self.keep_source_dtype = keep_source_dtype
        self.fsync_steps = fsync_steps
        self.hyperparameters = dict(hyperparameters or {})
        self.sampling = sampling or SamplingPolicy()
        self.rank, self.world_size = distributed_rank()
        self._observer: StepObserver | None = make_observer(guard, self.root, self.rank)
        self.guard_raises = True  # record() raises GuardStop; an integration that stops its trainer itself sets False
        self._guard_said = False  # the manifest's guard entry names the stop
        self._closed = False
        self._last_step: int | None = None  # the highest step recorded (the manifest's ended.last_step)
        self._recorder: int | None = None  # the thread that recorded last (threading.get_ident())
        # (exception, thread name) that ended the recording thread, heard by the exit hooks; a later record clears it
        self._uncaught: tuple[BaseException, str] | None = None
        self._pid = os.getpid()  # a forked child must not close (or unlock) its parent's trace
        self._checks = RecordChecks(algorithm, self.hyperparameters)  # a non-JSON hyperparameter raises now
        self._steps_dir = self.root / STEPS_DIR
        # a step file's path: a child made without parsing (as tracer.record.step_writer makes it)
        self._step_path = getattr(self._steps_dir, "_make_child_relpath", self._steps_dir.joinpath)
        try:
            refuse_existing_trace(self.root, self.rank)
            self._steps_dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = lock_rank(self.root, self.rank)  # one writer per (trace, rank), across processes
        except BaseException:
            self._close_observer()  # a guard's thread of a writer that never was
            raise
        self._scalar_log = ScalarLog(self.root, self.rank)  # logged scalars (tracer.format.scalar_log)
        start_findings(self.root, self.rank)  # the live guard's findings of this run only (tracer.format.findings_log)
        self._backends: Backends | None = None  # set last: a writer thread it starts may tick before
        try:  # from here on a failure must not keep the rank's lock (the next writer would be refused)
            manifest = new_manifest(algorithm, self.world_size, self.hyperparameters, config, self.sampling,
                                    {"async_write": async_write, "max_queue_steps": max_queue_steps,
                                     "max_queue_bytes": max_queue_bytes, "when_full": when_full, "writer": mode,
                                     "fsync_steps": fsync_steps})
            manifest["guard"] = {"mode": self._observer.mode if self._observer is not None else "off"}
            self._book = ManifestBook(self.root, self.rank, manifest, strict, lambda path, data: write_json_atomic(path, data))
            if tokenizer is not None:
                manifest["tokenizer"] = tokenizer_identity(tokenizer)
                if self.rank == 0:
                    self._write_tokens(lambda: token_strings(tokenizer))
            elif vocabulary_tokens is not None:
                manifest["tokenizer"] = {"class": "vocabulary", "size": len(vocabulary_tokens)}
                if self.rank == 0:
                    self._write_tokens(lambda: vocabulary_tokens)
            if self.rank == 0:
                self._reserve_counts()
            try:
                self._book.write()
            except OSError as err:
                if strict:
                    raise TraceError(f"could not write {self.root / MANIFEST_NAME}: {err}") from err
                log.warning("tracer: could not write the manifest of %s: %s", self.root, err)
            self._queue = (max_queue_steps, max_queue_bytes, when_full)
            self._pool = BufferPool(per_key=max(4, 2 * min(max_queue_steps, MAX_BATCH)))
            if mode in ("process", "auto"):
                # the rank's summary index starts again now, as the writer thread's does: a child that dies
                # before starting its own leaves this one to be resumed, not an older run's
                IndexWriter(self.root, self.rank).close()
                RolloutWriter(self.root, self.rank, enabled=algorithm != "dpo").close()
            self._backends = Backends(mode, self._local_backend, self._process_writer, self._book, strict,
                                      self.sampling.first_k_sequences,
                                      guard_stops=self._observer is not None and self._observer.mode == "stop")
        except BaseException:
            unlock_rank(self._lock_fd, self.root, self.rank)
            self._lock_fd = None
            self._close_observer()
            raise
        _OPEN_WRITERS.add(self)
        exit_hooks.install(_hear_uncaught)

    # -- public verbs -------------------------------------------------------------------------

    def record(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor] | None = None,
        inner_step: int = 0,
        micro_batch: int = 0,
        metadata: Mapping[str, Any] | None = None,
        scalars: Mapping[str, Any] | None = None,
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
            scalars: the step's own numbers by name (``{"grad_norm": 0.3, "learning_rate": 1e-6}``), each
                a number (NaN and infinities kept); shown as ``scalars/<name>`` columns of ``Trace.step_summary()`` and on the
                Steps page (stored in the step's summary: :mod:`tracer.format.summary`).
            **named_tensors: more tensors by keyword (merged with ``tensors``).

        The step's wall-clock time (``time.time()`` now) is kept with it (``wall_time``).

        Raises:
            SchemaError: a tensor disagrees with the schema, metadata is not JSON, or a scalar is not
                a number (the caller's mistake: raised whatever ``strict`` says).
            TraceError: the writer is closed or was inherited through fork(); in strict mode, an
                earlier write failed.
        """
        return self._record(step, {**dict(tensors or {}), **named_tensors}, inner_step, micro_batch, metadata,
                            scalars=check_scalars(scalars) if scalars is not None else None)

    def record_captured(self, captured: CapturedStep) -> None:
        """Record a step that a watcher or an integration captured (:class:`tracer.record.capture.CapturedStep`):
        the checks, sampling and hand-over of :meth:`record`, with the captured step's own tensors staged
        without a copy (``owned``) and its ``derive`` fields computed off the training thread. Returns
        nothing (making the step file's path costs the training thread time a watcher does not want).

        Raises:
            SchemaError, TraceError: as :meth:`record`; also a ``tensors`` that is not a dict, a ``derive``
            naming a field that cannot be derived, a ``signature`` that does not describe the tensors.
        """
        check_captured(captured.tensors, captured.derive, captured.signature)
        self._record(captured.step, captured.tensors, captured.inner_step, captured.micro_batch, captured.metadata,
                     captured.owned, captured.derive, captured.signature, path_wanted=False)

    def _record(self, step: int, tensors: dict[str, torch.Tensor], inner_step: int = 0, micro_batch: int = 0,
                metadata: Mapping[str, Any] | None = None, owned: frozenset[str] | set[str] = frozenset(),
                derive: tuple[str, ...] = (), signature: tuple | None = None, path_wanted: bool = True,
                scalars: dict[str, float] | None = None) -> Path | None:
        """:meth:`record` and :meth:`record_captured` (their arguments: :class:`tracer.record.capture.CapturedStep`);
        ``path_wanted=False``: the caller ignores the returned path, so a step handed to the writer
        process returns None without making it (a ``Path`` a step: about 15 us of the training thread's)."""
        if torch.is_inference_mode_enabled():
            # A record under inference_mode (a rollout): the staging buffers, the ring and its views made
            # here are written in place after the block, which an inference tensor refuses.
            with torch.inference_mode(False):
                return self._record(step, tensors, inner_step, micro_batch, metadata, owned, derive,
                                    signature, path_wanted, scalars)
        wall_time = wall_clock()
        self._check_process()
        self._backends.poll(due_only=True)  # the writer process's results so far (a strict failure raises next)
        if self._observer is not None and not self._guard_said and self.guard_raises:
            if self._observer.stop_finding() is not None:
                self._stop_for_guard((step, inner_step, micro_batch))
        self._book.raise_pending()
        if self._closed:
            raise TraceError(f"trace writer for {self.root} is closed; open a new TraceWriter")
        if not tensors:
            raise TraceError(f"record(step={step}) got no tensors; pass canonical fields such as policy_logprobs=...")
        coordinates, source_dtype = self._checks.step(step, inner_step, micro_batch, tensors, metadata, signature)
        self._recorder, self._uncaught = threading.get_ident(), None  # the run goes on in this thread
        if self._last_step is None or coordinates[0] > self._last_step:
            self._last_step = coordinates[0]
        group_key = self._checks.signatures.group_key  # the staging buffers: all on the CPU, or on one CUDA device
        sampled = self.sampling.sampled(coordinates[0])
        if not sampled and not self.sampling.anomaly_ring:
            self._book.skipped()
            return None
        json_metadata = self._checks.metadata(metadata)
        # the wall clock and the user's scalars: moved into the summary by the writer (tracer.format.summary)
        recorded = {"wall_time": wall_time, **scalars} if scalars else {"wall_time": wall_time}
        json_metadata = {**(json_metadata or {}), RECORDED_KEY: recorded}  # a new dict: json_form's is cached
        if self.sampling.first_k_sequences is not None:  # the shapes kept depend on the signature alone
            tensors, rows = cut_rows(tensors, self.sampling.first_k_sequences, self.algorithm)
            group_key = group_key and (group_key, self.sampling.first_k_sequences)
            if rows is not None:  # the checks must know the step's scalar loss covers rows the file lacks
                json_metadata = {**(json_metadata or {}), "rows_before_cut": rows}  # a new dict: json_form's is cached
        pending = PendingStep(coordinates, tensors, json_metadata, source_dtype, sampled, owned, derive, group_key,
                              self._checks.signatures.last)
        written = self._backends.submit(pending)
        return self._step_path(step_file_name(*coordinates, self.rank)) if written and path_wanted else None

    def log_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Log numbers of ``step`` that arrive after its files were recorded (a trainer's logs: the
        TRL integration calls this from ``on_log``), appended at once to ``scalars.rank_N.jsonl``
        (:mod:`tracer.format.scalar_log`); ``Trace.step_summary()`` shows them as ``scalars/<name>``.
        Values as ``record(..., scalars=...)``; a scalar recorded with the step wins over a logged one.

        Raises:
            SchemaError: a name or value :func:`tracer.record.validation.check_scalars` refuses.
            TraceError: the writer is closed, or was inherited through fork().
        """
        self._check_process()
        if self._closed:
            raise TraceError(f"trace writer for {self.root} is closed; open a new TraceWriter")
        checked = check_scalars(scalars)
        self._scalar_log.add(coordinate("step", step), {k[len(SCALAR_PREFIX):]: v for k, v in checked.items()})

    def flush(self) -> None:
        """Wait until every recorded step is on disk (or dropped). Raises TraceError in strict mode
        when a write failed, or when the writer was inherited through fork(). The manifest's live
        counts are brought up to date."""
        self._check_process()
        self._backends.flush()
        self._update_manifest(force=True)
        self._book.raise_pending()

    def close(self) -> None:
        """Flush, stop the writer thread (or process) and record how the run ended in the manifest
        (idempotent): ``finished``, or ``crashed`` / ``interrupted`` when an uncaught exception has ended
        the thread that recorded last (:mod:`tracer.format.run_end`)."""
        self._close("close", *(self._uncaught or (None, None)))

    def _close(self, closed_by: str, exc: BaseException | None, thread: str | None) -> None:
        """:meth:`close`, recording ``closed_by`` and the exception ``exc`` that ended the run in the thread
        named ``thread`` (None: none did). Closed while an exception is being handled (a ``finally:
        close()``), the writer is kept in :data:`_CLOSED_IN_FLIGHT`: if that exception turns out to be
        uncaught, :func:`_hear_uncaught` rewrites the status."""
        if self._closed:
            return
        self._closed = True
        _OPEN_WRITERS.discard(self)
        if os.getpid() != self._pid:  # inherited through fork: the parent owns the files and the lock
            return
        self._backends.close()
        if self._observer is not None:
            self._close_observer()  # its last checks, then the findings file closed
            if not self._guard_said and self._observer.stop_finding() is not None:
                self._say_guard_stop(None)  # found after the last record: the run ended by itself
        self._scalar_log.close()
        self._say_end(closed_by, exc, thread)
        if exc is None and (in_flight := sys.exc_info()[1]) is not None:
            _CLOSED_IN_FLIGHT.append((self, in_flight))
        unlock_rank(self._lock_fd, self.root, self.rank)
        self._lock_fd = None
        self._book.raise_pending()

    def _say_end(self, closed_by: str, exc: BaseException | None, thread: str | None) -> None:
        """Write the manifest's ``status`` and ``ended`` entry (:func:`tracer.format.run_end.ended_entry`);
        a failed write is counted as any manifest write's (strict: raised by :meth:`close`)."""
        status, ended = ended_entry(closed_by, self._last_step, exc, thread)
        with self._book.lock:
            self._book.manifest["status"] = status
            self._book.manifest[ENDED_KEY] = ended
        try:
            self._book.write()
        except OSError as err:
            self._book.manifest_failed(err)

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

    def _close_observer(self) -> None:
        """Close the guard (its last checks); a failure is logged, never raised."""
        if self._observer is not None:
            try:
                self._observer.close()
            except Exception as err:  # noqa: BLE001  (a guard never breaks the trace's close)
                log.warning("tracer: closing the guard of %s failed: %s", self.root, err)

    @property
    def guard_stop(self) -> Any:
        """The finding (:class:`tracer.checks.finding.Finding`) the live guard stops the run for
        (``guard="stop"``), else None; integrations that stop their trainer themselves poll it."""
        return self._observer.stop_finding() if self._observer is not None else None

    def _stop_for_guard(self, coordinates: tuple[int, int, int]) -> None:
        """The guard found an error: every step recorded so far on disk, the manifest saying why, then
        GuardStop (once; the record of ``coordinates`` is not taken)."""
        self.flush()
        self._say_guard_stop(coordinates)
        self._update_manifest(force=True)
        finding = self._observer.stop_finding()
        raise GuardStop(self._observer.stop_text() or f"tracer guard stopped the run: {finding}", finding, self.root)

    def _say_guard_stop(self, coordinates: tuple[int, int, int] | None) -> None:
        """The manifest's ``guard`` entry: mode, the step whose record was refused (None: none came after
        the finding), the finding."""
        self._guard_said = True
        finding = self._observer.stop_finding()
        stopped_at = None if coordinates is None else dict(zip(("step", "inner_step", "micro_batch"), coordinates))
        self._book.annotate("guard", {"mode": self._observer.mode, "stopped_at": stopped_at,
                                      "finding": finding.to_dict() if hasattr(finding, "to_dict") else str(finding)})

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

    @property
    def writer(self) -> str:
        """Where steps are written now: ``"thread"``, ``"process"``, or ``"inline"`` (``async_write=False``);
        ``"auto"`` until the first step chooses; a writer whose process died goes on with ``"thread"``."""
        return self._backends.name

    @property
    def peak_queued_bytes(self) -> int:
        """Most bytes the background queue held at once (0 when writing synchronously)."""
        return self._backends.peak_bytes

    # the writer thread and the writer process themselves, for diagnostics (None when not in use)
    _background = property(lambda self: self._backends.background)
    _process = property(lambda self: self._backends.process)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, traceback: Any) -> None:
        """Close; an exception leaving the block is the run's end (``crashed`` / ``interrupted``)."""
        if exc is None:
            self._close("with", *(self._uncaught or (None, None)))
        else:
            self._close("with", exc, threading.current_thread().name)

    # -- private: choosing, starting and replacing the backend -------------------------------

    def _local_backend(self, background: bool, resume_index: bool = False) -> LocalBackend:
        """Write in this process: on a background thread, or inside ``record`` (``resume_index``:
        append to the summary index a dead writer process left)."""
        steps = StepWriter(self.root, self.rank, self.algorithm, self.keep_source_dtype, self.hyperparameters,
                           self._book, lambda *args: _save_atomic(*args),  # looked up at call time
                           fsync_steps=self.fsync_steps, resume_index=resume_index, observer=self._observer)
        start = getattr(self._observer, "start_local", None)
        if start is not None:  # the guard's checks start now, before the writer thread (a fork sees one thread)
            start()
        thread = None
        if background:
            max_queue_steps, max_queue_bytes, when_full = self._queue
            thread = BackgroundWriter(
                steps.write, steps.normalise, steps.on_normalise_error, self._book.queue_full,
                max_queue_steps, max_queue_bytes, when_full, self.sampling.anomaly_ring, self.sampling.kl_spike,
                self._pool, tick=self._update_manifest, tick_interval=MANIFEST_INTERVAL_S, prepare=steps.summarise,
                linger_s=getattr(self._observer, "linger_s", None))  # a guard wants each file soon
            self._book.on_writer_thread = thread.on_writer_thread
        return LocalBackend(steps, self._book, self._pool, self._steps_dir, self.rank, self._header,
                            lambda force: self._update_manifest(force), thread)

    def _header(self, pending: PendingStep) -> dict[str, Any]:
        return step_header(self.hyperparameters, pending.json_metadata, self.algorithm, *pending.coordinates,
                           self.rank, self.world_size, pending.source_dtype)

    def _process_writer(self) -> Any:
        """A writer process for this trace (:class:`tracer.record.process.parent.ProcessWriter`).
        Raises TraceError when it cannot start."""
        from tracer.record.process.parent import ProcessWriter  # imported only by those who use it

        max_queue_steps, max_queue_bytes, when_full = self._queue
        process = ProcessWriter(self._child_config(), self._book, max_queue_steps, max_queue_bytes, when_full,
                                self._lock_fd, self._stall_s)
        if self._observer is not None:
            process.on_guard = self._observer.receive  # what the writer process's checks report
        return process

    def _child_config(self) -> dict[str, Any]:
        """What the writer process needs to write this trace's steps (JSON)."""
        return {"root": os.fspath(self.root), "rank": self.rank, "world_size": self.world_size,
                "algorithm": self.algorithm, "keep_source_dtype": self.keep_source_dtype,
                "fsync_steps": self.fsync_steps,
                "hyperparameters": jsonable(self.hyperparameters), "manifest": self._book.manifest,
                "anomaly_ring": self.sampling.anomaly_ring, "kl_spike": self.sampling.kl_spike,
                "max_queue_steps": self._queue[0], "max_queue_bytes": self._queue[1],
                "observer": self._observer.child_spec() if self._observer is not None else None,
                **({"linger_s": self._observer.linger_s} if getattr(self._observer, "linger_s", None) is not None else {})}

    def _update_manifest(self, force: bool = False) -> None:
        """Rewrite the manifest when its counts changed, at most every MANIFEST_INTERVAL_S seconds
        unless ``force`` (the writer thread's tick, ``flush``). A failure is logged (strict: kept
        to raise from the next call), never raised here. Also appends the summary index's lines
        (when the index is written in this process)."""
        if self._backends is not None:
            self._backends.flush_index(force)
        self._book.update(force)

    def _reserve_counts(self) -> None:
        """Room for the manifest's counts while the disk has some (:mod:`tracer.format.counts`): a
        disk the step files fill later cannot hide the drops. A failure is logged (the disk is full
        already: the manifest cannot be written either)."""
        try:
            reserve_counts(self.root)
        except OSError as err:
            log.warning("tracer: could not reserve %s in %s: %s; a disk that fills may hide the drop count",
                        COUNTS_NAME, self.root, err)

    def _write_tokens(self, strings: Callable[[], list[str]]) -> None:
        """``tokens.json``: the text of every token id (rank 0), ``strings()``. A failure leaves the
        trace usable (ids show as ``<id N>``); strict: TraceError."""
        try:
            write_json_atomic(self.root / TOKENS_NAME, {"tokens": strings()})
        except OSError as err:
            if self.strict:
                raise TraceError(f"could not write {self.root / TOKENS_NAME}: {err}") from err
            warnings.warn(f"tracer: could not write {self.root / TOKENS_NAME} ({err}); token ids "
                          "will show without text. Training continues.", RuntimeWarning,
                          stacklevel=user_stacklevel())

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise TraceError(
                f"tracer: this TraceWriter for {self.root} was created by process {self._pid} and inherited "
                f"through fork() by process {os.getpid()}, which cannot use it (its writer thread and file "
                "lock stayed in the parent, so records here would be lost or wait forever); create a new "
                "TraceWriter in the child (its own out_dir, or its own rank) or record only in the parent")


Tracer = TraceWriter

wall_clock = time.time  # the clock of a step's wall_time (looked up at call time: tests fix it)

_OPEN_WRITERS: "weakref.WeakSet[TraceWriter]" = weakref.WeakSet()  # the open TraceWriters, closed at exit
# (writer, exception being handled) of the last writers closed inside an except or finally block
_CLOSED_IN_FLIGHT: "collections.deque[tuple[TraceWriter, BaseException]]" = collections.deque(maxlen=8)


def _hear_uncaught(exc: BaseException, thread: threading.Thread) -> None:
    """The exit hooks' listener (:mod:`tracer.record.exit_hooks`): ``exc`` ended ``thread``. The open writers
    it ends (every one for the main thread, whose end ends the program; else those that ``thread`` recorded
    last) will record it when closed; a writer already closed while ``exc`` (or the exception it arose
    from) was being handled has its manifest rewritten now."""
    main = thread is threading.main_thread()
    for writer in list(_OPEN_WRITERS):
        if main or writer._recorder == thread.ident:
            writer._uncaught = (exc, thread.name)
    chain, seen = [], exc
    while seen is not None and len(chain) < 16:  # the exceptions exc was raised from, or while handling
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for writer, in_flight in list(_CLOSED_IN_FLIGHT):
        if any(in_flight is link for link in chain) and os.getpid() == writer._pid:
            _CLOSED_IN_FLIGHT.remove((writer, in_flight))
            writer._say_end(writer._book.manifest.get(ENDED_KEY, {}).get("closed_by", "close"), exc, thread.name)


def note_uncaught(exc: BaseException) -> None:
    """Tell the open writers that ``exc`` ended the program, as the exit hooks would: for a runner that catches
    the script's exception itself (prints it and returns an exit code, as ``tracer run`` does), to be called
    before it closes them, so that they record ``crashed`` / ``interrupted`` (:mod:`tracer.format.run_end`)
    rather than ``finished``. Never raises."""
    try:
        _hear_uncaught(exc, threading.main_thread())
    except Exception as err:  # noqa: BLE001  (the trace's status is never worth a second traceback)
        log.warning("tracer: could not record the exception that ended the run: %s", err)


@atexit.register
def _close_open_writers() -> None:
    """At interpreter exit, flush and close writers the program left open, recording the exception that
    ended the program, if one did (heard by the hooks, else ``sys.last_value``: a hook installed later that
    did not chain ours)."""
    fallback = exit_hooks.uncaught_at_exit(_hear_uncaught)
    for writer in list(_OPEN_WRITERS):
        exc, thread = writer._uncaught or (fallback, threading.main_thread().name)
        try:
            writer._close("exit", exc, thread if exc is not None else None)
        except Exception as err:  # never turn a clean exit into a crash
            log.warning("tracer: closing %s at exit failed: %s", writer.root, err)
