"""Every argument ``tracer`` refuses is refused before torch (or pandas) is imported, the whole
package loaded as ``python -m tracer`` loads it: a misspelt check or threshold, a tolerance that is not
a number, a path that is not a trace, a demo name, a port out of range. They used to answer after a
2-7 s torch import (the check registry, the diff engine, the demo runner), where the promise is an
answer at once (issue 49). tests/cli/test_help_and_bad_arguments_import_no_torch.py holds tracer/cli.py
alone to the stricter rule (no numpy either); these reach the commands, which may read the trace
(numpy) but not import the checks or the diff engine."""

from __future__ import annotations

import pytest

from tests.fixtures.cli_probe import run_cli
from tests.fixtures.paths import REPO

RUN = str(REPO / "sample_traces" / "grpo-tiny")


def _run(argv):
    return run_cli(argv, ("torch", "pandas"))


@pytest.mark.parametrize("argv, message", [
    (["check", "--select", "nope", RUN], "unknown check 'nope'; known checks: advantages.group_size"),
    (["check", RUN, "--threshold", "foo=1"], "unknown threshold 'foo'; known: ref_kl (default 2)"),
    (["check", RUN, "--threshold", "clip_fraction=2"], "threshold clip_fraction = 2 is out of range: a share in [0, 1]"),
    (["check", "/nonexistent/run"], "/nonexistent/run does not exist"),
    (["check", str(REPO / "README.md")], "README.md"),
    (["diff", "--atol", "x", RUN, RUN], "--atol 'x': expected FIELD=NUMBER or NUMBER"),
    (["diff", "/nonexistent/run", RUN], "/nonexistent/run does not exist"),
    (["diff", RUN, "/nonexistent/run"], "/nonexistent/run does not exist"),
    (["demo", "--algo", "nope"], "argument --algo: invalid choice: 'nope'"),
    (["view", "--port", "99999", RUN], "argument --port: expected a port number 1-65535, got 99999"),
])
def test_a_refused_argument_answers_without_torch(argv, message):
    result = _run(argv)
    assert result["code"] == 2 and message in result["err"], result
    assert result["heavy"] == [], result


def test_demo_help_lists_the_demos_without_torch():
    result = _run(["demo", "--help"])
    assert result["code"] == 0 and "grpo-trl" in result["out"] and result["heavy"] == []
