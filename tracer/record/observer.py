"""What the write side tells an observer of the steps it writes: the hook the live guard
(:mod:`tracer.guard`) hangs on, defined here so that the writer (this stage) knows the protocol and
never the checks (a stage above it).

A :class:`StepObserver` is handed to :class:`tracer.record.writer.TraceWriter` (``guard=``). The writer
calls :meth:`StepObserver.step_written` from wherever its step files are renamed into place: the writer
thread, ``record`` itself (``async_write=False``), or, under the writer process, the observer the
process builds for itself from :meth:`StepObserver.child_spec` (a factory named by module and
function, with JSON arguments: the writer process imports nothing it was not told to). What that one
finds comes back to the training process as messages (:meth:`StepObserver.receive`). The training
thread asks :meth:`StepObserver.stop_finding` at each ``record``: a finding there ends the run with
:class:`tracer.errors.GuardStop`.

A guard given as a word (``"off" | "warn" | "stop"``) or a callable is made into an observer by the
factory :mod:`tracer.guard` registers when it is imported: :func:`make_observer` imports it by name the
first time a writer wants a guard (a plugin: this stage never imports the checks, and ``import tracer``
does not pay for them, 70-260 ms here).
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tracer.errors import TraceError

GUARD_ENV = "TRACER_GUARD"  # the guard of a writer given none (``off | warn | stop``)
# The guard of a writer given none and no TRACER_GUARD: "warn" (its checks run in a forked checker process or
# the writer process, off the training process's interpreter lock: bench/guard_cost.py, BENCHMARKS.md).
DEFAULT_GUARD = "warn"
GUARD_MODES = ("off", "warn", "stop")


@runtime_checkable
class StepObserver(Protocol):
    """Sees each step file once it is on disk, off the training thread.

    ``step_written(path)``: called on the write side (writer thread or process) after ``path`` was
    renamed into place; must return at once (queue the work). ``stop_finding()``: the finding that asks
    the run to stop (an object with ``to_dict()``, :class:`tracer.checks.finding.Finding`), else None;
    read on the training thread at each ``record``. ``stop_text()``: one line that says why. ``child_spec()``: ``{"factory": "module:function", "config": {...}}``
    that builds this observer's counterpart inside the writer process, or None to observe in this
    process only. ``receive(message)``: a message the counterpart sent (training process side).
    ``close()``: finish the work queued (bounded), then stop; the writer calls it at its close.
    An optional ``start_local()`` is called on the training thread when the writer starts writing in
    this process, before its writer thread starts (the guard forks its checker process then).
    An optional ``linger_s`` attribute caps how long the writer waits for more steps before writing a
    batch (:data:`tracer.record.thread.LINGER_S`): an observer that acts on each file wants it soon.
    """

    mode: str

    def step_written(self, path: Path) -> None: ...

    def stop_finding(self) -> Any: ...

    def stop_text(self) -> str: ...

    def child_spec(self) -> dict[str, Any] | None: ...

    def receive(self, message: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


_factory: list[Callable[..., StepObserver | None]] = []  # set by tracer/__init__.py (tracer.guard.make_guard, imported when asked)


def register_factory(factory: Callable[..., StepObserver | None]) -> None:
    """Make ``factory(guard, root, rank) -> StepObserver | None`` the maker of observers from a guard
    word or callable (``tracer/__init__.py`` registers :func:`tracer.guard.make_guard`, imported when a writer asks)."""
    _factory[:] = [factory]


def make_observer(guard: Any, root: Path, rank: int) -> StepObserver | None:
    """The observer for ``TraceWriter(guard=...)``: None for ``"off"``; an object with
    ``step_written`` as it is; ``"warn" | "stop"`` or a callable through the registered factory. None
    (not given): the ``TRACER_GUARD`` environment variable, else :data:`DEFAULT_GUARD` (``"warn"``).

    Raises:
        TraceError: ``guard`` is none of these, or no factory is registered (``tracer.guard`` could
            not be imported).
    """
    if guard is None:
        guard = os.environ.get(GUARD_ENV, DEFAULT_GUARD).strip().lower() or DEFAULT_GUARD
    if isinstance(guard, str) and guard == "off":
        return None
    if isinstance(guard, StepObserver):
        return guard
    if isinstance(guard, str) and guard not in GUARD_MODES:
        raise TraceError(f"guard={guard!r} is not one of {list(GUARD_MODES)} or a callable that takes a Finding "
                         f"(from TraceWriter(guard=...) or the {GUARD_ENV} environment variable)")
    if not isinstance(guard, str) and not callable(guard):
        raise TraceError(f"guard={guard!r} is not one of {list(GUARD_MODES)} or a callable that takes a Finding")
    if not _factory:  # tracer/__init__.py registers it; only a partial import of the package lacks it
        raise TraceError(f"guard={guard!r}: no guard factory is registered (tracer/__init__.py registers "
                         "tracer.guard's; was the package imported whole?)")
    return _factory[0](guard, Path(root), rank)


def build_in_child(spec: dict[str, Any], root: Path, rank: int, send: Callable[[dict[str, Any]], None]
                   ) -> StepObserver:
    """The writer process's observer from ``spec`` (:meth:`StepObserver.child_spec`): the factory
    ``module:function`` called with ``(root, rank, send, **config)``; ``send(message)`` reaches the
    training process's :meth:`StepObserver.receive` (thread-safe)."""
    module, _, name = spec["factory"].partition(":")
    factory = getattr(importlib.import_module(module), name)
    return factory(root, rank, send, **spec.get("config", {}))


class LockedSend:
    """``send(message)`` made safe to call from an observer's own thread beside the caller's loop."""

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self._send, self._lock = send, threading.Lock()

    def __call__(self, message: dict[str, Any]) -> None:
        with self._lock:
            self._send(message)
