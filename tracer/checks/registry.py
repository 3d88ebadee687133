"""The registry of named checks (:data:`tracer.checks.CHECKS`), filled on first use.

Each check module registers its checks when imported (:func:`tracer.checks.finding.register`), and the
check modules import torch. So that ``from tracer.checks import ERROR, WARNING`` (the viewer's Runs page,
``tracer --help``) stays torch-free, the package imports no check module; the registry imports all of
:data:`CHECK_MODULES` the first time it is read (a lookup, ``in``, iteration, ``len``).

The order of the registry is the order the checks run in and ``tracer check`` lists them: by the
module whose body registered the check, in :data:`CHECK_MODULES` order, then in registration order
within the module. It does not depend on which check module a caller imported first. Checks
registered from elsewhere (a user's own ``register``) come after, in registration order.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import ItemsView, Iterator, KeysView, MutableMapping, ValuesView
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracer.checks.finding import Check

PACKAGE = "tracer.checks"
# the modules whose import registers checks, in the order their checks run (each imports the shared
# modules it needs: context, comparison, advantage_rules, ...)
CHECK_MODULES = ("advantages", "alignment", "fields", "turns", "staleness", "identity", "integrity", "kl",
                 "logprobs", "masks", "nonfinite", "per_token_loss", "recompute", "reduction", "importance",
                 "sampler", "micro_batches", "probability", "effective_config", "dpo", "health")
_RANK = {f"{PACKAGE}.{name}": i for i, name in enumerate(CHECK_MODULES)}
_PASSING_THROUGH = frozenset({f"{PACKAGE}.finding", __name__})  # frames between a module body and __setitem__


class CheckRegistry(MutableMapping):
    """Check id (``family.name``) -> :class:`~tracer.checks.finding.Check`, a mutable mapping whose
    first read imports every check module (thread-safe; a check module imported on its own registers
    its checks at once, and they take their place in the order on that first read).

    Writing (``register``) does not load. Reading raises what importing a check module raises.
    """

    def __init__(self, checks: dict[str, Check] | None = None) -> None:
        self._checks: dict[str, Check] = dict(checks or {})
        self._registered_by: dict[str, tuple[int, int]] = {}  # id -> (module rank, registration number)
        self._count = 0
        self._loaded = False
        self._loading = False
        self._lock = threading.RLock()

    def load(self) -> None:
        """Import every check module (once), then put the checks in their running order."""
        if self._loaded:
            return
        with self._lock:
            if self._loaded or self._loading:  # _loading: a check module read the registry while importing
                return
            self._loading = True
            try:
                for name in CHECK_MODULES:
                    importlib.import_module(f"{PACKAGE}.{name}")
            finally:
                self._loading = False
            order = sorted(self._checks, key=lambda check_id: self._registered_by.get(check_id, (len(_RANK), 0)))
            self._checks = {check_id: self._checks[check_id] for check_id in order}
            self._loaded = True

    def __setitem__(self, check_id: str, check: Check) -> None:
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") in _PASSING_THROUGH:
            frame = frame.f_back
        module = frame.f_globals.get("__name__") if frame is not None else None
        with self._lock:
            self._count += 1
            self._registered_by[check_id] = (_RANK.get(module, len(_RANK)), self._count)
            self._checks[check_id] = check

    def __delitem__(self, check_id: str) -> None:
        self.load()
        with self._lock:
            del self._checks[check_id]
            self._registered_by.pop(check_id, None)

    def __getitem__(self, check_id: str) -> Check:
        self.load()
        return self._checks[check_id]

    def __contains__(self, check_id: object) -> bool:
        self.load()
        return check_id in self._checks

    def get(self, check_id: str, default: Any = None) -> Any:
        self.load()
        return self._checks.get(check_id, default)

    def __iter__(self) -> Iterator[str]:
        self.load()
        return iter(self._checks)

    def __len__(self) -> int:
        self.load()
        return len(self._checks)

    def keys(self) -> KeysView[str]:
        self.load()
        return self._checks.keys()

    def values(self) -> ValuesView[Check]:
        self.load()
        return self._checks.values()

    def items(self) -> ItemsView[str, Check]:
        self.load()
        return self._checks.items()

    def __repr__(self) -> str:
        return f"CheckRegistry({list(self)!r})"
