"""identity.first_step names a training forward that leaves out the sampling temperature (found by an
adversarial review: it used to blame "other weights"). The MiniMind-style GRPO loop samples and scores old
at temperature 0.7, and with ``--bug no_temp_train`` scores the policy at 1.0: on confident tokens
log(1 - p_old) = (T_policy / T_old) log(1 - p_policy), a factor above 1 (1 / 0.7 for a dominant runner-up).
The loop runs with zero edits under `tracer run`; the factor is recomputed here by hand."""

from __future__ import annotations

import math

import torch

from tracer import Trace
from tracer.checks import ERROR, run_checks
from tracer.cli import main as cli_main

from tests.fixtures.paths import SCRIPTS


def rma_slope(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Reduced major axis slope of y on x and their correlation, by hand."""
    xc, yc = x - x.mean(), y - y.mean()
    sxx, syy, sxy = float((xc * xc).sum()), float((yc * yc).sum()), float((xc * yc).sum())
    corr = sxy / math.sqrt(sxx * syy)
    return math.copysign(math.sqrt(syy / sxx), corr), corr


def test_a_policy_forward_without_the_sampling_temperature_is_named(model_dir, tmp_path):
    out = tmp_path / "no_temp"
    assert cli_main(["run", "--algo", "grpo", "--out", str(out), "--", str(SCRIPTS / "minimind_grpo.py"),
                     "--model_dir", str(model_dir), "--bug", "no_temp_train", "--temperature", "0.7"]) == 0
    trace = Trace(out)
    first = {f.step: f for f in run_checks(out, select=["identity.first_step"]) if f.severity == ERROR}
    named = {s: f for s, f in first.items() if "old and policy follow one model at two temperatures" in f.message}
    assert named, [f.message[-300:] for f in first.values()]
    for step, f in named.items():
        d = trace.load_step(next(k for k in trace.steps() if k.step == step and k.inner_step == 0))
        keep = d["completion_mask"].bool()
        policy, old = d["policy_logprobs"].double()[keep], d["old_logprobs"].double()[keep]
        confident = (policy > -math.log(2)) & (old > -math.log(2)) & (policy < -1e-5) & (old < -1e-5)
        slope, corr = rma_slope(torch.log(-torch.expm1(policy[confident])), torch.log(-torch.expm1(old[confident])))
        assert corr >= 0.98 and slope > 1.2  # the policy at the higher temperature: T_policy / T_old > 1
        assert f"log(1 − p_old) ≈ {slope:.3f} × log(1 − p_policy)" in f.message
        assert "says the policy forward leaves the temperature out" in f.message
