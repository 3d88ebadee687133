"""Public names imported on first use (PEP 562), for the packages whose face must import fast:
``tracer`` (``import tracer``, ``tracer --help``) and :mod:`tracer.views`.

It lives in the record stage because that is the lowest stage both can import at no cost: ``import
tracer`` already imports :mod:`tracer.record` (torch-free) to register the live guard's factory, while
:mod:`tracer.format` imports numpy (~0.1 s). It imports nothing but the standard library.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(module_globals: dict[str, Any], table: Mapping[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` (PEP 562) of the package whose globals are
    ``module_globals``, for ``__getattr__, __dir__ = lazy_exports(globals(), table)``.

    ``table`` maps each lazily exported public name to the module that defines it; the first lookup
    imports that module, takes the name from it and keeps it in ``module_globals`` (later lookups do
    not come back). A name not in ``table`` raises ``AttributeError``. ``__dir__`` lists the globals and
    ``__all__``.

    Importing a submodule ``pkg.name`` makes Python set the attribute ``pkg.name`` to that module, which
    would hide a public object of the same name. So this also gives the package a module type that keeps
    the public object: the function ``name`` of a lazily exported ``pkg.name.name`` (``tracer.views
    .conversation``), or a public name (in ``__all__``) the package itself defines (the function
    ``tracer.diff``, beside the subpackage :mod:`tracer.diff`). Call it after those definitions.
    """
    package = module_globals["__name__"]

    def __getattr__(name: str) -> Any:
        """The public name ``name``, imported from its module on first use and kept (PEP 562)."""
        home = table.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        module_globals[name] = value  # later lookups find it without coming here
        return value

    def __dir__() -> list[str]:
        return sorted(set(module_globals) | set(module_globals.get("__all__", ())))

    class _PublicNamesFirst(types.ModuleType):
        """The package's type: a submodule bound as an attribute does not hide a public name."""

        def __setattr__(self, name: str, value: Any) -> None:
            if isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{name}":
                if table.get(name) == value.__name__:
                    value = getattr(value, name)
                elif name in module_globals.get("__all__", ()) and name in module_globals \
                        and not isinstance(module_globals[name], types.ModuleType):
                    return  # the package's own public object stays
            super().__setattr__(name, value)

    sys.modules[package].__class__ = _PublicNamesFirst
    return __getattr__, __dir__
