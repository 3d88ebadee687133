"""What the app may open: traces under the root it was started with, and within a trace only the
files inside its own directory; step files that cannot be read are set aside with the reason.

- :func:`inside` and :func:`resolve_request`: a path (from the sidebar, the URL's ``?run=``) is
  resolved (``..`` and symlinks followed) and refused unless it lies under the root.
- :class:`SafeTrace`: a :class:`tracer.read.reader.Trace` whose manifest, token strings and step files
  must resolve inside the trace directory, and whose ``steps()`` leave out step files whose
  safetensors header does not open (truncated file, garbage header); :meth:`SafeTrace.problems`
  says which files were left out and why, so that the app keeps serving the other steps.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np

from tracer.errors import TraceError
from tracer.format.integrity import check_step_header, open_step_file
from tracer.format.names import MANIFEST_NAME, STEPS_DIR, TOKENS_NAME
from tracer.read import StepKey, Trace
from tracer.read.step_table import StepTable
from tracer.format.metadata_codec import decode_metadata

# A listing is reused while the trace directory and steps/ keep their modification times, unless
# one of them changed less than this long ago: file times have the kernel's coarse clock tick, so a
# file added in the same tick as a listing could leave the directory's time unchanged.
RACY_LISTING_NS = 2_000_000_000
SIZES_FRESH_S = 0.5  # sizes stat'ed by a listing this recent stand for the files' current sizes

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
            "root; to browse elsewhere, start the viewer on that directory: python -m tracer view DIR.")
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
        with open_step_file(path, framework="np") as fh:  # the header only: no torch
            meta = decode_metadata(fh.metadata())
            named = meta.get("algorithm")
            check_step_header(path, fh, named if isinstance(named, str) else algorithm)
    except TraceError as err:
        return str(err)
    except Exception as err:  # anything else a hostile header provokes: set the file aside, say why
        return f"{path}: not a readable step file ({type(err).__name__}: {err})"
    return None


def _lstats(names: list[str], folders: list[str], bases: list[str], folder_fd: "_Folders") -> list[Any]:
    """``os.lstat`` of each file (``bases[i]`` of ``folders[i]``, full path ``names[i]``), relative to
    the open folder (the path is not resolved again for every file); the OSError where one fails."""
    fds = {folder: folder_fd(folder) for folder in set(folders)}
    try:
        return [os.lstat(b, dir_fd=fds[f]) if fds[f] is not None else os.lstat(n)
                for n, f, b in zip(names, folders, bases)]
    except OSError:  # a file gone since the listing: one by one, keeping each error
        out: list[Any] = []
        for n, f, b in zip(names, folders, bases):
            try:
                out.append(os.lstat(b, dir_fd=fds[f]) if fds[f] is not None else os.lstat(n))
            except OSError as err:
                out.append(err)
        return out


class _Folders:
    """Open folders (``O_DIRECTORY`` descriptors) by path, for ``stat(name, dir_fd=...)``; a folder
    that cannot be opened, or a platform without ``dir_fd``, gives None. Closed on exit."""

    def __init__(self) -> None:
        self._fds: dict[str, int | None] = {}

    def __enter__(self) -> "_Folders":
        return self

    def __call__(self, folder: str) -> int | None:
        fd = self._fds.get(folder, -1)
        if fd != -1:
            return fd
        if folder not in self._fds:
            fd = None
            if os.stat in os.supports_dir_fd and folder:
                try:
                    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
                except OSError:
                    fd = None
            self._fds[folder] = fd
        return self._fds[folder]

    def __exit__(self, *exc: Any) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)


class SafeTrace(Trace):
    """A trace that reads only files inside its own directory and skips unreadable step files.

    Listing the step files (``steps()``, ``problems()``, :meth:`key_of`) is done once per state of
    the directory: it is reused while the trace directory and its ``steps/`` keep their (inode,
    modification time), so a rerun of the app on a trace of many steps costs two ``stat`` calls,
    not one per step file (a listing younger than :data:`RACY_LISTING_NS` is not reused). A trace
    whose step files are all regular files in ``steps/`` under the writer's names is listed as a
    :class:`tracer.read.step_table.StepTable` (one ``listdir``, one ``lstat`` per file, the index's
    vouching compared as arrays) and builds no ``Path`` or :class:`StepKey` per file until
    ``steps()`` asks for them; any other trace is listed file by file as before. With
    ``handles``, step files are read through that shared cache of open handles, and each handle's
    header is checked against the schema once.

    Args:
        path: a trace directory or a single step file (as for :class:`Trace`).
        handles: a :class:`app.components.step_handles.StepHandles` (None: open a file per read).

    Raises:
        OutsideRootError: ``manifest.json``, ``tokens.json`` or ``steps/`` is a link leaving the
            trace directory.
        TraceFormatError: as :class:`Trace` (no trace there, unreadable or malformed manifest).
    """

    def __init__(self, path: str | os.PathLike, handles: Any = None) -> None:
        self._base = Path(path).resolve()
        self._header_memo: dict[str, tuple[tuple[int, ...], str | None]] = {}
        self._handles = handles
        self._safe_listing: tuple[Any, StepTable, dict[Path, str]] | None = None
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
        if not hasattr(self, "manifest"):  # Trace.__init__ asks before the manifest is read: no memo yet
            paths = self._all_step_paths()
            problems = self._problems(paths)
            return [p for p in paths if p not in problems] if problems else paths
        return [k.path for k in self._listed()[1].keys_list]

    def steps(self) -> list[StepKey]:
        """As :meth:`Trace.steps` (the readable step files inside the directory), from the memo."""
        return self._listed()[1].keys()

    def step_table(self) -> StepTable:
        """As :meth:`Trace.step_table`, from the memo: on a trace whose step files all lie in
        ``steps/`` under the writer's names, no ``Path`` or key per file is built for it."""
        return self._listed()[1]

    def key_of(self, step_path: str) -> StepKey | None:
        """The :class:`StepKey` of the listed step file at ``step_path`` (its ``str``), or None: O(1)."""
        table = self._listed()[1]
        found = table.position(step_path)
        return None if found is None else table.key(found)

    def _listing_signature(self) -> tuple | None:
        """(inode, mtime_ns) of the trace directory and of ``steps/``; None when the listing must
        not be reused (a single step file, a directory that cannot be stat'ed, or one changed
        less than RACY_LISTING_NS ago)."""
        if self._single:
            return None
        sig = []
        for folder in (self.root, self.root / STEPS_DIR):
            try:
                st = os.stat(folder)
            except OSError:
                return None
            sig.append((st.st_ino, st.st_mtime_ns))
        if time.time_ns() - max(m for _, m in sig) < RACY_LISTING_NS:
            return None
        return tuple(sig)

    def _listed(self) -> tuple[Any, StepTable, dict[Path, str]]:
        """(signature, the table of the readable step files, problems)."""
        sig = self._listing_signature()
        memo = self._safe_listing
        if sig is not None and memo is not None and memo[0] == sig:
            return memo
        fast = self._listed_by_name()
        if fast is None:  # links, files at the root or named by the user, a file gone meanwhile: one by one
            paths = self._all_step_paths()
            problems = self._problems(paths)
            fast = StepTable.from_keys(self._keys([p for p in paths if p not in problems] if problems else paths)), \
                problems
        listing = (sig, *fast)
        if sig is not None:
            self._safe_listing = listing
        return listing

    def _step_names(self) -> tuple[list[str], bool] | None:
        """The ``*.safetensors`` names in ``steps/`` (one ``listdir``) and whether the trace directory
        holds any too; None for a single step file or a folder that cannot be listed."""
        if self._single:
            return None
        try:
            names = [name for name in os.listdir(self.root / STEPS_DIR) if name.endswith(".safetensors")]
            at_root = any(name.endswith(".safetensors") for name in os.listdir(self.root))
        except OSError:
            return None
        return names, at_root

    def _listed_by_name(self) -> tuple[StepTable, dict[Path, str]] | None:
        """The listing of a trace whose step files are all regular files in ``steps/`` (a folder
        inside the trace directory) under the writer's names with distinct coordinates: the table
        and the problems, with one ``lstat`` per file and the index's vouching compared as arrays
        (a file vouched for only at its current size); None when another case holds (the general
        path, :meth:`_problems`, decides those)."""
        listed = self._step_names()
        if listed is None or listed[1] or os.stat not in os.supports_dir_fd:
            return None
        table = StepTable.of_folder(self.root / STEPS_DIR, listed[0])
        folder = str(self.root / STEPS_DIR)
        if table is None or not inside(folder, self._base):
            return None
        try:
            fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            return None
        try:
            stats = [os.lstat(name, dir_fd=fd) for name in table.names]
        except OSError:  # a file gone since the listing
            return None
        finally:
            os.close(fd)
        n = len(stats)
        modes = np.fromiter((st.st_mode for st in stats), dtype=np.int64, count=n)
        if ((modes & 0o170000) != stat.S_IFREG).any():  # a link or not a file
            return None
        sizes = np.fromiter((st.st_size for st in stats), dtype=np.int64, count=n)
        index = self.summary_index()  # before the columns: it refreshes them
        columns = self.summary_columns()
        from tracer.read import overview  # (pandas with it: imported after the sidebar's first element)

        vouched = overview.vouched_files(columns, index, folder, table.names, sizes, self._steps_folder,
                                         None if columns is None else overview.table_rows(columns, table))
        self._sizes_seen = (time.monotonic(), folder, dict(zip(table.names, sizes.tolist())))
        problems, bad = {}, []
        for i in np.flatnonzero(~vouched).tolist():
            path = table.path(i)
            problem = self._header_verdict(path, str(path), stats[i], stats[i])
            if problem is not None:
                problems[path] = problem
                bad.append(i)
        return (table.take(np.setdiff1d(np.arange(n), bad)) if bad else table), problems

    def _header_verdict(self, path: Path, name: str, link: Any, target: Any) -> str | None:
        """Why the header of ``path`` is unusable (the problem text), or None; checked once per
        (l)stat signature of the file (``link``) and of what it points to (``target``)."""
        signature = (link.st_ino, link.st_mtime_ns, target.st_ino, target.st_mtime_ns, target.st_size)
        memo = self._header_memo.get(name)
        if memo is None or memo[0] != signature:
            problem = header_problem(path, self._manifest_algorithm())
            memo = (signature, None if problem is None else f"{UNREADABLE}: {problem}")
            self._header_memo[name] = memo
        return memo[1]

    def _open(self, path: Path):
        if self._handles is None:
            return super()._open(path)
        return self._handles.lease(path)

    def _checked(self, key: StepKey, fh) -> None:
        notes = None if self._handles is None else self._handles.notes(fh)
        if notes is not None and notes.get("checked"):
            return
        super()._checked(key, fh)
        if notes is not None:
            notes["checked"] = True

    def _problems(self, paths: list[Path]) -> dict[Path, str]:
        """Why each of ``paths`` is set aside (files absent from the result are fine). A file is
        resolved only when it is a symlink or its folder leaves the trace directory; its header is
        checked once per (l)stat signature, so listing a trace of many steps costs one lstat per
        file once the headers have been checked; a file the run's summary index or columns vouch
        for (:meth:`tracer.read.reader.Trace.index_vouched`: listed under its name at its size, compared
        as arrays) is not opened at all."""
        names = [str(p) for p in paths]
        if self.path.is_file():  # a single step file is the whole trace (and its own directory)
            problems = {p: header_problem(p, self._manifest_algorithm()) for p in paths}
            return {p: f"{UNREADABLE}: {problem}" for p, problem in problems.items() if problem is not None}
        split = [name.rpartition(os.sep) for name in names]
        folder_of = [f or (os.sep if n.startswith(os.sep) else "") for (f, _, _), n in zip(split, names)]  # dirname
        bases = [b for _, _, b in split]
        folders = {folder: inside(folder, self._base) for folder in set(folder_of)}
        with _Folders() as folder_fd:
            stats = _lstats(names, folder_of, bases, folder_fd)
        out = {paths[i]: f"{UNREADABLE}: {paths[i]}: {st}" for i, st in enumerate(stats) if isinstance(st, OSError)}
        ok = [i for i, st in enumerate(stats) if not isinstance(st, OSError)] if out else range(len(paths))
        targets = {}  # {i: stat of the target} for the symlinks
        for i in [i for i in ok if stat.S_ISLNK(stats[i].st_mode)]:
            try:
                targets[i] = os.stat(names[i])
            except OSError as err:
                out[paths[i]] = f"{UNREADABLE}: {paths[i]}: {err}"
        ok = [i for i in ok if paths[i] not in out] if out else ok
        whole = len(ok) == len(paths)  # every file stat'ed (the common case): no per-file selection
        sizes = [targets[i].st_size if i in targets else stats[i].st_size for i in ok] if targets \
            else [st.st_size for st in stats] if whole else [stats[i].st_size for i in ok]
        # a file the run's summary index or columns list at this size was written whole by the
        # writer: its header is not read here (a bad one still fails cleanly when a page reads it)
        vouched = self._vouched(folder_of if whole else [folder_of[i] for i in ok],
                                bases if whole else [bases[i] for i in ok], sizes)
        in_steps = [j for j, i in enumerate(ok) if folder_of[i] == self._steps_folder]
        self._sizes_seen = (time.monotonic(), self._steps_folder, {bases[ok[j]]: sizes[j] for j in in_steps})
        inside_all = all(folders.values())
        for j in [j for j, v in enumerate(vouched.tolist()) if not v or not inside_all or ok[j] in targets]:
            i = ok[j]
            path, name, link = paths[i], names[i], stats[i]
            target = targets.get(i, link)
            if not folders[folder_of[i]] or (link is not target and not inside(path, self._base)):
                out[path] = f"{OUTSIDE}: {path} resolves to {_resolved(path)}, outside the trace directory; not read"
                continue
            if vouched[j]:
                continue
            problem = self._header_verdict(path, name, link, target)
            if problem is not None:
                out[path] = problem
        return out

    def _current_sizes(self, folder: str, names: list[str]) -> list[int]:
        """As :meth:`Trace._current_sizes`, from the sizes this listing stat'ed when it was taken
        under :data:`SIZES_FRESH_S` ago (the listing and the overview of one page run: one stat per
        file, not two); else stat'ed again."""
        seen_at, seen_folder, seen = self.__dict__.get("_sizes_seen") or (0.0, None, {})
        if time.monotonic() - seen_at >= SIZES_FRESH_S or folder != seen_folder:
            return super()._current_sizes(folder, names)
        sizes = [seen.get(name, -1) for name in names]
        missing = [i for i, size in enumerate(sizes) if size < 0]
        for i, size in zip(missing, super()._current_sizes(folder, [names[i] for i in missing])):
            sizes[i] = size
        return sizes

    def _manifest_algorithm(self) -> str | None:
        algorithm = getattr(self, "manifest", {}).get("algorithm")  # no manifest yet while Trace.__init__ lists
        return algorithm if isinstance(algorithm, str) else None

    def problems(self) -> dict[Path, str]:
        """``{step file: reason}`` for the step files ``steps()`` leaves out: ``outside: ...``
        (a link leaving the trace directory) or ``unreadable: ...`` (the TraceFormatError message)."""
        return dict(self._listed()[2])
