"""``tracer.diff`` is both the public function ``tracer.diff(a, b)`` and the subpackage
``tracer.diff``. ``tracer/__init__.py`` imports its public names lazily (so that ``import tracer``
does not import torch), and Python sets the package attribute ``tracer.diff`` to the subpackage when
that is first imported: the attribute must stay the function whatever imports what first, as it was
when ``tracer/__init__.py`` imported everything eagerly. Each order runs in a fresh interpreter (the
test process has imported the subpackage long ago)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.fixtures.paths import REPO, SAMPLES

ORDERS = {
    "subpackage first": "import tracer.diff.engine\nimport tracer",
    "package first": "import tracer\nimport tracer.diff.engine",
    "from-import of the subpackage": "import tracer\nfrom tracer.diff import DiffReport",
    "public name first": "import tracer\ntracer.DiffReport\nimport tracer.diff.report",
}
PROBE = """
{imports}
import sys
from tracer import diff as imported
report = tracer.diff({a!r}, {b!r})
same = tracer.diff({a!r}, {a!r})
print(json.dumps({{"kind": type(tracer.diff).__name__, "imported": type(imported).__name__,
                  "report": type(report).__name__, "equal": [report.equal, same.equal],
                  "is_report": isinstance(report, tracer.DiffReport)}}))
"""


@pytest.mark.parametrize("order", ORDERS)
def test_tracer_diff_is_the_function_whatever_was_imported_first(order):
    a, b = SAMPLES / "grpo-diff-baseline", SAMPLES / "grpo-diff-scorer-clip"
    code = "import json\n" + PROBE.format(imports=ORDERS[order], a=str(a), b=str(b))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # the two bundled traces differ (a scorer clip changes the rewards); a trace equals itself
    assert out == {"kind": "function", "imported": "function", "report": "DiffReport",
                   "equal": [False, True], "is_report": True}
