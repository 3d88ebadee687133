"""The on-disk format of a trace, alone (SPEC.md sections 4 and 5): the field schema, file names and
paths, atomic writes, the content checksum, bounded reads of untrusted files, the metadata codec, the
step summary's keys and the run's summary index. Imports nothing of tracer but :mod:`tracer.errors`;
the writer (:mod:`tracer.record`) and the reader (:mod:`tracer.read`) both build on it.

- :mod:`~tracer.format.schema`: canonical fields (name, dims, dtype, unit, algorithms), metadata keys.
- :mod:`~tracer.format.names`: file names and paths; :mod:`~tracer.format.files`: atomic writes, locks.
- :mod:`~tracer.format.hashing`: ``content_sha256``; :mod:`~tracer.format.integrity`: bounded, verified reads.
- :mod:`~tracer.format.metadata_codec`, :mod:`~tracer.format.text`: header values and text.
- :mod:`~tracer.format.summary`: the step summary's keys; :mod:`~tracer.format.run_index`,
  :mod:`~tracer.format.summary_store`: the run's summary index and its columns.
- :mod:`~tracer.format.capture_report`: zero-edit capture reports.
"""

from tracer.format.schema import ALGORITHMS, FIELDS, SCHEMA_VERSION, required_fields

__all__ = ["ALGORITHMS", "FIELDS", "SCHEMA_VERSION", "required_fields"]
