"""tracer.formulas against verl 0.9.1's own objective code, run here on CPU: every registered policy loss
tracer models (vanilla with dual clip, gspo, cispo, gpg) reduced with every loss_agg_mode, the registry
itself (a loss verl registers that tracer does not list fails this test), the KL estimators of
``kl_penalty`` (k1/k2/k3/abs and their straight-through ``+`` forms), the entropy term of ``ppo_loss``,
and the tracer GRPO formula with dual clip (``clip_ratio_c``) and at the sequence level (GSPO) against
verl's vanilla and gspo losses.

Runs in the verl venv (``make test-verl``); in the main venv verl is not installed and it is skipped.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from tracer.formulas.losses import entropy_bonus, grpo_per_token_loss, sequence_ratio  # noqa: E402
from tracer.formulas.verl_losses import (  # noqa: E402
    VERL_KL_PENALTIES,
    VERL_LOSS_AGG_MODES,
    VERL_POLICY_LOSSES,
    verl_agg_loss,
    verl_cispo_per_token_loss,
    verl_gpg_per_token_loss,
    verl_gspo_per_token_loss,
    verl_kl_penalty,
    verl_policy_loss,
    verl_vanilla_per_token_loss,
)

LOW, HIGH, C = 0.2, 0.28, 2.5


def batch(seed: int, spread: float = 0.8):
    """old/policy logprobs with ratios far outside [1 - LOW, 1 + HIGH] on both sides, mixed-sign advantages
    per token, a mask with one empty row, and rollout IS weights; all [4, 6]."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 6, generator=gen) * 3
    policy = old + spread * torch.randn(4, 6, generator=gen)
    advantages = torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.2
    mask[3] = False
    weights = torch.rand(4, 6, generator=gen) + 0.5
    return old, policy, advantages, mask, weights


def config(loss_mode: str) -> ActorConfig:
    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                       clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=C,
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode))


def test_tracer_lists_every_policy_loss_the_installed_verl_registers():
    registered = {name for name in core_algos.POLICY_LOSS_REGISTRY if not name.startswith("tracer_")}
    assert registered == set(VERL_POLICY_LOSSES)


OURS = {
    "vanilla": lambda old, pol, adv, mask, w: verl_vanilla_per_token_loss(pol, old, adv, LOW, HIGH, C, w),
    "gspo": lambda old, pol, adv, mask, w: verl_gspo_per_token_loss(pol, old, adv, mask, LOW, HIGH, w),
    "cispo": lambda old, pol, adv, mask, w: verl_cispo_per_token_loss(pol, old, adv, LOW, HIGH, w),
    "gpg": lambda old, pol, adv, mask, w: verl_gpg_per_token_loss(pol, adv, w),
}


@pytest.mark.parametrize("loss_mode", sorted(OURS))
@pytest.mark.parametrize("agg_mode", sorted(VERL_LOSS_AGG_MODES))
def test_each_modelled_policy_loss_reduces_to_verls_pg_loss(loss_mode, agg_mode):
    assert VERL_POLICY_LOSSES[loss_mode]  # listed as modelled
    old, policy, advantages, mask, weights = batch(7)
    for w in (None, weights):
        pg_loss, _ = core_algos.POLICY_LOSS_REGISTRY[loss_mode](old, policy, advantages, mask, loss_agg_mode=agg_mode,
                                                              config=config(loss_mode), rollout_is_weights=w)
        ours = verl_agg_loss(OURS[loss_mode](old, policy, advantages, mask, w), mask, agg_mode)
        assert float(ours) == pytest.approx(float(pg_loss), rel=1e-5, abs=1e-7), (loss_mode, agg_mode, w is None)


