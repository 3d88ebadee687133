"""tracer.checks.catalogue, what `tracer check` validates --select and --threshold against without
importing the checks, names exactly the registered checks and the CheckOptions health thresholds
with their defaults (a check added to the registry and not to the catalogue would be refused by name)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from tracer.checks import CHECKS, CheckOptions
from tracer.checks.catalogue import CHECK_IDS, HEALTH_DEFAULTS, HEALTH_THRESHOLDS, SHARE_THRESHOLDS, threshold_problem


def test_the_catalogue_lists_every_registered_check_once():
    assert list(CHECK_IDS) == sorted(CHECKS) and len(set(CHECK_IDS)) == len(CHECK_IDS)


def test_the_thresholds_are_checkoptions_fields_with_their_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(CheckOptions)}
    assert set(HEALTH_THRESHOLDS.values()) == set(HEALTH_DEFAULTS)
    assert all(defaults[a] == HEALTH_DEFAULTS[a] for a in HEALTH_DEFAULTS)
    assert set(SHARE_THRESHOLDS) <= set(HEALTH_DEFAULTS)
    assert threshold_problem("ref_kl", 3.0) is None and threshold_problem("ref_kl_max", 3.0) is None
    assert threshold_problem("clip_fraction", 1.5) == "threshold clip_fraction = 1.5 is out of range: a share in [0, 1]"
    assert threshold_problem("ref_kl", -1.0) == "threshold ref_kl = -1 is out of range: a value >= 0"
    assert CheckOptions().with_thresholds({"ref_kl": 3.0}).ref_kl_max == 3.0


def test_the_catalogue_imports_only_the_standard_library():
    code = ("import sys; before = set(sys.modules); import tracer.checks.catalogue; "
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('torch', 'numpy', 'pandas')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
