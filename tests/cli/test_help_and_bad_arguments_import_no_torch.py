"""The command line answers ``--help``, ``--version`` and a mistyped argument without importing torch,
pandas or numpy (seconds of start-up on a busy machine): tracer/cli.py imports only the standard
library and light modules, and each command imports what it uses.

These tests hold tracer/cli.py to its part by importing it under an empty ``tracer`` package (no
numpy or safetensors either), in a fresh process; tests/read/test_reading_a_trace_imports_no_torch.py
runs ``python -m tracer`` as a whole (``tracer/__init__.py`` imports its public names lazily)."""

from __future__ import annotations

import pytest

from tests.fixtures.cli_probe import run_cli

HEAVY = ("torch", "pandas", "numpy", "safetensors")


def _run(argv):
    return run_cli(argv, HEAVY, light=True)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["info", "--help"], ["check", "--help"],
                                  ["diff", "--help"], ["view", "--help"]])
def test_help_and_version_import_no_torch(argv):
    result = _run(argv)
    assert result["code"] == 0 and result["out"], result
    assert result["heavy"] == []


@pytest.mark.parametrize("argv, message", [
    (["info"], "the following arguments are required: path"),
    (["info", "run", "--bogus"], "unrecognized arguments: --bogus"),
    (["check", "run", "--max-per-check", "0"], "expected an integer >= 1, got 0"),
    (["check"], "tracer check: error: no trace given: tracer check PATH [--select ID ...]"),
    (["check", "run", "--threshold", "ref_kl"], "--threshold 'ref_kl': expected NAME=VALUE with a number"),
    (["check", "run", "--sampler-ratio-bound", "0.5"], "--sampler-ratio-bound must be > 1, got 0.5"),
    (["view", "--server.headless", "true"], "--server.headless is a Streamlit option, not one of tracer view's"),
    (["diff", "a"], "the following arguments are required: b"),
])
def test_a_bad_argument_is_refused_with_exit_2_before_torch_is_imported(argv, message):
    result = _run(argv)
    assert result["code"] == 2 and message in result["err"], result
    assert result["heavy"] == []


def test_the_algorithm_choices_are_read_when_an_algorithm_is_checked():
    """The names of the demos and algorithms live in modules that import torch: a bad --algo is
    still refused with the full list (read then), as argparse's own choices would."""
    result = _run(["run", "--algo", "sac", "--out", "o", "--", "s.py"])
    assert result["code"] == 2
    assert ("argument --algo: invalid choice: 'sac' (choose from 'ppo', 'grpo', 'cispo', 'rloo', 'dpo')"
            in result["err"])
