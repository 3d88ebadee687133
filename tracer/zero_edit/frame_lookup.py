"""Looking a training loop's variables up in its frames (zero-edit tracing; the rules are in
:mod:`tracer.zero_edit.frames`): the calling frame of a backward, the value a map expression names there, and
the integer indices, step metadata and objects (tokenizer, config) the frame and its callers hold.
"""

from __future__ import annotations

import argparse
import inspect
import operator
import sys
from abc import get_cache_token
from collections import abc
from types import CodeType, FrameType
from typing import Any, Iterator, Mapping

import torch

from tracer.errors import is_library_frame, of_roots
from tracer.zero_edit.name_maps import Expression, NameMap

RUNNER_ROOTS = frozenset({"runpy", "tracer", "IPython", "ipykernel", "_pytest", "pytest", "pluggy"})
INDEX_DEPTH = 4
_MISSING = object()


def calling_frame(frame: FrameType | None) -> FrameType | None:
    """The first frame from ``frame`` outwards that is not library code (see the module rules)."""
    while frame is not None and is_library_frame(frame):
        frame = frame.f_back
    return frame


def _is_runner(frame: FrameType) -> bool:
    return of_roots(frame, RUNNER_ROOTS)


def _user_frames(frame: FrameType, depth: int) -> Iterator[FrameType]:
    """``frame`` and up to ``depth - 1`` of its callers, up to the first runner (runpy, pytest...)."""
    yield frame
    for _ in range(depth - 1):
        frame = frame.f_back
        if frame is None or _is_runner(frame):
            return
        yield frame


def scopes_of(frame: FrameType) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """``(locals, globals)`` of ``frame``. Reading ``f_locals`` copies every local of a function
    frame, so a capture takes it once and passes it to each :func:`resolve`."""
    return frame.f_locals, frame.f_globals


def _lookup(name: str, local: Mapping, global_: Mapping) -> Any:
    value = local.get(name, _MISSING)
    return global_.get(name, _MISSING) if value is _MISSING else value


def resolve(expr: Expression, frame: FrameType, scopes: tuple[Mapping, Mapping] | None = None) -> Any:
    """The value ``expr`` names in ``frame`` (locals, then globals), or ``_MISSING``; ``scopes``:
    :func:`scopes_of` the frame, when the caller has it already."""
    local, global_ = scopes or scopes_of(frame)
    return resolve_in(expr, local, global_)


def resolve_in(expr: Expression, local: Mapping, global_: Mapping) -> Any:
    """:func:`resolve` in the scopes ``local`` and ``global_`` (a frame's ``f_locals``, ``f_globals``)."""
    path = expr.path
    value = local.get(path[0], _MISSING)
    if value is _MISSING:
        value = global_.get(path[0], _MISSING)
    for attr in path[1:] if len(path) > 1 else ():
        if value is _MISSING:
            return _MISSING
        if _is_mapping(value) and attr in value:
            value = value[attr]
        else:
            value = getattr(value, attr, _MISSING)
    if value is _MISSING:
        return value
    if expr.slices is not None:
        return take_slices(value, expr.subscript)
    if expr.index is None:
        return value
    index = _lookup(expr.index, local, global_)
    return take_rows(value, index) if row_index(index) else _MISSING


_SLICEABLE = frozenset({torch.Tensor, torch.nn.Parameter})


def take_slices(value: Any, subscript: tuple) -> Any:
    """``value[subscript]`` (a view; ``subscript`` holds slices and at most one Ellipsis), or ``_MISSING``
    when ``value`` is not a plain tensor (a tensor subclass may run its own code on indexing: map a
    variable holding the sliced plain tensor) or has fewer dimensions than the slices."""
    if type(value) not in _SLICEABLE:
        return _MISSING
    try:
        if value.dim() < sum(item is not Ellipsis for item in subscript):
            return _MISSING
        return value[subscript]
    except Exception:  # noqa: BLE001  (a nested or sparse tensor that refuses slicing: no value)
        return _MISSING


_NAMESPACE_MAPPING: list = [None, False]  # [abc.get_cache_token() when known, isinstance(a Namespace, abc.Mapping)]


