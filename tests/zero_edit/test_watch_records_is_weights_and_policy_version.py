"""Zero-edit capture of an asynchronous loop: the shipped name map reads ``is_weights``,
``sampler_logprobs``, ``policy_version`` and the correction's settings (``args.is_mode``,
``args.is_clip_max``, ``trainer_version``, ``args.max_policy_lag``) from the frame, so
``sampler.is_weights`` and ``sampler.policy_lag`` run on the capture: a healthy loop passes, one whose
cap is not applied is named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tracer
from tracer import Trace
from tracer.checks import ERROR, INFO, run_checks


def _async_loop(steps: int, capped: bool) -> list[torch.Tensor]:
    """Rows of step s are sampled by the weights after max(0, s - 1) updates; returns the weights used."""
    args = SimpleNamespace(is_correction=True, is_mode="token_truncate", is_clip_max=2.0, max_policy_lag=1)
    weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6))
    optimizer = torch.optim.SGD([weight], lr=3.0)
    history, used = [weight.detach().clone()], []
    for step in range(steps):
        trainer_version = step
        version = max(0, step - 1)
        policy_version = torch.full((4,), version, dtype=torch.int64)
        sampler_logprobs = torch.log_softmax(history[version].expand(4, 6), dim=-1)
        policy_logprobs = torch.log_softmax(weight.expand(4, 6), dim=-1)
        old_logprobs = policy_logprobs.detach()
        completion_mask = torch.ones(4, 6, dtype=torch.bool)
        raw = torch.exp(old_logprobs - sampler_logprobs)
        is_weights = raw.clamp(max=args.is_clip_max) if capped else raw
        adv = torch.linspace(2.0, -2.0, 6).expand(4, 6)  # per token: the update moves mass to the first tokens
        loss = -(torch.exp(policy_logprobs - old_logprobs) * is_weights * adv).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append(weight.detach().clone())
        used.append(is_weights)
        assert trainer_version >= 0 and policy_version.shape == (4,) and args.is_mode
    return used


@pytest.mark.parametrize("capped", [True, False])
def test_capture_records_is_weights_and_lag(tmp_path, capped):
    with tracer.watch(algo="grpo", out=tmp_path / "run"):
        used = _async_loop(steps=3, capped=capped)
    trace = Trace(tmp_path / "run")
    keys = sorted(trace.steps(), key=lambda k: k.step)
    for key, weights in zip(keys, used):
        data, meta = trace.load_step(key), trace.metadata(key)
        assert torch.equal(data["is_weights"], weights)
        assert data["policy_version"].tolist() == [max(0, key.step - 1)] * 4
        assert meta["trainer_version"] == key.step and meta["is_mode"] == "token_truncate"
    findings = run_checks(trace, select=["sampler.is_weights", "sampler.policy_lag"])
    lag = {f.step: f.details["policy_lag"] for f in findings if f.check == "sampler.policy_lag"}
    assert lag == {0: [0] * 4, 1: [1] * 4, 2: [1] * 4}
    weights = [f for f in findings if f.check == "sampler.is_weights"]
    raw_max = max(float(w.max()) for w in used)
    if capped:
        assert [f.severity for f in weights] == [INFO] * 3
    else:
        assert raw_max > 2.0, "the loop must push a ratio past the cap"
        errors = [f for f in weights if f.severity == ERROR]
        assert errors and all(f.message.startswith("is_weights are the raw ratio exp(old − sampler): the "
                                                   "token_truncate cap") for f in errors)
