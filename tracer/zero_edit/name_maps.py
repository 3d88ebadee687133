"""Name maps: which variable of a training loop holds which canonical field (zero-edit tracing,
``tracer run`` and ``tracer.watch``).

A map is a TOML (or YAML) file; the shipped one, ``tracer/zero_edit/maps/minimind.toml``, knows MiniMind's
names (seed lesson 25) and documents the format. A user map is tried before the map it ``extends``
(default ``"minimind"``; ``extends = ""`` for a map that stands alone; one level)::

    [fields]
    policy_logprobs = ["logp_new"]          # canonical field = variables, tried in order
    old_logprobs = ["logp_old[idx]"]        # `name[index]`: rows of the whole rollout
    completion_ids = ["input_ids[:, 1:]"]   # slices: the tokens each position of a packed row predicts
    [indices]
    step = ["update"]

Expressions are ``name``, ``name.attr...`` (attribute, or key of a dict-like) and an optional
subscript at the end: ``[index_name]`` (rows of a whole-rollout tensor) or slices with integer
bounds, one per dimension from the first, ``...`` allowed once (``[:, 1:]``, ``[:, :-1]``,
``[..., 2:-1]``, ``[1::2]``). Nothing is evaluated: the expression is parsed and looked up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tracer.errors import TraceError
from tracer.format.schema import ALGORITHMS, FIELDS

MAPS_DIR = Path(__file__).with_name("maps")
DEFAULT_MAP = "minimind"
CANDIDATE_SECTIONS = ("fields", "stacked", "indices", "metadata", "objects")
INDEX_KEYS = ("step", "epoch", "inner_step", "micro_batch")
STACKED_STEMS = ("ids", "mask", "policy_logprobs", "ref_logprobs")
OBJECT_KEYS = ("tokenizer", "config")
DERIVABLE = ("ratio", "ref_kl_k3", "approx_kl_k2", "group_ids", "dpo_terms")
_EXPRESSION = re.compile(r"(?P<path>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\[(?P<subscript>[^\[\]]*)\])?")
_INDEX_NAME = re.compile(r"[A-Za-z_]\w*")
_BOUND = r"\s*(-?\d+)?\s*"
_SLICE = re.compile(rf"{_BOUND}:{_BOUND}(?::{_BOUND})?")
ELLIPSIS = "..."


class NameMapError(TraceError):
    """A name map file that cannot be used (unknown section, field or expression)."""


@dataclass(frozen=True)
class Expression:
    """A parsed map entry: ``path`` (``("args", "beta")``) and an optional row index variable, or
    slices: ``(start, stop, step)`` triples (None where the text gives no bound) and
    :data:`ELLIPSIS`, applied as ``value[subscript]`` (``input_ids[:, 1:]``)."""

    text: str
    path: tuple[str, ...]
    index: str | None = None
    slices: tuple[tuple[int | None, int | None, int | None] | str, ...] | None = None
    subscript: tuple = field(default=(), compare=False, repr=False)  # the slices as Python objects

    def __post_init__(self) -> None:
        if self.slices is not None and not self.subscript:
            object.__setattr__(self, "subscript", tuple(
                Ellipsis if item == ELLIPSIS else slice(*item) for item in self.slices))


@dataclass(frozen=True)
class NameMap:
    """A map resolved for one algorithm: each key's candidate expressions, in the order tried."""

    source: str
    fields: Mapping[str, tuple[Expression, ...]] = field(default_factory=dict)
    stacked: Mapping[str, tuple[Expression, ...]] = field(default_factory=dict)
    indices: Mapping[str, tuple[Expression, ...]] = field(default_factory=dict)
    metadata: Mapping[str, tuple[Expression, ...]] = field(default_factory=dict)
    objects: Mapping[str, tuple[Expression, ...]] = field(default_factory=dict)
    derive: tuple[str, ...] = ()

    def names(self, section: str, key: str) -> list[str]:
        """The candidate expressions of ``section.key`` as text (for messages)."""
        return [e.text for e in getattr(self, section).get(key, ())]


