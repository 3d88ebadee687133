"""How a run ended, as the manifest records it: ``status`` and the ``ended`` entry.

``status`` is one of:

- ``running``: the writer has not closed: the trainer is still writing, or its process was killed
  (SIGKILL, SIGTERM's default action, ``os._exit``) before any Python code could run.
- ``finished``: closed by the program (``close()``, leaving a ``with`` block normally) or at a normal
  interpreter exit (the atexit hook closes writers left open; the loop ran to its end). A run the live
  guard stopped (:class:`tracer.errors.GuardStop`) is finished too: its manifest's ``guard`` entry says why.
- ``crashed``: an uncaught exception ended the thread that recorded (``sys.excepthook`` /
  ``threading.excepthook``), or left the writer's ``with`` block, or a non-zero ``SystemExit`` left it
  (``sys.exit(1)`` outside a ``with`` block reaches no hook: that run reads ``finished``).
- ``interrupted``: a ``KeyboardInterrupt`` (Ctrl-C, SIGINT) ended it the same way.

``ended`` (a JSON object, written at close; absent in traces of older writers) holds ``closed_by``
(``close`` | ``with`` | ``exit``: the program's call, its ``with`` block, or the atexit hook), ``last_step``
(the highest step passed to ``record``, None when none was) and, for ``crashed`` and ``interrupted``,
``exception`` (the exception's qualified type name), ``message`` (``str(exception)``, at most
:data:`MAX_MESSAGE_CHARS` characters) and ``thread`` (the name of the thread it ended).
"""

from __future__ import annotations

from typing import Any

from tracer.errors import GuardStop

RUNNING, FINISHED, CRASHED, INTERRUPTED = "running", "finished", "crashed", "interrupted"
ENDED_KEY = "ended"
MAX_MESSAGE_CHARS = 500  # of str(exception): enough for a shape mismatch or a CUDA error's first lines
CLOSED_BY = ("close", "with", "exit")


def exception_status(exc: BaseException | None) -> str:
    """The status a run ends with when ``exc`` ends it: ``interrupted`` for KeyboardInterrupt, ``finished``
    for None, ``SystemExit(0)`` / ``SystemExit(None)`` and the guard's stop (``GuardStop``, recorded in the
    manifest's ``guard`` entry), else ``crashed``."""
    if exc is None or isinstance(exc, GuardStop):
        return FINISHED
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(exc, SystemExit):
        return FINISHED if exc.code in (None, 0) else CRASHED
    return CRASHED


def ended_entry(closed_by: str, last_step: int | None, exc: BaseException | None = None,
                thread: str | None = None) -> tuple[str, dict[str, Any]]:
    """``(status, ended)`` for a run closed by ``closed_by`` (one of :data:`CLOSED_BY`) after recording up
    to ``last_step``; ``exc``: the exception that ended it (None: none), raised in the thread named ``thread``."""
    assert closed_by in CLOSED_BY, closed_by
    status = exception_status(exc)
    entry: dict[str, Any] = {"closed_by": closed_by, "last_step": last_step}
    if status in (CRASHED, INTERRUPTED):
        kind = type(exc)
        name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"
        message = f"exit status {exc.code}" if isinstance(exc, SystemExit) else _text(exc)
        entry.update(exception=name, message=message[:MAX_MESSAGE_CHARS], thread=thread)
    return status, entry


def read_ended(manifest: Any) -> dict[str, Any] | None:
    """The manifest's ``ended`` entry with its values checked (a hand-edited or hostile manifest may hold
    anything): a dict of the keys above whose values have the documented types, or None when absent."""
    ended = manifest.get(ENDED_KEY) if isinstance(manifest, dict) else None
    if not isinstance(ended, dict):
        return None
    out: dict[str, Any] = {}
    for key in ("closed_by", "exception", "message", "thread"):
        if isinstance(ended.get(key), str):
            out[key] = ended[key][:MAX_MESSAGE_CHARS]
    step = ended.get("last_step")
    if isinstance(step, int) and not isinstance(step, bool):
        out["last_step"] = step
    return out


def _text(exc: BaseException) -> str:
    """``str(exc)``; its repr, or nothing, when ``__str__`` itself fails (never raised here)."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001  (an exception class with a broken __str__ must not break the close)
        try:
            return repr(exc)
        except Exception:  # noqa: BLE001
            return ""
