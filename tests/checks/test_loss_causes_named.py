"""recompute.loss names the one explanation that reproduces a recorded loss, on real MiniMind-style loops
traced with zero edits (`tracer run`), and says nothing where the explanations cannot be told apart.

tests/scripts/minimind_ppo.py `--loss_form minimind` builds the loss as the real trainer/train_ppo.py
does: one scalar `policy_loss` (masked mean of max(-A*r, -A*clip(r)) + kl_coef * masked mean of k3), no
per-token loss variable, so the check recomputes the per-token loss from the recorded tensors. The bugs
(`--bug flip_kl`, `clip_typo` = `1 + 2.0` typed for `1 + 0.2`, `loss_over_padding` = unmasked means over
B x T) are injected in the script. Every expected value is recomputed here by hand from the recorded
tensors, independently of tracer.formulas.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures.paths import SCRIPTS
from tracer import Trace
from tracer.checks import ERROR, INFO, WARNING, run_checks
from tracer.cli import main as cli_main

KL_COEF, EPS = 0.02, 0.2  # minimind_ppo.py's defaults


def run_minimind_ppo(out: Path, model_dir, *argv: str) -> Path:
    """`tracer run --algo ppo` on the MiniMind-form PPO loop (no early stop, whitened GAE, token-mean
    declared: MiniMind's policy_loss is a masked mean over the minibatch's kept tokens)."""
    code = cli_main(["run", "--algo", "ppo", "--out", str(out), "--meta", "loss_reduction=token_mean", "--",
                     str(SCRIPTS / "minimind_ppo.py"), "--model_dir", str(model_dir), "--target_kl", "1e9",
                     "--whiten_advantages", "--loss_form", "minimind", *argv])
    assert code == 0
    return out


def by_hand(d: dict, kl_sign: float = 1.0, clip_high: float = EPS, kl_coef: float = KL_COEF) -> torch.Tensor:
    """MiniMind's per-token PPO loss [B, T] from one recorded step file, in float64:
    max(-A*r, -A*clip(r, 1 - 0.2, 1 + clip_high)) + sign * kl_coef * (exp(ref - pi) - (ref - pi) - 1)."""
    pi, old, ref = d["policy_logprobs"].double(), d["old_logprobs"].double(), d["ref_logprobs"].double()
    adv, r = d["advantages"].double(), torch.exp(pi - old)
    k3 = torch.exp(ref - pi) - (ref - pi) - 1
    return torch.max(-adv * r, -adv * r.clamp(1 - EPS, 1 + clip_high)) + kl_sign * kl_coef * k3


def token_mean(x: torch.Tensor, keep: torch.Tensor) -> float:
    return float((x * keep).sum() / keep.sum())


def steps(trace_dir: Path):
    trace = Trace(trace_dir)
    for key in trace.steps():
        yield (key.step, key.inner_step, key.micro_batch), trace.load_step(key)


def loss_findings(trace_dir: Path, severity=None):
    return {(f.step, f.inner_step, f.micro_batch): f for f in run_checks(trace_dir)
            if f.check == "recompute.loss" and (severity is None or f.severity == severity)}


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("minimind_ppo")
    return {name: run_minimind_ppo(root / name, model_dir, *argv) for name, argv in (
        ("healthy", ()), ("flip_kl", ("--bug", "flip_kl")), ("flip_kl_small", ("--bug", "flip_kl", "--kl_coef", "0.005")),
        ("clip_typo", ("--bug", "clip_typo")), ("loss_over_padding", ("--bug", "loss_over_padding")))}


def test_healthy_minimind_form_ppo_has_no_loss_finding_and_passes(runs):
    findings = run_checks(runs["healthy"])
    assert [f for f in findings if f.severity in (ERROR, WARNING)] == []
    assert [f for f in findings if f.check == "recompute.loss"] == []  # token-mean declared and reproduced
    for _, d in steps(runs["healthy"]):  # the recorded loss is the scalar form, to float precision
        assert abs(float(d["loss"]) - token_mean(by_hand(d), d["completion_mask"])) < 1e-6
    assert cli_main(["check", str(runs["healthy"])]) == 0


@pytest.mark.parametrize("run, kl_coef", [("flip_kl", KL_COEF), ("flip_kl_small", 0.005)])
def test_flipped_kl_sign_is_named_on_every_step_where_k3_is_not_zero(runs, run, kl_coef):
    errors = loss_findings(runs[run], ERROR)
    within_old_tolerance = 0
    for where, d in steps(runs[run]):
        keep = d["completion_mask"]
        added, subtracted = (token_mean(by_hand(d, sign, kl_coef=kl_coef), keep) for sign in (1.0, -1.0))
        recorded = float(d["loss"])
        assert abs(recorded - subtracted) < 1e-6  # the script's bug, recomputed by hand
        if abs(added - subtracted) < 1e-6:  # k3 = 0 (policy == ref): the sign cannot show, nothing is said
            assert where not in errors
            continue
        f = errors[where]
        assert f.message.startswith(f"KL penalty sign flipped: recorded loss {recorded:.6g} equals the token-mean of "
                                    "the per-token loss with kl_coef * ref_kl_k3 subtracted instead of added")
        assert f.details["kl_sign_flipped"] is True and f.details["explained_residual"] < 1e-6
        # the declared form is off by 2 * kl_coef * masked mean of k3, worked out by hand
        assert abs(abs(recorded - f.details["token_mean"]) - abs(added - subtracted)) < 1e-6
        within_old_tolerance += abs(recorded - added) <= 1e-5 + 1e-3 * abs(added)  # the old pass/fail rule
    assert (0, 0, 0) not in errors and len(errors) >= 10
    if run == "flip_kl_small":  # the user's report: inside loss_rtol 1e-3, yet named by the ranking
        assert within_old_tolerance >= 1
    assert cli_main(["check", str(runs[run])]) == 1


def test_clip_typo_names_the_clip_range_not_the_reduction(runs):
    errors = loss_findings(runs["clip_typo"], ERROR)
    named = set()
    for where, d in steps(runs["clip_typo"]):
        keep = d["completion_mask"].bool()
        recorded = float(d["loss"])
        assert abs(recorded - token_mean(by_hand(d, clip_high=2.0), keep)) < 1e-6  # 1 + 2.0, by hand
        r = torch.exp(d["policy_logprobs"].double() - d["old_logprobs"].double())
        binds = keep & (d["advantages"] > 0) & (r > 1 + EPS)  # tokens the declared 1 + 0.2 would clip
        if not bool(binds.any()):
            assert where not in errors  # the typo changes nothing here
            continue
        named.add(where)
        f = errors[where]
        assert f.message.startswith(f"clip range: recorded loss {recorded:.6g} equals the token-mean of the objective "
                                    "whose upper clip binds on no token: clip_epsilon_high ≥ ")
        assert "not the declared 0.2, which clips" in f.message
        largest = float((r - 1)[keep & (d["advantages"] > 0)].max())  # no ratio reached 3: only a lower bound
        assert largest < 2.0 and f.details["clip_unbound"] is True
        assert abs(f.details["implied_clip_epsilon_high"] - largest) < 1e-6
    assert named and set(errors) == named


def test_loss_over_padding_is_named_on_every_step(runs):
    errors = loss_findings(runs["loss_over_padding"], ERROR)
    lengths_differ = 0
    for where, d in steps(runs["loss_over_padding"]):
        keep = d["completion_mask"].bool()
        B, T = keep.shape
        recorded = float(d["loss"])
        assert abs(recorded - float(by_hand(d).mean())) < 1e-6  # the unmasked mean over B x T, by hand
        lengths_differ += len(set(keep.sum(dim=1).tolist())) > 1
        f = errors[where]
        assert f.message.startswith(f"loss over padding: recorded loss {recorded:.6g} equals the unmasked mean of "
                                    f"the per-token loss recomputed from the recorded inputs over all {B} × {T} "
                                    f"positions, padding included ({int((~keep).sum())} of {B * T} positions are masked")
        assert f.details["cause"] == "unmasked_mean" and f.details["explained_residual"] < 1e-6
    assert len(errors) == 12 and lengths_differ >= 1  # 2 steps x 3 epochs x 2 minibatches


def test_grpo_loss_over_padding_with_a_recorded_per_token_loss_is_named_where_it_differs(model_dir, tmp_path):
    """The hand-written GRPO loop records per_token_loss (as the README's explicit-API skeleton does) and
    takes per_token_loss.mean(): where the unmasked mean equals the sequence mean (step 0's first pass:
    ratio 1 and k3 0, so every row's per-token loss is the constant -A, whose means agree), nothing is said."""
    out = tmp_path / "grpo"
    assert cli_main(["run", "--algo", "grpo", "--out", str(out), "--", str(SCRIPTS / "minimind_grpo.py"),
                     "--model_dir", str(model_dir), "--bug", "loss_over_padding"]) == 0
    findings = loss_findings(out)
    for where, d in steps(out):
        keep, ptl = d["completion_mask"].bool(), d["per_token_loss"].double()
        unmasked = float(ptl.mean())
        sequence_mean = float(((ptl * keep).sum(1) / keep.sum(1)).mean())
        assert abs(float(d["loss"]) - unmasked) < 1e-6
        if abs(unmasked - sequence_mean) < 1e-6:
            assert findings[where].severity == INFO and findings[where].details["matches"] == ["sequence_mean"]
        else:
            assert findings[where].severity == ERROR
            assert findings[where].message.startswith("loss over padding: ")
            assert f"{keep.shape[0]} × {keep.shape[1]} positions" in findings[where].message
    assert sum(f.severity == ERROR for f in findings.values()) >= 2


def test_grpo_clip_typo_that_binds_names_eps_high_2_from_the_recorded_per_token_loss(model_dir, tmp_path):
    """A ratio above 1 + 2.0 pins the typed value: the recorded per_token_loss there is -(3 * A - beta * k3)."""
    out = tmp_path / "grpo"
    assert cli_main(["run", "--algo", "grpo", "--out", str(out), "--", str(SCRIPTS / "minimind_grpo.py"),
                     "--model_dir", str(model_dir), "--bug", "clip_typo"]) == 0
    pinned = set()
    for where, d in steps(out):
        r = torch.exp(d["policy_logprobs"].double() - d["old_logprobs"].double())
        if bool((d["completion_mask"].bool() & (d["advantages"] > 0).unsqueeze(1) & (r > 3.0)).any()):
            pinned.add(where)
    assert pinned, "the run no longer drives a ratio past 3: the typed bound cannot show"
    per_token = {(f.step, f.inner_step, f.micro_batch): f for f in run_checks(out)
                 if f.check == "recompute.per_token_loss" and f.severity == ERROR}
    assert pinned <= set(per_token)
    for where in pinned:
        f = per_token[where]
        assert f.message.startswith("clip range: the recorded per_token_loss follows the clipped surrogate with "
                                    "clip_epsilon_high = 2, not the recorded 0.2 (ratio clipped to [0.8, 3] instead "
                                    "of [0.8, 1.2])")
        assert f.details["implied_clip_epsilon_high"] == 2.0


def test_clip_typo_is_solved_for_from_the_scalar_loss_where_a_ratio_passes_3(model_dir, tmp_path):
    """MiniMind's scalar loss alone, a faster learning rate driving ratios past 1 + 2.0: the loss is
    monotone in eps_high, and the solution is the typed 2 (a bound from below where no ratio passed 3)."""
    out = run_minimind_ppo(tmp_path / "fast", model_dir, "--bug", "clip_typo", "--learning_rate", "0.01")
    errors = loss_findings(out, ERROR)
    pinned = 0
    for where, d in steps(out):
        keep, recorded = d["completion_mask"].bool(), float(d["loss"])
        assert abs(recorded - token_mean(by_hand(d, clip_high=2.0), keep)) < 1e-6
        r = torch.exp(d["policy_logprobs"].double() - d["old_logprobs"].double())
        positive = keep & (d["advantages"] > 0)
        if not bool((positive & (r > 1 + EPS)).any()):
            continue
        f = errors[where]
        if bool((positive & (r > 3.0)).any()):
            pinned += 1
            assert f.message.startswith(f"clip range: recorded loss {recorded:.6g} equals the token-mean of the "
                                        "clipped objective with clip range [0.8, 3] (clip_epsilon_high 2, declared 0.2)")
            assert f.details["implied_clip_epsilon_high"] == 2.0 and f.details["clip_unbound"] is False
        else:
            assert f.details["clip_unbound"] is True
            assert abs(f.details["implied_clip_epsilon_high"] - float((r - 1)[positive].max())) < 1e-6
    assert pinned >= 1, "the run no longer drives a ratio past 3: the typed bound cannot show"


def test_grpo_kl_coefficient_ten_times_the_declared_beta_is_named(model_dir, tmp_path):
    """MiniMind-style GRPO with 0.4 typed for beta 0.04 in its loss (the trace records args.beta = 0.04): the
    per-token loss is linear in the coefficient, so (recorded - loss without KL) / k3 is 0.4 on every token."""
    out = tmp_path / "beta"
    assert cli_main(["run", "--algo", "grpo", "--out", str(out), "--", str(SCRIPTS / "minimind_grpo.py"),
                     "--model_dir", str(model_dir), "--bug", "beta_x10"]) == 0
    named = []
    for where, d in steps(out):
        keep = d["completion_mask"].bool()
        ratio = torch.exp(d["policy_logprobs"].double() - d["old_logprobs"].double())
        adv = d["advantages"].double().unsqueeze(1)
        base = -torch.min(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
        delta = d["ref_logprobs"].double() - d["policy_logprobs"].double()
        k3 = torch.exp(delta) - delta - 1
        usable = keep & (k3 >= 1e-4)
        if int(usable.sum()) >= 3:  # by hand: the recorded loss carries 0.4 * k3
            implied = (d["per_token_loss"].double() - base)[usable] / k3[usable]
            assert float((implied - 0.4).abs().max()) < 4e-3
            named.append(where)
    assert named, "the run no longer moves the policy from the reference: the coefficient cannot show"
    found_ = {(f.step, f.inner_step, f.micro_batch): f for f in run_checks(out)
              if f.check == "recompute.per_token_loss" and f.severity == ERROR}
    for where in named:
        f = found_[where]
        assert f.message.startswith("KL coefficient: the recorded per_token_loss follows the loss with its ref_kl_k3 "
                                    "term weighted by 0.4, not the recorded beta 0.04")
        assert f.details["implied_kl_coef"] == 0.4 and f.details["cause"] == "kl_coef"
