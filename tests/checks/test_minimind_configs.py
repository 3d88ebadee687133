"""`tracer check` on healthy runs of the hand-written MiniMind-style loops in tests/scripts/
(minimind_grpo.py, minimind_ppo.py, minimind_dpo.py) under option combinations the other tests do not
cover: CISPO bounds, inner iterations, group sizes, sampling temperature, beta 0, truncated completions,
PPO's minibatching, whitening, GAE's gamma / lambda, approx-KL early stop, DPO's beta and batch size.

Each script is traced with zero edits through `tracer run` (the shipped minimind name map), with
`--meta loss_reduction=...` as tests/zero_edit/test_watch.py gives it. A healthy run must raise no error or warning
finding. Each case has a precondition that proves the option really changed the run (else it tests
nothing and fails), and optionally the finding the option must give instead (TRL's pattern, see
tests/integrations/test_trl_grpo_configs.py). No mocks: real loops, tiny local model, real files.

Learning rate 0 (the first step of a warmup schedule that starts at 0) was a false alarm of
identity.old_aliases_policy: the minimind name map recorded no ``learning_rate``, so the check's
learning-rate-0 relaxation (identity.py, _previous_learning_rate) was never reached. The map now reads the
optimizer's rate in effect (tracer.zero_edit.frame_lookup: an optimizer reads as its largest param-group lr).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from tracer import Trace  # noqa: E402
from tracer.checks import ERROR, INFO, WARNING, run_checks  # noqa: E402
from tracer.cli import main as cli_main  # noqa: E402
from tracer.demo.tiny_model import torch_threads  # noqa: E402

from tests.fixtures.paths import SCRIPTS
SCRIPT = {"grpo": "minimind_grpo.py", "cispo": "minimind_grpo.py", "ppo": "minimind_ppo.py", "dpo": "minimind_dpo.py"}
REDUCTION = {"grpo": "sequence_mean", "cispo": "sequence_mean", "ppo": "token_mean", "dpo": "sequence_mean"}
NO_STOP = ("--target_kl", "1e9")  # PPO: no approx-KL early stop (the script's default 0.1 rarely trips here)


def _steps(trace: Trace):
    for key in trace.steps():
        yield key, trace.load_step(key), trace.metadata(key)


# -- preconditions: the option really changed the run -------------------------------------------------


def _meta(**expected):
    def holds(trace: Trace, eos: int) -> bool:
        return all(all(meta.get(k) == v for k, v in expected.items()) for _, _, meta in _steps(trace))
    holds.__name__ = f"meta_{'_'.join(expected)}"
    return holds


def _inner_steps(n: int):
    def holds(trace: Trace, eos: int) -> bool:
        return {k.inner_step for k in trace.steps()} == set(range(n))
    holds.__name__ = f"inner_steps_{n}"
    return holds


def _rows(n: int):
    """Every step file holds n rows (GRPO: num_prompts x G; PPO: one minibatch; DPO: chosen pairs)."""
    def holds(trace: Trace, eos: int) -> bool:
        field = "chosen_mask" if trace.metadata(trace.steps()[0]).get("algorithm") == "dpo" else "completion_mask"
        return all(data[field].shape[0] == n for _, data, _ in _steps(trace))
    holds.__name__ = f"rows_{n}"
    return holds


def _row_counts(*counts: int):
    """The step files hold exactly these row counts (PPO: a last minibatch smaller than the others)."""
    def holds(trace: Trace, eos: int) -> bool:
        return {data["completion_mask"].shape[0] for _, data, _ in _steps(trace)} == set(counts)
    holds.__name__ = f"row_counts_{'_'.join(map(str, counts))}"
    return holds


def _one_micro_batch(trace: Trace, eos: int) -> bool:
    """mini_batch_size == batch_size: one minibatch per PPO epoch, holding the whole rollout."""
    return {k.micro_batch for k in trace.steps()} == {0}


def _truncated(length: int):
    """Some completion keeps all ``length`` tokens and none of them is EOS: cut off, not finished."""
    def holds(trace: Trace, eos: int) -> bool:
        for _, data, _ in _steps(trace):
            keep = data["completion_mask"].bool()
            ended = ((data["completion_ids"] == eos) & keep).any(dim=1)
            if bool(((keep.sum(dim=1) == length) & ~ended).any()):
                return True
        return False
    holds.__name__ = f"truncated_{length}"
    return holds


def _cispo_bound_binds(trace: Trace, eos: int) -> bool:
    """CISPO's clamp(ratio, max=epsilon_high) changes some kept token's weight."""
    for _, data, meta in _steps(trace):
        if bool((data["ratio"][data["completion_mask"].bool()] > meta["cispo_epsilon_high"]).any()):
            return True
    return False


def _early_stopped(full: int):
    """The approx-KL early stop cut the run: fewer backward calls than steps x epochs x minibatches."""
    def holds(trace: Trace, eos: int) -> bool:
        return len(trace.steps()) < full
    holds.__name__ = f"early_stopped_below_{full}"
    return holds


def _all(*preconditions):
    def holds(trace: Trace, eos: int) -> bool:
        return all(p(trace, eos) for p in preconditions)
    holds.__name__ = "+".join(p.__name__ for p in preconditions)
    return holds


# (algo, script argv, extra --meta, precondition, expected): ``expected`` the (check, severity, text in the
# message) the option must give (severity None: no finding of that check at all), or None. Script defaults:
# GRPO 2 steps, 2 prompts x G = 4, num_iterations 2, beta 0.04, epsilon 0.2, max_new_tokens 8, lr 1e-3;
# PPO 2 steps, batch 8, minibatch 4, 3 epochs, kl_coef 0.02, gamma 1, lam 0.95; DPO 2 steps, batch 4, beta 0.1.
CASES = [
    # -- GRPO / CISPO ----------------------------------------------------------------------------------
    pytest.param("cispo", ["--loss_type", "cispo"], [], _meta(algorithm="cispo", cispo_epsilon_high=5.0), None,
                 id="cispo"),
    # MiniMind's CISPO epsilon_high is the ratio's cap itself: 0.28 clamps every token's weight (ratio ~ 1)
    pytest.param("cispo", ["--loss_type", "cispo", "--epsilon_high", "0.28"], [], _cispo_bound_binds,
                 ("recompute.loss", None, None), id="cispo-epsilon-high-0.28"),
    pytest.param("cispo", ["--loss_type", "cispo", "--epsilon_high", "1.28", "--num_iterations", "3"], [],
                 _all(_cispo_bound_binds, _inner_steps(3)), ("recompute.loss", None, None),
                 id="cispo-epsilon-high-1.28-iterations-3"),
    pytest.param("cispo", ["--loss_type", "cispo", "--beta", "0", "--max_new_tokens", "3"], [],
                 _all(_meta(beta=0.0), _truncated(3)), None, id="cispo-beta-0-truncated"),
    pytest.param("grpo", ["--num_iterations", "1"], [], _inner_steps(1), None, id="grpo-iterations-1"),
    pytest.param("grpo", ["--num_iterations", "3"], [], _inner_steps(3), None, id="grpo-iterations-3"),
    pytest.param("grpo", ["--num_generations", "2"], [], _all(_meta(num_generations=2), _rows(4)), None,
                 id="grpo-generations-2"),
    pytest.param("grpo", ["--num_generations", "8"], [], _all(_meta(num_generations=8), _rows(16)), None,
                 id="grpo-generations-8"),
    pytest.param("grpo", ["--temperature", "0.7"], [], _meta(temperature=0.7), None, id="grpo-temperature-0.7"),
    pytest.param("grpo", ["--beta", "0"], [], _meta(beta=0.0), None, id="grpo-beta-0"),
    pytest.param("grpo", ["--max_new_tokens", "3"], [], _truncated(3), None, id="grpo-truncated"),
    pytest.param("grpo", ["--num_prompts", "4", "--num_generations", "8", "--max_new_tokens", "3",
                          "--temperature", "0.7"], [], _all(_rows(32), _truncated(3), _meta(temperature=0.7)), None,
                 id="grpo-32-rows-truncated-temperature-0.7"),
    # clipping binds hard: lr 1e-2 and epsilon 0.05 over 3 inner steps
    pytest.param("grpo", ["--epsilon", "0.05", "--num_iterations", "3", "--learning_rate", "1e-2"], [],
                 _meta(clip_epsilon_low=0.05, clip_epsilon_high=0.05), None, id="grpo-tight-clip-lr-1e-2"),
    pytest.param("grpo", ["--seed", "2", "--beta", "0", "--num_iterations", "3"], [], _inner_steps(3), None,
                 id="grpo-seed-2-beta-0-iterations-3"),
    # lr 0: the weights do not move, old == policy after the optimizer step (was an error: no learning_rate read)
    pytest.param("grpo", ["--learning_rate", "0"], [], _all(_inner_steps(2), _meta(learning_rate=0.0)),
                 ("identity.old_aliases_policy", INFO, "learning rate 0"), id="grpo-lr-0"),
    # -- PPO ---------------------------------------------------------------------------------------------
    pytest.param("ppo", ["--ppo_update_iters", "1", *NO_STOP], [], _inner_steps(1), None, id="ppo-update-iters-1"),
    pytest.param("ppo", ["--mini_batch_size", "8", *NO_STOP], [], _all(_one_micro_batch, _rows(8)), None,
                 id="ppo-minibatch-eq-batch"),
    pytest.param("ppo", ["--batch_size", "6", "--mini_batch_size", "4", *NO_STOP], [], _row_counts(4, 2), None,
                 id="ppo-uneven-minibatches"),
    pytest.param("ppo", ["--whiten_advantages", *NO_STOP], [], None,
                 ("recompute.advantages", INFO, "'gae_whitened'"), id="ppo-whitened"),
    pytest.param("ppo", ["--gamma", "0.99", *NO_STOP], [], _meta(gamma=0.99), ("recompute.advantages", None, None),
                 id="ppo-gamma-0.99"),
    pytest.param("ppo", ["--lam", "1.0", *NO_STOP], [], _meta(lam=1.0), ("recompute.advantages", None, None),
                 id="ppo-lam-1"),
    pytest.param("ppo", ["--kl_coef", "0", *NO_STOP], [], _meta(kl_coef=0.0), None, id="ppo-kl-coef-0"),
    pytest.param("ppo", ["--whiten_advantages", "--gamma", "0.99", "--lam", "1.0", "--kl_coef", "0",
                         "--ppo_update_iters", "1", "--mini_batch_size", "8", *NO_STOP], [],
                 _all(_one_micro_batch, _inner_steps(1), _meta(gamma=0.99, lam=1.0, kl_coef=0.0)),
                 ("recompute.advantages", INFO, "'gae_whitened'"), id="ppo-combined"),
    # early stop in the first epoch's second minibatch (2 of 2 x 3 x 2 = 12 backward calls)
    pytest.param("ppo", ["--target_kl", "1e-4"], [], _early_stopped(12), None, id="ppo-target-kl-1e-4"),
    # early stop after two updates, in epoch 1 of step 0
    pytest.param("ppo", ["--target_kl", "0.03"], [], _all(_early_stopped(12), _inner_steps(1)), None,
                 id="ppo-target-kl-0.03"),
    pytest.param("ppo", ["--target_kl", "0.05", "--whiten_advantages"], [], _early_stopped(12), None,
                 id="ppo-target-kl-0.05-whitened"),
    pytest.param("ppo", ["--max_new_tokens", "3", "--temperature", "0.7", "--whiten_advantages", *NO_STOP], [],
                 _all(_truncated(3), _meta(temperature=0.7)), None, id="ppo-truncated-temperature-0.7"),
    pytest.param("ppo", ["--clip_epsilon", "0.05", "--learning_rate", "1e-2", *NO_STOP], [],
                 _meta(clip_epsilon_low=0.05), None, id="ppo-tight-clip-lr-1e-2"),
    # lr 0: the weights do not move, old == policy after the optimizer step (was an error: no learning_rate read)
    pytest.param("ppo", ["--learning_rate", "0", *NO_STOP], [], _all(_inner_steps(3), _meta(learning_rate=0.0)),
                 ("identity.old_aliases_policy", INFO, "learning rate 0"), id="ppo-lr-0"),
    # -- DPO ---------------------------------------------------------------------------------------------
    pytest.param("dpo", ["--beta", "0.5"], [], _meta(beta=0.5), None, id="dpo-beta-0.5"),
    pytest.param("dpo", ["--batch_size", "1"], [], _rows(1), None, id="dpo-batch-1"),
    pytest.param("dpo", ["--batch_size", "1", "--beta", "0.5"], [], _all(_rows(1), _meta(beta=0.5)), None,
                 id="dpo-batch-1-beta-0.5"),
    pytest.param("dpo", ["--batch_size", "8", "--seed", "1"], [], _rows(8), None, id="dpo-batch-8-seed-1"),
    pytest.param("dpo", ["--learning_rate", "1e-2", "--steps", "4"], [], None, None, id="dpo-lr-1e-2-steps-4"),
]


def _trace(out: Path, model_dir: Path, algo: str, argv: list[str], meta: list[str]) -> Path:
    """`tracer run` on the unmodified MiniMind-style script."""
    meta_args = [a for m in (f"loss_reduction={REDUCTION[algo]}", *meta) for a in ("--meta", m)]
    with torch_threads(1):
        code = cli_main(["run", "--algo", algo, "--out", str(out), *meta_args, "--",
                         str(SCRIPTS / SCRIPT[algo]), "--model_dir", str(model_dir), *argv])
    assert code == 0
    return out


@pytest.mark.parametrize(("algo", "argv", "meta", "precondition", "expected"), CASES)
def test_healthy_minimind_configs_pass_check(tmp_path, model_dir, algo, argv, meta, precondition, expected):
    """A healthy MiniMind-style run under the options: `tracer check` finds no error or warning."""
    from transformers import AutoTokenizer

    out = _trace(tmp_path / "trace", model_dir, algo, argv, meta)
    trace = Trace(out)
    assert trace.steps()
    if precondition is not None and not precondition(trace, AutoTokenizer.from_pretrained(model_dir).eos_token_id):
        raise RuntimeError(f"{precondition.__name__}: the option did not change this run; the case tests nothing")
    findings = run_checks(out)
    bad = [f"{f.severity} {f.check} (step {f.step}, inner {f.inner_step}, mb {f.micro_batch}): {f.message}"
           for f in findings if f.severity in (ERROR, WARNING)]
    assert bad == [], "\n".join(bad)
    if expected is not None and expected[1] is None:
        assert [f.message for f in findings if f.check == expected[0]] == []
    elif expected is not None:
        check, severity, text = expected
        hits = [f for f in findings if f.check == check and f.severity == severity]
        assert hits and all(text in f.message for f in hits), [(f.severity, f.message) for f in findings
                                                              if f.check == check]


@pytest.mark.parametrize("argv", [["--num_prompts", "1", "--num_generations", "2"], ["--max_new_tokens", "1"]],
                         ids=["one-prompt-G2", "max-new-tokens-1"])
def test_all_groups_tied_warns_truthfully(tmp_path, model_dir, argv):
    """Not a false alarm: where every group of a step has equal rewards, advantages.zero_variance warns
    that the step carries no learning signal. The loop is correct, the warning is true of the data (every
    recorded advantage is 0), and it is the only error or warning."""
    out = _trace(tmp_path / "trace", model_dir, "grpo", argv, [])
    trace = Trace(out)
    findings = run_checks(out)
    bad = [f for f in findings if f.severity in (ERROR, WARNING)]
    assert bad and {f.check for f in bad} == {"advantages.zero_variance"}
    for f in bad:
        key = next(k for k in trace.steps() if (k.step, k.inner_step, k.micro_batch)
                   == (f.step, f.inner_step, f.micro_batch))
        data = trace.load_step(key)
        G = trace.metadata(key)["num_generations"]
        rewards = data["rewards"].view(-1, G)
        assert bool((rewards == rewards[:, :1]).all()) and not bool(data["advantages"].bool().any())
