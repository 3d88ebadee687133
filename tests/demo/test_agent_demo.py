"""``python -m tracer demo agent``: the tool-calling TRL demo runs from the command line, carries its
model, and ``tracer info`` reads its trace; ``--leak-tool-output`` leaves tool tokens in the loss."""

from __future__ import annotations

import json
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

from tracer import Trace  # noqa: E402
from tracer.cli import main  # noqa: E402
from tracer.demo.runner import run_demo  # noqa: E402
from tracer.format.turns import ROLE_NAMES  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
TOOL = ROLE_NAMES.index("tool")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "agent"
    assert main(["demo", "agent", "--out", str(out), "--steps", "1"]) == 0
    return out


def test_demo_agent_writes_a_multi_turn_trace_that_info_reads(demo_dir, capsys):
    capsys.readouterr()
    assert main(["info", str(demo_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["algorithm"] == "grpo" and info["status"] == "finished" and info["steps"] == [0]
    assert main(["info", str(demo_dir)]) == 0
    assert "turn_ids" in capsys.readouterr().out
    trace = Trace(demo_dir)
    assert trace.manifest["config"]["demo"] == "tracer.demo.agent_trl.run_agent_demo"
    assert (demo_dir / "model" / "config.json").is_file()  # the trace carries the model that produced it
    (key,) = trace.steps()
    data = trace.load_step(key)
    assert bool((data["token_roles"] == TOOL).any())
    assert not bool(data["completion_mask"][data["token_roles"] == TOOL].any())


def test_leak_tool_output_keeps_tool_tokens(demo_dir, tmp_path):
    out = run_demo("agent", tmp_path / "leak", steps=1, progress=False, model_dir=demo_dir / "model",
                   leak_tool_output=True)
    (key,) = Trace(out).steps()
    data = Trace(out).load_step(key)
    tool = data["token_roles"] == TOOL  # (B, T)
    assert bool(tool.any()) and bool(data["completion_mask"][tool].all())


def test_leak_tool_output_is_refused_for_another_demo(tmp_path, capsys):
    assert main(["demo", "grpo", "--out", str(tmp_path / "d"), "--leak-tool-output"]) == 2
    assert "--leak-tool-output applies to the agent demo only, not grpo" in capsys.readouterr().err
    assert main(["demo", "agent", "--algo", "grpo", "--out", str(tmp_path / "d")]) == 2
    assert "name one demo" in capsys.readouterr().err