def _is_mapping(value: Any) -> bool:
    """``isinstance(value, collections.abc.Mapping)``; for an ``argparse.Namespace`` (what ``args.beta``
    reads) remembered until an ABC registers a class (``abc.get_cache_token()`` changes)."""
    if type(value) is argparse.Namespace:  # exactly the class: its __class__ is the class itself
        token = get_cache_token()
        if _NAMESPACE_MAPPING[0] != token:
            _NAMESPACE_MAPPING[:] = [token, isinstance(value, abc.Mapping)]
        return _NAMESPACE_MAPPING[1]
    return isinstance(value, abc.Mapping)


def row_index(index: Any) -> bool:
    """True for what ``name[index]`` reads rows by: a 1-d tensor of integers (never raises: a tensor that
    cannot be read, a nested one, is none)."""
    if not isinstance(index, torch.Tensor):
        return False
    try:
        return index.dim() == 1 and index.dtype != torch.bool and not index.is_floating_point()
    except Exception:  # noqa: BLE001  (a nested tensor, a subclass that refuses: no row index)
        return False


def take_rows(value: Any, index: torch.Tensor) -> Any:
    """``value[index]`` (rows; the index moved to ``value``'s device), or ``_MISSING`` when ``value`` is
    no tensor or the rows are not there. Plain CPU tensors and an int64 index take
    ``value.index_select(0, index)``: the same values, dtype and shape for rows in range, by a shorter
    path than indexing's (a PPO capture gathers 12 rollout fields by ``inds`` at every backward); a
    negative row or one out of range falls back to ``value[index]``, which counts the first from the
    end and refuses the second."""
    if not isinstance(value, torch.Tensor):
        return _MISSING
    try:
        if type(value) is torch.Tensor and type(index) is torch.Tensor and value.is_cpu and index.is_cpu:
            if index.dtype is torch.int64 and value.dim():
                try:
                    return value.index_select(0, index)
                except (IndexError, RuntimeError):
                    pass
            return value[index]  # the same device, without making two device objects
        return value[index if index.device == value.device else index.to(value.device)]
    except Exception:  # noqa: BLE001  (rows that are not there, a 0-d, nested or sparse value: no rows)
        return _MISSING


def _as_int(value: Any) -> int | None:
    if type(value) is int:
        return value
    if isinstance(value, bool) or value is _MISSING or not hasattr(type(value), "__index__"):
        return None  # operator.index would raise (a function, a string, a float...): without the exception
    try:
        return operator.index(value)
    except Exception:  # noqa: BLE001  (no integer: a float, a meta or nested tensor, an object that refuses)
        return None


_CO_OPTIMIZED = inspect.CO_OPTIMIZED
# id(code object) -> (it, the names its frames' f_locals can hold): keyed by identity, as hashing a code
# object hashes its bytecode and constants each time (about 1 us for a training loop's function); the entry
# holds the code object, so its id is not given to another while it is kept
_CODE_NAMES: dict = {}


def code_variables(code: CodeType) -> frozenset[str]:
    """The variables of a function's code (``co_varnames``, cell and free variables): the keys its
    frames' ``f_locals`` refreshes (remembered per code object)."""
    cached = _CODE_NAMES.get(id(code))
    if cached is not None and cached[0] is code:
        return cached[1]
    names = frozenset(code.co_varnames + code.co_cellvars + code.co_freevars)
    if len(_CODE_NAMES) < 4096:
        _CODE_NAMES[id(code)] = (code, names)
    return names


