"""`tracer check` beyond the ten cases: each check class on its own input (the advantage checks are
in tests/checks/test_advantages.py), a clean GRPO trace with two inner steps (no error, no warning,
nothing skipped), a deliberately broken hand-written GRPO loop, the CLI's exit codes, and every
committed sample trace (no error, no warning)."""


import pytest
import torch
from safetensors.torch import save_file

from tracer import formulas
from tracer.checks import ERROR, INFO, SKIPPED, WARNING, count_by_severity, run_checks
from tracer.cli import main

from tests.fixtures.check_traces import EOS, PAD, case1_tensors, case9_tensors, cli_json, found, write_trace
from tests.fixtures.paths import REPO


HYPER = {"num_generations": 4, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "beta": 0.04,
         "temperature": 1.0, "top_p": 1.0, "top_k": 0, "loss_reduction": "sequence_mean"}


def clean_grpo_step(inner: int, seed: int = 0) -> dict:
    """A correct GRPO step: P = 2, G = 4, B = 8, T = 6, prompts left-padded to L = 3."""
    g = torch.Generator().manual_seed(seed)
    B, T = 8, 6
    lengths = torch.tensor([6, 3, 4, 2, 5, 6, 1, 3])  # kept tokens per row, EOS last unless 6 (truncated)
    pos = torch.arange(T).expand(B, T)
    completion_mask = pos < lengths.unsqueeze(1)  # (B, T)
    completion_ids = torch.randint(3, 60, (B, T), generator=g)
    completion_ids[torch.arange(B), lengths - 1] = torch.where(lengths < T, EOS, completion_ids[:, -1])
    completion_ids = completion_ids.masked_fill(~completion_mask, PAD)
    prompt_ids = torch.randint(3, 60, (B, 3), generator=g)
    prompt_mask = torch.ones(B, 3, dtype=torch.bool)
    prompt_mask[::2, 0] = False  # every other row is left-padded by one
    prompt_ids = prompt_ids.masked_fill(~prompt_mask, PAD)
    old = -torch.rand(B, T, generator=g) * 3 - 0.05  # (B, T) nats
    # logprobs are <= 0 (logprobs.positive): the noisy copies are clamped below 0
    sampler = (old + 0.01 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    ref = (old + 0.05 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    policy = old.clone() if inner == 0 else (old + 0.05 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.1])
    advantages = formulas.group_advantages(rewards, 4)
    per_token_loss = formulas.grpo_per_token_loss(policy, old, advantages, 0.2, 0.2, 0.04, ref)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "policy_logprobs": policy, "old_logprobs": old,
        "ref_logprobs": ref, "sampler_logprobs": sampler, "ratio": formulas.ratio(policy, old),
        "ref_kl_k3": formulas.ref_kl_k3(policy, ref), "approx_kl_k2": formulas.approx_kl_k2(policy, old),
        "rewards": rewards, "advantages": advantages, "group_ids": torch.arange(2).repeat_interleave(4),
        "per_token_loss": per_token_loss, "loss": formulas.sequence_mean_loss(per_token_loss, completion_mask),
    }


@pytest.fixture
def clean_trace(tmp_path):
    return write_trace(tmp_path / "clean", "grpo", [(0, 0, clean_grpo_step(0)), (0, 1, clean_grpo_step(1)),
                                                    (1, 0, clean_grpo_step(0, 1)), (1, 1, clean_grpo_step(1, 1))],
                       HYPER)


def test_clean_grpo_trace_with_two_inner_steps_has_no_error_or_warning(clean_trace, capsys):
    findings = run_checks(clean_trace)
    counts = count_by_severity(findings)
    assert counts["error"] == counts["warning"] == 0, [f.message for f in findings if f.severity in (ERROR, WARNING)]
    assert counts["skipped"] == 0, [f.message for f in findings if f.severity == SKIPPED]  # every check ran
    # the sampler report is an info with its numbers: noise of std 0.01 nats, nothing outside [1/2, 2]
    sampler = found(findings, "sampler.mismatch")
    assert sampler and all(f.severity == INFO and f.details["share_outside"] == 0.0 for f in sampler)
    assert main(["check", str(clean_trace)]) == 0
    assert "PASS  0 error, 0 warning" in capsys.readouterr().out


