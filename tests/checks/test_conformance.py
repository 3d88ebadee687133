"""Conformance: `tracer check` on runs shaped like trainers we did not write. Each false-alarm class
has a healthy input that must pass, and its broken twin that must fail at the right place.

The PPO cases run tests/scripts/minimind_ppo.py (MiniMind's train_ppo.py in the seed's names) through
`tracer run`, unmodified apart from its own flags: `--whiten_advantages` (the real MiniMind whitens
GAE over the rollout's kept tokens), `--ignore_warnings` (MiniMind silences all warnings) and `--bug`
(a known bug injected). The other cases write real step files whose values are computed here by hand.
"""

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch

from tracer import Trace, formulas
from tracer.checks import ERROR, INFO, SKIPPED, WARNING, run_checks
from tracer.cli import main as cli_main

from tests.fixtures.check_traces import EOS, PAD, found, write_trace
from tests.fixtures.paths import SCRIPTS


def run_ppo(out: Path, model_dir, *argv: str, meta: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> Path:
    """`tracer run --algo ppo` on the MiniMind-style PPO script (no early stop, token-mean loss)."""
    meta_args = [a for m in ("loss_reduction=token_mean", *meta) for a in ("--meta", m)]
    code = cli_main(["run", "--algo", "ppo", "--out", str(out), *meta_args, *extra, "--",
                     str(SCRIPTS / "minimind_ppo.py"), "--model_dir", str(model_dir), "--target_kl", "1e9", *argv])
    assert code == 0
    return out


def errors_and_warnings(findings):
    return [f"{f.check}: {f.message}" for f in findings if f.severity in (ERROR, WARNING)]


# -- PPO with whitened GAE (MiniMind, OpenRLHF, verl) -------------------------------------------------


@pytest.fixture(scope="module")
def whitened_ppo(model_dir, tmp_path_factory):
    return run_ppo(tmp_path_factory.mktemp("ppo") / "whitened", model_dir, "--whiten_advantages")


def test_whitened_gae_passes_and_the_rule_is_named(whitened_ppo):
    findings = run_checks(whitened_ppo)
    assert errors_and_warnings(findings) == []
    infos = found(findings, "recompute.advantages", INFO)
    assert infos and all(f.details["rule"] == "gae_whitened" for f in infos)
    # The scale a of recorded = a * raw + b is 1 / sqrt(var + 1e-8) of the rollout's kept raw GAE (MiniMind
    # uses the population variance). Rebuild the rollout of step 0 from the rows of its first epoch.
    trace = Trace(whitened_ppo)
    keys = [k for k in trace.steps() if k.step == 0 and k.inner_step == 0]
    raw = []
    for key in keys:
        d = trace.load_step(key)
        keep = d["completion_mask"].bool()
        adv, _ = formulas.gae(d["token_rewards"], d["values"], keep, 1.0, 0.95)
        raw.append(adv.double()[keep])
    raw = torch.cat(raw)  # every kept token of the rollout, once
    var = ((raw - raw.mean()) ** 2).mean()
    expected_scale = float(1 / torch.sqrt(var + 1e-8))
    step0 = [f for f in infos if f.step == 0 and f.inner_step == 0]
    assert step0 and all(math.isclose(f.details["scale"], expected_scale, rel_tol=1e-4) for f in step0)
    assert cli_main(["check", str(whitened_ppo)]) == 0


def test_declaring_the_whitened_rule_silences_the_info(model_dir, tmp_path):
    out = run_ppo(tmp_path / "declared", model_dir, "--whiten_advantages", meta=("advantage_rule=gae_whitened",))
    findings = run_checks(out)
    assert errors_and_warnings(findings) == []
    assert found(findings, "recompute.advantages") == []


def test_whitened_advantages_declared_as_raw_gae_are_an_error(model_dir, tmp_path):
    out = run_ppo(tmp_path / "declared_raw", model_dir, "--whiten_advantages", meta=("advantage_rule=gae",))
    (first, *_) = found(run_checks(out), "recompute.advantages", ERROR)
    assert first.message.startswith("the values follow the 'gae_whitened' rule instead of the declared 'gae'. "
                                    "recorded advantages differs from tracer.formulas.gae (gamma 1, lam 0.95)")


def test_whitened_gae_with_another_gamma_than_declared_is_an_error(model_dir, tmp_path):
    # the script discounts with gamma 1.0; the run declares 0.9 (as if the config and the code disagreed)
    out = run_ppo(tmp_path / "gamma", model_dir, "--whiten_advantages",
                  meta=("advantage_rule=gae_whitened", "gamma=0.9"))
    bad = found(run_checks(out), "recompute.advantages", ERROR)
    assert bad and "no affine image a * raw + b (a > 0) of the GAE recomputed with tracer.formulas.gae " \
                   "(gamma 0.9, lam 0.95)" in bad[0].message


def test_verl_style_whitening_leaves_one_constant_on_masked_slots(tmp_path):
    """verl's masked_whiten: Bessel's variance, masked slots not zeroed afterwards (-mean * rsqrt(var + eps))."""
    B, T = 4, 5
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(B, T, generator=g) * keep
    rewards = torch.tensor([1.0, -0.5, 0.25, 2.0])
    token_rewards = formulas.token_rewards_from_sequence(rewards, keep)
    raw, returns = formulas.gae(token_rewards, values, keep, 1.0, 0.95)
    n = int(keep.sum())
    mean = raw[keep].double().mean()
    var = ((raw[keep].double() - mean) ** 2).sum() / (n - 1)  # Bessel, as verl's masked_var(unbiased=True)
    whitened = ((raw.double() - mean) * torch.rsqrt(var + 1e-8)).float()  # (B, T), masked slots not zeroed
    ids = torch.randint(3, 60, (B, T), generator=g).masked_fill(~keep, PAD)
    step = {"completion_ids": ids, "completion_mask": keep, "policy_logprobs": -torch.rand(B, T, generator=g) - 0.1,
            "values": values, "returns": returns, "token_rewards": token_rewards, "advantages": whitened,
            "rewards": rewards}
    step["old_logprobs"] = step["policy_logprobs"].clone()
    findings = run_checks(write_trace(tmp_path / "verl", "ppo", [(0, 0, step)], {"gamma": 1.0, "lam": 0.95}))
    assert errors_and_warnings(findings) == []
    (masked,) = found(findings, "advantages.masked_positions")
    assert masked.severity == INFO and f"carry the same advantage {float(-mean * torch.rsqrt(var + 1e-8)):.4g}" \
        in masked.message
    assert found(findings, "recompute.advantages", INFO)[0].details["rule"] == "gae_whitened"


# -- PPO loss side ------------------------------------------------------------------------------------


def test_flipped_kl_sign_in_the_ppo_loss_is_an_error(model_dir, tmp_path, whitened_ppo):
    healthy = found(run_checks(whitened_ppo), "recompute.per_token_loss")
    assert healthy == []  # ran on the healthy run (the script records per_token_loss) and agreed
    out = run_ppo(tmp_path / "flip", model_dir, "--whiten_advantages", "--bug", "flip_kl")
    findings = run_checks(out)
    (first, *_) = found(findings, "recompute.per_token_loss", ERROR)
    assert first.message.startswith("The recorded values match the loss with the KL term's sign flipped "
                                    "(kl_coef * ref_kl_k3 subtracted from the loss instead of added)")
    # the first minibatch has policy == ref (k3 = 0, the sign does not show); the second one is named
    assert (first.step, first.inner_step, first.micro_batch) == (0, 0, 1) and first.sequence is not None
    assert cli_main(["check", str(out)]) == 1


def test_flipped_kl_sign_without_a_per_token_loss_is_caught_on_the_loss(tmp_path):
    """Only the scalar loss recorded (MiniMind's policy_loss): the recomputed PPO loss disagrees."""
    B, T = 2, 4
    keep = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -0.5, -2.0, -0.1], [-0.3, -1.2, -0.7, -0.9]])
    policy = old + torch.tensor([[0.1, -0.05, 0.02, 0.0], [0.0, 0.03, -0.08, 0.04]])
    ref = old - 0.2
    advantages = torch.tensor([[0.5, -0.3, 1.0, 0.0], [-1.0, 0.2, 0.4, -0.6]])
    ratio = torch.exp(policy - old)
    pg = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    k3 = torch.exp(ref - policy) - (ref - policy) - 1
    loss = ((pg - 0.1 * k3) * keep).sum() / keep.sum()  # bug: the penalty subtracted
    step = {"completion_ids": torch.full((B, T), 5), "completion_mask": keep, "policy_logprobs": policy,
            "old_logprobs": old, "ref_logprobs": ref, "advantages": advantages, "loss": loss}
    hyper = {"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "kl_coef": 0.1, "loss_reduction": "token_mean"}
    (f,) = found(run_checks(write_trace(tmp_path / "bad", "ppo", [(0, 1, step)], hyper)), "recompute.loss")
    assert f.severity == ERROR and f.details["kl_sign_flipped"] is True
    step["loss"] = ((pg + 0.1 * k3) * keep).sum() / keep.sum()  # healthy twin
    assert found(run_checks(write_trace(tmp_path / "good", "ppo", [(0, 1, step)], hyper)), "recompute.loss") == []


def test_old_recomputed_from_the_updated_actor_is_caught(model_dir, tmp_path, whitened_ppo):
    assert found(run_checks(whitened_ppo), "identity.old_aliases_policy") == []
    out = run_ppo(tmp_path / "stale", model_dir, "--whiten_advantages", "--bug", "recompute_old")
    bad = found(run_checks(out), "identity.old_aliases_policy", ERROR)
    # epoch 1 minibatch 0 of every step: old was recomputed from the actor the epoch-0 updates produced
    assert {(f.step, f.inner_step, f.micro_batch) for f in bad} >= {(0, 1, 0), (1, 1, 0)}
    assert all(0 < f.details["max_abs_gap"] <= 1e-5 or f.details["max_abs_gap"] == 0 for f in bad)


# -- the tracer is never silent --------------------------------------------------------------------------


def test_a_script_that_ignores_warnings_still_gets_the_summary(model_dir, tmp_path, capsys):
    bad_map = tmp_path / "map.toml"
    bad_map.write_text('[fields]\nentropy = ["resp_policy_mask"]\n')  # a bool mask is no entropy: rejected
    out = run_ppo(tmp_path / "quiet", model_dir, "--ignore_warnings", extra=("--map", str(bad_map)))
    err = capsys.readouterr().err
    assert "tracer: traced 12 step file(s) into" in err  # 2 steps x 3 epochs x 2 minibatches
    assert "tracer: fields mapped: " in err and "policy_logprobs <- mb_resp_logp" in err
    assert "tracer: not recorded: entropy <- `resp_policy_mask`" in err
    report = json.loads((out / "manifest.json").read_text())["capture_report"]
    assert report["steps_recorded"] == 12 and report["backward_calls"] == 12
    assert report["fields_mapped"]["advantages"] == "advantages[inds]"
    assert any(e.startswith("entropy <- `resp_policy_mask`") for e in report["map_entries_unused"])
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli_main(["info", str(out)]) == 0
    assert "capture: 12 step file(s) from 12 backward call(s)" in printed.getvalue()
    assert "not recorded: entropy <- `resp_policy_mask`" in printed.getvalue()


# -- DPO with a chat template: an EOS-like token inside the prompt -------------------------------------------


def dpo_pair_step(keep_padding: bool) -> dict:
    """One pair, prompt + answer concatenated (MiniMind train_dpo.py): the user turn ends with EOS
    (``<|im_end|>``) at position 2, the answer starts at 5 and ends with its own EOS at 7."""
    chosen = torch.tensor([[11, 12, EOS, 13, 14, 21, 22, EOS, PAD, PAD]])
    rejected = torch.tensor([[11, 12, EOS, 13, 14, 31, EOS, PAD, PAD, PAD]])
    chosen_mask = torch.zeros(1, 10, dtype=torch.bool)
    chosen_mask[0, 5:8] = True
    rejected_mask = torch.zeros(1, 10, dtype=torch.bool)
    rejected_mask[0, 5:7] = True
    if keep_padding:  # bug: the mask keeps the answer and everything after it
        chosen_mask[0, 5:] = True
    lp = -0.5 * torch.ones(1, 10)
    return {"chosen_ids": chosen, "rejected_ids": rejected, "chosen_mask": chosen_mask,
            "rejected_mask": rejected_mask, "chosen_policy_logprobs": lp, "rejected_policy_logprobs": lp,
            "chosen_ref_logprobs": lp, "rejected_ref_logprobs": lp}


def test_dpo_prompt_eos_is_not_the_answer_s_end(tmp_path):
    findings = run_checks(write_trace(tmp_path / "good", "dpo", [(0, 0, dpo_pair_step(False))], {"beta": 0.1}))
    assert found(findings, "masks.after_eos") == [] and errors_and_warnings(findings) == []
    bad = run_checks(write_trace(tmp_path / "bad", "dpo", [(0, 0, dpo_pair_step(True))], {"beta": 0.1}))
    (f,) = found(bad, "masks.after_eos")
    # the answer's EOS is at 7; the first kept token after it is 8 (the EOS at 2 is the prompt's)
    assert (f.severity, f.sequence, f.token, f.field) == (ERROR, 0, 8, "chosen_mask")
    assert "after its first EOS (id 2) at token 7" in f.message


# -- sharper invariants ----------------------------------------------------------------------------------


def grpo_step(policy: torch.Tensor, old: torch.Tensor, keep: torch.Tensor | None = None) -> dict:
    B, T = policy.shape
    return {"completion_ids": torch.full((B, T), 5), "policy_logprobs": policy, "old_logprobs": old,
            "completion_mask": torch.ones(B, T, dtype=torch.bool) if keep is None else keep,
            "rewards": torch.zeros(B), "advantages": torch.zeros(B)}


def test_logprob_window_shifted_by_one_is_named_at_the_first_step(tmp_path):
    g = torch.Generator().manual_seed(1)
    full = -torch.rand(4, 9, generator=g) * 3  # logprobs of tokens 0..8
    old, policy = full[:, :-1].clone(), full[:, 1:].clone()  # policy read one position late
    (f,) = found(run_checks(write_trace(tmp_path / "r", "grpo", [(0, 0, grpo_step(policy, old))],
                                        {"num_generations": 2})), "identity.first_step")
    assert f.severity == ERROR and f.details["shift"] == 1 and f.details["mae_shifted"] == 0.0
    assert f.message.startswith("policy_logprobs and old_logprobs are shifted by one position: "
                                "policy_logprobs[:, j] equals old_logprobs[:, j + 1]")
    assert float(policy[f.sequence, f.token]) == float(old[f.sequence, f.token + 1])


def test_a_positive_logprob_is_an_error(tmp_path):
    policy = torch.tensor([[-0.5, -1.0, -0.2], [-0.3, -0.7, 0.3]])
    findings = found(run_checks(write_trace(tmp_path / "r", "grpo", [(0, 0, grpo_step(policy, policy.clone()))],
                                            {"num_generations": 2})), "logprobs.positive", ERROR)
    assert [(f.sequence, f.token, f.field) for f in findings] == [(1, 2, "policy_logprobs"), (1, 2, "old_logprobs")]
    f = findings[0]
    assert f.message.startswith("policy_logprobs[1, 2] = 0.3 nats > 0; 1 of 6 kept tokens are positive")


def k1_step(offset: float, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    policy = -torch.rand(16, 32, generator=g) * 2 - 0.1  # 512 kept tokens
    ref = policy - offset + 0.05 * torch.randn(16, 32, generator=g)
    return {**grpo_step(policy, policy.clone()), "ref_logprobs": ref}


def test_strongly_negative_k1_in_one_large_step_is_a_warning(tmp_path):
    # k1 = policy - ref = offset - noise: mean -0.3 nats with s.e. 0.05 / sqrt(512) = 0.0022 -> ~135 s.e.
    (f,) = found(run_checks(write_trace(tmp_path / "bad", "grpo", [(0, 0, k1_step(-0.3))], {"num_generations": 2})),
                 "kl.k1_negative_step")
    assert f.severity == WARNING and f.details["tokens"] == 512 and math.isclose(f.details["mean_k1"], -0.3, abs_tol=0.01)
    ok = run_checks(write_trace(tmp_path / "good", "grpo", [(0, 0, k1_step(0.0))], {"num_generations": 2}))
    assert found(ok, "kl.k1_negative_step") == []  # noise around 0: no alarm
    truncated = run_checks(write_trace(tmp_path / "top_p", "grpo", [(0, 0, k1_step(-0.3))],
                                       {"num_generations": 2, "top_p": 0.9}))
    (skip,) = [f for f in truncated if f.check == "kl.k1_negative_step"]
    assert skip.severity == SKIPPED and "sampling was truncated" in skip.message


def test_bessel_std_where_the_population_std_is_declared_is_an_error(tmp_path):
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # Bessel: std 0.5, A_0 = 0.75 / 0.5001; population: std 0.4330, A_0 = 0.75 / 0.4331
    advantages = formulas.trl_group_advantages(rewards, 4)
    step = {**grpo_step(-torch.ones(4, 3), -torch.ones(4, 3)), "rewards": rewards, "advantages": advantages}
    (f,) = found(run_checks(write_trace(tmp_path / "r", "grpo", [(0, 0, step)],
                                        {"num_generations": 4, "advantage_rule": "group_zscore"})),
                 "recompute.advantages")
    assert f.severity == ERROR and "group_zscore_unbiased" in f.details["matching_rules"]


def test_cispo_per_token_loss_runs_on_minimind_grpo(model_dir, tmp_path):
    """MiniMind's CISPO (`epsilon_high` is the ratio's bound; the shipped map clears clip_epsilon_high)."""
    out = tmp_path / "cispo"
    assert cli_main(["run", "--algo", "cispo", "--out", str(out), "--meta", "loss_reduction=sequence_mean", "--",
                     str(SCRIPTS / "minimind_grpo.py"), "--model_dir", str(model_dir), "--loss_type", "cispo"]) == 0
    findings = run_checks(out)
    mine = [f for f in findings if f.check == "recompute.per_token_loss"]
    assert mine == [], [f.message for f in mine]  # ran (no skipped finding) and agreed
    assert errors_and_warnings(findings) == []


# -- found by the adversarial review ----------------------------------------------------------------------


def test_a_reference_scored_one_position_late_is_named_even_when_policy_equals_old(tmp_path):
    g = torch.Generator().manual_seed(2)
    full = -torch.rand(4, 9, generator=g) * 3
    policy = full[:, :-1].clone()  # first step: policy == old, and ref is the same weights ...
    step = {**grpo_step(policy, policy.clone()), "ref_logprobs": full[:, 1:].clone()}  # ... read one token late
    (f,) = found(run_checks(write_trace(tmp_path / "r", "grpo", [(0, 0, step)], {"num_generations": 2})),
                 "identity.first_step")
    # policy[:, j] = full[:, j] = ref[:, j - 1]
    assert f.severity == ERROR and f.details["shifted_against"] == "ref_logprobs" and f.details["shift"] == -1
    assert "policy_logprobs[:, j] equals ref_logprobs[:, j - 1]" in f.message


def test_z_bound_runs_row_by_row_when_micro_batches_split_groups(tmp_path):
    # G = 4, but the micro-batch holds 2 rows of each of 2 groups: no complete group. |A| = 5.2 > sqrt(3).
    step = {**grpo_step(-torch.ones(4, 3), -torch.ones(4, 3)), "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
            "advantages": torch.tensor([5.2, -1.7, 1.7, -1.7]), "group_ids": torch.tensor([0, 0, 1, 1])}
    (f,) = found(run_checks(write_trace(tmp_path / "r", "grpo", [(0, 0, step)], {"num_generations": 4})),
                 "advantages.z_bound")
    assert (f.severity, f.sequence) == (ERROR, 0) and math.isclose(f.details["bound"], math.sqrt(3))


def test_warmup_with_learning_rate_zero_is_not_old_aliasing_policy(tmp_path):
    policy = torch.tensor([[-0.5, -1.0, -0.2], [-0.3, -0.7, -0.9]])
    step = {**grpo_step(policy, policy.clone()), "advantages": torch.tensor([1.0, -1.0])}
    steps = [(0, 0, step, {"learning_rate": 0.0}), (0, 1, step, {"learning_rate": 1e-3})]
    (f,) = found(run_checks(write_trace(tmp_path / "r", "grpo", steps, {"num_generations": 2})),
                 "identity.old_aliases_policy")
    assert f.severity == INFO and "learning rate 0" in f.message
    steps[0] = (0, 0, step, {"learning_rate": 1e-3})  # the step before moved the weights: aliasing
    (f,) = found(run_checks(write_trace(tmp_path / "r2", "grpo", steps, {"num_generations": 2})),
                 "identity.old_aliases_policy")
    assert f.severity == ERROR


@pytest.mark.parametrize("shape, hyper", [((0, 3), {"num_generations": 2}), ((2, 0), {"num_generations": 2}),
                                          ((2, 3), {"num_generations": 0})], ids=["B0", "T0", "G0"])
def test_empty_shapes_and_a_zero_group_size_never_crash_a_check(tmp_path, shape, hyper):
    B, T = shape
    step = {"completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": torch.ones(B, T, dtype=torch.bool),
            "policy_logprobs": -torch.ones(B, T), "old_logprobs": -torch.ones(B, T), "rewards": torch.zeros(B),
            "advantages": torch.zeros(B)}
    findings = run_checks(write_trace(tmp_path / "r", "grpo", [(0, 0, step)], hyper))
    assert [f.message for f in findings if "could not run" in f.message] == []
