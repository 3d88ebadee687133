"""Read traces lazily: list steps from file names, open step files with ``safe_open``, read one
sequence with ``get_slice``, and give pandas long tables (one row per token) for the app.

Files are read with safetensors' numpy API (``safe_open(..., framework="np")``): opening a trace,
listing it, reading headers and metadata, ``tracer info`` and the token tables import neither torch
nor pandas. :meth:`Trace.load_step` and :meth:`Trace.load_sequence` give torch tensors (made from
the numpy arrays without a copy, ``torch.from_numpy``; torch imported then) for the checks and the
formulas, or numpy arrays with ``as_numpy=True``. Fields numpy cannot hold (bfloat16, float8) are
read through torch.

A trace is a directory written by :class:`tracer.record.writer.TraceWriter`, or a single ``.safetensors``
step file with canonical field names (metadata optional).
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from safetensors import safe_open

from tracer.errors import TraceFormatError
from tracer.format.arrays import NUMPY_DTYPES, to_numpy, to_torch
from tracer.format.counts import COUNT_KEYS, COUNTS_NAME, newer_counts
from tracer.format.derived_fields import derivable, derivation_inputs
from tracer.format.integrity import (
    MAX_MANIFEST_BYTES,
    MAX_TOKEN_ENTRIES,
    MAX_TOKENS_BYTES,
    check_mask_values,
    check_step_header,
    clean_manifest,
    clean_tokens,
    open_step_file,
    read_json,
)
from tracer.format.names import MANIFEST_NAME, STEPS_DIR, TOKENS_NAME, step_file_name
from tracer.format.schema import FIELDS
from tracer.format.text import MAX_TOKEN_TEXT, shown_token
from tracer.read.metadata_cache import MetadataCache
from tracer.read.step_table import StepKey, StepTable, keys_of, list_step_files

if TYPE_CHECKING:  # imported where used: reading a trace imports neither torch nor pandas
    import pandas as pd
    import torch

    from tracer.read import overview


class Trace:
    """A trace opened for reading. Cheap to open: it reads the manifest and lists file names.

    Args:
        path: a trace directory (with ``manifest.json`` and ``steps/``) or one step file.

    A trace may hold files that cannot be read (truncated by a crash, corrupt, hostile): opening
    it still works, ``steps()`` lists the step files by name, and reading a bad one raises
    TraceFormatError naming the file and the reason; :meth:`scan` lists every such file.
    A manifest that is not JSON, or has wrong-typed keys, is ignored in whole or in part and noted
    in ``manifest_notes`` when step files exist.

    Raises:
        TraceFormatError: the path does not exist or holds no trace; the message says what was
            expected there.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest_notes: list[str] = []  # why (parts of) the manifest were ignored
        self.counts_note: str | None = None  # where the counts came from when not from the manifest
        if self.path.is_file():
            if self.path.suffix != ".safetensors":
                raise TraceFormatError(
                    f"{self.path}: expected a trace directory or a .safetensors step file, got a "
                    f"'{self.path.suffix or 'no-suffix'}' file")
            self.root = self.path.parent
            self.manifest: dict[str, Any] = {}
            self._single = True
        elif self.path.is_dir():
            self.root = self.path
            self._single = False
            manifest_path = self.root / MANIFEST_NAME
            if manifest_path.exists():
                self.manifest = self._with_counts(self._read_manifest(manifest_path))
            elif self._step_paths():
                self.manifest = self._with_counts({})
            else:
                raise TraceFormatError(
                    f"{self.path} is not a trace: expected {MANIFEST_NAME} and {STEPS_DIR}/*.safetensors "
                    "(written by tracer), or pass a single .safetensors step file")
        else:
            raise TraceFormatError(f"{self.path} does not exist: expected a trace directory or a step file")

    def _read_manifest(self, manifest_path: Path) -> dict[str, Any]:
        """The cleaned manifest; {} with a note when it is unreadable but step files exist."""
        try:
            manifest, self.manifest_notes = clean_manifest(
                read_json(manifest_path, "trace manifest", MAX_MANIFEST_BYTES), manifest_path)
        except TraceFormatError as err:
            if not self._step_paths():
                raise
            manifest, self.manifest_notes = {}, [f"{err}; manifest ignored"]
        if self.manifest_notes and not self._step_paths() and not manifest:
            raise TraceFormatError(self.manifest_notes[0])
        return manifest

    def _with_counts(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """``manifest`` with the status and counts of ``manifest.counts`` when they are newer: the
        writer kept them there because the manifest could not be rewritten (a full disk;
        :mod:`tracer.format.counts`). ``counts_note`` then says so."""
        counts = newer_counts(self.root, manifest)
        if counts is None:
            return manifest
        manifest = {**manifest, **{key: counts[key] for key in COUNT_KEYS}}
        why = counts.get("manifest_error")
        self.counts_note = (f"status and counts from {COUNTS_NAME}: the writer could not rewrite {MANIFEST_NAME}"
                            + (f" ({why})" if isinstance(why, str) else ""))
        return manifest

    # -- listing ------------------------------------------------------------------------------

    def _step_paths(self) -> list[Path]:
        if self._single:
            return [self.path]
        return list(self._listing())

    def _listing(self) -> list[Path]:
        """The ``*.safetensors`` files of ``steps/`` and the root, sorted by text
        (:func:`tracer.read.step_table.list_step_files`, listed again only when a folder changed)."""
        paths, self._listing_cache = list_step_files(self.root, self.__dict__.get("_listing_cache"))
        return paths

    def steps(self) -> list[StepKey]:
        """Every step file, sorted by (step, inner_step, micro_batch, rank). Reads no tensor data."""
        return self._keys(self._step_paths())

    def step_table(self) -> StepTable:
        """:meth:`steps` as arrays (:class:`tracer.read.step_table.StepTable`: names and coordinates in
        the same order, keys built when asked for). Reads no tensor data."""
        return StepTable.from_keys(self.steps())

    def step_count(self) -> int:
        """The number of step files :meth:`steps` lists."""
        return len(self.step_table())

    def _keys(self, paths: list[Path]) -> list[StepKey]:
        """The step keys of ``paths``, sorted (:func:`tracer.read.step_table.keys_of`: names parsed,
        a file named by the user keyed by its header)."""
        return keys_of(paths, self.__dict__.setdefault("_named_keys", {}), self._header)

    def scan(self) -> dict[Path, str]:
        """``{file: why it cannot be used}`` for the manifest, the token strings and every step
        file whose header does not open or disagrees with the schema. Reads every step file's
        header (no tensor data): O(step files)."""
        problems: dict[Path, str] = {}
        if self.manifest_notes:
            problems[self.root / MANIFEST_NAME] = "; ".join(self.manifest_notes)
        if self.tokens_problem is not None:
            problems[self.root / TOKENS_NAME] = self.tokens_problem
        paths = self._step_paths()
        named = {k.path for k in self._keys(paths)}
        for path in paths:
            try:
                with self._open(path) as fh:
                    meta = self._metadata_of(path, fh)
                    check_step_header(path, fh, self._algorithm_of(meta))
            except TraceFormatError as err:
                problems[path] = str(err)
                continue
            if path not in named:
                problems[path] = f"{path}: not listed as a step"
        return problems

    def step_key(self, step: int, inner_step: int = 0, micro_batch: int = 0, rank: int = 0) -> StepKey:
        """The key of one step file by its coordinates, without listing the directory (O(1) in the
        number of steps). Raises TraceFormatError when that step file does not exist."""
        if self._single:
            key = self.steps()[0]
            if (key.step, key.inner_step, key.micro_batch, key.rank) == (step, inner_step, micro_batch, rank):
                return key
            path = self.path
        else:
            path = self.root / STEPS_DIR / step_file_name(step, inner_step, micro_batch, rank)
            if path.is_file():
                return StepKey(step, inner_step, micro_batch, rank, path)
        raise TraceFormatError(
            f"{path}: no step file for step {step}, inner step {inner_step}, micro-batch {micro_batch}, "
            f"rank {rank} in {self.path}")

    @property
    def algorithm(self) -> str | None:
        """The manifest's algorithm, else that of the first step file whose header opens."""
        algo = self.manifest.get("algorithm")
        if algo is None:
            for key in self.steps():
                try:
                    algo = self.metadata(key).get("algorithm")
                except TraceFormatError:
                    continue
                break
        return algo if isinstance(algo, str) or algo is None else str(algo)

    def _algorithm_of(self, meta: dict[str, Any]) -> str | None:
        algo = meta.get("algorithm", self.manifest.get("algorithm"))
        return algo if isinstance(algo, str) else None

    @property
    def status(self) -> str:
        return str(self.manifest.get("status", "unknown"))

    # -- tokens -------------------------------------------------------------------------------

    @cached_property
    def _tokens(self) -> tuple[list[str] | None, str | None]:
        path = self.root / TOKENS_NAME
        if self._single:  # a step file in the steps/ folder of a trace: that trace's token strings
            home = self.root.parent
            path = home / TOKENS_NAME if self.root.name == STEPS_DIR and (home / MANIFEST_NAME).is_file() else None
        if path is None or not path.exists():
            return None, None
        try:
            return clean_tokens(read_json(path, "token strings", MAX_TOKENS_BYTES, MAX_TOKEN_ENTRIES, "tokens"),
                                path), None
        except TraceFormatError as err:
            return None, f"{err}; token ids are shown as <id N>"

    @property
    def tokens_problem(self) -> str | None:
        """Why ``tokens.json`` cannot be used (then ``tokens`` is None), or None."""
        return self._tokens[1]

    @property
    def tokens(self) -> list[str] | None:
        """Text of each token id (``tokens.json``), or None when the trace stores none or the file
        is unusable (then :meth:`scan` says why)."""
        return self._tokens[0]

    @cached_property
    def _shown_tokens(self) -> list[str]:
        """:attr:`tokens` as shown (:func:`tracer.format.text.shown_token`: at most 256 characters), made
        once per trace: every occurrence of an id in a table is the same string object."""
        return [t if len(t) <= MAX_TOKEN_TEXT else shown_token(t) for t in self.tokens or []]

    def token_text(self, ids: Iterable[int]) -> list[str]:
        """Text of each id as shown: at most :data:`tracer.format.text.MAX_TOKEN_TEXT` characters, a
        longer token's rest elided with its length named (``…(+1048320 chars)``); ``<id N>`` when the
        trace has no token strings or the id is unknown. Holds B x T x the cap characters at most."""
        tokens = self._shown_tokens
        n = len(tokens)
        return [tokens[i] if 0 <= i < n else f"<id {i}>" for i in ids]

    def decode(self, ids: Iterable[int]) -> str:
        """Concatenated text of ``ids``."""
        return "".join(self.token_text(ids))

    @property
    def eos_token_id(self) -> int | None:
        return self.manifest.get("tokenizer", {}).get("eos_token_id")

    @property
    def pad_token_id(self) -> int | None:
        return self.manifest.get("tokenizer", {}).get("pad_token_id")

    # -- one step -----------------------------------------------------------------------------

    def _open(self, path: Path):
        return open_step_file(path, framework="np")

    def _checked(self, key: StepKey, fh) -> None:
        """Schema check of an open step file's header (TraceFormatError naming the field)."""
        check_step_header(key.path, fh, self._algorithm_of(self._metadata_of(key.path, fh)))

    def _metadata_of(self, path: Path, fh) -> dict[str, Any]:
        """The decoded metadata of an open step file, decoded once per file version
        (:class:`tracer.read.metadata_cache.MetadataCache`); shared: not to be changed."""
        cache = self.__dict__.get("_metadata_cache")
        if cache is None:
            cache = self._metadata_cache = MetadataCache()
        return cache.get(path, fh)

    def _header(self, path: Path) -> dict[str, Any]:
        cache = self.__dict__.get("_metadata_cache")
        cached = cache.peek(path) if cache is not None else None
        if cached is not None:  # decoded for this version of the file already: no open
            return dict(cached)
        with self._open(path) as fh:
            return dict(self._metadata_of(path, fh))

    def metadata(self, key: StepKey) -> dict[str, Any]:
        """Decoded step metadata of one step file (a copy: the caller may change it). Decoded once per
        file version and cached; metadata over :data:`tracer.format.integrity.MAX_METADATA_KEYS` keys or
        :data:`~tracer.format.integrity.MAX_METADATA_BYTES` is refused (TraceFormatError naming the file)."""
        return self._header(key.path)

    def fields(self, key: StepKey) -> dict[str, tuple[list[int], str]]:
        """``{field: (shape, dtype)}`` of one step file, read from the header only."""
        out = {}
        with self._open(key.path) as fh:
            for name in fh.keys():
                sl = fh.get_slice(name)
                out[name] = (list(sl.get_shape()), str(sl.get_dtype()))
        return out

    def load_step(self, key: StepKey, fields: Iterable[str] | None = None,
                  derive: bool = True, as_numpy: bool = False) -> dict[str, torch.Tensor]:
        """Tensors of one step file (all fields, or only ``fields`` that are present). With
        ``derive`` (the default) the derived fields the file lacks but whose inputs it records are
        added (:func:`tracer.formulas.derived.derive_fields`; :meth:`derived_fields` names them).

        Torch tensors (importing torch), or with ``as_numpy`` numpy arrays (a bfloat16 or float8
        field as float32: numpy has neither; no torch imported unless such a field is read or a
        field is derived)."""
        with self._open(key.path) as fh:
            self._checked(key, fh)
            meta = self._metadata_of(key.path, fh)
            present = list(fh.keys())
            wanted = present if fields is None else [f for f in fields if f in present]
            missing = [] if fields is None else [f for f in fields if f not in present]
            extra = derivation_inputs(present, meta, missing) if derive else []
            tensors = _read_fields(key.path, fh, list(dict.fromkeys([*wanted, *extra])), as_numpy)
        check_mask_values(key.path, tensors)
        if derive:
            derived = _derive(tensors, meta)
            tensors.update({k: v for k, v in derived.items() if fields is None or k in missing})
            for name in extra:
                if name not in wanted:
                    tensors.pop(name, None)
        return tensors

    def derived_fields(self, key: StepKey) -> list[str]:
        """The fields the reader derives for this step file (header only): those of
        :data:`DERIVED_FIELDS` the file lacks while it records their inputs."""
        with self._open(key.path) as fh:
            return derivable(list(fh.keys()), self._metadata_of(key.path, fh))

    def load_sequence(self, key: StepKey, sequence: int, derive: bool = True,
                      as_numpy: bool = False) -> dict[str, torch.Tensor]:
        """Row ``sequence`` of every field whose first dim is B, read with ``get_slice`` (only that
        row's bytes), plus the derived fields as :meth:`load_step`. Fields without a B dim are
        skipped (a field outside the schema counts as having one when its first dim equals the
        canonical fields' B). Torch tensors, or numpy arrays with ``as_numpy`` (as
        :meth:`load_step`). Raises IndexError for a row out of range."""
        out = {}
        with self._open(key.path) as fh:
            self._checked(key, fh)
            algorithm = self._algorithm_of(self._metadata_of(key.path, fh))
            shapes = {name: fh.get_slice(name).get_shape() for name in fh.keys()}
            canonical_b = [shape[0] for name, shape in shapes.items()
                           if name in FIELDS and FIELDS[name].dims_for(algorithm)[:1] == ("B",) and shape]
            names = []
            for name, shape in shapes.items():
                if not shape or (canonical_b and name not in FIELDS and shape[0] != canonical_b[0]):
                    continue
                if not 0 <= sequence < shape[0]:
                    raise IndexError(f"{key.path}: sequence {sequence} out of range for {name!r} with B = {shape[0]}")
                names.append(name)
            out = _read_fields(key.path, fh, names, as_numpy, row=sequence)
            meta = self._metadata_of(key.path, fh)
        check_mask_values(key.path, out)
        if derive:
            out.update(_derive(out, meta))
        return out

    # -- tables for the app -------------------------------------------------------------------

    def token_table(self, key: StepKey, sequence: int | None = None, derive: bool = True) -> pd.DataFrame:
        """One row per completion token (and per prompt token) of one step, or of one sequence.

        Columns: ``step, inner_step, rank, sequence, section`` (prompt | completion), ``position``
        (index within its section), ``token_id, token_text, kept, mask_reason`` (``prompt``,
        ``tool_output``, ``after_eos``…: :func:`tracer.read.tables.mask_reasons`), ``turn, role``
        (0 and ``""`` on prompt rows) and one column per per-token value field present (``[B]``
        fields such as GRPO advantages are broadcast; placeholder logprobs and what is computed from
        them empty: :func:`tracer.read.tables.without_placeholders`);
        with ``derive``, the derived fields too, named in ``attrs["derived"]``.
        """
        import pandas as pd

        from tracer.read import tables

        data = self.load_step(key, derive=derive, as_numpy=True) if sequence is None else {
            k: v[None] for k, v in self.load_sequence(key, sequence, derive=derive, as_numpy=True).items()}
        ids = data.get("completion_ids", data.get("prompt_ids"))
        if ids is None:
            return pd.DataFrame()
        rows = list(range(ids.shape[0])) if sequence is None else [sequence]
        frames = []
        if "prompt_ids" in data:
            frames.append(tables.prompt_frame(data, rows, self.token_text))
        if "completion_ids" in data:
            frames.append(tables.completion_frame(data, rows, self.token_text, self.eos_token_id, self.pad_token_id,
                                                   self.metadata(key), self.tokens))
        if not frames:
            return pd.DataFrame()
        table = pd.concat(frames, ignore_index=True)
        table.attrs["derived"] = [name for name in self.derived_fields(key) if name in table] if derive else []
        table.insert(0, "rank", key.rank)
        table.insert(0, "inner_step", key.inner_step)
        table.insert(0, "step", key.step)
        return table

    def merged_token_table(self, step: int, inner_step: int = 0, micro_batch: int | None = None) -> pd.DataFrame:
        """Token tables of every rank (and micro-batch, unless one is given) of one step, stacked;
        the ``rank`` column tells them apart (``sequence`` is the row within its own file)."""
        import pandas as pd

        keys = [k for k in self.steps() if k.step == step and k.inner_step == inner_step
                and (micro_batch is None or k.micro_batch == micro_batch)]
        frames = [self.token_table(k).assign(micro_batch=k.micro_batch) for k in keys]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    # -- the run overview (tracer.read.overview) ----------------------------------------------

    @property
    def overview(self) -> overview.TraceOverview:
        """The run overview: per-step summaries from the summary index, columns or headers (made once
        per Trace; a copy of this Trace makes its own)."""
        from tracer.read import (
            overview,  # pandas: imported when the overview is asked for
        )

        made = self.__dict__.get("_overview")
        if made is None or made.trace is not self:
            made = self._overview = overview.TraceOverview(self)
        return made

    def step_summary(self) -> pd.DataFrame:
        """One row per step file with its summary: :meth:`tracer.read.overview.TraceOverview.step_summary`."""
        return self.overview.step_summary()

    def rollouts(self, progress: Any = None) -> pd.DataFrame:
        """One row per completion of every step file: :func:`tracer.read.rollouts.rollout_frame`
        (``progress(done, total)`` is called while step files are read from their tensors).
        Raises TraceError for a DPO trace."""
        from tracer.read.rollouts import rollout_frame  # rollouts builds on this module

        return rollout_frame(self, progress)

    def summary_index(self) -> dict[str, dict[str, Any]]:
        """The run's summary index beyond its columns: :meth:`tracer.read.overview.TraceOverview.summary_index`."""
        return self.overview.summary_index()

    def summary_columns(self) -> Any:
        """The run's summary columns: :meth:`tracer.read.overview.TraceOverview.summary_columns`."""
        return self.overview.summary_columns()

    def index_vouched(self, paths: list[Path], sizes: list[int], index: dict[str, dict[str, Any]] | None = None) -> Any:
        """``bool [n]``: whether the summary index or columns list each of ``paths`` at ``sizes`` bytes
        (a file the writer wrote and renamed whole): :meth:`tracer.read.overview.TraceOverview.vouched`."""
        split = [str(p).rpartition(os.sep) for p in paths]
        return self._vouched([f for f, _, _ in split], [b for _, _, b in split], sizes, index)

    def index_vouches(self, path: Path, size: int, index: dict[str, dict[str, Any]] | None = None) -> bool:
        """:meth:`index_vouched` of one file."""
        return bool(self.index_vouched([path], [size], index)[0])

    def _vouched(self, folders: list[str] | str, names: list[str], sizes: Any,
                 index: dict[str, dict[str, Any]] | None = None) -> Any:
        return self.overview.vouched(folders, names, sizes, index)

    def _current_sizes(self, folder: str, names: list[str]) -> list[int]:
        """The size in bytes of each of the files ``names`` of ``folder`` now (-1 for one that is gone)."""
        from tracer.read import overview

        return overview.current_sizes(folder, names)

    _steps_folder = property(lambda self: self.overview.steps_folder)

    def ranks(self) -> list[int]:
        """Ranks that wrote step files."""
        return sorted({k.rank for k in self.steps()})


def _read_fields(path: Path, fh: Any, names: list[str], as_numpy: bool, row: int | None = None) -> dict[str, Any]:
    """``names`` of the open step file ``fh`` (row ``row`` of each, read with ``get_slice``, or the
    whole tensors), as numpy arrays (``as_numpy``) or torch tensors. ``fh`` may be opened for numpy
    (the reader's) or torch (the app's handles): a field numpy cannot hold (bfloat16, float8) is read
    through a torch handle of the same file. Raises TraceFormatError when the data cannot be read."""
    out: dict[str, Any] = {}
    through_torch = []
    try:
        for name in names:
            sl = fh.get_slice(name)
            if sl.get_dtype() not in NUMPY_DTYPES:
                through_torch.append(name)
                continue
            out[name] = fh.get_tensor(name) if row is None else sl[row : row + 1][0]
        if through_torch:
            with safe_open(str(path), framework="pt", device="cpu") as pt:
                for name in through_torch:
                    out[name] = pt.get_tensor(name) if row is None else pt.get_slice(name)[row : row + 1][0]
    except Exception as err:
        raise TraceFormatError(f"{path}: could not read tensor data ({err})") from err
    convert = to_numpy if as_numpy else to_torch
    return {name: convert(out[name]) for name in names}


def _derive(data: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """:func:`tracer.formulas.derived.derive_fields` of ``data``, imported (with torch) only when
    ``data`` records what a derived field needs and lacks that field."""
    if not derivable(data, meta):
        return {}
    from tracer.formulas.derived import derive_fields

    return derive_fields(data, meta)


def find_traces(root: str | Path, max_depth: int = 2) -> list[Path]:
    """Trace directories at or under ``root`` (those holding a ``manifest.json``), sorted."""
    root = Path(root)
    found = []
    if (root / MANIFEST_NAME).is_file():
        found.append(root)
    frontier = [root]
    for _ in range(max_depth):
        nxt = []
        for d in frontier:
            try:
                children = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
            except OSError:
                continue
            for c in children:
                if c.name == STEPS_DIR:
                    continue
                if (c / MANIFEST_NAME).is_file():
                    found.append(c)
                nxt.append(c)
        frontier = nxt
    return found
