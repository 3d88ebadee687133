"""The manifest's live counts (``steps_written``, ``dropped_steps``, ``skipped_steps``,
``drop_reasons``), its rate-bounded rewrites, and the write failures strict mode raises.

One :class:`ManifestBook` per writer: the training thread counts skipped and dropped steps, the
write side (the writer thread, or the writer process of :mod:`tracer.record.process.parent`, which keeps
a book of its own mirrored by the parent's) counts written and failed ones. Only the lock is held
while counting, never during I/O.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import threading
import time
import warnings
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from tracer.errors import SchemaError, TraceError, user_stacklevel
from tracer.format.integrity import MAX_TOKEN_ENTRIES
from tracer.format.chat_template import TEMPLATE_TAIL_KEY, end_of_turn_tails
from tracer.format.counts import COUNT_KEYS, write_counts
from tracer.format.names import FORMAT_NAME, MANIFEST_NAME
from tracer.format.schema import SCHEMA_VERSION
from tracer.format.metadata_codec import jsonable

log = logging.getLogger(__name__)

MANIFEST_INTERVAL_S = 1.0  # the live manifest (steps_written, drops) is rewritten at most this often
MAX_DROP_REASONS = 20  # reasons kept in the manifest (every drop is counted)
# A full queue (when_full="drop") warns on its first drop, then once more per this many drops or
# after this many seconds since its last warning, whichever comes first; the others log at debug.
QUEUE_DROP_WARN_EVERY = 100
QUEUE_DROP_WARN_INTERVAL_S = 60.0


def new_manifest(algorithm: str, world_size: int, hyperparameters: Mapping[str, Any],
                 config: Mapping[str, Any] | None, sampling: Any, capture: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a trace just started (SPEC.md section 5); the counts are added when written."""
    return {
        "format": FORMAT_NAME,
        "schema_version": SCHEMA_VERSION,
        "algorithm": algorithm,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "producers": producers(),
        "world_size": world_size,
        "hyperparameters": jsonable(dict(hyperparameters)),
        "config": jsonable(dict(config or {})),
        "sampling": dataclasses.asdict(sampling),
        "capture": capture,
        "status": "running",
    }


