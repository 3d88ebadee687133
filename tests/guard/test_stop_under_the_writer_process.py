"""guard="stop" under the writer process: the checks run in the writer process, the error travels
back through its result pipe, and the next record of the training process raises GuardStop with the
step files written so far flushed and the manifest's guard entry saying why."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import tracer
from tracer.format.findings_log import findings_paths, read_lines
from tracer.read import Trace


def test_a_nan_logprob_stops_the_loop_through_the_writer_process(tmp_path):
    g = torch.Generator().manual_seed(0)
    recorded = []
    with pytest.raises(tracer.GuardStop) as raised, tracer.Tracer(
            tmp_path / "run", "grpo", hyperparameters={"num_generations": 2}, guard="stop", writer="process") as writer:
        for step in range(400):
            policy = -torch.rand(4, 3, generator=g) - 0.1
            if step == 0:
                policy[1, 2] = math.nan  # a kept token's logprob: an error at step 0, seq 1, token 2
            writer.record(step, {"policy_logprobs": policy, "old_logprobs": policy.clone(),
                                 "completion_mask": torch.ones(4, 3, dtype=torch.bool)})
            recorded.append(step)
            writer.flush()  # the step is in the writer process's hands before the next one
    f = raised.value.finding
    assert (f.severity, f.step, f.sequence, f.token) == ("error", 0, 1, 2)
    assert writer.writer == "process"
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    stopped_at = manifest["guard"]["stopped_at"]["step"]
    assert manifest["guard"]["mode"] == "stop" and manifest["guard"]["finding"] == f.to_dict()
    assert stopped_at == recorded[-1] + 1 < 400  # the refused record is the one after the last taken
    assert [k.step for k in Trace(tmp_path / "run").steps()] == recorded
    (path,) = findings_paths(tmp_path / "run")
    lines = list(read_lines(path))
    (guard_line,) = [line for line in lines if line["kind"] == "guard"]
    assert guard_line["pid"] != os.getpid()  # checked in the writer process
    errors = [line for line in lines if line["kind"] == "finding" and line["severity"] == "error"]
    assert errors[0]["check"] == f.check  # the first error the checks wrote stops the run
    assert "nonfinite.values" in {line["check"] for line in errors}
