"""The health family warns on a run that is healthy but drifting, once per quantity, with the value,
the threshold and the steps: a real MiniMind-style GRPO loop run at a learning rate 30x its default
with 4 inner steps (the ref KL and the clip fraction run away; values recomputed here from the
recorded tensors), hand-written step files for entropy collapse, the sampler gap and flat rewards
(values worked out by hand). No warning on the healthy sample_traces/ at the default thresholds;
warnings leave the exit code at 0 unless --fail-on warning; --threshold moves the line."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from tracer import Trace  # noqa: E402
from tracer.checks import WARNING, CheckOptions, run_checks  # noqa: E402
from tracer.cli import main as cli_main  # noqa: E402
from tracer.demo.tiny_model import torch_threads  # noqa: E402
from tracer.errors import TraceError  # noqa: E402

from tests.fixtures.check_traces import write_trace  # noqa: E402
from tests.fixtures.paths import REPO, SCRIPTS  # noqa: E402

HEALTH = ("health.ref_kl", "health.clip_fraction", "health.sampler_gap", "health.entropy_collapse",
          "health.reward_flat")


def _health(findings):
    return {f.check: f for f in findings if f.check.startswith("health.")}


@pytest.fixture(scope="module")
def diverging(tmp_path_factory, model_dir):
    """minimind_grpo.py at learning rate 3e-2 (default 1e-3) with 4 inner steps per rollout, 4 steps."""
    out = tmp_path_factory.mktemp("diverging") / "trace"
    with torch_threads(1):
        code = cli_main(["run", "--algo", "grpo", "--out", str(out), "--meta", "loss_reduction=sequence_mean", "--",
                         str(SCRIPTS / "minimind_grpo.py"), "--model_dir", str(model_dir), "--learning_rate", "3e-2",
                         "--num_iterations", "4", "--steps", "4"])
    assert code == 0
    return out


def _by_hand(trace: Trace):
    """Per step file: mean k3 = exp(ref - policy) - (ref - policy) - 1 over kept tokens, and (inner step > 0)
    the share of kept tokens whose gradient the clip removes: exp(policy - old) > 1 + eps_high with A > 0,
    or < 1 - eps_low with A < 0."""
    kl, clip = {}, {}
    for key in trace.steps():
        data, meta = trace.load_step(key, derive=False), trace.metadata(key)
        keep = data["completion_mask"].bool()
        d = (data["ref_logprobs"].double() - data["policy_logprobs"].double())[keep]
        kl[key] = float((d.exp() - d - 1).mean())
        if key.inner_step > 0:
            r = (data["policy_logprobs"].double() - data["old_logprobs"].double()).exp()
            A = data["advantages"].double()[:, None].expand_as(r)
            out = ((r < 1 - meta["clip_epsilon_low"]) & (A < 0)) | ((r > 1 + meta["clip_epsilon_high"]) & (A > 0))
            clip[key] = float(out[keep].double().mean())
    return kl, clip


def test_a_diverging_grpo_run_warns_once_for_its_ref_kl_and_once_for_its_clip_fraction(diverging, capsys):
    trace = Trace(diverging)
    kl, clip = _by_hand(trace)
    findings = run_checks(diverging)
    health = _health(findings)
    assert set(health) == {"health.ref_kl", "health.clip_fraction"}
    assert sum(f.check.startswith("health.") for f in findings) == 2  # one finding per quantity, not per step
    ref_kl = health["health.ref_kl"]
    assert ref_kl.severity == WARNING
    assert ref_kl.details["steps"] == sorted({k.step for k, v in kl.items() if v > 2.0})
    assert ref_kl.details["largest"] == pytest.approx(max(kl.values()), rel=1e-5)
    assert ref_kl.message.startswith("mean ref KL (k3, over kept tokens) above the threshold 2 nats (--threshold "
                                     "ref_kl=...) at steps ")
    assert f"{max(kl.values()):.4g} nats at its largest" in ref_kl.message and "(beta 0.04)" in ref_kl.message
    clipped = health["health.clip_fraction"]
    assert clipped.details["steps"] == sorted({k.step for k, v in clip.items() if v > 0.5})
    assert clipped.details["largest"] == pytest.approx(max(clip.values()))
    assert clipped.details["steps"]  # the run really clips most of some pass's tokens (0.59 at step 1 here)
    assert "above the threshold 50% (--threshold clip_fraction=...)" in clipped.message
    assert "clip_epsilon_low 0.2, clip_epsilon_high 0.2" in clipped.message
    capsys.readouterr()
    assert cli_main(["check", str(diverging)]) == 0  # warnings alone: exit 0
    assert cli_main(["check", str(diverging), "--fail-on", "warning"]) == 1
    assert cli_main(["check", str(diverging), "--threshold", f"ref_kl={max(kl.values()) + 1}",
                     "--threshold", "clip_fraction=1", "--json"]) == 0
    assert "health." not in capsys.readouterr().out.split("\n[", 1)[-1]


def test_the_healthy_sample_traces_get_no_health_warning():
    roots = sorted(p for p in (REPO / "sample_traces").iterdir() if (p / "manifest.json").exists())
    assert len(roots) >= 8
    for root in roots:
        assert _health(run_checks(root, select=["health"])) == {}, root.name


def _step(entropy: float, sampler_shift: float, rewards: list[float]):
    """A GRPO step file of 4 rows (2 groups of 2) x 3 kept tokens: policy = old = -1, sampler = old -
    ``sampler_shift``, entropy ``entropy`` on every token."""
    B, T = 4, 3
    old = torch.full((B, T), -1.0)
    return {"completion_ids": torch.full((B, T), 5), "completion_mask": torch.ones(B, T, dtype=torch.bool),
            "policy_logprobs": old.clone(), "old_logprobs": old, "sampler_logprobs": old - sampler_shift,
            "entropy": torch.full((B, T), entropy), "rewards": torch.tensor(rewards, dtype=torch.float32),
            "advantages": torch.zeros(B), "group_ids": torch.tensor([0, 0, 1, 1])}


def test_entropy_collapse_sampler_gap_and_flat_rewards_are_one_warning_each(tmp_path):
    # entropy 2.0 -> 1.0 -> 0.1 -> 0.04 nats: under 10% of 2.0 (= 0.2) at steps 2 and 3;
    # mean |old - sampler| 0.01, 0.2, 0.3, 0.3 nats: above 0.1 at steps 1..3;
    # rewards: both groups flat at steps 2 and 3 (share 1.0), one group flat at steps 0 and 1 (0.5)
    steps = [(0, 0, _step(2.0, 0.01, [1, 0, 1, 1])), (1, 0, _step(1.0, 0.2, [1, 0, 1, 1])),
             (2, 0, _step(0.1, 0.3, [1, 1, 0, 0])), (3, 0, _step(0.04, 0.3, [1, 1, 0, 0]))]
    root = write_trace(tmp_path / "t", "grpo", steps, {"num_generations": 2})
    health = _health(run_checks(root, select=["health"]))
    assert set(health) == {"health.entropy_collapse", "health.sampler_gap", "health.reward_flat"}
    entropy = health["health.entropy_collapse"]
    assert entropy.details["steps"] == [2, 3] and entropy.details["threshold"] == pytest.approx(0.2)
    assert entropy.message.startswith("mean token entropy fell from 2 nats (step 0) to 0.04 nats (step 3), under "
                                      "0.2 nats at steps 2, 3 (2 of 4 updates)")
    gap = health["health.sampler_gap"]
    assert gap.details["steps"] == [1, 2, 3] and gap.details["largest"] == pytest.approx(0.3, abs=1e-6)
    assert gap.message.startswith("mean |old − sampler| over kept tokens above the threshold 0.1 nats "
                                  "(--threshold sampler_gap=...) at steps 1..3 (3 of 4 updates): 0.3 nats")
    flat = health["health.reward_flat"]
    assert flat.details["steps"] == [2, 3] and flat.details["largest"] == 1.0
    # the floor (0.05 nats) decides when it is the larger line: drop 0.99 puts 1% of 2.0 = 0.02 under it
    options = CheckOptions().with_thresholds({"entropy_drop": 0.99, "sampler_gap": 0.5, "reward_flat": 0.5})
    health = _health(run_checks(root, select=["health"], options=options))
    assert health["health.entropy_collapse"].details["steps"] == [3]  # 0.04 < 0.05; 0.1 is not
    assert "health.sampler_gap" not in health
    assert health["health.reward_flat"].details["steps"] == [0, 1, 2, 3]


def test_unknown_or_out_of_range_thresholds_are_refused(tmp_path, capsys):
    with pytest.raises(TraceError, match="unknown threshold 'kl'; known: ref_kl"):
        CheckOptions().with_thresholds({"kl": 1.0})
    with pytest.raises(TraceError, match="clip_fraction = 2 is out of range: a share in"):
        CheckOptions().with_thresholds({"clip_fraction": 2})
    root = write_trace(tmp_path / "t", "grpo", [(0, 0, _step(1.0, 0.0, [1, 0, 1, 0]))], {"num_generations": 2})
    assert cli_main(["check", str(root), "--threshold", "ref_kl"]) == 2
    assert "expected NAME=VALUE with a number, e.g. --threshold ref_kl=2.0" in capsys.readouterr().err
    assert "ref_kl (mean k3 nats per kept token, default 2)" in " ".join(_check_help().split())


def _check_help() -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli_main(["check", "--help"])
    return out.getvalue()
