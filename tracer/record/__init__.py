"""Writing a trace: :class:`TraceWriter` (alias ``Tracer``) takes a step's tensors on the training
thread, stages them (:mod:`~tracer.record.capture`), checks them against the schema
(:mod:`~tracer.record.validation`), and hands them to a backend that writes step files off the
training thread (:mod:`~tracer.record.backends`: inline, thread, or the writer process of
:mod:`tracer.record.process`). :mod:`~tracer.record.step_writer` turns a staged step into a file and an
index line; :mod:`~tracer.record.manifest` keeps the manifest. Builds on :mod:`tracer.format` only.
"""

from tracer.record.capture import CapturedStep, SamplingPolicy
from tracer.record.writer import Tracer, TraceWriter

__all__ = ["CapturedStep", "SamplingPolicy", "Tracer", "TraceWriter"]
