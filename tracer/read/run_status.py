"""A run's status in words, as ``tracer info``, the Runs page and the sidebar say it: the manifest's
``status`` and, for a run that crashed or was interrupted, the exception and the last step recorded from
its ``ended`` entry (the vocabulary and the entry: :mod:`tracer.format.run_end`)."""

from __future__ import annotations

from typing import Any

from tracer.format.run_end import CRASHED, INTERRUPTED, read_ended

STATUS_TEXT = {"running": "unfinished (the writer did not close: crashed or still running)",
               "finished": "finished", "unknown": "unknown (no readable manifest)",
               CRASHED: "crashed", INTERRUPTED: "interrupted"}


def status_text(status: Any, manifest: Any = None) -> str:
    """``status`` (a manifest's ``status``) in words; for ``crashed`` and ``interrupted``, what the manifest's
    ``ended`` entry says, e.g. ``crashed after recording step 3: ValueError: loss is nan`` (``in thread
    worker`` when it was not the main thread; ``before recording any step`` when none was). A status that is
    not a string is shown as its repr."""
    if not isinstance(status, str):
        return repr(status)
    text = STATUS_TEXT.get(status, status)
    ended = read_ended(manifest) if status in (CRASHED, INTERRUPTED) else None
    if ended is None:
        return text
    if "last_step" in ended:
        text += f" after recording step {ended['last_step']}"
    elif "closed_by" in ended:
        text += " before recording any step"
    cause = ": ".join(part for part in (ended.get("exception"), ended.get("message")) if part)
    if cause:
        text += f": {cause}"
    if ended.get("thread") not in (None, "MainThread"):
        text += f" (in thread {ended['thread']})"
    return text
