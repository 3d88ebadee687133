"""Reading a trace needs neither torch nor pandas (issue 49, item 2): ``import tracer``, the read and
format stages, opening a trace, its headers, metadata, numpy loads, token tables and ``tracer info``
(the function and the command, with ``--json`` and ``--verify``), the rollouts from their stored summaries, ``--help`` and every bad argument
leave ``torch`` out of ``sys.modules`` in a fresh interpreter (seconds of start-up and ~200 MB each).
The numpy reads hold the values the torch reads hold, a bfloat16 field included (read through torch,
given as float32)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.fixtures.paths import REPO
from tests.fixtures.toy_traces import ToyTokenizer, write_trace
from tracer.read import Trace
from tracer.record.writer import TraceWriter

READ_MODULES = ["tracer", "tracer.errors", "tracer.read", "tracer.read.reader", "tracer.read.step_table",
                "tracer.read.metadata_cache", "tracer.read.overview", "tracer.read.tables",
                "tracer.read.trace_info", "tracer.read.rollouts"]  # + every module of tracer.format, listed in the probe

PROBE = """
import json, pkgutil, sys, importlib
import tracer.format
modules = {modules!r} + ["tracer.format." + m.name for m in pkgutil.iter_modules(tracer.format.__path__)]
for name in modules:
    importlib.import_module(name)
after_import = [m for m in ("torch",) if m in sys.modules]
import tracer
from tracer.read.trace_info import trace_info
trace = tracer.Trace({path!r})
key = trace.steps()[0]
data = trace.load_step(key, as_numpy=True)
row = trace.load_sequence(key, 1, as_numpy=True)
table = trace.token_table(key)
info = trace_info({path!r}, verify=True)
rollouts = trace.rollouts()  # from the rollout summaries the writer stored
print(json.dumps({{"after_import": after_import, "modules": len(modules),
                  "torch": "torch" in sys.modules, "steps": len(trace.steps()),
                  "policy": data["policy_logprobs"].tolist(), "mask": data["completion_mask"].tolist(),
                  "row_ids": row["completion_ids"].tolist(), "types": sorted({{type(v).__name__ for v in data.values()}}),
                  "table_rows": len(table), "table_kept": int(table["kept"].sum()),
                  "verified": info["integrity"]["verified"], "kept_first": info["overview"]["columns"]["kept_tokens"]["first"],
                  "rollout_rows": len(rollouts), "rollout_sources": sorted(set(rollouts["source"]))}}))
"""

CLI = """
import json, runpy, sys
sys.argv = ["tracer", *{argv!r}]
code = 0
try:
    runpy.run_module("tracer", run_name="__main__", alter_sys=True)
except SystemExit as stop:
    code = stop.code
print("\\n@@" + json.dumps({{"code": code, "heavy": [m for m in ("torch", "pandas") if m in sys.modules]}}))
"""


def _python(code: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return write_trace(tmp_path_factory.mktemp("torch_free") / "run", ToyTokenizer(), steps=2)


def test_import_read_and_info_leave_torch_out_and_read_the_values_torch_reads(trace_dir):
    out = json.loads(_python(PROBE.format(modules=READ_MODULES, path=str(trace_dir))).stdout)
    assert out["after_import"] == [] and out["modules"] > len(READ_MODULES) + 10
    assert out["torch"] is False
    trace = Trace(trace_dir)
    key = trace.steps()[0]
    tensors = trace.load_step(key)  # torch, as the checks read it
    assert out["types"] == ["ndarray"] and out["steps"] == len(trace.steps()) == 4
    assert out["policy"] == tensors["policy_logprobs"].tolist()
    assert out["mask"] == tensors["completion_mask"].tolist()
    assert out["row_ids"] == tensors["completion_ids"][1].tolist()
    ids, prompt = tensors["completion_ids"], tensors["prompt_ids"]
    assert out["table_rows"] == ids.numel() + prompt.numel()  # one row per prompt and completion token
    assert out["table_kept"] == int(tensors["completion_mask"].sum())
    assert out["verified"] == 4  # every step file's bytes match its checksum
    assert out["kept_first"] == int(tensors["completion_mask"].sum())
    assert out["rollout_rows"] == 4 * ids.shape[0] and out["rollout_sources"] == ["summary"]


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0), (["info", "--help"], 0), (["diff", "--help"], 0), (["check", "--help"], 0),
    (["info", "{trace}"], 0), (["info", "{trace}", "--json"], 0), (["info", "{trace}", "--verify"], 0),
    (["info", "{step_file}"], 0),
    (["info", "{trace}/no-such-run"], 2), (["info"], 2), (["diff", "{trace}"], 2),
    (["check", "{trace}", "--max-per-check", "0"], 2), (["view", "--server.headless", "true"], 2),
])
def test_the_command_line_answers_without_torch_or_pandas(trace_dir, argv, code):
    step_file = Trace(trace_dir).steps()[0].path
    argv = [a.format(trace=trace_dir, step_file=step_file) for a in argv]
    done = subprocess.run([sys.executable, "-c", CLI.format(argv=argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    result = json.loads(done.stdout.rpartition("\n@@")[2])
    assert result == {"code": code, "heavy": []}, done.stderr
    if argv[:1] == ["info"] and code == 0 and "--help" not in argv:
        assert "algorithm: grpo" in done.stdout or '"algorithm": "grpo"' in done.stdout


def test_a_bfloat16_field_is_read_through_torch_and_given_to_numpy_as_float32(tmp_path):
    """numpy holds no bfloat16: such a field (a writer keeping its source dtype) is read through torch;
    ``as_numpy`` gives it as float32 with the same values, the default read as bfloat16."""
    policy = torch.tensor([[-1.25, -0.5, -3.0], [-0.125, -2.0, -0.75]], dtype=torch.bfloat16)
    tensors = {"prompt_ids": torch.tensor([[5, 6], [7, 8]]), "completion_ids": torch.tensor([[2, 3, 1], [4, 1, 0]]),
               "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool),
               "policy_logprobs": policy, "old_logprobs": policy.clone(), "rewards": torch.tensor([1.0, 0.0]),
               "advantages": torch.tensor([0.5, -0.5]), "group_ids": torch.tensor([0, 0])}
    with TraceWriter(tmp_path / "bf16", "grpo", keep_source_dtype=True, async_write=False) as writer:
        writer.record(0, tensors)
    trace = Trace(tmp_path / "bf16")
    key = trace.steps()[0]
    assert trace.fields(key)["policy_logprobs"][1] == "BF16"
    as_torch = trace.load_step(key)
    as_numpy = trace.load_step(key, as_numpy=True)
    assert as_torch["policy_logprobs"].dtype == torch.bfloat16 and torch.equal(as_torch["policy_logprobs"], policy)
    assert as_numpy["policy_logprobs"].dtype == np.float32
    assert as_numpy["policy_logprobs"].tolist() == [[-1.25, -0.5, -3.0], [-0.125, -2.0, -0.75]]
    assert trace.load_sequence(key, 1, as_numpy=True)["policy_logprobs"].tolist() == [-0.125, -2.0, -0.75]
    # the ratio derived from the bf16 inputs: exp(policy - old) = 1 everywhere, in both kinds
    assert "ratio" in trace.derived_fields(key)
    assert as_numpy["ratio"].tolist() == [[1.0] * 3] * 2 and torch.equal(as_torch["ratio"], torch.ones(2, 3))
