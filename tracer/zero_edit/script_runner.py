"""Running a training script as ``python SCRIPT ARGS`` would, with a zero-edit :class:`tracer.zero_edit.watch.Watcher`
active (``python -m tracer run ... -- SCRIPT ARGS``): same ``__main__``, ``sys.argv`` and ``sys.path[0]``,
its exit code and traceback kept; a script stopped by the live guard (``--guard stop``) exits
:data:`GUARD_STOPPED_EXIT` with the finding printed instead of a traceback."""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracer.errors import GuardStop, TraceError

if TYPE_CHECKING:
    from tracer.zero_edit.watch import Watcher

GUARD_STOPPED_EXIT = 4  # `tracer run --guard stop`: a check found an error and the script was stopped


def _exit_code(code: Any) -> int:
    """What ``python SCRIPT`` exits with for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")  # what the interpreter does for sys.exit("message")
    return 1


def _print_script_traceback(err: BaseException, script: Path) -> None:
    """The traceback as ``python SCRIPT`` prints it: from the script's own frame down."""
    tb = err.__traceback__
    while tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve() != script:
        tb = tb.tb_next
    traceback.print_exception(type(err), err, tb or err.__traceback__)


def run_script(script: str | os.PathLike, argv: list[str], watcher: Watcher) -> int:
    """Run ``script`` like ``python SCRIPT ARGV...`` with ``watcher`` active; returns its exit code.

    ``sys.argv`` is ``[SCRIPT, *argv]``, ``sys.path[0]`` the script's directory, ``__name__`` is
    ``"__main__"`` (all restored after). A script that raises has its traceback printed and exits 1
    (130 on KeyboardInterrupt); the steps traced before the error are flushed to disk. A
    :class:`~tracer.errors.GuardStop` (the live guard with ``guard="stop"`` found an error) that
    leaves the script prints one line, ``tracer run: the guard stopped the script: <the finding>``,
    and exits :data:`GUARD_STOPPED_EXIT` (4).

    Raises:
        TraceError: the script does not exist, or the trace directory already holds a trace.
    """
    path = Path(script).resolve()
    if path.is_dir():
        raise TraceError(f"script {script} is a directory; pass the training script's file after `--`, e.g. "
                         "`python -m tracer run --algo grpo --out runs/x -- train_grpo.py --lr 1e-6`")
    if not path.is_file():
        raise TraceError(f"script {script} does not exist; pass the training script after `--`, e.g. "
                         "`python -m tracer run --algo grpo --out runs/x -- train_grpo.py --lr 1e-6`")
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *argv]
    sys.path[:1] = [str(path.parent)]
    code = 0
    try:
        with watcher:
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as exit_:
                code = _exit_code(exit_.code)
            except GuardStop as err:  # before Exception: the stop asked for, not the script's failure
                sys.stderr.write(f"tracer run: the guard stopped the script: {err}\n")
                code = GUARD_STOPPED_EXIT
            except KeyboardInterrupt as err:
                _print_script_traceback(err, path)
                _note_uncaught(err)
                code = 130
            except Exception as err:
                _print_script_traceback(err, path)
                _note_uncaught(err)
                code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return code


def _note_uncaught(err: BaseException) -> None:
    """The script's exception ended the run: the writers record ``crashed`` / ``interrupted`` when the
    watcher closes them, not ``finished`` (the exit hooks never see an exception caught here)."""
    from tracer.record.writer import note_uncaught

    note_uncaught(err)
