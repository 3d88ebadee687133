"""The live guard (issue: check while training): ``tracer check``'s checks run on each step file as the
writer writes it (:mod:`tracer.guard.checker`), and the training process warns, calls back or stops at
the first error (:mod:`tracer.guard.guard`). Importing this package registers its factory with the
writer (:func:`tracer.record.observer.register_factory`), which knows the protocol only."""

from __future__ import annotations

from tracer.guard.guard import Guard, make_guard, warn_line
from tracer.record.observer import register_factory

register_factory(make_guard)

__all__ = ["Guard", "make_guard", "warn_line"]