def _caller_scopes(frame: FrameType, heads: frozenset[str]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """:func:`scopes_of` a caller, without copying the locals of a function none of whose variables is
    among ``heads`` (a function frame's ``f_locals`` holds its variables only): ``({}, globals)``."""
    if frame.f_code.co_flags & _CO_OPTIMIZED and heads.isdisjoint(code_variables(frame.f_code)):
        return {}, frame.f_globals
    return scopes_of(frame)


_held: dict = {}
_ONE_HOLDER = sys.getrefcount(_held)  # a dict one name holds, as getrefcount counts it (the name, its argument)
del _held
# What release_locals counts for a snapshot nothing else holds: the frame's own reference, and the caller's
# variable and release_locals's parameter. Counted here, at module level, where no trace function can copy a
# variable into a snapshot of its own (in a function, each traced frame holding the dict adds one reference).
_UNSHARED_REFS = _ONE_HOLDER + 2


def release_locals(frame: FrameType, local: Any) -> None:
    """Empty ``frame``'s ``f_locals`` snapshot ``local`` (the dict :func:`scopes_of` took) once a capture is
    done with it, when nothing else holds it: CPython before 3.13 keeps the dict on the frame, so it
    would hold the loop's tensors of this backward (a whole rollout after a step's last one) until the
    next capture refreshes it. Unobservable: a function frame's next ``f_locals`` / ``locals()`` fills
    the dict again from the variables. Left alone: another holder (a ``locals()`` kept by the loop), a
    traced frame (a debugger's), a module or class body (there ``f_locals`` is the namespace itself), and
    a snapshot holding names that are not the function's variables (written by ``exec()`` or
    ``locals()[k] = v``: a refresh keeps them, and later ``locals()`` / ``eval()`` calls read them).
    The caller passes its only reference to ``local`` (``on_backward``'s variable).

    The values are set to None rather than the dict cleared: the next refresh then stores into the
    keys it has, where a cleared dict is grown again, resize by resize (20-50 us per backward for a
    loop of 54 locals, against 3 us: measured at a MiniMind PPO backward, bench/loops.py). They are
    set in place, key by key, not by ``update(dict.fromkeys(local))``: that builds a second table of
    the dict's size each time, 24-38 us at that backward (a 3 KB allocation beside the loop's
    tensors), against 6 us for the loop (BENCHMARKS.md, "Small, realistic and zero-edit loops")."""
    if (type(local) is not dict or frame.f_trace is not None or not frame.f_code.co_flags & _CO_OPTIMIZED
            or sys.getrefcount(local) > _UNSHARED_REFS or not local.keys() <= code_variables(frame.f_code)):
        return
    for name in local:  # the tensors let go; the keys (the table's size) kept; no key added or removed
        local[name] = None


_READERS: dict[int, tuple] = {}  # id(a name map's indices or metadata) -> (it, a copy, its compiled form, heads)


def _compiled(section: Mapping[str, tuple[Expression, ...]]) -> tuple[tuple, frozenset[str]]:
    """``(keys, heads)`` of a name map's ``indices`` or ``metadata``: ``keys`` the entries in map order,
    each ``(key, ((head, expr), ...))`` with ``head`` the variable of a one-name expression (two dict
    reads) or None (``expr`` resolved in full, :func:`resolve_in`); ``heads`` the variables the
    section reads. Remembered by the mapping's identity, kept with a copy of it that it must still
    equal, entries in the same order (a mapping changed in place, or another one given the id of
    one gone, is compiled again); at most 64 kept."""
    cached = _READERS.get(id(section))
    if cached is None or cached[0] is not section or cached[1] != section or tuple(cached[1]) != tuple(section):
        if len(_READERS) >= 64:
            _READERS.clear()
        keys = tuple((key, tuple((e.path[0] if len(e.path) == 1 and e.index is None and e.slices is None else None, e)
                                for e in exprs))
                     for key, exprs in section.items())
        heads = frozenset(e.path[0] for exprs in section.values() for e in exprs)
        cached = _READERS[id(section)] = (section, dict(section), keys, heads)
    return cached[2], cached[3]


def _value_in(head: str | None, expr: Expression, local: Mapping, global_: Mapping) -> Any:
    """:func:`resolve_in` of a compiled expression: a one-name one (``head``) by two dict lookups."""
    return resolve_in(expr, local, global_) if head is None else _lookup(head, local, global_)


def _find_ints(keys: tuple | list, local: Mapping, global_: Mapping, out: dict[str, int]) -> list:
    """Each entry's first expression naming an integer in the scopes ``local``, ``global_``, into
    ``out``; returns the entries none of whose expressions did (the next caller is read for them)."""
    rest = []
    for entry in keys:
        for head, expr in entry[1]:
            value = _value_in(head, expr, local, global_)
            if value is _MISSING:
                continue
            number = value if type(value) is int else _as_int(value)
            if number is not None:
                out[entry[0]] = number
                break
        else:
            rest.append(entry)
    return rest


def read_indices(frame: FrameType, name_map: NameMap, scopes=None) -> dict[str, int]:
    """Integer indices (step, epoch, inner_step, micro_batch) from the frame, then its callers
    (their variables are read only when a key is not found nearer); ``scopes``: the frame's own.
    Each key gets its first expression naming an integer, the frame's expressions in map order
    before its caller's; the dict is in map order. The callers' ``f_locals`` snapshots taken are
    released before returning (:func:`release_locals`): the ints read are all a capture keeps of them."""
    out: dict[str, int] = {}
    if not name_map.indices:
        return out
    keys, heads = _compiled(name_map.indices)
    pending = _find_ints(keys, *(scopes or scopes_of(frame)), out)
    if not pending:
        return out
    levels: list[tuple] = [()]  # the callers' scopes by level (level 0, the frame's, is the caller's to release)
    taken: list[FrameType] = []  # the callers whose f_locals snapshot was taken, by level
    callers = _user_frames(frame, INDEX_DEPTH)
    next(callers)
    while pending:
        caller = next(callers, None)
        if caller is None:
            break
        levels.append(_caller_scopes(caller, heads))
        taken.append(caller)
        pending = _find_ints(pending, *levels[-1], out)
    del caller
    _release_callers(taken, levels)
    return out if list(out) == [k for k, _ in keys if k in out] else {k: out[k] for k, _ in keys if k in out}


def _release_callers(callers: list[FrameType], levels: list[tuple]) -> None:
    """:func:`release_locals` of each of ``callers``' snapshots (``levels[1:]``, emptied here so that the
    snapshot's only reference left is the one release_locals counts as the caller's variable)."""
    while len(levels) > 1:
        caller, local = callers.pop(), levels.pop()[0]
        if caller.f_code.co_flags & _CO_OPTIMIZED and local:  # ({}, globals): no snapshot was taken
            release_locals(caller, local)
        del caller, local


_PLAIN_TYPES = frozenset({bool, int, float, str})


def _plain(value: Any) -> Any:
    """A JSON-able scalar for step metadata, or ``_MISSING``. A ``torch.optim.Optimizer`` reads as the
    largest learning rate of its param groups now (what a map's ``learning_rate = ["optimizer"]``
    records: the rate a scheduler or a hand-written warmup has set, not the configured base rate)."""
    if value is _MISSING or type(value) in _PLAIN_TYPES:
        return value
    if isinstance(value, torch.optim.Optimizer):
        rates = [_plain(group.get("lr")) for group in value.param_groups]
        rates = [float(r) for r in rates if isinstance(r, (int, float)) and not isinstance(r, bool)]
        return max(rates) if rates else _MISSING
    if isinstance(value, torch.Tensor):
        try:
            value = value.item() if value.numel() == 1 else _MISSING
        except Exception:  # noqa: BLE001  (a meta, nested or sparse tensor has no value to read)
            return _MISSING
    if isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return _plain(value.item())
        except Exception:  # noqa: BLE001
            return _MISSING
    return _MISSING


def read_metadata(frame: FrameType, name_map: NameMap, scopes=None) -> dict[str, Any]:
    """Step metadata keys (``beta``, ``num_generations``, ``early_stop``...) found in the frame: each
    key's first expression naming a JSON-able scalar (:func:`_plain`), in map order."""
    out: dict[str, Any] = {}
    if not name_map.metadata:
        return out
    keys, _ = _compiled(name_map.metadata)
    local, global_ = scopes or scopes_of(frame)
    for key, exprs in keys:
        for head, expr in exprs:
            value = _value_in(head, expr, local, global_)
            if value is _MISSING:
                continue
            if type(value) not in _PLAIN_TYPES:
                value = _plain(value)
                if value is _MISSING:
                    continue
            out[key] = value
            break
    return out


def read_objects(frame: FrameType, name_map: NameMap) -> tuple[Any, dict[str, Any]]:
    """``(tokenizer or None, config dict)``: the first candidate that looks like a tokenizer
    (has ``convert_ids_to_tokens``) and the JSON-able entries of an argparse Namespace or dict."""
    tokenizer = next((v for v in (resolve(e, frame) for e in name_map.objects.get("tokenizer", ()))
                      if hasattr(v, "convert_ids_to_tokens")), None)
    config: dict[str, Any] = {}
    for expr in name_map.objects.get("config", ()):
        value = resolve(expr, frame)
        items = vars(value) if isinstance(value, argparse.Namespace) else value if isinstance(value, Mapping) else None
        if items is not None:
            config = {str(k): v for k, v in items.items() if _plain(v) is not _MISSING or v is None}
            break
    return tokenizer, config
