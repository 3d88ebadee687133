"""The vLLM tests are not optional: ``make test`` (the README's test command, which ``.ci/run``
calls) runs tests/vllm_engine in the vLLM venv, and the main run leaves them to it. Read from ``make -n``
(what make would run), not from the Makefile's text."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_test_runs_the_vllm_tests_in_the_vllm_venv():
    plan = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    lines = [line for line in plan.splitlines() if "-m pytest" in line]
    vllm_runs = [line for line in lines if ".venv-vllm/bin/python" in line and line.rstrip().endswith("tests/vllm_engine")]
    main_runs = [line for line in lines if ".venv/bin/python" in line and ".venv-vllm" not in line]
    assert len(vllm_runs) == 1 and "VLLM_ENABLE_V1_MULTIPROCESSING=0" in vllm_runs[0]
    assert len(main_runs) == 1 and "--ignore=tests/vllm_engine" in main_runs[0]
    assert (REPO / "tests" / "vllm_engine" / "test_grpo_vllm.py").is_file()