def parse_expression(text: str, where: str) -> Expression:
    """Parse ``name(.attr)*`` with an optional ``[index_name]`` or ``[slices]``; raises NameMapError
    naming ``where`` otherwise."""
    match = _EXPRESSION.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise NameMapError(
            f"{where}: {text!r} is not a variable expression; write `name`, `name.attr`, `name[index_name]` "
            "or `name[slices]` (e.g. \"old_resp_logp[inds]\", \"args.beta\", \"input_ids[:, 1:]\")")
    path, subscript = tuple(match["path"].split(".")), match["subscript"]
    if subscript is None:
        return Expression(text.strip(), path)
    if _INDEX_NAME.fullmatch(subscript.strip()):
        return Expression(text.strip(), path, index=subscript.strip())
    return Expression(text.strip(), path, slices=_parse_slices(text.strip(), subscript, where))


def _parse_slices(text: str, subscript: str, where: str) -> tuple:
    """The ``(start, stop, step)`` triples and ellipses of ``subscript`` (what is between the brackets
    of ``text``); raises NameMapError naming ``where``, the entry and the item that is not a slice."""
    items = []
    for item in subscript.split(","):
        if item.strip() == ELLIPSIS:
            if ELLIPSIS in items:
                raise NameMapError(f"{where}: {text!r} has more than one `...`; a subscript may hold one "
                                   "(e.g. \"logps[..., 1:]\")")
            items.append(ELLIPSIS)
            continue
        match = _SLICE.fullmatch(item)
        if match is None:
            raise NameMapError(
                f"{where}: {text!r}: {item.strip()!r} is not a slice; a subscript is one row-index variable "
                "(`name[inds]`) or slices with integer bounds, one per dimension, and `...` "
                "(e.g. \"input_ids[:, 1:]\", \"logps[:, :-1]\"); integer indices, which drop a dimension, "
                "and expressions are not read")
        start, stop, step = (None if g is None else int(g) for g in match.groups())
        if step is not None and step <= 0:
            raise NameMapError(f"{where}: {text!r}: slice step {step} in {item.strip()!r}; tensors take "
                               "positive steps only")
        items.append((start, stop, step))
    return tuple(items)


def _toml_module():
    """``tomllib`` (Python 3.11+), else its backport ``tomli``."""
    try:
        import tomllib
    except ModuleNotFoundError:
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise NameMapError("reading TOML name maps on Python 3.10 needs tomli (pip install tomli)") from None
    return tomllib


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise NameMapError(f"name map {path} does not exist; pass a .toml (or .yaml) file, or a shipped map name "
                           f"({', '.join(shipped_maps())})")
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise NameMapError(f"{path}: reading a YAML map needs PyYAML (pip install pyyaml), or write it as TOML") from None
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    else:
        tomllib = _toml_module()
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as err:
            raise NameMapError(f"{path} is not valid TOML: {err}") from err
    if not isinstance(data, dict):
        raise NameMapError(f"{path}: a name map is a table of sections ([fields], [indices]...), got {type(data).__name__}")
    return data


def shipped_maps() -> list[str]:
    """Names of the maps shipped in ``tracer/zero_edit/maps/`` (usable as ``--map NAME``)."""
    return sorted(p.stem for p in MAPS_DIR.glob("*.toml"))


def _locate(spec: str | Path) -> Path:
    text = str(spec)
    if text in shipped_maps():
        return MAPS_DIR / f"{text}.toml"
    return Path(spec)


def _allowed_keys(section: str) -> tuple[str, ...] | None:
    if section == "fields":
        return tuple(FIELDS)
    if section == "stacked":
        return STACKED_STEMS
    if section == "indices":
        return INDEX_KEYS
    if section == "objects":
        return OBJECT_KEYS
    return None  # metadata: any key


def _section(raw: Mapping[str, Any], name: str, where: str) -> dict[str, tuple[Expression, ...]]:
    table = raw.get(name, {})
    if not isinstance(table, Mapping):
        raise NameMapError(f"{where}: [{name}] must be a table of key = [variable names]")
    allowed = _allowed_keys(name)
    out = {}
    for key, names in table.items():
        if allowed is not None and key not in allowed:
            hint = "canonical fields are listed in tracer/format/schema.py" if name == "fields" else f"known keys: {list(allowed)}"
            raise NameMapError(f"{where}: [{name}] has unknown key {key!r}; {hint}")
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list):
            raise NameMapError(f"{where}: [{name}] {key} must be a list of variable names, got {names!r}")
        out[key] = tuple(parse_expression(n, f"{where} [{name}] {key}") for n in names)
    return out


