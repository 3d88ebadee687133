"""The lazily exported public names of ``tracer`` and ``tracer.views`` (:mod:`tracer.record.lazy_exports`):
a name's module is imported on its first lookup, not before, and importing a submodule of the same name
(``tracer.diff``, ``tracer.views.conversation``) leaves the public function in place. Each case runs in a
fresh interpreter, since the imports under test happen once per process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.fixtures.paths import REPO


def _probe(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tracer_imports_a_public_name_module_on_first_lookup_and_keeps_the_diff_function():
    found = _probe("""
import json, sys, types
import tracer
before = "tracer.read" in sys.modules, "Trace" in vars(tracer)
trace_cls = tracer.Trace
import tracer.read
after = "Trace" in vars(tracer)
import tracer.diff
try:
    tracer.no_such_name
    missing = None
except AttributeError as error:
    missing = str(error)
print(json.dumps({"before": before, "same": trace_cls is tracer.read.Trace, "kept": after,
                  "diff_is_function": isinstance(tracer.diff, types.FunctionType),
                  "diff_module": sys.modules["tracer.diff"].__name__,
                  "report": tracer.DiffReport is sys.modules["tracer.diff"].DiffReport,
                  "missing": missing, "dir": sorted(set(tracer.__all__) - set(dir(tracer)))}))
""")
    assert found == {"before": [False, False], "same": True, "kept": True, "diff_is_function": True,
                     "diff_module": "tracer.diff", "report": True,
                     "missing": "module 'tracer' has no attribute 'no_such_name'", "dir": []}


def test_views_binds_the_conversation_function_when_its_submodule_is_imported():
    found = _probe("""
import json, sys, types
import tracer.views
before = "tracer.views.conversation" in sys.modules
import tracer.views.conversation
module = sys.modules["tracer.views.conversation"]
print(json.dumps({"before": before, "function": tracer.views.conversation is module.conversation,
                  "span": tracer.views.ConversationSpan is module.ConversationSpan,
                  "grouped": sorted(tracer.views.GROUPED_ALGORITHMS) == sorted(sys.modules["tracer.views.common"].GROUPED_ALGORITHMS)}))
""")
    assert found == {"before": False, "function": True, "span": True, "grouped": True}


@pytest.fixture
def toy_package(tmp_path, monkeypatch):
    """A package ``toy`` with submodules ``toy.shape`` (defining the lazy ``shape`` and ``Box``) and
    ``toy.merge`` (beside the package's own public function ``merge``)."""
    root = tmp_path / "toy"
    root.mkdir()
    (root / "__init__.py").write_text(
        "from tracer.record.lazy_exports import lazy_exports\n"
        "__all__ = ['shape', 'Box', 'merge']\n"
        "def merge(a, b):\n    return a + b\n"
        "__getattr__, __dir__ = lazy_exports(globals(), {'shape': 'toy.shape', 'Box': 'toy.shape'})\n")
    (root / "shape.py").write_text("def shape(x):\n    return len(x)\nclass Box:\n    pass\n")
    (root / "merge.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m == "toy" or m.startswith("toy.")]:
        del sys.modules[name]


def test_a_package_with_lazy_exports_keeps_its_public_names_over_its_submodules(toy_package):
    import importlib

    toy = importlib.import_module("toy")
    assert "toy.shape" not in sys.modules and "Box" not in vars(toy)
    assert toy.Box is sys.modules["toy.shape"].Box  # imported from toy.shape on first lookup, then kept
    assert vars(toy)["Box"] is toy.Box
    importlib.import_module("toy.shape")
    assert toy.shape("abc") == 3  # the function toy.shape.shape, not the module toy.shape
    importlib.import_module("toy.merge")
    assert toy.merge(2, 5) == 7 and sys.modules["toy.merge"].VALUE == 3
    assert {"shape", "Box", "merge"} <= set(dir(toy))
    with pytest.raises(AttributeError, match="module 'toy' has no attribute 'cube'"):
        _ = toy.cube