def test_checking_one_step_file_only(tmp_path):
    from tracer import Trace

    root = write_trace(tmp_path / "r", "grpo", [(0, 0, case1_tensors()), (1, 0, case1_tensors())],
                       {"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2})
    trace = Trace(root)
    findings = found(run_checks(trace, select=["identity"], steps=trace.steps()[1:]), "identity.first_step")
    assert [f.step for f in findings] == [1]


def test_mask_shifted_by_one_in_the_hand_written_grpo_loop(tmp_path, monkeypatch):
    """A deliberately broken variant of the real hand-written GRPO loop: its completion mask is
    shifted right by one (drops the first token, keeps the one after EOS)."""
    from tracer.demo import grpo_loop
    from tracer.demo import rollout as ro
    from tracer.demo.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    right_mask = ro._mask_after_eos

    def shifted_mask(completion_ids, eos_token_id):
        keep = right_mask(completion_ids, eos_token_id)  # (B, T)
        return torch.cat([torch.zeros_like(keep[:, :1]), keep[:, :-1]], dim=1)

    monkeypatch.setattr(ro, "_mask_after_eos", shifted_mask)
    run = grpo_loop.run(tmp_path / "run", grpo_loop.GRPOConfig(steps=1, num_iterations=1), model_dir)
    from tracer import Trace

    trace = Trace(run)
    key = trace.steps()[0]
    ids, keep = (trace.load_step(key)[n] for n in ("completion_ids", "completion_mask"))
    # independently: the first row that keeps a token after its first EOS, and that token (EOS + 1)
    eos_at = [row.index(trace.eos_token_id) if trace.eos_token_id in row else None for row in ids.tolist()]
    leaks = [(b, e + 1) for b, e in enumerate(eos_at) if e is not None and e + 1 < ids.shape[1] and keep[b, e + 1]]
    assert leaks, "the tiny model produced no EOS before the last position; pick another seed"
    (f,) = found(run_checks(run), "masks.after_eos")
    assert (f.severity, f.step, f.inner_step, (f.sequence, f.token)) == (ERROR, 0, 0, leaks[0])
    assert "looks shifted right by one position" in f.message
    assert cli_json(run, "--select", "masks")[0] == 1


SAMPLE_TRACES = sorted(p.parent for p in (REPO / "sample_traces").glob("*/manifest.json"))


@pytest.mark.parametrize("trace_dir", SAMPLE_TRACES, ids=[p.name for p in SAMPLE_TRACES])
def test_committed_sample_traces_pass_with_no_error_and_no_warning(trace_dir):
    findings = run_checks(trace_dir)
    bad = [f"{f.check} {f.severity} {f.step}/{f.inner_step}: {f.message}" for f in findings
           if f.severity in (ERROR, WARNING)]
    assert bad == []


# -- identity ---------------------------------------------------------------------------------------

def test_ppo_minibatch_after_an_optimizer_step_is_not_a_first_step(tmp_path):
    # PPO: each minibatch is an optimizer step, so at epoch 0 minibatch 1 policy has already moved.
    policy, old = torch.tensor([[-1.0, -0.5]]), torch.tensor([[-1.3, -0.5]])
    tensors = {"completion_mask": torch.ones(1, 2, dtype=torch.bool), "policy_logprobs": policy, "old_logprobs": old}
    from tracer import TraceWriter

    with TraceWriter(tmp_path / "r", "ppo") as writer:
        writer.record(0, tensors, inner_step=0, micro_batch=0)
        writer.record(0, tensors, inner_step=0, micro_batch=1)
    (f,) = found(run_checks(tmp_path / "r"), "identity.first_step")
    assert (f.micro_batch, f.sequence, f.token) == (0, 0, 0)


@pytest.mark.parametrize("accumulation, fresh", [(1, False), (2, True)])
def test_trl_generation_slice_after_an_optimizer_step_is_not_fresh(tmp_path, accumulation, fresh):
    # TRL: generation slice 1 is used after 1 // accumulation optimizer steps on this rollout.
    policy, old = torch.tensor([[-1.0, -0.5]]), torch.tensor([[-1.3, -0.5]])
    tensors = {"completion_mask": torch.ones(1, 2, dtype=torch.bool), "policy_logprobs": policy, "old_logprobs": old}
    meta = {"generation_slice": 1, "gradient_accumulation_steps": accumulation}
    write_trace(tmp_path / "r", "grpo", [(0, 0, tensors, meta)])
    assert bool(found(run_checks(tmp_path / "r"), "identity.first_step")) == fresh


# -- recompute ----------------------------------------------------------------------------------------

def test_recorded_ratio_inverted(tmp_path):
    policy, old = torch.tensor([[-1.0, -0.4]]), torch.tensor([[-1.2, -0.4]])
    tensors = {"completion_mask": torch.ones(1, 2, dtype=torch.bool), "policy_logprobs": policy,
               "old_logprobs": old, "ratio": formulas.ratio(old, policy)}  # exp(old - policy): the bug
    write_trace(tmp_path / "r", "grpo", [(0, 1, tensors)])
    (f,) = found(run_checks(tmp_path / "r"), "recompute.ratio")
    # token 0: recorded exp(-0.2) = 0.818731, recomputed exp(0.2) = 1.22140
    assert (f.severity, f.inner_step, f.sequence, f.token) == (ERROR, 1, 0, 0)
    assert "recorded 0.818731, recomputed 1.2214" in f.message and "at 1 of 2 kept positions" in f.message


def test_dpo_recompute(tmp_path):
    tensors = case9_tensors([0, 0, 1, 1])
    tensors["dpo_loss"] = torch.tensor([0.6982])  # the loss of the rejected-keeps-prompt masks, not 0.6733
    write_trace(tmp_path / "r", "dpo", [(0, 0, tensors)], {"beta": 0.1})
    (f,) = found(run_checks(tmp_path / "r"), "recompute.dpo")
    assert (f.severity, f.sequence, f.field) == (ERROR, 0, "dpo_loss") and "recomputed 0.6733" in f.message
    # the step's scalar loss is the mean of dpo_loss over pairs: 0.6733 for this one pair
    tensors = {**case9_tensors([0, 0, 1, 1]), "loss": torch.tensor(0.7)}
    write_trace(tmp_path / "s", "dpo", [(0, 0, tensors)], {"beta": 0.1})
    (f,) = found(run_checks(tmp_path / "s"), "recompute.dpo")
    assert (f.severity, f.field) == (ERROR, "loss") and "recorded 0.7, recomputed 0.673" in f.message


def test_clip_fractions_compared_with_recorded_metadata(tmp_path):
    # ratio e^0.3 = 1.35 (A > 0: high clip binds), e^-0.3 = 0.74 (A > 0: outside the region, no clip),
    # 1, 1. low 0, high 1/4, region 2/4; the trainer logged high = 0.5.
    policy, old = torch.tensor([[0.3, -0.3, 0.0, 0.0]]) - 1.0, torch.full((1, 4), -1.0)
    tensors = {"completion_mask": torch.ones(1, 4, dtype=torch.bool), "policy_logprobs": policy,
               "old_logprobs": old, "advantages": torch.tensor([1.0])}
    meta = {"clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "clip_fraction_high": 0.5}
    write_trace(tmp_path / "r", "grpo", [(0, 1, tensors, meta)])
    (f,) = found(run_checks(tmp_path / "r"), "recompute.clip_fractions")
    assert f.severity == ERROR and "high: recorded 0.5000, recomputed 0.2500" in f.message
    assert (f.details["low"], f.details["high"], f.details["region"]) == (0.0, 0.25, 0.5)


# -- KL -----------------------------------------------------------------------------------------------

def test_k3_sign_and_persistent_negative_k1(tmp_path):
    g = torch.Generator().manual_seed(0)
    steps = []
    for step in range(3):
        ref = -torch.rand(4, 8, generator=g) * 2
        policy = ref - 0.5 + 0.05 * torch.randn(4, 8, generator=g)  # k1 = policy - ref ≈ -0.5 everywhere
        steps.append((step, 0, {"completion_mask": torch.ones(4, 8, dtype=torch.bool), "policy_logprobs": policy,
                                "ref_logprobs": ref, "ref_kl_k3": formulas.kl_k1(policy, ref)}))  # k1 as k3: bug
    findings = run_checks(write_trace(tmp_path / "r", "grpo", steps))
    (f,) = found(findings, "kl.k1_negative")
    assert f.severity == WARNING and "significantly negative in all 3 step files" in f.message
    k3 = found(findings, "kl.k3_sign")
    assert len(k3) == 3 and all(x.severity == ERROR and "k3 = exp(d) - d - 1" in x.message for x in k3)


def test_negative_k1_after_an_update_is_not_flagged(tmp_path):
    # TRL reuses one rollout for num_iterations inner steps, sampled from old = ref at the first
    # rollout: on inner steps 1.. the mean of policy - ref over those tokens is -KL(ref || policy) < 0,
    # as it should be, and a policy/ref swap would look the same. Three such files (all inner step 1)
    # and no fresh one: an info, not a warning; the same files at inner step 0 (fresh rollouts) are the
    # warning of the test above.
    g = torch.Generator().manual_seed(0)
    steps = []
    for step in range(3):
        ref = -torch.rand(4, 8, generator=g) * 2
        policy = ref - 0.5 + 0.05 * torch.randn(4, 8, generator=g)
        steps.append((step, 1, {"completion_mask": torch.ones(4, 8, dtype=torch.bool), "policy_logprobs": policy,
                                "ref_logprobs": ref}))
    (note,) = found(run_checks(write_trace(tmp_path / "updated", "grpo", steps)), "kl.k1_negative")
    assert note.severity == INFO and "none of them is of fresh rollouts" in note.message  # not judged, not silent
    fresh = [(step, 0, tensors) for step, _, tensors in steps]
    assert len(found(run_checks(write_trace(tmp_path / "fresh", "grpo", fresh)), "kl.k1_negative")) == 1


# -- sampler ------------------------------------------------------------------------------------------

def sampler_step(old, sampler):
    B, T = old.shape
    return {"completion_mask": torch.ones(B, T, dtype=torch.bool), "old_logprobs": old,
            "policy_logprobs": old.clone(), "sampler_logprobs": sampler}


def test_sampler_temperature_and_truncation_patterns(tmp_path):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 16, generator=g) * 4 - 0.1
    # temperature: the sampler's logprobs are 0.7 x the trainer's -> slope 0.7, mean gap -0.3 * mean(old)
    write_trace(tmp_path / "temp", "grpo", [(0, 0, sampler_step(old, 0.7 * old), {"temperature": 0.7})])
    (f,) = found(run_checks(tmp_path / "temp"), "sampler.mismatch")
    assert f.severity in (WARNING, ERROR) and "sampler logprobs ≈ 0.700 × trainer logprobs" in f.message
    # top-p: the sampler renormalised over the nucleus -> trainer below sampler by 0.3 nats everywhere
    write_trace(tmp_path / "topp", "grpo", [(0, 0, sampler_step(old, old + 0.3), {"top_p": 0.9})])
    (f,) = found(run_checks(tmp_path / "topp"), "sampler.mismatch")
    assert f.severity == ERROR and "mean -0.3000 nats" in f.message  # a systematic pattern is an error
    assert "below the sampler's on 100% of tokens" in f.message and "top_p = 0.9" in f.message


def test_sampler_ratio_bound_is_configurable(tmp_path):
    # 16 of 64 tokens (25%) differ by 0.5 nats: exp(0.5) = 1.65 is inside [1/2, 2] but outside [1/1.5, 1.5].
    old = torch.full((4, 16), -1.0)
    sampler = old.clone()
    sampler[0] -= 0.5
    write_trace(tmp_path / "r", "grpo", [(0, 0, sampler_step(old, sampler))])
    code, rows = cli_json(tmp_path / "r", "--select", "sampler")
    assert code == 0 and rows[0]["details"]["share_outside"] == 0.0
    code, rows = cli_json(tmp_path / "r", "--select", "sampler", "--sampler-ratio-bound", "1.5")
    assert code == 1 and rows[0]["severity"] == "error" and "16 tokens (25.00%)" in rows[0]["message"]
    assert rows[0]["details"]["worst_tokens"][0]["old_minus_sampler"] == 0.5


# -- masks ----------------------------------------------------------------------------------------------

def test_empty_row_and_kept_padding(tmp_path):
    ids = torch.tensor([[5, 6, EOS, PAD], [7, 8, 9, PAD]])  # row 1 has no EOS; its padding is kept
    mask = torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    write_trace(tmp_path / "r", "grpo", [(0, 0, {"completion_ids": ids, "completion_mask": mask})])
    write_trace(tmp_path / "t", "grpo", [(0, 0, {"completion_ids": ids, "completion_mask": mask})],
                {"mask_truncated_completions": True})
    findings = run_checks(tmp_path / "r")
    (empty,) = found(findings, "masks.empty_row")
    assert (empty.severity, empty.sequence) == (ERROR, 0) and "1 of 2 rows keep no token" in empty.message
    (pad,) = found(findings, "masks.padding")
    # one pad id ending a row without EOS: most likely sampled (the row ran to the length limit), an info
    assert (pad.severity, pad.sequence, pad.token, pad.token_text) == (INFO, 1, 3, "<pad>")
    assert "has no EOS" in pad.message and "1 of 2 rows end so" in pad.message
    assert found(run_checks(tmp_path / "t"), "masks.empty_row")[0].severity == INFO


def test_kept_padding_after_eos_or_longer_than_one_token_is_an_error(tmp_path):
    ids = torch.tensor([[5, EOS, PAD, PAD],   # padding after EOS, kept: error
                        [7, 8, PAD, PAD],     # two pads, no EOS: padding, kept: error
                        [7, 8, 9, PAD],       # one pad, no EOS: a sampled token most likely: info
                        [7, 8, 9, 9]])        # no pad
    mask = torch.ones(4, 4, dtype=torch.bool)
    write_trace(tmp_path / "r", "grpo", [(0, 0, {"completion_ids": ids, "completion_mask": mask})])
    pads = found(run_checks(tmp_path / "r"), "masks.padding")
    assert [(f.severity, f.sequence, f.token, f.details["rows"], f.details["tokens"]) for f in pads] == [
        (ERROR, 0, 2, [0, 1], 4), (INFO, 2, 3, [2], 1)]


def test_dpo_sides_keep_padding_an_error_even_one_token_without_eos(tmp_path):
    # chosen/rejected ids come from a dataset (prompt included): a kept trailing pad there is padding
    ids = torch.tensor([[5, 6, 7, PAD], [5, 6, 8, 9]])
    mask = torch.ones(2, 4, dtype=torch.bool)
    logprobs = torch.full((2, 4), -1.0)
    step = {f"{side}_{name}": value for side in ("chosen", "rejected")
            for name, value in (("ids", ids), ("mask", mask), ("policy_logprobs", logprobs), ("ref_logprobs", logprobs))}
    write_trace(tmp_path / "r", "dpo", [(0, 0, step)], {"beta": 0.1})
    pads = found(run_checks(tmp_path / "r"), "masks.padding")
    assert [(f.severity, f.sequence, f.token) for f in pads] == [(ERROR, 0, 3), (ERROR, 0, 3)]


# -- non-finite and the CLI -----------------------------------------------------------------------------

def test_nan_loss_and_bare_step_file_without_metadata(tmp_path):
    path = tmp_path / "step.safetensors"
    save_file({"completion_mask": torch.ones(1, 2, dtype=torch.bool), "policy_logprobs": torch.zeros(1, 2),
               "loss": torch.tensor(float("nan"))}, str(path))  # no metadata at all
    code, rows = cli_json(path)
    assert code == 1
    (row,) = [r for r in rows if r["check"] == "nonfinite.values"]
    assert row["severity"] == "error" and row["field"] == "loss" and "nan at the scalar" in row["message"]
    assert {"check", "severity", "message", "step", "sequence", "token"} <= set(row)


def test_cli_unusable_input_and_unknown_check(tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    root = write_trace(tmp_path / "r", "grpo", [(0, 0, {"completion_mask": torch.ones(1, 2, dtype=torch.bool)})])
    assert main(["check", str(root), "--select", "masks.nope"]) == 2
    assert "unknown check 'masks.nope'" in capsys.readouterr().err


def test_every_check_is_documented():
    from tracer.checks import CHECKS

    doc = (REPO / "docs" / "checks.md").read_text(encoding="utf-8")
    assert [c for c in CHECKS if f"`{c}`" not in doc] == []


def test_group_ids_that_disagree_with_num_generations_are_reported_and_checked(tmp_path):
    # B = 8 in groups of 4 by group_ids, but metadata says G = 3: the group checks must still run on
    # the recorded groups (they used to be skipped, hiding the mistake) and the disagreement is a warning
    from tracer import TraceWriter
    from tracer.checks import run_checks

    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    advantages = torch.tensor([3.0, -1.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0]) * 0.5  # group 0 sums to 0
    advantages[0] += 1.0  # ... not any more: group 0 sums to 1
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters={"num_generations": 3}) as w:
        w.record(0, completion_ids=torch.ones(8, 2, dtype=torch.long), completion_mask=torch.ones(8, 2),
                 policy_logprobs=torch.zeros(8, 2), rewards=rewards, advantages=advantages,
                 group_ids=torch.arange(8) // 4)
    findings = {f.check: f for f in run_checks(tmp_path / "run")}
    assert findings["advantages.group_size"].severity == "warning"
    assert "num_generations = 3, but group_ids give groups of sizes [4]" in findings["advantages.group_size"].message
    assert findings["advantages.group_sum"].severity == "error"  # checked on the groups of 4
    assert findings["advantages.zero_variance"].severity == "info"  # group 1 (all 2.0)


def test_a_trace_whose_step_files_are_all_unreadable_is_unusable(tmp_path, capsys):
    from tracer.cli import main

    steps = tmp_path / "run" / "steps"
    steps.mkdir(parents=True)
    (steps / "step_00000000.inner_0.mb_0.rank_0.safetensors").write_bytes(b"\x00" * 64)
    assert main(["check", str(tmp_path / "run")]) == 2
    assert "none of its 1 step file(s) can be read" in capsys.readouterr().err


def test_an_unknown_algorithm_is_a_warning_not_a_silent_pass(tmp_path):
    from safetensors.torch import save_file

    from tracer.checks import run_checks

    path = tmp_path / "one.safetensors"
    save_file({"completion_ids": torch.ones(1, 2, dtype=torch.long), "completion_mask": torch.ones(1, 2, dtype=torch.bool),
               "policy_logprobs": torch.zeros(1, 2)}, path, metadata={"algorithm": "bogus"})
    (f,) = [f for f in run_checks(path) if f.severity == "warning"]
    assert f.check == "fields.required" and "unknown algorithm 'bogus'" in f.message
