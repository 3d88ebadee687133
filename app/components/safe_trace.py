"""What the app may open: traces under the root it was started with, and within a trace only the
files inside its own directory; step files that cannot be read are set aside with the reason.

- :func:`inside` and :func:`resolve_request`: a path (from the sidebar, the URL's ``?run=``) is
  resolved (``..`` and symlinks followed) and refused unless it lies under the root.
- :class:`SafeTrace`: a :class:`tracer.reader.Trace` whose manifest, token strings and step files
  must resolve inside the trace directory, and whose ``steps()`` leave out step files whose
  safetensors header does not open (truncated file, garbage header); :meth:`SafeTrace.problems`
  says which files were left out and why, so that the app keeps serving the other steps.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tracer.errors import TraceError
from tracer.integrity import check_step_header, open_step_file
from tracer.layout import MANIFEST_NAME, STEPS_DIR, TOKENS_NAME
from tracer.reader import Trace
from tracer.schema import decode_metadata

OUTSIDE = "outside"  # problems(): the file resolves outside the trace directory
UNREADABLE = "unreadable"  # problems(): the safetensors header does not open


class OutsideRootError(TraceError):
    """A path that resolves outside the directory the app may read."""


class BadRequestError(TraceError):
    """A requested path that is no path at all (a null byte, an unknown ``~user``, an OS refusal)."""


def inside(path: str | os.PathLike, base: str | os.PathLike) -> bool:
    """True when ``path`` resolves (symlinks and ``..`` followed) to ``base`` or below it."""
    try:
        return Path(path).resolve().is_relative_to(Path(base).resolve())
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a name too long, a null byte
        return False


def resolve_request(root: Path, requested: str) -> Path:
    """The path a user asked for (``?run=`` in the URL), relative to ``root`` or absolute, resolved.
    ``~`` is not expanded: a URL names a run under the root, not in someone's home directory.

    Raises:
        BadRequestError: it holds a null byte (no path can), or the OS refuses to resolve it.
        OutsideRootError: it resolves outside ``root`` (``..``, a symlink, another absolute path).
    """
    if "\0" in requested:
        raise BadRequestError(f"refused to open {requested!r}: a path cannot hold a null byte")
    candidate = Path(requested)
    candidate = candidate if candidate.is_absolute() else root / candidate
    if not inside(candidate, root):
        raise OutsideRootError(
            f"refused to open {requested!r}: it resolves to {_resolved(candidate)}, outside the root "
            f"{_resolved(root)} that the app was started with. The app opens only traces under its "
            "root; start it with another --root to browse elsewhere.")
    try:
        return candidate.resolve()
    except (OSError, RuntimeError, ValueError) as err:
        raise BadRequestError(f"refused to open {requested!r}: {type(err).__name__}: {err}") from err


def _resolved(path: Path) -> str:
    try:
        return str(path.resolve())
    except (OSError, RuntimeError):
        return str(path)


def header_problem(path: Path, algorithm: str | None = None) -> str | None:
    """Why the header of step file ``path`` cannot be used (the reader's TraceFormatError message),
    or None. Reads the header only, with the reader's bounded open (a regular file whose header
    length fits in it; a FIFO or a truncated file fails here) and schema check (shapes and dtype
    kinds of the canonical fields of the step's algorithm, else ``algorithm``)."""
    try:
        with open_step_file(path) as fh:
            meta = decode_metadata(fh.metadata())
            named = meta.get("algorithm")
            check_step_header(path, fh, named if isinstance(named, str) else algorithm)
    except TraceError as err:
        return str(err)
    except Exception as err:  # anything else a hostile header provokes: set the file aside, say why
        return f"{path}: not a readable step file ({type(err).__name__}: {err})"
    return None


class SafeTrace(Trace):
    """A trace that reads only files inside its own directory and skips unreadable step files.

    Args:
        path: a trace directory or a single step file (as for :class:`Trace`).

    Raises:
        OutsideRootError: ``manifest.json``, ``tokens.json`` or ``steps/`` is a link leaving the
            trace directory.
        TraceFormatError: as :class:`Trace` (no trace there, unreadable or malformed manifest).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self._base = Path(path).resolve()
        self._header_memo: dict[str, tuple[tuple[int, ...], str | None]] = {}
        if Path(path).is_dir():
            for name in (MANIFEST_NAME, TOKENS_NAME, STEPS_DIR):
                part = Path(path) / name
                if (part.exists() or part.is_symlink()) and not inside(part, self._base):
                    raise OutsideRootError(
                        f"{part} resolves to {_resolved(part)}, outside the trace directory {self._base}; "
                        "refusing to read it (a trace's files must lie inside its directory)")
        super().__init__(path)

    def _all_step_paths(self) -> list[Path]:
        return super()._step_paths()

    def _step_paths(self) -> list[Path]:  # Trace lists step files through this method
        paths = self._all_step_paths()
        problems = self._problems(paths)
        return [p for p in paths if p not in problems] if problems else paths

    def _problems(self, paths: list[Path]) -> dict[Path, str]:
        """Why each of ``paths`` is set aside (files absent from the result are fine). A file is
        resolved only when it is a symlink or its folder leaves the trace directory; its header is
        checked once per (l)stat signature, so listing a trace of many steps costs one lstat per
        file once the headers have been checked; a file the run's summary index vouches for
        (:meth:`tracer.reader.Trace.index_vouches`: listed under its name at its size) is not
        opened at all."""
        names = [str(p) for p in paths]
        if self.path.is_file():  # a single step file is the whole trace (and its own directory)
            problems = {p: header_problem(p, self._manifest_algorithm()) for p in paths}
            return {p: f"{UNREADABLE}: {problem}" for p, problem in problems.items() if problem is not None}
        folders = {folder: inside(folder, self._base) for folder in {os.path.dirname(n) for n in names}}
        index = self.summary_index()  # tracer.run_index: the step files the writer listed
        out = {}
        for path, name in zip(paths, names):
            try:
                link = os.lstat(name)
                target = os.stat(name) if stat.S_ISLNK(link.st_mode) else link
            except OSError as err:
                out[path] = f"{UNREADABLE}: {path}: {err}"
                continue
            if not folders[os.path.dirname(name)] or (link is not target and not inside(path, self._base)):
                out[path] = f"{OUTSIDE}: {path} resolves to {_resolved(path)}, outside the trace directory; not read"
                continue
            signature = (link.st_ino, link.st_mtime_ns, target.st_ino, target.st_mtime_ns, target.st_size)
            memo = self._header_memo.get(name)
            if memo is None or memo[0] != signature:
                # a file the run's summary index lists at this size was written whole by the writer:
                # its header is not read here (a bad one still fails cleanly when a page reads it)
                problem = None if self.index_vouches(path, target.st_size, index) else \
                    header_problem(path, self._manifest_algorithm())
                memo = (signature, None if problem is None else f"{UNREADABLE}: {problem}")
                self._header_memo[name] = memo
            if memo[1] is not None:
                out[path] = memo[1]
        return out

    def _manifest_algorithm(self) -> str | None:
        algorithm = getattr(self, "manifest", {}).get("algorithm")  # no manifest yet while Trace.__init__ lists
        return algorithm if isinstance(algorithm, str) else None

    def problems(self) -> dict[Path, str]:
        """``{step file: reason}`` for the step files ``steps()`` leaves out: ``outside: ...``
        (a link leaving the trace directory) or ``unreadable: ...`` (the TraceFormatError message)."""
        return self._problems(self._all_step_paths())
