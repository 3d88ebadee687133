"""The live guard (issue: check while training): ``tracer check``'s checks run on each step file as the
writer writes it (:mod:`tracer.guard.checker`), and the training process warns, calls back or stops at
the first error (:mod:`tracer.guard.guard`). The package's ``__init__`` registers :func:`make_guard`
with the writer (:func:`tracer.record.observer.register_factory`), which knows the protocol only."""

from __future__ import annotations

from tracer.guard.guard import Guard, make_guard, warn_line

__all__ = ["Guard", "make_guard", "warn_line"]
