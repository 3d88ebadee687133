"""The write side of a trace: a staged step (contiguous host tensors and its header values) becomes
a step file and a summary-index line. The same code runs on the writer thread
(``TraceWriter(writer="thread")``), inside ``record`` (``async_write=False``) and in the writer
process (``writer="process"``, :mod:`tracer.record.process.parent`).

Per step: stored form (:func:`tracer.format.schema.normalise_tensors`, skipped for a field signature
already in stored form), checksum and non-finite fields in one pass (:mod:`tracer.record.step_bytes`),
the summary (:mod:`tracer.format.summary`, steps of a batch together), the header encoding (the
hyperparameters' made once), the atomic file (:func:`tracer.format.files.save_atomic`) and the index
line (:mod:`tracer.format.run_index`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping

import os

from tracer.record import step_bytes
from tracer.format import rollout_store
from tracer.format import summary as summary_format
from tracer.format.integrity import MAX_TOKEN_ENTRIES, MAX_TOKENS_BYTES, clean_tokens, read_json
from tracer.formulas import rows as row_formulas
from tracer.formulas import summaries
from tracer.record.capture import StagedStep
from tracer.formulas.derived import derivable, derive_fields, derive_recorded
from tracer.format.names import STEPS_DIR, TOKENS_NAME, step_file_name, step_label
from tracer.format.files import unshare
from tracer.record.manifest import ManifestBook
from tracer.format.run_index import IndexWriter
from tracer.format.schema import SCHEMA_VERSION, normalise_tensors
from tracer.format.metadata_codec import encode_metadata

log = logging.getLogger(__name__)


class StepWriter:
    """Writes staged steps of one (trace, rank).

    Args:
        root, rank, algorithm, keep_source_dtype: the writer's.
        hyperparameters: the values every header holds (a step's metadata may override them).
        book: counts written steps and failures (:class:`tracer.record.manifest.ManifestBook`).
        save: ``save_atomic(path, tensors, metadata, specs, fsync)``, returning the file's size when
            it knows it (else None: the index takes it from the file); the caller's name for it,
            looked up at call time (tests replace it to simulate a full disk).
        fsync_steps: flush each step file to the device before its rename
            (:func:`tracer.format.files.save_atomic`).
        observer: told of each step file once it is in place (:class:`tracer.record.observer.StepObserver`:
            the live guard), or None.
    """

    def __init__(self, root: Path, rank: int, algorithm: str, keep_source_dtype: bool,
                 hyperparameters: Mapping[str, Any], book: ManifestBook,
                 save: Callable[..., None], fsync_steps: bool = False, resume_index: bool = False,
                 observer: Any = None) -> None:
        self.fsync_steps = fsync_steps
        self.observer = observer
        self.root, self.rank, self.algorithm, self.keep_source_dtype = Path(root), rank, algorithm, keep_source_dtype
        self.hyperparameters = dict(hyperparameters)
        self._hyperparameters_encoded = encode_metadata(self.hyperparameters)  # once, not per step
        self.book, self._save = book, save
        self._plans: dict[tuple, step_bytes.StepPlan] = {}  # signatures already in stored form, planned
        # the run's summary index (tracer.format.run_index); resume_index: go on with a dead writer process's
        self.index = IndexWriter(self.root, rank, resume=resume_index)
        # the run's per-row summaries (tracer.format.rollout_store), with the token strings of tokens.json
        self.rollouts = rollout_store.RolloutWriter(self.root, rank, resume=resume_index, enabled=algorithm != "dpo")
        self._shown_tokens: list[str] | None = None
        steps_dir = self.root / STEPS_DIR  # a step file's path: a child made without parsing (tracer.format.names)
        self._child = getattr(steps_dir, "_make_child_relpath", steps_dir.joinpath)

    def normalise(self, item: StagedStep) -> None:
        """Stored form, non-finite fields and checksum of a staged step. Staged tensors are contiguous
        CPU tensors, each its own; a signature already in stored form skips the conversion pass, and
        its :class:`tracer.record.step_bytes.StepPlan` is remembered. Fields the capture left to the writer
        (``item.derive``) are derived first. Raises what normalising raises."""
        if item.derive:
            item.tensors.update(derive_recorded(item.tensors, item.derive))
        staged = step_bytes.signature(item.tensors)
        plan = self._plans.get(staged)
        if plan is None:
            item.tensors = unshare(normalise_tensors(item.tensors, self.algorithm, self.keep_source_dtype))
            plan = step_bytes.make_plan(item.tensors)
            # same signature out as in: nothing was converted (a 0/1 float mask always is, so never lands here)
            if step_bytes.signature(item.tensors) == staged and len(self._plans) < step_bytes.MAX_PLANS:
                self._plans[staged] = plan
        described = step_bytes.describe(item.tensors, plan)
        if described.nonfinite:
            item.metadata["nonfinite_fields"] = described.nonfinite
        item.metadata["content_sha256"] = described.content_sha256
        item.specs = described.specs

    def on_normalise_error(self, item: StagedStep, err: Exception) -> None:
        self.book.fail(f"{step_label(item.step, item.inner_step, item.micro_batch)}: {type(err).__name__}: {err}", err)

    def write(self, item: StagedStep, anomaly: str | None) -> None:
        """Write one normalised step (and queue its index line); a failure is counted, never raised."""
        if anomaly is not None:
            item.metadata["anomaly"] = anomaly
        name = step_file_name(item.step, item.inner_step, item.micro_batch, self.rank)
        path = self._child(name)
        if not item.summarised:  # written alone (synchronously, or through the anomaly ring)
            self.summarise([item])
        try:
            encoded = self.encoded_metadata(item.metadata)
            size = self._save(path, item.tensors, encoded, item.specs, self.fsync_steps)
        except Exception as err:  # disk full, directory gone, serialiser refusal: never kill training
            self.book.fail(f"{name}: {type(err).__name__}: {err}", err)
            return
        self.book.written(item.sampled)
        # never raises; the size save_atomic knows spares a stat (an int: a replaced save may return anything)
        self.index.add(path, derivable(item.tensors, item.metadata), encoded, item.metadata,
                       size if type(size) is int else None)
        rows, item.rows = item.rows, None
        if rows is not None:
            self._add_rollouts(path, item, rows, size)
        if self.observer is not None:
            try:
                self.observer.step_written(path)
            except Exception as err:  # noqa: BLE001  (the guard is a report: never a reason to lose a step)
                log.warning("tracer: the guard was not told of %s: %s: %s", name, type(err).__name__, err)

    def _add_rollouts(self, path: Path, item: StagedStep, rows: tuple, size: Any) -> None:
        """Append the rollout line of a step file just written (never raises)."""
        try:
            if type(size) is not int:
                size = os.stat(path).st_size
            stats, texts, names = rows
            self.rollouts.add(rollout_store.line_of(
                path.name, (item.step, item.inner_step, item.micro_batch, self.rank), size, stats,
                [t for t, _ in texts], [c for _, c in texts], names))
        except Exception as err:  # noqa: BLE001  (an accelerator: the reader reads the file instead)
            log.warning("tracer: %s not listed in %s (%s: %s)", path.name, self.rollouts.path.name,
                        type(err).__name__, err)

    def summarise(self, items: list[StagedStep]) -> None:
        """Put each step's summary (:mod:`tracer.format.summary`, steps of one batch computed together)
        into its metadata. A failure leaves it out of the steps it concerns (readers then summarise
        those files from their tensors) and never costs a step."""
        for item in items:
            item.summarised = True
        try:
            batch = [({**it.tensors, **derive_fields(it.tensors, it.metadata)}, it.metadata) for it in items]
            for item, summary in zip(items, summaries.compute_summaries(batch)):  # ratio/KL derived from inputs
                item.metadata[summary_format.SUMMARY_KEY] = summary_format.header_text(summary)  # encoded once, here
                item.metadata.pop(summary_format.RECORDED_KEY, None)  # wall_time, scalars: now in the summary
        except Exception as err:  # noqa: BLE001  (a summary is an optimisation, never a reason to drop data)
            if len(items) > 1:  # find the step that fails; the others keep theirs
                for item in items:
                    self.summarise([item])
                return
            log.warning("tracer: step %s: no summary in its header (%s: %s)", items[0].step, type(err).__name__, err)
            return
        for item, (tensors, metadata) in zip(items, batch):
            self._summarise_rows(item, tensors, metadata)

    def _summarise_rows(self, item: StagedStep, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
        """The step's per-row statistics and texts (:mod:`tracer.format.rollout_store`), kept on the item for
        :meth:`write`; nothing for a DPO step or one without completions, or when they fail."""
        if self.algorithm == "dpo" or "completion_ids" not in tensors:
            return
        try:
            stats = row_formulas.row_statistics(tensors, metadata)
            shown = self._token_strings()
            texts = [rollout_store.completion_text(shown, ids) for ids in row_formulas.kept_ids(tensors)]
            names = metadata.get("reward_component_names")
            item.rows = (stats, texts, names if isinstance(names, list) else None)
        except Exception as err:  # noqa: BLE001  (an accelerator, never a reason to drop data)
            log.warning("tracer: step %s: no rollout summary (%s: %s)", item.step, type(err).__name__, err)

    def _token_strings(self) -> list[str]:
        """The token strings of the trace's ``tokens.json`` as the reader shows them, read once it
        exists (rank 0 writes it when the writer starts); [] until then (ids show as ``<id N>``)."""
        if self._shown_tokens is None:
            path = self.root / TOKENS_NAME
            if not path.is_file():
                return []
            try:
                tokens = clean_tokens(read_json(path, "token strings", MAX_TOKENS_BYTES, MAX_TOKEN_ENTRIES, "tokens"),
                                      path)
            except Exception:  # noqa: BLE001  (unusable: the reader shows <id N> too)
                tokens = []
            self._shown_tokens = rollout_store.shown_tokens(tokens)
        return self._shown_tokens

    def encoded_metadata(self, metadata: dict[str, Any]) -> dict[str, str]:
        """``encode_metadata(metadata)``, reusing the hyperparameters' encoding made once (the header
        holds them unchanged unless the step's metadata overrode one)."""
        hyper = self.hyperparameters
        own = {k: v for k, v in metadata.items() if k not in hyper or v is not hyper[k]}
        return {**{k: v for k, v in self._hyperparameters_encoded.items() if k not in own}, **encode_metadata(own)}


def step_header(hyperparameters: Mapping[str, Any], metadata: Mapping[str, Any] | None, algorithm: str, step: int,
                inner_step: int, micro_batch: int, rank: int, world_size: int, source_dtype: str) -> dict[str, Any]:
    """The header values of one step: the hyperparameters, the step's own metadata over them, then
    the keys the writer sets (SPEC.md section 4)."""
    return {
        **hyperparameters,
        **dict(metadata or {}),
        "schema_version": SCHEMA_VERSION,
        "algorithm": algorithm,
        "step": int(step),
        "inner_step": int(inner_step),
        "micro_batch": int(micro_batch),
        "rank": rank,
        "world_size": world_size,
        "source_dtype": source_dtype,
    }
