"""Shared test setup: no model hub access, ever; the shared fixtures of tests/fixtures (``model_dir``,
``sync_playwright``) registered as plugins; ``tests`` names this folder."""

import importlib.util
import os
import sys
import types
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The same float32 results on every x86-64 machine of one CPU vendor that CI may draw: ATen picks
# AVX-512 or AVX2 kernels per CPU, and their last-bit differences, amplified by one optimizer step,
# moved the committed regression baselines (tests/demo/test_regression/) by up to 1e-3 on an
# AVX2-only machine. An Intel and an AMD machine still differ under these pins (up to 3e-4), so the
# demo baselines are kept per vendor (tests/demo/test_regression.py). Both libraries read these variables when they first compute, not at
# import, so setting them here (after the tracer plugin imported torch) still takes effect;
# tests/demo/test_regression.py asserts that it did. docs/regression-testing.md gives users the same recipe.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("MKL_CBWR", "AVX2")
# TraceWriter's default writer ("auto") starts a writer process for CPU tensors: a fresh interpreter
# per writer, 1-3 s of CPU on these 2 cores. Tests use the writer thread unless they test the process
# (writer="process") or the choice (tests/record/test_writer_auto.py, which unsets this);
# TRACER_WRITER=auto (or process) in the environment runs the whole suite with it.
os.environ.setdefault("TRACER_WRITER", "thread")

# tests/integrations/test_verl.py and test_verl_configs.py need verl, which pins its own transformers: they
# run in .venv-verl (`make test-verl`, part of `make test`), not here, and are left out of collection
# rather than reported as skipped.
VERL_TESTS = ["integrations/test_verl.py", "integrations/test_verl_configs.py"]
collect_ignore = [] if importlib.util.find_spec("verl") is not None else VERL_TESTS


def pytest_report_header(config):
    if collect_ignore:
        return ("tests/integrations/test_verl.py, tests/integrations/test_verl_configs.py not collected: verl is not "
                "installed here; they run in .venv-verl (make test-verl)")
    return None


def _claim_tests_package() -> None:
    """verl's wheel installs a top-level ``tests`` package into site-packages, which would shadow this
    directory for ``from tests.fixtures.toy_traces import ...``; make ``tests`` name this directory (the
    package of tests/__init__.py, so that ``tests.app``, ``tests.fixtures``... are its subpackages)."""
    here = Path(__file__).resolve().parent
    spec = importlib.util.find_spec("tests")
    locations = [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else [here]
    if here not in locations or len(locations) > 1:
        package = types.ModuleType("tests")
        package.__path__ = [str(here)]
        sys.modules["tests"] = package


_claim_tests_package()

# fixtures every test module may ask for (after _claim_tests_package: they are imported as tests.fixtures.*)
pytest_plugins = ["tests.fixtures.models", "tests.fixtures.browser"]
