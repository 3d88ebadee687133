"""The error family raised for callers' mistakes and unusable input."""

from __future__ import annotations


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
