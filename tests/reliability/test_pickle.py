"""Safe to open: no code path in the package can unpickle or evaluate file data. An AST scan of
every source file under tracer/ and app/ refuses pickle-family imports, torch.load/torch.save,
pickle.load(s), numpy.load(allow_pickle=True), pandas pickles, yaml.load without a safe loader,
and eval/exec; the scanner itself is tested on snippets so that adding one makes this fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.fixtures.paths import REPO

SCANNED = ("tracer", "app")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal", "pickletools"}
# (module, attribute) calls that deserialise arbitrary objects or write pickles.
FORBIDDEN_CALLS = {
    ("torch", "load"), ("torch", "save"), ("torch.jit", "load"), ("torch.serialization", "load"),
    ("pandas", "read_pickle"), ("yaml", "unsafe_load"), ("yaml", "full_load"),
}
FORBIDDEN_METHODS = {"to_pickle", "read_pickle"}  # on any object (DataFrame.to_pickle...)
FORBIDDEN_FROM_IMPORTS = {("torch", "load"), ("torch", "save"), ("pandas", "read_pickle"),
                          ("numpy", "load"), ("yaml", "load"), ("yaml", "unsafe_load")}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader"}


class _Scanner(ast.NodeVisitor):
    """Collects ``(line, what)`` for every forbidden construct of one module."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}  # local name -> module it names
        self.found: list[tuple[int, str]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in PICKLE_MODULES:
                self.found.append((node.lineno, f"import {alias.name}"))
            self.aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                alias.name.split(".")[0]
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if module.split(".")[0] in PICKLE_MODULES:
            self.found.append((node.lineno, f"from {module} import ..."))
        for alias in node.names:
            if (module, alias.name) in FORBIDDEN_FROM_IMPORTS:
                self.found.append((node.lineno, f"from {module} import {alias.name}"))
            elif alias.name in PICKLE_MODULES:
                self.found.append((node.lineno, f"from {module} import {alias.name}"))
            else:
                self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
        self.generic_visit(node)

    def _dotted(self, node: ast.AST) -> str | None:
        """``torch.jit.load`` for an attribute chain, with the first name resolved through imports."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = self._dotted(func)
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
            self.found.append((node.lineno, f"{func.id}()"))
        elif name:
            module, _, attr = name.rpartition(".")
            module = {"np": "numpy", "pd": "pandas"}.get(module, module)
            if (module, attr) in FORBIDDEN_CALLS or module.split(".")[0] in PICKLE_MODULES:
                self.found.append((node.lineno, f"{name}()"))
            elif module == "builtins" and attr in ("eval", "exec"):
                self.found.append((node.lineno, f"{name}()"))
            elif (module, attr) == ("numpy", "load") and _truthy(keywords.get("allow_pickle")):
                self.found.append((node.lineno, "numpy.load(allow_pickle=True)"))
            elif (module, attr) == ("yaml", "load") and _loader_name(keywords.get("Loader")) not in SAFE_YAML_LOADERS:
                self.found.append((node.lineno, "yaml.load() without a safe Loader"))
            elif (module, attr) in (("importlib", "import_module"), ("builtins", "__import__")) or name == "__import__":
                if node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value) in PICKLE_MODULES:
                    self.found.append((node.lineno, f"{name}({node.args[0].value!r})"))
        if isinstance(func, ast.Attribute) and func.attr in FORBIDDEN_METHODS:
            self.found.append((node.lineno, f".{func.attr}()"))
        self.generic_visit(node)


def _truthy(node: ast.AST | None) -> bool:
    return node is not None and not (isinstance(node, ast.Constant) and not node.value)


def _loader_name(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def scan_source(source: str, filename: str = "<snippet>") -> list[tuple[int, str]]:
    """Forbidden constructs in ``source``, as ``(line, what)``."""
    scanner = _Scanner()
    scanner.visit(ast.parse(source, filename=filename))
    return scanner.found


def package_sources() -> list[Path]:
    files = [p for d in SCANNED for p in sorted((REPO / d).rglob("*.py")) if "__pycache__" not in p.parts]
    assert len(files) > 20, files  # the scan really covers the package
    return files


def test_no_pickle_torch_load_or_eval_anywhere_in_the_package():
    found = [f"{path.relative_to(REPO)}:{line}: {what}"
             for path in package_sources() for line, what in scan_source(path.read_text(), str(path))]
    assert found == [], "unsafe deserialisation or eval in the package:\n" + "\n".join(found)


@pytest.mark.parametrize("snippet", [
    "import pickle",
    "import pickle as pk\npk.loads(b'')",
    "from pickle import loads",
    "import cloudpickle",
    "import joblib",
    "import marshal",
    "import torch\ntorch.load('x.pt')",
    "import torch\ntorch.load('x.pt', weights_only=True)",
    "import torch as t\nt.save({}, 'x.pt')",
    "from torch import load",
    "import torch\ntorch.jit.load('m.pt')",
    "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
    "import numpy\nnumpy.load('x.npy', allow_pickle=flag)",
    "from numpy import load",
    "import pandas as pd\npd.read_pickle('x.pkl')",
    "frame.to_pickle('x.pkl')",
    "import yaml\nyaml.load(text)",
    "import yaml\nyaml.unsafe_load(text)",
    "eval(open('metadata.txt').read())",
    "exec(code)",
    "import builtins\nbuiltins.eval(text)",
    "import importlib\nimportlib.import_module('pickle')",
    "__import__('pickle')",
])
def test_the_scanner_refuses(snippet):
    assert scan_source(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "from safetensors import safe_open\nsafe_open('x.safetensors', framework='pt')",
    "from safetensors.torch import load_file, save_file",
    "import json\njson.loads(text)",
    "import numpy as np\nnp.load('x.npy')",
    "import numpy as np\nnp.load('x.npy', allow_pickle=False)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
    "import yaml\nyaml.safe_load(text)",
    "model.load_state_dict(state)",
    "self.evaluate(x)",
    "ast.literal_eval(text)",
])
def test_the_scanner_allows(snippet):
    assert scan_source(snippet) == [], snippet
