"""The error family raised for callers' mistakes and unusable input, and where tracer's warnings point
(the user's line, not tracer's own). Every stage imports this module; it imports nothing of tracer."""

from __future__ import annotations

import sys
from types import FrameType

LIBRARY_ROOTS = frozenset({"torch", "accelerate", "deepspeed", "tracer"})
_KINDS: dict[tuple[str, frozenset], bool] = {}  # (module name, roots) -> whether it is of those roots


def of_roots(frame: FrameType, roots: frozenset[str]) -> bool:
    """True when ``frame``'s module is under one of ``roots`` and not ``tracer.demo`` (remembered by
    module name: a backward walks past the same few modules every time)."""
    name = frame.f_globals.get("__name__") or ""
    found = _KINDS.get((name, roots))
    if found is None:
        found = name.split(".")[0] in roots and not name.startswith("tracer.demo")
        if len(_KINDS) < 4096:
            _KINDS[name, roots] = found
    return found


def is_library_frame(frame: FrameType) -> bool:
    """True for frames of torch / accelerate / deepspeed / tracer itself (not ``tracer.demo``)."""
    return of_roots(frame, LIBRARY_ROOTS)


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by this function's caller that names the first
    frame outside the libraries (:func:`is_library_frame`: tracer's own, torch's...), so that a
    warning points at the user's line whatever the depth of tracer's calls; 1 (the caller itself)
    when every frame is library code (tracer's writer thread)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        if not is_library_frame(frame):
            return level
        frame, level = frame.f_back, level + 1
    return 1


class TraceError(Exception):
    """A caller's mistake or an unusable trace.

    Messages name the offending file or field, the expected and the actual value, and the fix.
    """


class SchemaError(TraceError):
    """A recorded tensor disagrees with the canonical schema (shape, dtype, or name)."""


class TraceFormatError(TraceError):
    """A file or directory on disk is not a readable trace (missing manifest, corrupt header...)."""


class ChecksumError(TraceFormatError):
    """A step file's tensor bytes disagree with the ``content_sha256`` its own header records: the
    file was corrupted (a flipped bit, a bad copy) or its tensors were rewritten after writing."""


class GuardStop(BaseException):
    """The live guard stopped the run (``guard="stop"``): a check found an error in a step just written.

    Raised by the first ``record`` after the error is found, once every step recorded before it is on
    disk and the manifest's ``guard`` entry says why. A :class:`BaseException`, as ``KeyboardInterrupt``
    is: a stop the user asked for, which the ``except Exception`` that keeps tracing from ever ending a
    run (in tracer's integrations, in trainers' own error handling) must not swallow; catch it by name
    (``except tracer.GuardStop``).

    Attributes:
        finding: the :class:`tracer.checks.finding.Finding` that stopped the run.
        root: the trace directory (``tracer check ROOT`` shows it again).
    """

    def __init__(self, message: str, finding: object = None, root: object = None) -> None:
        super().__init__(message)
        self.finding, self.root = finding, root
