"""A checkout in a folder named ``tracer``, used from its parent, shadows the package: Python imports
the checkout folder as an empty namespace package. ``python -m tracer`` there runs the checkout's
``__main__.py``, which names the folder it imported, the real package inside it and what to do,
instead of a bare "No module named tracer.__main__" or a command line of another copy. Real
processes on a copy of the checkout's layout (its ``tracer/`` package and its root files)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.fixtures.paths import REPO


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """``<tmp>/tracer``: the checkout's root files and its package, laid out as a clone is."""
    checkout = tmp_path_factory.mktemp("parent") / "tracer"
    shutil.copytree(REPO / "tracer", checkout / "tracer", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("__main__.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, checkout / name)
    return checkout


def _python(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_python_m_tracer_from_the_parent_names_the_shadowing_folder(clone):
    done = _python("-m", "tracer", "info", "run", cwd=clone.parent)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"tracer: error: python imported the folder {clone} as the package 'tracer', but it is a checkout of "
        f"tracer (the package is its subfolder {clone / 'tracer'}): Python looks in the current folder "
        f"({clone.parent}) first, and a folder named 'tracer' there shadows the real package. Scripts run from "
        f"{clone.parent} fail the same way (module 'tracer' has no attribute 'Tracer'). Run from another folder "
        f"(e.g. cd {clone}), or rename the checkout (mv {clone} {clone.parent / 'tracer-src'}, then "
        f"pip install -e {clone.parent / 'tracer-src'} if it was installed from there).\n")


def test_a_script_in_the_parent_fails_as_the_hint_says(clone):
    (clone.parent / "train.py").write_text("import tracer\ntracer.Tracer\n")
    done = _python("train.py", cwd=clone.parent)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == "AttributeError: module 'tracer' has no attribute 'Tracer'"


def test_the_checkout_run_as_a_folder_or_from_inside_runs_its_own_command_line(clone):
    package = clone / "tracer"
    as_folder = _python(str(clone), "--version", cwd=clone.parent)
    assert as_folder.returncode == 0 and as_folder.stdout.strip().endswith(f"({package})")
    inside = _python("-m", "tracer", "--version", cwd=clone)
    assert inside.returncode == 0 and inside.stdout.strip().endswith(f"({package})")
