"""`tracer check` on healthy runs of TRL's real GRPOTrainer under valid configurations that
tests/integrations/test_trl_grpo.py does not cover (GSPO, entropy masking, truncation masking, two-sided and
asymmetric clipping, several inner steps, sampling parameters, ...). A healthy, unmodified TRL run
must raise no error or warning finding. No mocks: real trainer, tiny local model, real files.

Four of them were false alarms before the integration recorded the option in step metadata
(delta, top_entropy_quantile, off_policy_mask_threshold, mask_truncated_completions): the run is
healthy (the recorded loss is TRL's rule applied to the recorded tensors) but the checks, not
knowing the option, fired. Each has a precondition that proves the option really changed the run
(else the case tests nothing and fails), and the finding the check now gives instead."""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

import tracer  # noqa: E402
from tracer import Trace  # noqa: E402
from tracer.demo import grpo_trl  # noqa: E402
from tracer.demo.tiny_model import torch_threads  # noqa: E402

G = grpo_trl.NUM_GENERATIONS
B = G * grpo_trl.PROMPTS_PER_STEP
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _steps(trace: Trace):
    for key in trace.steps():
        yield trace.load_step(key), trace.metadata(key)


def _some_row_masked_out(trace: Trace) -> bool:
    """mask_truncated_completions bit: some completion keeps no token."""
    return any(bool((~data["completion_mask"].bool().any(dim=1)).any()) for data, _ in _steps(trace))


def _delta_binds(delta: float):
    """Two-sided clipping changes the loss only where A < 0 and ratio > max(delta, 1 + eps_high)."""
    def binds(trace: Trace) -> bool:
        for data, meta in _steps(trace):
            keep = data["completion_mask"].bool() & (data["advantages"].unsqueeze(1) < 0)
            bound = max(delta, 1 + meta["clip_epsilon_high"])
            if bool((data["ratio"][keep] > bound).any()):
                return True
        return False
    return binds


def _off_policy_mask_drops(threshold: float):
    """TRL's get_off_policy_mask drops an A < 0 row whose mean (old - policy) over kept tokens > threshold."""
    def drops(trace: Trace) -> bool:
        for data, _ in _steps(trace):
            if "old_logprobs" not in data:
                continue
            keep = data["completion_mask"].double()
            kl = ((data["old_logprobs"].double() - data["policy_logprobs"].double()) * keep).sum(1) / keep.sum(1).clamp(min=1)
            if bool(((data["advantages"] < 0) & (kl > threshold)).any()):
                return True
        return False
    return drops


def _passes_in_one_optimizer_step(trace: Trace) -> bool:
    """Both inner steps of a rollout accumulate into one optimizer step: a file at inner step 1 of an
    optimizer step that also has inner step 0 (TRL's "aligned" case: it drops old_per_token_logps)."""
    first_pass = {key.step for key in trace.steps() if key.inner_step == 0}
    return any(key.inner_step == 1 and key.step in first_pass for key in trace.steps())


def _ref_replaced_by_policy(trace: Trace) -> bool:
    """sync_ref_model with mixup alpha 1: ref == old on a rollout after the first (the check's evidence)."""
    return any(key.step > 0 and key.inner_step == 0 and "ref_logprobs" in data
               and float((data["ref_logprobs"] - data["old_logprobs"]).abs().max()) <= 1e-5
               for key, (data, _) in zip(trace.steps(), _steps(trace)) if "old_logprobs" in data)