def _parse(raw: Mapping[str, Any], where: str, algorithm: str | None) -> dict[str, Any]:
    """One file's sections for ``algorithm`` (its ``[ALGO.section]`` keys replace the common ones)."""
    known = set(CANDIDATE_SECTIONS) | {"derive", "extends"} | set(ALGORITHMS)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise NameMapError(f"{where}: unknown top-level key(s) {unknown}; known: {sorted(known)}")
    parsed: dict[str, Any] = {s: _section(raw, s, where) for s in CANDIDATE_SECTIONS}
    derive = raw.get("derive")
    for algo in ALGORITHMS:  # every [ALGO] table is checked; only the chosen algorithm's applies
        extra = raw.get(algo, {})
        bad = sorted(set(extra) - set(CANDIDATE_SECTIONS) - {"derive"}) if isinstance(extra, Mapping) else [algo]
        if bad:
            raise NameMapError(f"{where}: [{algo}] may hold only {list(CANDIDATE_SECTIONS)} and derive, got {bad}")
        sections = {s: _section(extra, s, f"{where} [{algo}]") for s in CANDIDATE_SECTIONS}
        if algo == algorithm:
            for s in CANDIDATE_SECTIONS:
                parsed[s].update(sections[s])
            derive = extra.get("derive", derive)
    if derive is not None:
        bad = [d for d in derive if d not in DERIVABLE] if isinstance(derive, list) else [derive]
        if bad:
            raise NameMapError(f"{where}: derive lists {bad}; derivable fields are {list(DERIVABLE)}")
        parsed["derive"] = tuple(derive)
    return parsed


def _merge(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Candidates of ``first`` before those of ``then``; ``first``'s derive list wins when it has one."""
    out: dict[str, Any] = {}
    for s in CANDIDATE_SECTIONS:
        keys = list(first[s]) + [k for k in then[s] if k not in first[s]]
        out[s] = {k: tuple(dict.fromkeys(first[s].get(k, ()) + then[s].get(k, ()))) for k in keys}
    out["derive"] = first.get("derive", then.get("derive", ()))
    return out


def load_name_map(spec: str | Path | Mapping[str, Any] | None = None, algorithm: str | None = None) -> NameMap:
    """Load a name map for ``algorithm``.

    Args:
        spec: a shipped map's name (``"minimind"``), a path to a ``.toml``/``.yaml`` file, a dict
            with a file's structure (handy in a notebook), or None for the default shipped map.
            A user map (file or dict) extends ``"minimind"`` unless it says ``extends = ""``.
        algorithm: selects the ``[ALGO.section]`` replacements.

    Raises:
        NameMapError: a missing or malformed file, an unknown section, canonical field, index key or
            derivable field, or an expression that is not ``name(.attr)*`` with an optional
            ``[index_name]`` or ``[slices]``.
    """
    if isinstance(spec, Mapping):
        raw, where, shipped = dict(spec), "name map dict", False
    else:
        path = _locate(spec if spec is not None else DEFAULT_MAP)
        raw, where, shipped = _read_file(path), str(path), path.parent == MAPS_DIR
    parsed = _parse(raw, where, algorithm)
    extends = raw.get("extends", "" if shipped else DEFAULT_MAP)
    sources = [where]
    if extends:
        base_path = _locate(extends)
        if where == str(base_path):
            raise NameMapError(f"{where}: a map cannot extend itself (extends = {extends!r})")
        parsed = _merge(parsed, _parse(_read_file(base_path), str(base_path), algorithm))
        sources.append(str(base_path))
    return NameMap(" + ".join(sources), parsed["fields"], parsed["stacked"], parsed["indices"],
                   parsed["metadata"], parsed["objects"], parsed.get("derive", ()))
