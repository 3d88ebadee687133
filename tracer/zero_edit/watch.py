"""Zero-edit tracing: record a hand-written training loop's tensors at each backward, by name.

``python -m tracer run --algo grpo --out runs/x -- train_grpo.py --lr 1e-6`` runs the script as
``python train_grpo.py --lr 1e-6`` would (same ``__main__``, ``sys.argv``, ``sys.path[0]``) with
:class:`Watcher` installed; from Python (a notebook)::

    with tracer.watch(algo="grpo", out="runs/x") as w:
        train()                                  # any loop that calls loss.backward()
    # leaving the block logs the summary (w.summary(): its first line; w.report(): a dict)

How it works: ``torch.Tensor.backward`` and ``torch.autograd.backward`` are wrapped (and restored
on exit). Before the real backward runs, the calling frame's variables are read through a name map
(:mod:`tracer.zero_edit.name_maps`, rules in :mod:`tracer.zero_edit.frames`), so the tensors recorded are the ones the
loss was built from; a line seen before is read by its plan (:mod:`tracer.zero_edit.site_plans`), which gives
the same capture for less. Steps are numbered from the frame's indices (:class:`StepClock`). The trace
writer is created at the first traced backward, so a script that never traces leaves no empty
trace behind, and ``torch.distributed`` ranks (initialised by the script) are known by then.

Tracing never stops the script: a failed capture is warned about and counted (``strict=True``
raises instead). The one exception is the live guard with ``guard="stop"``: once a check has found an
error in a recorded step, the next traced ``backward()`` raises :class:`tracer.errors.GuardStop` into
the script (before the backward runs, so no further update is applied), with every step recorded so
far written and the manifest saying why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from tracer.zero_edit import frame_lookup, frames, site_plans
from tracer.format.capture_report import write_capture_report
from tracer.errors import TraceError, user_stacklevel
from tracer.format.files import refuse_existing_trace
from tracer.zero_edit.name_maps import NameMap, load_name_map
from tracer.format.schema import ALGORITHMS
from tracer.zero_edit.step_clock import StepClock
from tracer.record.capture import CapturedStep
from tracer.record.writer import TraceWriter

MAX_WARNINGS = 3  # capture failures warned about one by one; later ones are only counted
log = logging.getLogger("tracer.watch")


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is at the time of each record (it may be replaced
    after the handler is made: pytest's capture, a notebook)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def summary_logger(always: bool = False) -> logging.Logger:
    """``log``, writing to stderr at INFO when logging is not configured (or ``always``, as ``tracer run``
    asks), so the end-of-run summary is shown even by scripts that silence ``warnings`` (MiniMind calls
    ``warnings.filterwarnings('ignore')``)."""
    if not any(isinstance(h, _StderrHandler) for h in log.handlers) and (always or not logging.getLogger().handlers):
        log.addHandler(_StderrHandler())
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


_state = threading.local()
_installed: dict[str, Any] = {}  # the original backward functions while a Watcher is active


class Watcher:
    """Traces every backward of a training loss run while it is active (a context manager).

    Args:
        algo: ``ppo | grpo | cispo | rloo | dpo``.
        out: the trace directory (refused when it already holds a trace).
        name_map: a :class:`NameMap`, a shipped map's name, a ``.toml``/``.yaml`` path, or None
            for the shipped MiniMind-style map.
        strict: raise TraceError from ``backward`` when a capture fails; default: warn, count, go on.
        hyperparameters: step metadata for every step; wins over values read from the frame.
        config: run configuration for the manifest (merged with the frame's ``args``).
        tokenizer: for ``tokens.json``; default: the frame's ``tokenizer`` variable.
        nothing_traced: what leaving the block without an error does when no step was traced:
            ``"warn"`` (RuntimeWarning; the default), ``"raise"`` (TraceError; the default when
            ``strict``) or ``"ignore"`` (the caller reads ``nothing_traced_message()``).
        **writer_kwargs: passed to :class:`tracer.TraceWriter` (``sampling``, ``async_write``...).

    Attributes:
        backward_calls, steps_recorded, unmatched_calls (frame without policy logprobs),
        repeated_calls (same policy tensor as the previous record, e.g. a second loss), failures;
        plans (:class:`tracer.zero_edit.site_plans.SitePlans`: ``hits``, ``misses``, ``built``; ``enabled``);
        plan_differences (None; a list makes every plan's capture be compared with a full read, and
        receive what differs: tests).
    """

    def __init__(self, algo: str, out: str | os.PathLike, name_map: NameMap | str | os.PathLike | None = None, *,
                 strict: bool = False, hyperparameters: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None, tokenizer: Any = None,
                 nothing_traced: str | None = None, **writer_kwargs: Any) -> None:
        if algo not in ALGORITHMS:
            raise TraceError(f"algo {algo!r} is not one of {list(ALGORITHMS)}")
        self.algorithm, self.out, self.strict = algo, Path(out), strict
        self.name_map = name_map if isinstance(name_map, NameMap) else load_name_map(name_map, algo)
        self.hyperparameters = dict(hyperparameters or {})
        self.config, self.tokenizer, self.writer_kwargs = dict(config or {}), tokenizer, writer_kwargs
        self.nothing_traced = nothing_traced or ("raise" if strict else "warn")
        if self.nothing_traced not in ("warn", "raise", "ignore"):
            raise TraceError(f"nothing_traced={nothing_traced!r}; choose 'warn', 'raise' or 'ignore'")
        self.writer: TraceWriter | None = None
        self.backward_calls = self.steps_recorded = self.unmatched_calls = self.repeated_calls = self.failures = 0
        self.clock = StepClock()
        self._last_unmatched: tuple | None = None  # (file, line, function, [(name, shape)]) of the last one
        self._last_anchor: tuple[weakref.ref, int] | None = None
        self.rejected: dict[tuple[str, str], str] = {}  # (field or key, variable text) -> why not recorded
        self.sources: dict[str, str] = {}  # field -> the variable it was read from
        self._checks: dict = {}  # schema-check outcomes by signature (frames.read_frame)
        self.plans = site_plans.SitePlans()  # per call site: what the full read of its frame did
        self.plan_differences: list[str] | None = None  # a list: every plan's capture is compared with a full read
        self._pauses = 0  # paused() blocks open (nested ones count)
        self._ended = False  # the watcher's block was left

    # -- context manager ----------------------------------------------------------------------

    def __enter__(self) -> "Watcher":
        refuse_existing_trace(self.out, int(os.environ.get("RANK", "0")))
        _install(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._ended = True
        _uninstall(self)
        if self.writer is not None:
            report = self.report()
            self.writer.annotate_manifest("capture_report", report)  # rank 0's copy (the manifest is rank 0's)
            try:
                self.writer.close()
            except TraceError as err:
                if exc_type is None and self.strict:
                    raise
                warnings.warn(f"tracer.watch: closing the trace failed: {err}", RuntimeWarning,
                              stacklevel=user_stacklevel())
            write_capture_report(self.writer.root, self.writer.rank, report, self.strict and exc_type is None)
        self._log_summary()
        if self.steps_recorded == 0 and exc_type is None:
            if self.nothing_traced == "raise":
                raise TraceError(self.nothing_traced_message())
            if self.nothing_traced == "warn":
                warnings.warn(self.nothing_traced_message(), RuntimeWarning,
                              stacklevel=user_stacklevel())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside ``with w.paused():`` backward runs untouched (torch's own functions are put back, so
        nothing is read or recorded: an evaluation pass, a probe); tracing resumes on leaving the block,
        into the same trace, with steps still increasing. Pauses nest (an inner one changes nothing);
        a watcher whose block ended during the pause stays off. Raises TraceError when the watcher is
        not active."""
        if self._pauses:  # already paused by an enclosing block
            self._pauses += 1
            try:
                yield
            finally:
                self._pauses -= 1
            return
        if _installed.get("watcher") is not self:
            raise TraceError("Watcher.paused() is only for an active watcher: use it inside `with tracer.watch(...) as w:`")
        _uninstall(self)
        self._pauses = 1
        try:
            yield
        finally:
            self._pauses = 0
            if not self._ended:
                _install(self)

    # -- reports ------------------------------------------------------------------------------

    def summary(self) -> str:
        """One line: step files traced, backward calls, and what was not traced."""
        where = f" into {self.out}" if self.steps_recorded else ""
        return (f"tracer: traced {self.steps_recorded} step file(s){where} from {self.backward_calls} backward call(s)"
                f" ({self.unmatched_calls} without policy logprobs in the frame, {self.repeated_calls} repeated, "
                f"{self.failures} failed)")

    def report(self) -> dict[str, Any]:
        """What was and was not captured (kept in the manifest as ``capture_report``, shown by ``tracer
        info``): backward calls, step files recorded, steps dropped and why, the variable each field
        was read from, and the map entries that could not be used, with the reason."""
        writer = self.writer
        return {
            "backward_calls": self.backward_calls,
            "steps_recorded": self.steps_recorded,
            "unmatched_calls": self.unmatched_calls,
            "repeated_calls": self.repeated_calls,
            "failures": self.failures,
            "dropped_steps": writer.dropped_steps if writer is not None else self.failures,
            "drop_reasons": list(writer.drop_reasons[:5]) if writer is not None else [],
            "fields_mapped": dict(sorted(self.sources.items())),
            "map_entries_unused": [f"{key} <- `{text}`: {why}" for (key, text), why in sorted(self.rejected.items())],
            "name_map": self.name_map.source,
        }

    def summary_lines(self) -> list[str]:
        """The end-of-run summary, a few lines of text (``tracer run`` and ``tracer.watch`` log it)."""
        r = self.report()
        lines = [self.summary()]
        missing_ids = self.missing_token_ids()
        if missing_ids:
            lines.append(missing_ids)
        if r["dropped_steps"]:
            why = "; ".join(r["drop_reasons"][:3]) or "see the manifest's drop_reasons"
            lines.append(f"tracer: {r['dropped_steps']} step(s) dropped: {why}")
        if r["fields_mapped"]:
            lines.append("tracer: fields mapped: " + ", ".join(f"{f} <- {v}" for f, v in r["fields_mapped"].items()))
        for entry in r["map_entries_unused"][:10]:
            lines.append(f"tracer: not recorded: {entry}")
        if len(r["map_entries_unused"]) > 10:
            lines.append(f"tracer: ... and {len(r['map_entries_unused']) - 10} more map entries not recorded "
                         "(manifest capture_report)")
        return lines

    def missing_token_ids(self) -> str | None:
        """The summary's line for a run traced without token ids (no candidate of ``completion_ids``, DPO's
        ``chosen_ids``, held them): what cannot be checked, and the map entry that fixes it; None otherwise."""
        ids_field = "chosen_ids" if self.algorithm == "dpo" else "completion_ids"
        if not self.steps_recorded or ids_field in self.sources:
            return None
        tried = self.name_map.names("fields", ids_field) + [
            f"{n} (stacked)" for n in self.name_map.names("stacked", "ids") if self.algorithm == "dpo"]
        why = (f"none of the variables the map names for {ids_field} ({', '.join(tried)}) held the tokens the "
               "logprobs score" if tried else f"the map names no variable for {ids_field}")
        return (f"tracer: token ids not captured: {why}, so `tracer check` skips every check that reads them "
                "(EOS and padding masks, the completion's start, turns of packed rows) and no token text is shown. "
                f"Fix: map {ids_field} to them, e.g. `{ids_field} = [\"input_ids[:, 1:]\"]` (a packed row [B, L] whose logprobs "
                "are [B, L-1]) under [fields] in a name map passed with --map FILE (tracer.watch(name_map=FILE))")

    def _log_summary(self) -> None:
        if self.backward_calls == 0 and self.writer is None:
            return  # nothing_traced_message() says it
        logger = summary_logger()
        incomplete = bool(self.failures or self.rejected or (self.writer is not None and self.writer.dropped_steps)
                          or self.missing_token_ids())
        for line in self.summary_lines():
            logger.log(logging.WARNING if incomplete else logging.INFO, line)

    @property
    def last_unmatched(self) -> str | None:
        """Where the last backward without policy logprobs in its frame ran, and the frame's tensor
        variables (``name [shape]``, at most 30), or None."""
        if self._last_unmatched is None:
            return None
        filename, line, function, shapes = self._last_unmatched
        return f"{filename}:{line} in {function}(), tensor variables {[f'{k} {list(s)}' for k, s in shapes]}"

    def nothing_traced_message(self) -> str:
        """Why no step was traced, and what to do."""
        if self.backward_calls == 0:
            return ("tracer: nothing was traced: the code never called backward() (torch.Tensor.backward or "
                    "torch.autograd.backward), and zero-edit tracing records the loss's tensors at each backward; "
                    f"no trace was written to {self.out}. Is this the training script, and does it reach its "
                    "training loop with these arguments?")
        anchor = frames.anchor_field(self.algorithm)
        names = self.name_map.names("fields", anchor) + [
            f"{n} (stacked)" for n in self.name_map.names("stacked", "policy_logprobs")]
        return (f"tracer: nothing was traced: backward() ran {self.backward_calls} time(s), but no calling frame "
                f"held the policy logprobs under a name the map knows ({anchor}: {names}; map: "
                f"{self.name_map.source}). Last backward: {self.last_unmatched}. Write a map file naming your "
                f"variables (see tracer/zero_edit/maps/minimind.toml) and pass --map FILE (tracer.watch(name_map=FILE)).")

    # -- capture ------------------------------------------------------------------------------

    def on_backward(self, loss: Any) -> None:
        """Called before each backward runs (from the wrapped functions)."""
        frame = frame_lookup.calling_frame(sys._getframe(2))
        if frame is None:  # a backward from library code only (e.g. inside the autograd engine)
            return
        self.backward_calls += 1
        local = None
        try:
            local = self._capture(frame)
        except Exception as err:  # never break training because tracing failed (GuardStop is no Exception)
            self.failures += 1
            where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
            reason = f"backward at {where}: {type(err).__name__}: {err}"
            if self.strict:
                raise TraceError(f"tracer.watch: {reason}") from err
            if self.writer is not None:
                self.writer.count_drop(reason)
            if self.failures <= MAX_WARNINGS:
                warnings.warn(f"tracer.watch: step not traced ({self.failures} so far): {reason}. Training "
                              "continues; strict=True (--strict) raises instead.", RuntimeWarning,
                              stacklevel=user_stacklevel())
        finally:
            if local is not None:
                frame_lookup.release_locals(frame, local)
            del frame, local

    def _capture(self, frame) -> dict | None:
        capture = self.plans.read(frame, self.name_map, self.algorithm, self._checks, self.hyperparameters,
                                  self.plan_differences)
        self._warn_rejected(capture)
        if capture.anchor is None:
            self.unmatched_calls += 1
            code, local = frame.f_code, capture.scopes[0]
            shapes = [(k, frames.shape_of(v)) for k, v in local.items() if isinstance(v, torch.Tensor)][:30]
            self._last_unmatched = (code.co_filename, frame.f_lineno, code.co_name, shapes)  # text made when asked
            return capture.scopes[0]
        base = capture.anchor._base if capture.anchor._base is not None else capture.anchor
        if self._last_anchor is not None and self._last_anchor[0]() is base and self._last_anchor[1] == base._version:
            self.repeated_calls += 1
            return capture.scopes[0]
        step, inner, mb = self.clock.key(capture.indices)
        metadata = capture.metadata  # this capture's own dict
        if self.hyperparameters:
            metadata = {k: v for k, v in metadata.items() if k not in self.hyperparameters}
        if "epoch" in capture.indices:
            metadata["epoch"] = capture.indices["epoch"]
        if self.clock.offset and "step" in capture.indices:
            metadata["source_step"] = capture.indices["step"]
        if mb and "micro_batch" not in capture.indices and "inner_step" not in capture.indices:
            metadata["micro_batch_counted"] = True  # no index named it: a later pass may look like this
        writer = self.writer or self._open_writer(frame, capture)
        writer.record_captured(CapturedStep(step, capture.fields, inner, mb, metadata, capture.owned,
                                            tuple(capture.derive), capture.signature))
        self.sources.update(capture.sources)
        self._last_anchor = (weakref.ref(base), base._version)
        self.steps_recorded += 1
        return capture.scopes[0]  # the frame's locals snapshot, released by on_backward

    def _open_writer(self, frame, capture: frames.FrameCapture) -> TraceWriter:
        tokenizer, frame_config = frame_lookup.read_objects(frame, self.name_map)
        config = {**frame_config, **self.config, "trainer": "tracer.watch", "name_map": self.name_map.source,
                  "field_sources": dict(capture.sources)}
        self.writer = TraceWriter(self.out, self.algorithm, tokenizer=self.tokenizer or tokenizer, config=config,
                                  hyperparameters=self.hyperparameters, strict=self.strict, **self.writer_kwargs)
        return self.writer

    def _warn_rejected(self, capture: frames.FrameCapture) -> None:
        for (key, text), why in capture.rejected.items():
            if (key, text) not in self.rejected:
                self.rejected[(key, text)] = str(why)
                warnings.warn(f"tracer.watch: variable `{text}` was not recorded as {key}: {why}",
                              RuntimeWarning, stacklevel=user_stacklevel())


def watch(algo: str, out: str | os.PathLike, name_map: NameMap | str | os.PathLike | None = None,
          **kwargs: Any) -> Watcher:
    """Trace every backward run inside ``with tracer.watch(algo=..., out=...):`` (see :class:`Watcher`)."""
    return Watcher(algo, out, name_map, **kwargs)


# -- the backward wrappers ------------------------------------------------------------------------


def _install(watcher: Watcher) -> None:
    if _installed:
        raise TraceError("tracer.watch is already active; nest no watchers (one trace per run)")
    _installed.update(watcher=watcher, tensor_backward=torch.Tensor.backward, autograd_backward=torch.autograd.backward)

    def tensor_backward(self, *args, **kwargs):
        _before_backward(self)
        return _call_original("tensor_backward", self, *args, **kwargs)

    def autograd_backward(tensors, *args, **kwargs):
        _before_backward(tensors)
        return _call_original("autograd_backward", tensors, *args, **kwargs)

    tensor_backward.__wrapped__ = _installed["tensor_backward"]
    autograd_backward.__wrapped__ = _installed["autograd_backward"]
    torch.Tensor.backward = tensor_backward
    torch.autograd.backward = autograd_backward


def _uninstall(watcher: Watcher) -> None:
    if _installed.get("watcher") is watcher:
        torch.Tensor.backward = _installed["tensor_backward"]
        torch.autograd.backward = _installed["autograd_backward"]
        _installed.clear()


def _before_backward(loss: Any) -> None:
    watcher = _installed.get("watcher")
    if watcher is None or getattr(_state, "busy", False):
        return  # Tensor.backward calls torch.autograd.backward: trace the outer call only
    watcher.on_backward(loss)


def _call_original(name: str, *args, **kwargs):
    outer = not getattr(_state, "busy", False)
    _state.busy = True
    try:
        return _installed.get(name, _ORIGINALS[name])(*args, **kwargs)
    finally:
        if outer:
            _state.busy = False


_ORIGINALS = {"tensor_backward": torch.Tensor.backward, "autograd_backward": torch.autograd.backward}


