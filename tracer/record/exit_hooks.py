"""Hear of the uncaught exception that ends a thread, so that a writer closed afterwards (by the atexit
hook, or by the program) records that the run crashed or was interrupted (:mod:`tracer.format.run_end`)
instead of ``finished``.

:func:`install` wraps ``sys.excepthook`` and ``threading.excepthook``: each wrapper tells the listener
``(exception, thread)``, then calls the hook it replaced, so that the traceback is printed as before and a
hook the program or another library installed still runs. A failure of the listener is logged, never
raised: the trainer must not die of its tracer. An exception at the interactive prompt (``sys.ps1`` is
set) ends nothing and is not reported. ``install`` is idempotent, and wraps again a hook that a library
set without chaining ours.

At exit, :func:`uncaught_at_exit` gives the exception that ended the main thread when the wrapper could
not see it (``sys.last_value``, which the interpreter sets before it calls whatever hook is installed).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Listener = Callable[[BaseException, threading.Thread], None]


class _Chained:
    """A hook that tells ``listener`` of the exception, then calls ``previous`` (the hook it replaced)."""

    def __init__(self, previous: Callable[..., Any], listener: Listener, main: bool) -> None:
        self.previous, self.listener, self.main = previous, listener, main

    def __call__(self, *args: Any) -> Any:
        try:
            if self.main:  # sys.excepthook(type, value, traceback)
                if args[1] is not None and not hasattr(sys, "ps1"):
                    self.listener(args[1], threading.main_thread())
            else:  # threading.excepthook(ExceptHookArgs)
                hook_args = args[0]
                if hook_args.exc_value is not None and hook_args.thread is not None:
                    self.listener(hook_args.exc_value, hook_args.thread)
        except Exception as err:  # noqa: BLE001  (the trace's status is never worth a second traceback)
            log.warning("tracer: could not record the exception that ended the run: %s", err)
        return self.previous(*args)


def install(listener: Listener) -> None:
    """Put ``listener`` in front of ``sys.excepthook`` and ``threading.excepthook`` (once; again when a
    hook set later replaced ours)."""
    if not _ours(sys.excepthook, listener):
        sys.excepthook = _Chained(sys.excepthook, listener, main=True)
    if not _ours(threading.excepthook, listener):
        threading.excepthook = _Chained(threading.excepthook, listener, main=False)


def _ours(hook: Any, listener: Listener) -> bool:
    """Whether ``listener`` is already in the chain of ``hook`` (through our wrappers)."""
    while isinstance(hook, _Chained):
        if hook.listener is listener:
            return True
        hook = hook.previous
    return False


def uncaught_at_exit(listener: Listener) -> BaseException | None:
    """The exception that ended the main thread, as the interpreter kept it (``sys.last_value``), when
    ``listener`` could not hear it: a hook set after ours replaced it without calling it. None when our hook
    is still installed (it heard the exception, if there was one), in an interactive session (the value
    names an error at the prompt, which ended nothing; IPython and Jupyter keep there the last cell's error,
    which ended nothing either), or when no exception ended the main thread."""
    if _ours(sys.excepthook, listener) or hasattr(sys, "ps1") or sys.flags.interactive or "IPython" in sys.modules:
        return None
    value = getattr(sys, "last_value", None)
    return value if isinstance(value, BaseException) else None
