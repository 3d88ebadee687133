"""docs/agentic.md works as written: its explicit-API example runs and writes a trace with turns,
roles and reasons; its TRL example runs on the agent demo's model; every `python -m tracer` command
in it is one the CLI accepts. Each snippet is taken from the doc itself."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.fixtures.paths import REPO

DOC = (REPO / "docs" / "agentic.md").read_text(encoding="utf-8")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC, re.M | re.S)


def python(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def test_every_tracer_command_in_the_doc_parses():
    from tracer.cli import _parser

    commands = [line for block in blocks("bash") for line in block.replace("\\\n", " ").splitlines()
                if line.startswith("python -m tracer ")]
    assert len(commands) >= 8
    for command in commands:
        argv = shlex.split(command.split("#")[0])[3:]
        _parser().parse_args(argv)  # SystemExit on an unknown option or choice


def test_the_explicit_api_example_runs_and_records_the_turn_fields(tmp_path):
    (example,) = [b for b in blocks("python") if "writer.record(" in b]
    (tmp_path / "example.py").write_text(example)
    run = python(["example.py"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    from tracer import Trace

    trace = Trace(tmp_path / "runs" / "agent-explicit")
    (key,) = trace.steps()
    data, meta = trace.load_step(key), trace.metadata(key)
    assert {"turn_ids", "token_roles", "mask_reasons"} <= set(data)
    assert meta["advantage_assignment"] == "episode" and meta["role_names"][3] == "tool"
    assert int(data["completion_mask"].sum()) == 10 + 9 - 3 - 3  # assistant tokens: rows minus tool and pad


def test_the_trl_example_runs_on_the_agent_model(tmp_path):
    pytest.importorskip("trl")
    from tracer.demo.agent_model import build_agent_model

    model = build_agent_model(tmp_path / "agent" / "model", seed=0, warmup_steps=100)
    (example,) = [b for b in blocks("python") if "tools=[add]" in b]
    assert '"/tmp/agent/model"' in example
    example = example.replace('"/tmp/agent/model"', repr(str(model))).replace(
        '"/tmp/agent-trl-scratch"', repr(str(tmp_path / "scratch")))
    (tmp_path / "example.py").write_text(example)
    run = python(["example.py"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    from tracer import Trace

    trace = Trace(tmp_path / "runs" / "my-agent")
    assert trace.status == "finished" and len(trace.steps()) == 2
    assert "token_roles" in trace.load_step(trace.steps()[0])