def test_dual_clip_binds_and_the_tracer_grpo_form_equals_verls_vanilla():
    old, policy, advantages, mask, _ = batch(11, spread=1.5)
    r = torch.exp(policy - old)
    assert bool(((advantages < 0) & (r > C) & mask).any())  # the dual clip binds on some kept token
    pg_loss, metrics = core_algos.compute_policy_loss_vanilla(old, policy, advantages, mask, "token-mean",
                                                              config("vanilla"))
    assert metrics["actor/pg_clipfrac_lower"] > 0
    ours = grpo_per_token_loss(policy, old, advantages, LOW, HIGH, clip_ratio_c=C)
    assert float(verl_agg_loss(ours, mask, "token-mean")) == pytest.approx(float(pg_loss), rel=1e-6)
    without = grpo_per_token_loss(policy, old, advantages, LOW, HIGH)  # without the dual clip: another loss
    assert abs(float(verl_agg_loss(without, mask, "token-mean")) - float(pg_loss)) > 1e-3


def test_tracer_sequence_level_grpo_equals_verls_gspo_below_its_clamp():
    old, policy, advantages, mask, _ = batch(5, spread=0.3)
    per_row = advantages[:, 0]  # GSPO's advantage is one per sequence: broadcast over the tokens
    adv = per_row.unsqueeze(1).expand_as(policy)
    pg_loss, _ = core_algos.compute_policy_loss_gspo(old, policy, adv, mask, "seq-mean-token-mean", config("gspo"))
    ours = grpo_per_token_loss(policy, old, per_row, LOW, HIGH, sequence_mask=mask)
    assert float(verl_agg_loss(ours, mask, "seq-mean-token-mean")) == pytest.approx(float(pg_loss), rel=1e-6)
    # the sequence ratio is exp of the masked mean log-ratio: row 0 by hand
    keep = mask[0]
    assert float(sequence_ratio(policy, old, mask)[0]) == pytest.approx(
        float(torch.exp((policy[0] - old[0])[keep].sum() / keep.sum())), rel=1e-6)


@pytest.mark.parametrize("name", [*VERL_KL_PENALTIES, *(n + "+" for n in VERL_KL_PENALTIES)])
def test_kl_penalty_values_equal_verls(name):
    _, policy, _, _, _ = batch(3, spread=2.0)
    ref = policy + 3.0 * torch.randn(policy.shape, generator=torch.Generator().manual_seed(9))  # past the k3 clamp
    expected = core_algos.kl_penalty(policy, ref, name)
    assert torch.allclose(verl_kl_penalty(policy, ref, name), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("agg_mode", sorted(VERL_LOSS_AGG_MODES))
def test_actor_loss_with_entropy_and_kl_terms_equals_verls_ppo_loss_arithmetic(agg_mode):
    """verl's ppo_loss: pg_loss - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl_penalty)."""
    old, policy, advantages, mask, _ = batch(13)
    entropy = torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) * 2
    ref = policy + 0.3
    pg_loss, _ = core_algos.compute_policy_loss_vanilla(old, policy, advantages, mask, agg_mode, config("vanilla"))
    entropy_loss = core_algos.agg_loss(entropy, mask, agg_mode)
    kl_loss = core_algos.agg_loss(core_algos.kl_penalty(policy, ref, "low_var_kl"), mask, agg_mode)
    expected = pg_loss - 0.01 * entropy_loss + kl_loss * 0.05  # the order of ppo_loss's lines
    ours = verl_policy_loss(verl_agg_loss(verl_vanilla_per_token_loss(policy, old, advantages, LOW, HIGH, C), mask,
                                          agg_mode),
                            verl_agg_loss(entropy, mask, agg_mode), 0.01,
                            verl_agg_loss(verl_kl_penalty(policy, ref, "k3"), mask, agg_mode), 0.05)
    assert float(ours) == pytest.approx(float(expected), rel=1e-6)
    if agg_mode == "token-mean":  # verl's token-mean entropy term is tracer's token-mean entropy bonus
        assert float(entropy_bonus(entropy, mask, 0.01)) == pytest.approx(0.01 * float(entropy_loss), rel=1e-6)
