"""The vLLM tests are not optional: ``make test`` (the README's test command, which ``.ci/run``
calls) runs tests/vllm_engine in the vLLM venv, and the main run leaves them to it. Read from ``make -n``
(what make would run), not from the Makefile's text."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import pytest

from tests.fixtures.paths import REPO


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_test_runs_the_vllm_tests_in_the_vllm_venv():
    plan = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    lines = [line for line in plan.splitlines() if "-m pytest" in line]
    vllm_runs = [line for line in lines if ".venv-vllm/bin/python" in line and line.rstrip().endswith("tests/vllm_engine")]
    main_runs = [line for line in lines if ".venv/bin/python" in line and ".venv-vllm" not in line]
    assert len(vllm_runs) == 1 and "VLLM_ENABLE_V1_MULTIPROCESSING=0" in vllm_runs[0]
    assert len(main_runs) == 1 and "--ignore=tests/vllm_engine" in main_runs[0]
    assert (REPO / "tests" / "vllm_engine" / "test_grpo_vllm.py").is_file()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("args", [["--algo", "grpo-vllm"], ["--algo", "grpo", "--rollout", "vllm"]])
def test_vllm_demos_without_vllm_say_how_to_get_it(tmp_path, capsys, args):
    from tracer.cli import main

    assert main(["demo", *args, "--out", str(tmp_path / "t")]) == 2
    assert "make .venv-vllm" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("args, message", [
    (["--algo", "grpo", "--bug", "top-p"], "--bug applies to --algo grpo-vllm only"),
    (["--algo", "dpo", "--rollout", "vllm"], "--rollout vllm applies to --algo grpo and cispo only"),
])
def test_vllm_options_on_other_demos_are_refused(tmp_path, capsys, args, message):
    from tracer.cli import main

    assert main(["demo", *args, "--out", str(tmp_path / "t")]) == 2
    assert message in capsys.readouterr().err