# (overrides, steps, seed, precondition, expected): ``expected`` the (check, severity, text in the
# message) the option must now give (severity None: the check ran, no finding of it at all), or None. make_trainer's own defaults: num_iterations=2,
# beta=0.04, loss_type="grpo", max_completion_length=10, B = 8 (2 prompts x G = 4).
CASES = [
    pytest.param({"importance_sampling_level": "sequence"}, 2, 0, None, None, id="gspo-grpo"),
    pytest.param({"importance_sampling_level": "sequence", "loss_type": "dapo"}, 2, 0, None, None,
                 id="gspo-dapo-default"),
    # TRL's entropy mask: the loss is not recomputed (skipped, naming the key) rather than an error
    pytest.param({"top_entropy_quantile": 0.5}, 2, 0, None,
                 ("recompute.loss", "skipped", "top_entropy_quantile = 0.5"), id="top-entropy-0.5"),
    # seed 1: completions 1 and 6 reach 3 tokens without EOS (masked out); group 0 still has reward variance
    pytest.param({"mask_truncated_completions": True, "max_completion_length": 3}, 2, 1, _some_row_masked_out,
                 ("masks.empty_row", "info", "mask_truncated_completions = true"), id="mask-truncated"),
    pytest.param({"delta": 1.5, "num_iterations": 2}, 2, 0, None, None, id="two-sided-delta"),  # the clamp never binds
    pytest.param({"delta": 1.02, "epsilon": 0.01, "num_iterations": 2}, 2, 0, _delta_binds(1.02),
                 ("recompute.loss", None, None), id="two-sided-delta-binding"),  # recomputed with delta: passes
    pytest.param({"epsilon": 0.1, "epsilon_high": 0.3, "num_iterations": 2}, 2, 0, None, None, id="asymmetric-clip"),
    pytest.param({"steps_per_generation": 2}, 2, 0, None, None, id="steps-per-generation-2"),
    pytest.param({"generation_batch_size": 2 * B}, 2, 0, None, None, id="generation-batch-2x"),
    pytest.param({"temperature": 0.7, "top_p": 0.9}, 2, 0, None, None, id="temperature-top-p"),
    pytest.param({"temperature": 0.7, "top_k": 5}, 2, 0, None, None, id="temperature-top-k"),
    # min_p truncates and repetition_penalty reshapes what is sampled (TRL's logprobs leave both out):
    # the k1 sign test is skipped on the fresh steps, naming the option
    pytest.param({"min_p": 0.3}, 2, 0, None, ("kl.k1_negative_step", "skipped", "min_p > 0"), id="min-p"),
    pytest.param({"repetition_penalty": 1.5}, 2, 0, None,
                 ("kl.k1_negative_step", "skipped", "repetition_penalty != 1"), id="repetition-penalty"),
    pytest.param({"scale_rewards": "none", "loss_type": "dapo"}, 2, 0, None, None, id="dapo-no-scale"),
    pytest.param({"num_iterations": 3}, 3, 0, None, None, id="num-iterations-3"),  # inner steps 0, 1, 2
    # TRL 1.16's other loss types: soft-gated (SAPO), variance-reduced sequence weights (VESPO), LUSPO
    pytest.param({"loss_type": "sapo"}, 2, 0, None, None, id="sapo"),
    pytest.param({"loss_type": "vespo"}, 2, 0, None, None, id="vespo"),
    pytest.param({"loss_type": "luspo"}, 2, 0, None, None, id="luspo"),
    # found by a false-alarm hunt (2026-12-05): both passes over a rollout in one optimizer step, where TRL
    # leaves old = policy at inner step 1 on purpose (identity.old_aliases_policy fired; now fresh_rollouts)
    pytest.param({"gradient_accumulation_steps": 2, "steps_per_generation": 1}, 2, 0, _passes_in_one_optimizer_step,
                 ("identity.old_aliases_policy", None, None), id="iterations-in-one-optimizer-step"),
    # the reference replaced by the policy at every optimizer step, as asked (kl.ref_tracks_policy warned)
    pytest.param({"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 1.0}, 6, 0,
                 _ref_replaced_by_policy, ("kl.ref_tracks_policy", "info", "sync_ref_model"), id="sync-ref-alpha-1"),
    pytest.param({"off_policy_mask_threshold": 0.001}, 2, 0, _off_policy_mask_drops(0.001),
                 ("recompute.loss", "skipped", "off_policy_mask_threshold = 0.001"), id="off-policy-mask"),
]


@pytest.mark.parametrize(("overrides", "steps", "seed", "precondition", "expected"), CASES)
def test_healthy_trl_configs_pass_check(tmp_path, model_dir, overrides, steps, seed, precondition, expected):
    """A healthy TRL run under the config: `tracer check` finds no error or warning."""
    from tracer.checks import ERROR, WARNING, run_checks

    with torch_threads(1):
        trainer = grpo_trl.make_trainer(model_dir, tmp_path / "scratch", steps=steps, seed=seed, progress=False,
                                        **overrides)
        for name, value in overrides.items():
            assert getattr(trainer.args, name) == value, name  # TRL kept the option as given
        tracer.attach(trainer, tmp_path / "trace")
        trainer.train()
    if precondition is not None and not precondition(Trace(tmp_path / "trace")):
        raise RuntimeError(f"{precondition.__name__}: the option did not change this run; the case tests nothing")
    findings = run_checks(tmp_path / "trace")
    bad = [f"{f.severity} {f.check}: {f.message}" for f in findings if f.severity in (ERROR, WARNING)]
    assert bad == [], "\n".join(bad)
    if expected is not None and expected[1] is None:
        assert [f.message for f in findings if f.check == expected[0]] == []
    elif expected is not None:
        check, severity, text = expected
        hits = [f for f in findings if f.check == check and f.severity == severity]
        assert hits and all(text in f.message for f in hits), [(f.severity, f.message) for f in findings
                                                              if f.check == check]
