"""A run recorded with ``keep_source_dtype=True`` whose logprobs are float8 (a loop that keeps them in
float8 to save memory) is readable: the writer stored them as F8_E4M3 / F8_E5M2 without complaint, and
every reader (``tracer info``, ``check``, ``diff``, the viewer) then refused every step file ("stored as
F8_E4M3; float fields are stored as one of BF16, F16, F32, F64"), losing the whole run. Values read back
are the float8 values the loop held, as float32 (torch's own conversion)."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

import tracer
from tracer.cli import main
from tracer.format.integrity import check_step_header, open_step_file
from tracer.read import Trace


def test_float8_logprobs_kept_in_their_dtype_read_back_as_their_values(tmp_path, capsys):
    out = tmp_path / "f8"
    B, T = 4, 6
    torch.manual_seed(0)
    policy = -torch.rand(B, T)
    old = (policy - 0.25).to(torch.float8_e4m3fn)
    ref = (policy + 0.125).to(torch.float8_e5m2)
    with tracer.Tracer(out, algorithm="grpo", keep_source_dtype=True, guard="off",
                       hyperparameters={"num_generations": 2}) as tr:
        tr.record(0, {"completion_ids": torch.randint(0, 50, (B, T)), "completion_mask": torch.ones(B, T, dtype=torch.bool),
                      "policy_logprobs": policy, "old_logprobs": old, "ref_logprobs": ref,
                      "rewards": torch.tensor([1.0, 0.0, 0.5, 0.5]), "advantages": torch.tensor([0.7, -0.7, 0.0, 0.0]),
                      "group_ids": torch.arange(B) // 2})
    (path,) = (out / "steps").glob("*.safetensors")
    with safe_open(str(path), "pt") as f:  # kept as float8 on disk
        assert f.get_slice("old_logprobs").get_dtype() == "F8_E4M3"
        assert f.get_slice("ref_logprobs").get_dtype() == "F8_E5M2"
    with open_step_file(path) as handle:  # the reader's header check: no TraceFormatError
        check_step_header(path, handle, "grpo")
    trace = Trace(out)
    step = trace.load_step(trace.steps()[0])
    assert torch.equal(step["old_logprobs"].float(), old.float())
    assert torch.equal(step["ref_logprobs"].float(), ref.float())
    assert torch.equal(step["policy_logprobs"], policy)
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    text = json.dumps(info)
    assert '"old_logprobs": {"shape": [4, 6], "dtype": "F8_E4M3"}' in text and "not readable" not in text
    # the mean ratio of the step's summary is exp(policy - old) with old as the float8 value, over 24 kept tokens
    assert abs(info["overview"]["columns"]["mean_ratio"]["first"]
               - float(torch.exp(policy - old.float()).mean())) < 1e-6
    assert main(["check", str(out), "--json"]) in (0, 1)
    findings = json.loads(capsys.readouterr().out)
    findings = findings["findings"] if isinstance(findings, dict) else findings
    assert not [f for f in findings if f["check"] == "trace.unreadable"], findings
