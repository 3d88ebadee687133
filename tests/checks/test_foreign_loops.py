"""`tracer check` on RL loops written in the styles of trainers tracer did not write
(tests/scripts/foreign/): an OpenRLHF-style PPO with a separate critic and the KL penalty in the
per-token reward, a DAPO-style GRPO (asymmetric clip, token-mean loss, two passes over each rollout
under a loop variable the shipped name map does not list) traced with zero edits, and a GRPO with a k3
KL in the loss and gradient accumulation over micro-batches. Each ran clean except for five false
alarms that a hunt on them found; these tests hold the fixes:

1. kl_coef recorded with the KL in the reward: recompute.per_token_loss added kl_coef * k3 to a loss
   that has none. Now the recorded token_rewards show where the penalty is (or metadata kl_in_reward
   says so), and recompute.token_rewards checks the penalty itself (a flipped sign is named).
2. The shipped map reads clip_epsilon_high from args.epsilon (MiniMind's); a DAPO loop clips at
   args.epsilon_high. The per-token loss check now names the epsilons the loss follows and, for a
   zero-edit trace whose config names them, reports an info instead of an error.
3. A later pass over the rollout numbered as a micro-batch (no inner-step variable found) was checked
   as fresh (identity.first_step errors, identity.micro_batch_position blaming verl's layout). A row
   scored by other weights in an earlier micro-batch of the step now proves an optimizer step between.
4. advantages.zero_variance warned "the step carries no learning signal" for a micro-batch file whose
   one group had equal rewards while the step's other micro-batches had signal: now an info.
5. A k2 KL in the loss (verl's "mse") could not be declared: metadata kl_estimator now says it, and an
   undeclared estimator that explains the loss is named in an info.

Each healthy case asserts no error or warning; each bug case asserts the finding that names it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from tracer import Trace  # noqa: E402
from tracer.checks import ERROR, INFO, WARNING, run_checks  # noqa: E402
from tracer.cli import main as cli_main  # noqa: E402
from tracer.demo.tiny_model import torch_threads  # noqa: E402

from tests.fixtures.paths import SCRIPTS

FOREIGN = SCRIPTS / "foreign"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("foreign_cache")


def _run(script: str, out: Path, cache: Path, **env: str) -> Path:
    """One explicit-API foreign loop in its own process (``python SCRIPT OUT``)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("BUG", "KLR", "OMIT_KLCOEF", "MB", "KL_EST",
                                                                   "KL_EST_META")}
    environ.update({"FOREIGN_CACHE": str(cache), "HF_HUB_OFFLINE": "1", **env})
    done = subprocess.run([sys.executable, str(FOREIGN / script), str(out)], env=environ, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _zero_edit(out: Path, cache: Path, meta: list[str], map_text: str | None = None, bug: str = "",
               script_args: tuple[str, ...] = (), untrained: bool = False) -> Path:
    """grpo_dapo.py traced with zero edits: `tracer run` with the shipped map (plus ``map_text``)."""
    argv = ["run", "--algo", "grpo", "--out", str(out), *[a for m in meta for a in ("--meta", m)]]
    if map_text is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        (out.parent / "map.toml").write_text(map_text)
        argv += ["--map", str(out.parent / "map.toml")]
    old = {k: os.environ.get(k) for k in ("FOREIGN_CACHE", "BUG", "FOREIGN_UNTRAINED")}
    os.environ["FOREIGN_CACHE"] = str(cache)
    os.environ["BUG"] = bug
    os.environ["FOREIGN_UNTRAINED"] = "1" if untrained else ""
    try:
        with torch_threads(1):
            assert cli_main([*argv, "--", str(FOREIGN / "grpo_dapo.py"), *script_args]) == 0
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return out


def _alarms(findings) -> list[str]:
    """Errors and warnings of the correctness checks. The ``health`` family is advice on how far a run
    moves, not a bug class: these loops step Adam at lr 3e-3 .. 1e-2 on a tiny model (about 1000 times a
    real run's rate, so that one update shows) and clip 55-65 % of their tokens' gradients, which
    ``health.clip_fraction`` reports truthfully (its behaviour is pinned in test_health_warnings.py)."""
    return [f"{f.severity} {f.check} (step {f.step}, inner {f.inner_step}, mb {f.micro_batch}): {f.message}"
            for f in findings if f.severity in (ERROR, WARNING) and f.family != "health"]


def _of(findings, check: str, severity: str | None = None) -> list:
    return [f for f in findings if f.check == check and (severity is None or f.severity == severity)]


# -- 1. the KL penalty in the reward (OpenRLHF, InstructGPT, TRL's PPOTrainer) --------------------------


def test_openrlhf_ppo_with_the_kl_in_the_reward_passes_and_says_where_the_penalty_is(tmp_path, cache):
    out = _run("ppo_openrlhf.py", tmp_path / "ppo", cache)  # kl_coef recorded, kl_in_reward not
    trace = Trace(out)
    assert trace.manifest["hyperparameters"]["kl_coef"] == 0.05 and "kl_in_reward" not in trace.manifest["hyperparameters"]
    findings = run_checks(out)
    assert _alarms(findings) == []
    found = _of(findings, "recompute.token_rewards", INFO)
    assert found and all(f.details["kl_in_reward"] for f in found)
    assert "kl_in_reward = true" in found[0].message
    # step 0's files score old == ref (the first rollout), so they cannot show the penalty: the run's later
    # files decide for them (the loss checks raised no error there either)
    assert {f.step for f in found} == {0, 1, 2}


def test_openrlhf_ppo_declared_kl_in_reward_checks_the_penalty_and_names_a_flipped_sign(tmp_path, cache):
    healthy = run_checks(_run("ppo_openrlhf.py", tmp_path / "ok", cache, KLR="1"))
    assert _alarms(healthy) == [] and _of(healthy, "recompute.token_rewards") == []  # declared and right: silent
    flipped = run_checks(_run("ppo_openrlhf.py", tmp_path / "bug", cache, KLR="1", BUG="kl_sign"))
    errors = _of(flipped, "recompute.token_rewards", ERROR)
    assert errors and all(f.details.get("kl_sign_flipped") for f in errors)
    assert "sign flipped" in errors[0].message
    # step 0 scores old == ref (the first rollout): the penalty is 0 there, so nothing to flip
    assert {f.step for f in errors} == {1, 2}


def test_a_flipped_kl_sign_in_the_reward_is_named_without_any_declaration(tmp_path, cache):
    findings = run_checks(_run("ppo_openrlhf.py", tmp_path / "bug", cache, BUG="kl_sign"))
    errors = _of(findings, "recompute.token_rewards", ERROR)
    assert errors and all(f.details.get("kl_sign_flipped") for f in errors)
    # the loss checks follow the run's placement of the penalty: no error of the loss itself
    assert _of(findings, "recompute.per_token_loss", ERROR) == []


def test_a_kl_penalty_in_the_rewards_and_in_the_loss_is_named_as_counted_twice(tmp_path, cache):
    findings = run_checks(_run("ppo_openrlhf.py", tmp_path / "twice", cache, BUG="kl_twice"))
    errors = _of(findings, "recompute.per_token_loss", ERROR)
    assert errors and all(f.details.get("kl_counted_twice") for f in errors)
    assert "counted twice" in errors[0].message


def test_kl_coef_without_any_kl_in_the_rewards_still_expects_it_in_the_loss(tmp_path, cache):
    """The evidence is the token rewards: when they hold the sequence reward alone, the penalty must be in
    the loss, and a loss without it is the error it always was."""
    findings = run_checks(_run("ppo_openrlhf.py", tmp_path / "nokl", cache, BUG="no_reward_kl"))
    errors = _of(findings, "recompute.per_token_loss", ERROR)
    assert errors and {f.step for f in errors} >= {1, 2}


# -- 2 and 3. DAPO traced with zero edits through the shipped map ----------------------------------------


def test_dapo_zero_edit_with_the_shipped_map_passes(tmp_path, cache):
    out = _zero_edit(tmp_path / "dapo", cache, ["loss_reduction=token_mean"])
    trace = Trace(out)
    keys = trace.steps()
    # the pass loop's `it` is not in the map: the second pass is numbered as micro-batch 1
    assert {(k.inner_step, k.micro_batch) for k in keys} == {(0, 0), (0, 1)}
    assert trace.metadata(keys[0])["clip_epsilon_high"] == 0.2  # read from args.epsilon by the shipped map
    findings = run_checks(out)
    assert _alarms(findings) == []
    passes = _of(findings, "identity.first_step", INFO)
    assert {(f.step, f.micro_batch) for f in passes} == {(0, 1), (1, 1), (2, 1)}
    assert all(f.details["updated_since_micro_batches"] == [0] for f in passes)
    assert _of(findings, "identity.micro_batch_position") == []
    clip = _of(findings, "recompute.per_token_loss", INFO)
    assert clip and all(f.details["implied_clip_epsilon_high"] == 0.28 for f in clip)
    assert "config epsilon_high" in clip[0].message


def test_dapo_with_its_epsilons_mapped_is_silent_and_a_symmetric_clip_is_an_explained_error(tmp_path, cache):
    mapped = "[indices]\ninner_step = [\"it\"]\n[metadata]\nclip_epsilon_high = [\"args.epsilon_high\"]\n"
    ok = run_checks(_zero_edit(tmp_path / "ok" / "t", cache, ["loss_reduction=token_mean"], mapped))
    assert _alarms(ok) == [] and _of(ok, "recompute.per_token_loss") == []
    assert _of(ok, "identity.first_step") == []  # the passes are inner steps now
    bad = run_checks(_zero_edit(tmp_path / "bug" / "t", cache, ["loss_reduction=token_mean"], mapped, bug="sym_clip"))
    errors = _of(bad, "recompute.per_token_loss", ERROR)
    assert errors and errors[0].details["implied_clip_epsilon_high"] == 0.2
    assert "clip_epsilon_high = 0.2 (config epsilon), not the recorded 0.28" in errors[0].message


# -- 4 and 5. GRPO with gradient accumulation ------------------------------------------------------------


@pytest.mark.parametrize("rows", [2, 4, 16])
def test_grpo_accumulation_passes_at_every_micro_batch_size(tmp_path, cache, rows):
    """2 rows a micro-batch: identical rows (same prompt, same completion) fall in several micro-batches
    and are scored alike by the same weights, which is no later pass. 4 rows: one group a file, one of
    them with equal rewards, while the step's other groups carry signal."""
    out = _run("grpo_accum.py", tmp_path / "accum", cache, MB=str(rows))
    findings = run_checks(out)
    assert _alarms(findings) == []
    assert _of(findings, "identity.first_step", INFO) == []
    if rows == 2:  # the case tests something only if a row repeats in another micro-batch of its pass
        trace = Trace(out)
        repeats = False
        for step in {k.step for k in trace.steps()}:
            seen: set = set()
            for key in [k for k in trace.steps() if (k.step, k.inner_step) == (step, 0)]:
                data = trace.load_step(key, ["prompt_ids", "completion_ids"])
                rows_here = {tuple(p + c) for p, c in zip(data["prompt_ids"].tolist(), data["completion_ids"].tolist())}
                repeats |= bool(rows_here & seen)
                seen |= rows_here
        assert repeats
        return
    zero = _of(findings, "advantages.zero_variance", INFO)
    assert zero  # the run has a group of equal rewards (else the case tests nothing)
    if rows == 4:
        assert all("step_zero_variance_share" in f.details and f.details["step_zero_variance_share"] < 1 for f in zero)


def test_a_k2_kl_in_the_loss_is_named_when_undeclared_and_checked_when_declared(tmp_path, cache):
    undeclared = run_checks(_run("grpo_accum.py", tmp_path / "k2", cache, KL_EST="k2", MB="8"))
    assert _alarms(undeclared) == []
    named = _of(undeclared, "recompute.per_token_loss", INFO)
    assert named and all(f.details["kl_estimator"] == "k2" for f in named)
    declared = run_checks(_run("grpo_accum.py", tmp_path / "k2m", cache, KL_EST="k2", KL_EST_META="k2", MB="8"))
    assert _alarms(declared) == [] and _of(declared, "recompute.per_token_loss") == []
    # declared k2 while the loop uses k3: the error names the estimator the loss follows
    wrong = run_checks(_run("grpo_accum.py", tmp_path / "k3m", cache, KL_EST_META="k2", MB="8"))
    errors = _of(wrong, "recompute.per_token_loss", ERROR)
    assert errors and errors[0].details["kl_estimator_matched"] == "k3"


# -- the classic off-by-one: logits[:, L:] gathered at the completion ids ---------------------------------


def _repeats(trace: Trace) -> int:
    """Kept positions where a completion token repeats the one before it (where the bug shows)."""
    total = 0
    for key in trace.steps():
        data = trace.load_step(key, ["completion_ids", "completion_mask"])
        ids, keep = data["completion_ids"], data["completion_mask"].bool()
        total += int(((ids[:, 1:] == ids[:, :-1]) & keep[:, 1:] & keep[:, :-1]).sum())
    return total


def test_logits_read_one_position_late_are_named_where_tokens_repeat(tmp_path, cache):
    """Each token scored with the next position's distribution fits no shift of whole rows (the README's
    classic bug used to show only as a sampler mismatch), but where a token repeats its neighbour the
    recorded logprob equals the sampler's for the next token. An untrained model repeats tokens often."""
    mapped = ("[fields]\nsampler_logprobs = [\"sampling_logps\"]\n[indices]\ninner_step = [\"it\"]\n"
              "[metadata]\nclip_epsilon_high = [\"args.epsilon_high\"]\n")
    args = ("--max_new", "12")
    healthy = _zero_edit(tmp_path / "ok" / "t", cache, ["loss_reduction=token_mean"], mapped, script_args=args,
                         untrained=True)
    assert _repeats(Trace(healthy)) > 0  # else the healthy case tests nothing
    found = run_checks(healthy)
    assert _alarms(found) == [] and _of(found, "alignment.logprob_shift") == []
    buggy = _zero_edit(tmp_path / "bug" / "t", cache, ["loss_reduction=token_mean"], mapped, bug="shift",
                       script_args=args, untrained=True)
    assert _repeats(Trace(buggy)) > 0
    errors = _of(run_checks(buggy), "alignment.logprob_shift", ERROR)
    assert errors and all(f.details["distribution_shift"] == 1 and f.details["mae_repeats_shifted"] < 1e-5
                          for f in errors)
    assert "logits[:, L-1:-1]" in errors[0].message and "logits[:, L:]" in errors[0].message


# -- a reference model that moves with the policy ----------------------------------------------------------


@pytest.mark.parametrize(("script", "bug"), [("ppo_openrlhf.py", "ref_is_actor"), ("grpo_accum.py", "ref_sync")])
def test_a_reference_that_moves_with_the_policy_is_named(tmp_path, cache, script, bug):
    """`ref = actor` (no copy) or the policy's weights loaded into the reference after each step: ref ==
    old at every rollout after the first, so the KL penalty is 0 throughout. Before: PASS."""
    findings = run_checks(_run(script, tmp_path / "t", cache, BUG=bug, MB="8"))
    warned = _of(findings, "kl.ref_tracks_policy", WARNING)
    assert len(warned) == 1 and warned[0].details["steps"] == [1, 2]
    if script == "ppo_openrlhf.py":  # the loss has no KL term and the token rewards cannot show one
        errors = _of(findings, "recompute.per_token_loss", ERROR)
        assert errors and all(f.details.get("matches_without_kl") for f in errors)
        assert not any(f.details.get("kl_sign_flipped") for f in errors)
