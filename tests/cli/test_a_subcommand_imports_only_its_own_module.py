"""Each subcommand lives in its own module of ``tracer.commands``, imported when that subcommand runs:
``tracer --help`` imports none of them, ``tracer info RUN`` only ``tracer.commands.info`` (and the helper
it shares with ``check``), a refused ``tracer check`` option only ``tracer.commands.check``. Each probe
is a fresh interpreter running ``python -m tracer``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.fixtures.paths import REPO
from tests.fixtures.toy_traces import ToyTokenizer, write_trace

PROBE = """
import contextlib, io, json, runpy, sys
sys.argv = ["tracer", *{argv!r}]
code = 0
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        runpy.run_module("tracer", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
print(json.dumps({{"code": code, "commands": sorted(m for m in sys.modules if m.startswith("tracer.commands."))}}))
"""


def _commands_imported(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return write_trace(tmp_path_factory.mktemp("commands") / "run", ToyTokenizer(), steps=1)


def test_help_imports_no_subcommand(run):
    assert _commands_imported(["--help"]) == {"code": 0, "commands": []}
    assert _commands_imported(["diff", "--help"]) == {"code": 0, "commands": []}


def test_info_imports_its_own_module_only(run):
    assert _commands_imported(["info", str(run)]) == {
        "code": 0, "commands": ["tracer.commands.info", "tracer.commands.trace_paths"]}


def test_a_refused_check_option_imports_the_check_module_only(run):
    assert _commands_imported(["check", str(run), "--threshold", "ref_kl"]) == {
        "code": 2, "commands": ["tracer.commands.check", "tracer.commands.trace_paths"]}