class ManifestBook:
    """Counts and the manifest of one writer.

    Args:
        root: the trace directory (the manifest is ``root / manifest.json``, written by rank 0 only).
        rank: this writer's rank.
        manifest: the manifest's static part (mutated: the counts are kept in it).
        strict: keep the first failure to raise (:meth:`raise_pending`) instead of warning.
        write_json: ``write_json_atomic(path, payload)``, looked up by the caller at call time.
        interval_s: the least time between two manifest rewrites that are not forced.
    """

    def __init__(self, root: Path, rank: int, manifest: dict[str, Any], strict: bool,
                 write_json: Callable[[Path, Any], None], interval_s: float = MANIFEST_INTERVAL_S) -> None:
        self.root, self.rank, self.strict, self.manifest = Path(root), rank, strict, manifest
        self._write_json, self.interval_s = write_json, interval_s
        self.steps_written = 0
        self.dropped_steps = 0
        self.skipped_steps = 0  # not selected by the sampling policy (not an error)
        self.drop_reasons: list[str] = []
        self.error: tuple[str, BaseException] | None = None  # strict mode: the first failure not yet raised
        self.failures_pending = 0  # strict mode: failures since the last one raised
        self.lock = threading.Lock()  # counts; held briefly, never during I/O
        self._write_lock = threading.Lock()  # one manifest write at a time
        self.dirty = False  # counts changed since the manifest was last written
        self.written_at = 0.0
        self.on_writer_thread: Callable[[], bool] = lambda: False  # where a warning must not raise
        self.queue_drops = 0  # steps dropped because the queue was full (when_full="drop")
        self._queue_drops_warned, self._queue_warned_at = 0, 0.0  # the count at, and time of, the last warning
        # counts made here that a writer process must hear of (tracer.record.process.parent), else None
        self.forward: dict[str, Any] | None = None

    # -- counting (any thread) ----------------------------------------------------------------

    def written(self, sampled: bool = True) -> None:
        """A step file was written (``sampled`` False: it came out of the anomaly ring)."""
        with self.lock:
            self.steps_written += 1
            if not sampled:
                self.skipped_steps -= 1
            self.dirty = True

    def skipped(self, count: int = 1) -> None:
        with self.lock:
            self.skipped_steps += count
            if self.forward is not None:
                self.forward["skipped"] = self.forward.get("skipped", 0) + count

    def add_drops(self, count: int, reasons: list[str]) -> None:
        """Count ``count`` drops at once (``reasons``: the first of them), without a warning."""
        with self.lock:
            self.dropped_steps += count
            self.drop_reasons.extend(reasons[:MAX_DROP_REASONS - len(self.drop_reasons)])
            self.dirty = True

    def count_drop(self, reason: str, warn: bool = True, forward: bool = True) -> None:
        """Count a dropped step in memory (no I/O: the manifest is written later). ``forward``: tell
        the writer process (when there is one) about it."""
        with self.lock:
            self.dropped_steps += 1
            if len(self.drop_reasons) < MAX_DROP_REASONS:
                self.drop_reasons.append(reason)
            dropped = self.dropped_steps
            self.dirty = True
            if forward and self.forward is not None:
                self.forward["drops"] = self.forward.get("drops", 0) + 1
                reasons = self.forward.setdefault("reasons", [])
                if len(reasons) < MAX_DROP_REASONS:
                    reasons.append(reason)
        if not warn:
            return
        self._warn(f"tracer: dropped a step ({dropped} so far): {reason}. "
                   "Training continues; pass strict=True to raise instead.")

    def queue_full(self, reason: str) -> None:
        """Count a step dropped because the queue was full (``when_full="drop"``), exactly as
        :meth:`count_drop` does. Only the first such drop warns; then one summary warning per
        :data:`QUEUE_DROP_WARN_EVERY` drops or after :data:`QUEUE_DROP_WARN_INTERVAL_S` seconds since
        the last one, whichever comes first; the drops in between are logged at debug level."""
        self.count_drop(reason, warn=False)
        now = time.monotonic()
        with self.lock:
            self.queue_drops += 1
            count, dropped, since = self.queue_drops, self.dropped_steps, self.queue_drops - self._queue_drops_warned
            due = (count == 1 or since >= QUEUE_DROP_WARN_EVERY
                   or now - self._queue_warned_at >= QUEUE_DROP_WARN_INTERVAL_S)
            if due:
                self._queue_drops_warned, self._queue_warned_at = count, now
        if not due:
            log.debug("tracer: dropped a step (%d so far): %s", dropped, reason)
            return
        if count == 1:
            self._warn(f"tracer: dropped a step ({dropped} so far): {reason}. Training continues; pass "
                       "when_full='block' to wait for the writer instead. Further drops are counted in the "
                       "manifest's dropped_steps (shown by `tracer info`) without a warning each: one warning "
                       f"sums them up per {QUEUE_DROP_WARN_EVERY} drops or {QUEUE_DROP_WARN_INTERVAL_S:g} s.")
        else:
            self._warn(f"tracer: dropped {since} more steps because the queue was full ({dropped} dropped so far; "
                       f"the latest: {reason}). They are counted in the manifest's dropped_steps (`tracer info`).")

    def _warn(self, message: str) -> None:
        """Warn (RuntimeWarning); warnings made errors raise on the caller's thread, never on the
        writer's (logged there)."""
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())
        except Warning:  # warnings made errors (-W error): raised on the caller's thread, never on the writer's
            if not self.on_writer_thread():
                raise
            log.error("%s", message)  # the drop is counted; the writer goes on (or flush would hang)

    def fail(self, reason: str, err: BaseException, forward: bool = True) -> None:
        """A write (or staging) failed: counted in every mode; strict mode keeps it to raise."""
        if self.strict:
            with self.lock:
                self.error = self.error or (reason, err)
                self.failures_pending += 1
        self.count_drop(reason, warn=not self.strict, forward=forward)

    def annotate(self, key: str, value: Any) -> None:
        with self.lock:
            self.manifest[key] = value
            self.dirty = True
            if self.forward is not None:
                self.forward.setdefault("notes", {})[key] = value

    def take_forward(self) -> dict[str, Any] | None:
        """The counts to forward since the last call (None when there are none), and start again."""
        with self.lock:
            if not self.forward:
                return None
            taken, self.forward = self.forward, {}
            return taken

    def raise_pending(self) -> None:
        """Raise the first failure kept by strict mode (TraceError, with the count of those since)."""
        if self.error is None or not self.strict:
            return
        with self.lock:
            (reason, err), self.error = self.error, None
            count, self.failures_pending = self.failures_pending, 0
        more = (f" ({count} writes failed since the last error raised; all are counted in the trace's "
                "dropped_steps, shown by `tracer info`)") if count > 1 else ""
        raise TraceError(f"tracer: writing {self.root} failed: {reason}{more}") from err

    # -- the manifest -------------------------------------------------------------------------

    def update(self, force: bool = False) -> None:
        """Rewrite the manifest when its counts changed, at most every ``interval_s`` unless ``force``.
        A failure is logged (strict: kept to raise from the next call), never raised here."""
        if not self.dirty or (not force and time.monotonic() - self.written_at < self.interval_s):
            return
        try:
            self.write()
        except OSError as err:
            self.manifest_failed(err)

    def write(self) -> None:
        """Write the manifest with the current counts (rank 0 only). Raises OSError."""
        if self.rank != 0:
            return
        with self._write_lock:
            with self.lock:
                self.manifest.update(steps_written=self.steps_written, dropped_steps=self.dropped_steps,
                                     skipped_steps=self.skipped_steps, drop_reasons=list(self.drop_reasons),
                                     revision=time.time_ns())
                payload, self.dirty = dict(self.manifest), False
            try:
                self._write_json(self.root / MANIFEST_NAME, payload)
            except OSError as err:
                self.dirty = True
                self._write_counts(payload, err)
                raise
            finally:
                self.written_at = time.monotonic()

    def _write_counts(self, payload: dict[str, Any], err: OSError) -> None:
        """The manifest could not be rewritten (a full disk): keep its counts in the space reserved
        for them (:mod:`tracer.format.counts`), which needs no new block. A failure there is logged:
        the manifest's failure is the one reported."""
        body = {key: payload[key] for key in COUNT_KEYS}
        body.update(revision=payload["revision"], manifest_error=f"{type(err).__name__}: {err}"[:500])
        try:
            write_counts(self.root, body)
        except OSError as counts_err:
            log.warning("tracer: could not keep the counts of %s in its reserved file either: %s; "
                        "`tracer info` will say its drop count is unknown", self.root, counts_err)

    def manifest_failed(self, err: OSError) -> None:
        """The manifest could not be rewritten: strict mode raises it from the next call."""
        if not self.strict:
            log.warning("tracer: could not update the manifest of %s: %s", self.root, err)
            return
        with self.lock:
            self.error = self.error or (f"{MANIFEST_NAME}: {type(err).__name__}: {err}", err)
            self.failures_pending += 1


