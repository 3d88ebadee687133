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
