"""Checks over several step files (health trends) run while the run goes on, after 2, 4, 8, ... checked
files, not only at its end: a reference KL that stays past its threshold from the first step is in the
findings file (scope "trace") before the later step files are checked, once per place."""

from __future__ import annotations

import torch

from tracer.format.findings_log import findings_paths, read_lines
from tracer.record.writer import TraceWriter


def test_a_persistent_ref_kl_is_found_after_the_second_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACER_GUARD_SHARE", "1")
    got = []
    # ref - policy = 3 nats at every kept token: k3 = exp(3) - 3 - 1 = 16.09 nats per token, past 2 nats
    policy = torch.full((4, 3), -4.0)
    ref = policy + 3.0
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 2, "beta": 0.04},
                     guard=got.append) as writer:
        for step in range(6):
            writer.record(step, {"policy_logprobs": policy, "old_logprobs": policy, "ref_logprobs": ref,
                                 "completion_mask": torch.ones(4, 3, dtype=torch.bool)})
            writer.flush()
    (path,) = findings_paths(tmp_path / "run")
    lines = list(read_lines(path))
    kinds = [(line["kind"], line.get("check") or line.get("file")) for line in lines]
    at = kinds.index(("finding", "health.ref_kl"))
    checked_before = [k for k in kinds[:at] if k[0] == "checked"]
    assert len(checked_before) == 2  # found by the trace checks' first run, after 2 checked files
    found = [line for line in lines if line["kind"] == "finding" and line["check"] == "health.ref_kl"]
    assert len(found) == 1 and found[0]["scope"] == "trace" and found[0]["severity"] == "warning"
    assert abs(found[0]["details"]["largest"] - (torch.e ** 3 - 3 - 1)) < 1e-3
    assert [f.check for f in got].count("health.ref_kl") == 1