def token_strings(tokenizer: Any) -> list[str]:
    """Text of every token id of ``tokenizer`` (a transformers tokenizer or a ``tokenizers.Tokenizer``).

    Each id is decoded on its own with special tokens kept, so ``tokens[i]`` is what id i shows as.
    """
    if hasattr(tokenizer, "batch_decode"):  # transformers PreTrainedTokenizer(Fast)
        n = len(tokenizer)
        return tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
    if hasattr(tokenizer, "decode_batch"):  # tokenizers.Tokenizer
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        return tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    raise TraceError(
        f"tokenizer of type {type(tokenizer).__name__} has neither batch_decode nor decode_batch; "
        "pass a transformers tokenizer or a tokenizers.Tokenizer"
    )


def vocabulary_strings(vocabulary: Any) -> list[str]:
    """The token strings of a plain vocabulary, as ``tokens.json`` holds them (index = token id).

    Args:
        vocabulary: a list (or tuple) of strings, ``vocabulary[i]`` the text of id i; or a dict
            ``{id: text}`` (int keys, str values); or a dict ``{text: id}`` (str keys, int values:
            what a tokenizer's ``get_vocab()`` returns). An id a dict does not name (up to its
            largest) gets ``<id N>``, the text the reader shows for an unknown id.

    Raises:
        SchemaError: another type, a non-string text, a negative or non-int id, two texts for one id,
            or ids beyond :data:`tracer.format.integrity.MAX_TOKEN_ENTRIES` (the reader would refuse
            the file).
    """
    def bad(what: str, *got: Any) -> SchemaError:
        return SchemaError(f"vocabulary: {what}{f', got {got[0]!r}' if got else ''}; pass a list of token strings "
                           "(id = index), {id: text} or {text: id}")

    if isinstance(vocabulary, (list, tuple)):
        for i, text in enumerate(vocabulary):
            if not isinstance(text, str):
                raise bad(f"entry {i} is not a string", type(text).__name__)
        pairs = list(enumerate(vocabulary))
    elif isinstance(vocabulary, Mapping):
        items = list(vocabulary.items())
        if all(_token_id(k) and isinstance(v, str) for k, v in items):
            pairs = [(int(k), v) for k, v in items]
        elif all(isinstance(k, str) and _token_id(v) for k, v in items):
            pairs = [(int(v), k) for k, v in items]
        else:
            k, v = next((k, v) for k, v in items if not (_token_id(k) and isinstance(v, str)))
            raise bad("a dict must map every int id >= 0 to its text, or every text to its int id >= 0; "
                      f"entry {k!r}: {v!r} is neither")
    else:
        raise bad("expected a list or a dict", type(vocabulary).__name__)
    size = max((i for i, _ in pairs), default=-1) + 1
    if size > MAX_TOKEN_ENTRIES:
        raise bad(f"ids up to {MAX_TOKEN_ENTRIES - 1} are stored", size - 1)
    tokens: list[str | None] = [None] * size
    for i, text in pairs:
        if tokens[i] is not None and tokens[i] != text:
            raise bad(f"id {i} has two texts ({tokens[i]!r} and {text!r})")
        tokens[i] = text
    return [f"<id {i}>" if t is None else t for i, t in enumerate(tokens)]


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """Class, name and special token ids of ``tokenizer`` (kept in the manifest), and when it has a
    chat template, the token ids the template writes after its end-of-turn token
    (``template_end_of_turn_tail``, :mod:`tracer.format.chat_template`)."""
    ident: dict[str, Any] = {"class": type(tokenizer).__name__}
    for key in ("name_or_path", "eos_token_id", "pad_token_id", "bos_token_id", "padding_side"):
        value = getattr(tokenizer, key, None)
        if isinstance(value, (str, int)):
            ident[key] = value
    tails = end_of_turn_tails(tokenizer)
    if tails is not None:
        ident[TEMPLATE_TAIL_KEY] = tails
    return ident


def producers() -> dict[str, str]:
    """Versions of the packages that produced a trace, and the CPU kernels torch computes with.

    ``cpu_kernels`` is ``torch.backends.cpu.get_cpu_capability()`` (``AVX512``, ``AVX2``,
    ``DEFAULT``...: the vector width of ATen's CPU kernels on this machine, or what
    ``ATEN_CPU_CAPABILITY`` pinned) and ``mkl_cbwr`` the ``MKL_CBWR`` code path when one is pinned.
    float32 results differ in the last bits between kernel paths, and training amplifies that, so
    ``tracer diff`` says when two traces differ in them (docs/regression-testing.md).
    """
    versions = {"python": platform.python_version()}
    for pkg in ("tracer", "torch", "transformers", "trl", "safetensors"):
        try:
            versions[pkg] = importlib_metadata.version(pkg)
        except importlib_metadata.PackageNotFoundError:
            pass
    try:
        versions["cpu_kernels"] = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # a torch too old to say: the trace just does not record it
        pass
    if os.environ.get("MKL_CBWR"):
        versions["mkl_cbwr"] = os.environ["MKL_CBWR"]
    return versions
