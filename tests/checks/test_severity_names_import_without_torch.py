"""``from tracer.checks import ERROR, WARNING`` (the viewer's Runs page, the command line's help) imports
neither torch nor a check module: the registry ``CHECKS`` imports the check modules on its first read,
and its order (the order the checks run in) does not depend on which check module was imported first.
Each case runs in a fresh interpreter, since the imports under test happen once per process."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.fixtures.paths import REPO


def _probe(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_severities_and_light_names_leave_torch_and_the_check_modules_out():
    found = _probe("""
import json, sys
from tracer.checks import CHECKS, ERROR, FAMILIES, SEVERITIES, WARNING, Finding, count_by_severity, has_errors
from tracer.checks.registry import CHECK_MODULES
light = {"torch": "torch" in sys.modules,
         "check_modules": [m for m in CHECK_MODULES if "tracer.checks." + m in sys.modules],
         "errors": has_errors([Finding("masks.after_eos", ERROR, "m"), Finding("kl.k3_sign", WARNING, "m")]),
         "counts": count_by_severity([Finding("kl.k3_sign", WARNING, "m")]), "severities": list(SEVERITIES)}
known = "masks.after_eos" in CHECKS  # the first read imports every check module
import tracer.checks, tracer.checks.runner
print(json.dumps({**light, "known": known, "torch_after_read": "torch" in sys.modules,
                  "all_imported": all("tracer.checks." + m in sys.modules for m in CHECK_MODULES),
                  "families": sorted({c.family for c in CHECKS.values()} - set(FAMILIES)),
                  "run_checks": tracer.checks.run_checks is tracer.checks.runner.run_checks}))
""")
    assert found == {"torch": False, "check_modules": [], "errors": True,
                     "counts": {"error": 0, "warning": 1, "info": 0, "skipped": 0},
                     "severities": ["error", "warning", "info", "skipped"], "known": True, "torch_after_read": True,
                     "all_imported": True, "families": [], "run_checks": True}


ORDER = """
import json
{first}
from tracer.checks.finding import CHECKS  # the name guard and tests import: the same registry
print(json.dumps({{"order": list(CHECKS), "modules": [c.run.__module__ for c in CHECKS.values()]}}))
"""


def test_the_running_order_does_not_depend_on_which_check_module_is_imported_first():
    plain = _probe(ORDER.format(first=""))
    late_first = _probe(ORDER.format(first="import tracer.checks.health, tracer.checks.reduction, tracer.checks.masks"))
    assert late_first["order"] == plain["order"]
    order = plain["order"]
    # the package's order: advantages' checks first, health's last ...
    assert order[0].startswith("advantages.") and order[-1].startswith("health.")
    # ... and within recompute.py, recompute.advantages (a function of advantage_rules that recompute.py
    # registers between its approx_kl_k2 and token_rewards checks) keeps its place in that module's body
    at = order.index("recompute.advantages")
    assert order[at - 1:at + 2] == ["recompute.approx_kl_k2", "recompute.advantages", "recompute.token_rewards"]
    assert plain["modules"][at] == "tracer.checks.advantage_rules"
