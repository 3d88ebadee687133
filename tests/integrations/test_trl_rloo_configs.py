"""`tracer check` on healthy runs of TRL's real RLOOTrainer under valid configurations that
tests/integrations/test_trl_rloo.py does not cover (β = 0, a larger β, advantage normalisation, binding reward
clipping, truncation masking, one and three inner steps, asymmetric clipping, batching options,
sampling parameters, reward weights, reference-model sync, padding). A healthy, unmodified TRL run
must raise no error or warning finding. No mocks: real trainer, tiny local model, real files.

Each case that needs it has a precondition proving the option really changed the run (else the case
tests nothing and fails), and where the option should show, the finding the check gives for it.

RLOOConfig (TRL 1.16) has no loss_type, importance-sampling, delta or off-policy-mask option, and
make_trainer's two reward functions (correct_answer, brevity) are what reward_weights weighs. Two
cases were false alarms of the checks on healthy runs, now fixed: kl.k1_negative on several inner
steps of one rollout (it now looks at fresh rollouts only), advantages.zero_variance on KL-only RLOO
advantages (now an info finding saying where the advantages come from)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("trl")

import tracer  # noqa: E402
from tracer import Trace, formulas  # noqa: E402
from tracer.demo import rloo_trl  # noqa: E402
from tracer.demo.tiny_model import torch_threads  # noqa: E402

G = rloo_trl.NUM_GENERATIONS
B = G * rloo_trl.PROMPTS_PER_STEP
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _steps(trace: Trace):
    for key in trace.steps():
        yield key, trace.load_step(key), trace.metadata(key)


def _some_row_masked_out(trace: Trace, model_dir) -> bool:
    """mask_truncated_completions bit: some completion keeps no token."""
    return any(bool((~data["completion_mask"].bool().any(dim=1)).any()) for _, data, _ in _steps(trace))


def _no_ref(trace: Trace, model_dir) -> bool:
    """β = 0: TRL loads no reference model, so no ref logprobs and the plain leave-one-out rule."""
    return all("ref_logprobs" not in data and meta["advantage_rule"] == "rloo" for _, data, meta in _steps(trace))


def _kl_penalty_moves_advantages(trace: Trace, model_dir) -> bool:
    """β > 0 changes the advantages somewhere: leave-one-out on the bare rewards differs."""
    for _, data, _ in _steps(trace):
        if "reward_kl_k1" in data and float(data["reward_kl_k1"].abs().max()) > 1e-3:
            return True
    return False


def _normalised(trace: Trace, model_dir) -> bool:
    """normalize_advantages: each step file (= the generation batch here) has advantage std ~1."""
    return all(abs(float(data["advantages"].std()) - 1.0) < 1e-2 for _, data, _ in _steps(trace))


def _rewards_clipped(lo: float, hi: float):
    def binds(trace: Trace, model_dir) -> bool:
        return any(bool(((data["rewards"] < lo) | (data["rewards"] > hi)).any()) for _, data, _ in _steps(trace))
    binds.__name__ = f"rewards_clipped_{lo}_{hi}"
    return binds


def _sequence_clip_binds(trace: Trace, model_dir) -> bool:
    """The sequence-ratio clip binds: (sr > 1 + eps_high, A > 0) or (sr < 1 - eps_low, A < 0)."""
    for _, data, meta in _steps(trace):
        sr, adv = data["sequence_ratio"], data["advantages"]
        hi, lo = 1 + meta["clip_epsilon_high"], 1 - meta["clip_epsilon_low"]
        if bool((((sr > hi) & (adv > 0)) | ((sr < lo) & (adv < 0))).any()):
            return True
    return False


def _micro_batches(n: int):
    def has(trace: Trace, model_dir) -> bool:
        return {k.micro_batch for k in trace.steps()} == set(range(n))
    has.__name__ = f"micro_batches_{n}"
    return has


def _inner_steps(n: int):
    def has(trace: Trace, model_dir) -> bool:
        return {k.inner_step for k in trace.steps()} == set(range(n))
    has.__name__ = f"inner_steps_{n}"
    return has


def _generation_slices(n: int):
    def has(trace: Trace, model_dir) -> bool:
        return {meta["generation_slice"] for _, _, meta in _steps(trace)} == set(range(n))
    has.__name__ = f"generation_slices_{n}"
    return has


def _weighted_rewards(weights):
    def weighted(trace: Trace, model_dir) -> bool:
        moved = False
        for _, data, meta in _steps(trace):
            comps = data["reward_components"]
            if meta["reward_weights"] != weights:
                return False
            if not torch.allclose(data["rewards"], (comps * torch.tensor(weights)).sum(1)):
                return False
            moved |= bool((comps[:, 1] != 0).any())  # a non-zero brevity term: the weight matters
        return moved
    weighted.__name__ = f"weighted_rewards_{weights}"
    return weighted


def _groups_of(n: int):
    def has(trace: Trace, model_dir) -> bool:
        return all(data["group_ids"].tolist() == [b // n for b in range(B)] for _, data, _ in _steps(trace))
    has.__name__ = f"groups_of_{n}"
    return has


def _reused_rollout_sampled_from_ref(trace: Trace, model_dir) -> bool:
    """One rollout (old == ref exactly: sampled before any update) scored by >= 3 moved policies."""
    moved = 0
    for key, data, meta in _steps(trace):
        mask = data["completion_mask"].bool()
        if meta["rollout_index"] != 0 or not torch.equal(data["old_logprobs"][mask], data["ref_logprobs"][mask]):
            return False
        moved += key.inner_step > 0 and float((data["policy_logprobs"] - data["old_logprobs"]).abs()[mask].max()) > 1e-3
    return moved >= 3


def _equal_rewards_nonzero_advantages(trace: Trace, model_dir) -> bool:
    """A step whose rewards are all equal while its advantages are not 0 (RLOO's KL penalty alone)."""
    return any(float(data["rewards"].max() - data["rewards"].min()) == 0.0 and float(data["advantages"].abs().max()) > 1e-3
               for _, data, _ in _steps(trace))


def _padded_to(multiple: int):
    """pad_to_multiple_of: prompt and completion widths are multiples, wider than max_completion_length."""
    def padded(trace: Trace, model_dir) -> bool:
        return all(data["completion_ids"].shape[1] % multiple == 0 and data["prompt_ids"].shape[1] % multiple == 0
                   and data["completion_ids"].shape[1] > meta["max_completion_length"] for _, data, meta in _steps(trace))
    padded.__name__ = f"padded_to_{multiple}"
    return padded


def _ref_synced(trace: Trace, model_dir) -> bool:
    """sync_ref_model: after the first optimizer step the ref logprobs are no longer the initial model's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for key, data, meta in _steps(trace):
        if key.step == 0:
            continue
        ids = torch.cat([data["prompt_ids"], data["completion_ids"]], dim=1)
        attention = torch.cat([data["prompt_mask"], data["completion_mask"]], dim=1).long()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention).logits
        initial = formulas.token_logprobs(logits, ids, data["prompt_ids"].shape[1], meta["temperature"])
        mask = data["completion_mask"].bool()
        if float((data["ref_logprobs"] - initial).abs()[mask].max()) > 1e-3:
            return True
    return False


def _passes_in_one_optimizer_step(trace: Trace, model_dir) -> bool:
    """Both inner steps of a rollout accumulate into one optimizer step: a file at inner step 1 of an
    optimizer step that also has inner step 0 (TRL's "aligned" case: it drops old_logps)."""
    first_pass = {key.step for key in trace.steps() if key.inner_step == 0}
    return any(key.inner_step == 1 and key.step in first_pass for key in trace.steps())


def _ref_replaced_by_policy(trace: Trace, model_dir) -> bool:
    """sync_ref_model with mixup alpha 1: ref == old on a rollout after the first (the check's evidence)."""
    return any(key.step > 0 and key.inner_step == 0 and "ref_logprobs" in data and "old_logprobs" in data
               and float((data["ref_logprobs"] - data["old_logprobs"]).abs().max()) <= 1e-5
               for key, data, _ in _steps(trace))


# (overrides, steps, seed, precondition, expected): ``expected`` the (check, severity, text in the
# message) the option must now give, or None. make_trainer's own defaults: num_iterations=2,
# beta=0.05, max_completion_length=10, B = 8 (2 prompts x G = 4), steps_per_generation = 1.
CASES = [
    pytest.param({"beta": 0.0}, 2, 0, _no_ref, None, id="beta-0"),
    pytest.param({"beta": 0.5}, 3, 0, _kl_penalty_moves_advantages, None, id="beta-0.5"),
    pytest.param({"normalize_advantages": True}, 3, 0, _normalised,
                 ("recompute.advantages", "skipped", "normalize_advantages"), id="normalize-advantages"),
    # the demo's rewards are 0 / 1 plus -0.1 per surplus token: the clamp at -0.05 binds on every long answer
    pytest.param({"reward_clip_range": (-0.05, 1.0)}, 3, 0, _rewards_clipped(-0.05, 1.0), None,
                 id="reward-clip-binding"),
    pytest.param({"reward_clip_range": (-0.05, 1.0), "beta": 0.0}, 2, 0, _rewards_clipped(-0.05, 1.0), None,
                 id="reward-clip-binding-beta-0"),
    pytest.param({"reward_clip_range": (-0.05, 1.0), "normalize_advantages": True, "gradient_accumulation_steps": 2},
                 2, 0, _rewards_clipped(-0.05, 1.0), None, id="clip-normalize-accumulate"),
    pytest.param({"mask_truncated_completions": True, "max_completion_length": 3}, 2, 1, _some_row_masked_out,
                 ("masks.empty_row", "info", "mask_truncated_completions = true"), id="mask-truncated"),
    pytest.param({"num_iterations": 1}, 2, 0, _inner_steps(1), None, id="num-iterations-1"),
    pytest.param({"num_iterations": 3}, 3, 0, _inner_steps(3), None, id="num-iterations-3"),
    pytest.param({"epsilon": 0.05, "epsilon_high": 0.3}, 2, 0, _sequence_clip_binds, None, id="asymmetric-clip"),
    pytest.param({"steps_per_generation": 2}, 2, 0, _generation_slices(2), None, id="steps-per-generation-2"),
    pytest.param({"generation_batch_size": 2 * B}, 2, 0, _generation_slices(2), None, id="generation-batch-2x"),
    pytest.param({"gradient_accumulation_steps": 2}, 2, 0, _micro_batches(2), None, id="grad-accumulation-2"),
    pytest.param({"temperature": 0.7, "top_p": 0.9}, 2, 0, None, None, id="temperature-top-p"),
    pytest.param({"temperature": 0.7, "top_k": 5}, 2, 0, None, None, id="temperature-top-k"),
    pytest.param({"min_p": 0.1}, 2, 0, None, None, id="min-p"),
    pytest.param({"repetition_penalty": 1.5}, 2, 0, None, None, id="repetition-penalty"),
    pytest.param({"reward_weights": [1.0, 0.5]}, 2, 0, _weighted_rewards([1.0, 0.5]), None, id="reward-weights"),
    pytest.param({"num_generations": 2}, 2, 0, _groups_of(2), None, id="num-generations-2"),
    pytest.param({"num_generations": 8}, 2, 0, _groups_of(8), None, id="num-generations-8"),  # one prompt a step
    pytest.param({"num_generations": 3, "per_device_train_batch_size": 6}, 2, 0, None, None, id="num-generations-3"),
    # seed 1: group 0 has reward variance (seed 0's first rollout scores 0 everywhere: a true zero-signal warning)
    pytest.param({"max_completion_length": 2}, 2, 1, None, None, id="max-completion-length-2"),
    pytest.param({"bf16": True}, 2, 0, None, None, id="bf16-autocast"),  # CPU autocast; weights stay float32
    pytest.param({"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.6,
                  "num_iterations": 1}, 3, 0, _ref_synced, None, id="sync-ref-model"),
    pytest.param({"pad_to_multiple_of": 16}, 2, 0, _padded_to(16), None, id="pad-to-multiple-16"),
    # found by a false-alarm hunt (2026-12-05): both passes over a rollout in one optimizer step (TRL leaves
    # old = policy at inner step 1 on purpose), and the reference replaced by the policy at every step
    pytest.param({"gradient_accumulation_steps": 2, "steps_per_generation": 1}, 2, 0, _passes_in_one_optimizer_step, None,
                 id="iterations-in-one-optimizer-step"),
    pytest.param({"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 1.0}, 6, 0,
                 _ref_replaced_by_policy, ("kl.ref_tracks_policy", "info", "sync_ref_model"), id="sync-ref-alpha-1"),
    # one rollout reused for 4 optimizer steps (2 slices x 2 iterations): 3 step files after updates
    pytest.param({"steps_per_generation": 2, "num_iterations": 2}, 4, 0, _generation_slices(2), None,
                 id="spg-2-iterations-2"),
    # 4 inner steps on one rollout of 32 completions: inner steps 1-3 score tokens sampled from old == ref with a
    # moved policy, so mean(policy - ref) = -KL(ref || policy) < 0 there, as it must be
    pytest.param({"num_iterations": 4, "per_device_train_batch_size": 32}, 4, 0, _reused_rollout_sampled_from_ref, None,
                 id="num-iterations-4-batch-32"),
    # seed 1, step 2: every reward is 0, but old != ref, so RLOO's advantages are the KL penalty's (not 0)
    pytest.param({"max_completion_length": 2}, 3, 1, _equal_rewards_nonzero_advantages,
                 ("advantages.zero_variance", "info", "the recorded advantages are not 0"),
                 id="equal-rewards-kl-advantages"),
]


@pytest.mark.parametrize(("overrides", "steps", "seed", "precondition", "expected"), CASES)
def test_healthy_trl_rloo_configs_pass_check(tmp_path, model_dir, overrides, steps, seed, precondition, expected):
    """A healthy TRL RLOO run under the config: `tracer check` finds no error or warning."""
    from tracer.checks import ERROR, WARNING, run_checks

    with torch_threads(1):
        trainer = rloo_trl.make_trainer(model_dir, tmp_path / "scratch", steps=steps, seed=seed, progress=False,
                                        **overrides)
        for name, value in overrides.items():
            kept = getattr(trainer.args, name)
            assert (list(kept) if isinstance(value, tuple) else kept) == \
                (list(value) if isinstance(value, tuple) else value), name  # TRL kept the option as given
        tracer.attach(trainer, tmp_path / "trace")
        trainer.train()
    trace = Trace(tmp_path / "trace")
    assert trace.status == "finished" and trace.manifest["dropped_steps"] == 0
    if precondition is not None and not precondition(trace, model_dir):
        raise RuntimeError(f"{precondition.__name__}: the option did not change this run; the case tests nothing")
    findings = run_checks(tmp_path / "trace")
    bad = [f"{f.severity} {f.check}: {f.message}" for f in findings if f.severity in (ERROR, WARNING)]
    assert bad == [], "\n".join(bad)
    if expected is not None:
        check, severity, text = expected
        hits = [f for f in findings if f.check == check and f.severity == severity]
        assert any(text in f.message for f in hits), [(f.severity, f.message) for f in findings if f.check == check]
