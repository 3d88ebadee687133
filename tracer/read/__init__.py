"""Reading a trace: :class:`Trace` opens a trace folder or one step file lazily
(:mod:`~tracer.read.reader`), keyed by :class:`StepKey` (:mod:`~tracer.read.step_table`); the run
overview from the summary index (:mod:`~tracer.read.overview`), pandas token tables
(:mod:`~tracer.read.tables`) and ``tracer info`` (:mod:`~tracer.read.trace_info`). Builds on
:mod:`tracer.format`; checks, diff and the views build on it.
"""

from tracer.read.reader import Trace, find_traces
from tracer.read.step_table import StepKey

__all__ = ["StepKey", "Trace", "find_traces"]
