"""Writing a trace: :class:`TraceWriter` (alias ``Tracer``) takes a step's tensors on the training
thread, stages them (:mod:`~tracer.record.capture`), checks them against the schema
(:mod:`~tracer.record.validation`), and hands them to a backend that writes step files off the
training thread (:mod:`~tracer.record.backends`: inline, thread, or the writer process of
:mod:`tracer.record.process`). :mod:`~tracer.record.step_writer` turns a staged step into a file and an
index line; :mod:`~tracer.record.manifest` keeps the manifest. Builds on :mod:`tracer.format` only.

The public names are imported on first use (PEP 562): ``import tracer`` imports
:mod:`tracer.record.observer` (torch-free) to register the live guard's factory, and that must not
import the writer and torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracer.record.capture import CapturedStep, SamplingPolicy
    from tracer.record.writer import Tracer, TraceWriter

__all__ = ["CapturedStep", "SamplingPolicy", "Tracer", "TraceWriter"]
_HOMES = {"CapturedStep": "tracer.record.capture", "SamplingPolicy": "tracer.record.capture",
          "Tracer": "tracer.record.writer", "TraceWriter": "tracer.record.writer"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
