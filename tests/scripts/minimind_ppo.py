"""PPO written the way MiniMind's trainer/train_ppo.py is (seed lesson 25): actor + critic + frozen
reference, the seed's variable names, minibatches drawn by `inds` from the whole rollout. It knows
nothing of tracer: tests trace it with `python -m tracer run --algo ppo ... -- minimind_ppo.py`.

Numerically it is tracer/demo/ppo_loop.py (same seed, same order of random draws), so its zero-edit
trace can be compared with the demo's explicit-API trace.
"""

import argparse
import copy
import random
import warnings

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracer.demo import rollout as ro
from tracer.demo.ppo_loop import Critic


def ppo_train_epoch(actor, critic, ref_model, tokenizer, optimizer, args):
    rng = random.Random(args.seed)
    for step in range(args.steps):
        actor.eval()
        prompts = ro.arithmetic_prompts(args.batch_size, rng)
        rollout_result = ro.rollout(actor, tokenizer, prompts, 1, args.max_new_tokens, args.temperature)
        gen_out, full_mask = rollout_result.input_ids, rollout_result.attention_mask  # (B, L + R)
        prompt_ids, prompt_mask = rollout_result.prompt_ids, rollout_result.prompt_mask  # (B, L)
        completion_ids = rollout_result.completion_ids  # (B, R)
        resp_policy_mask = rollout_result.completion_mask  # (B, R)
        old_resp_logp = rollout_result.old_logprobs  # (B, R), saved at sampling time
        prompt_len = prompt_ids.size(1)

        responses = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        reward_components = ro.reward_components(rollout_result.prompts, responses)  # (B, F)
        rewards = reward_components.sum(dim=1)  # (B,)
        with torch.no_grad():
            ref_resp_logp = ro.completion_logprobs(ref_model, gen_out, full_mask, prompt_len, args.temperature)
            old_resp_values = critic(gen_out, full_mask, prompt_len) * resp_policy_mask  # (B, R)

        B, gen_len = old_resp_logp.shape
        resp_lengths = resp_policy_mask.sum(dim=1)
        valid_resp = resp_lengths > 0
        last_idx = resp_lengths - 1
        token_rewards = torch.zeros_like(old_resp_logp)
        token_rewards[torch.arange(B)[valid_resp], last_idx[valid_resp]] += rewards[valid_resp]
        lastgaelam = torch.zeros(B)
        advs_rev = []
        for t in reversed(range(gen_len)):
            nv = old_resp_values[:, t + 1] if t < gen_len - 1 else 0.0
            delta = token_rewards[:, t] + args.gamma * nv - old_resp_values[:, t]
            lastgaelam = delta + args.gamma * args.lam * lastgaelam
            advs_rev.append(lastgaelam)
        advantages = torch.stack(advs_rev[::-1], dim=1) * resp_policy_mask  # (B, R)
        returns = (advantages + old_resp_values) * resp_policy_mask
        if args.whiten_advantages:  # MiniMind's real train_ppo.py: whiten over the rollout's kept tokens
            adv_mean = (advantages * resp_policy_mask).sum() / resp_policy_mask.sum().clamp(min=1)
            adv_var = ((advantages - adv_mean) ** 2 * resp_policy_mask).sum() / resp_policy_mask.sum().clamp(min=1)
            advantages = (advantages - adv_mean) * torch.rsqrt(adv_var + 1e-8) * resp_policy_mask

        actor.train()
        early_stop = False
        for ppo_epoch in range(args.ppo_update_iters):
            if args.bug == "recompute_old":  # bug: old logprobs recomputed from the (already updated) actor
                with torch.no_grad():
                    old_resp_logp = ro.completion_logprobs(actor, gen_out, full_mask, prompt_len, args.temperature)
            perm = torch.randperm(B)
            for mb_start in range(0, B, args.mini_batch_size):
                inds = perm[mb_start : mb_start + args.mini_batch_size]
                mb_resp_logp = ro.completion_logprobs(actor, gen_out[inds], full_mask[inds], prompt_len,
                                                      args.temperature)  # (b, R)
                mask = resp_policy_mask[inds]
                log_ratio = mb_resp_logp - old_resp_logp[inds]
                approx_kl = (0.5 * (log_ratio**2) * mask).sum() / mask.sum().clamp(min=1)
                if approx_kl > args.target_kl:
                    early_stop = True
                    break
                ratio = torch.exp(log_ratio)
                clip_high = 2.0 if args.bug == "clip_typo" else args.clip_epsilon  # bug: 1 + 2.0 typed for 1 + 0.2
                kl_sign = -1.0 if args.bug == "flip_kl" else 1.0  # bug: the KL penalty subtracted
                if args.loss_form == "minimind":
                    policy_loss = minimind_policy_loss(ratio, mb_resp_logp, ref_resp_logp[inds], advantages[inds],
                                                       resp_policy_mask[inds], clip_high, kl_sign, args)
                else:
                    clipped_ratio = torch.clamp(ratio, 1 - args.clip_epsilon, 1 + clip_high)
                    per_token_loss = -torch.min(ratio * advantages[inds], clipped_ratio * advantages[inds])
                    kl_ref = torch.exp(ref_resp_logp[inds] - mb_resp_logp) - (ref_resp_logp[inds] - mb_resp_logp) - 1.0
                    per_token_loss = per_token_loss + kl_sign * args.kl_coef * kl_ref
                    if args.bug == "loss_over_padding":  # bug: the mean over all B x T positions, padding included
                        policy_loss = per_token_loss.mean()
                    else:
                        policy_loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1)
                mb_values = critic(gen_out[inds], full_mask[inds], prompt_len)
                value_loss = (((mb_values - returns[inds]) ** 2) * mask).sum() / mask.sum().clamp(min=1)
                loss = policy_loss + args.vf_coef * value_loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            if early_stop:
                break
        print(f"step {step}: reward {rewards.mean().item():.3f}")


def minimind_policy_loss(ratio, mb_resp_logp, ref_resp_logp, advantages, resp_policy_mask, clip_high, kl_sign, args):
    """The real MiniMind train_ppo.py's policy loss, one scalar and no per-token loss variable:
    masked mean of max(-A * r, -A * clip(r)) plus kl_coef times the masked mean of k3. The arguments are
    the minibatch's rows (MiniMind indexes them with [inds] inline). Injected bugs: `kl_sign` -1 (the
    penalty subtracted), `clip_high` (the upper clip bound 1 + clip_high), `--bug loss_over_padding`
    (both means taken over all B x T positions)."""
    if args.bug == "loss_over_padding":  # bug: unmasked means, padding included
        resp_policy_mask = torch.ones_like(resp_policy_mask)
    kl_ref_penalty = ((torch.exp(ref_resp_logp - mb_resp_logp) - (ref_resp_logp - mb_resp_logp) - 1.0)
                      * resp_policy_mask).sum() / resp_policy_mask.sum().clamp(min=1)
    policy_loss = ((torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - args.clip_epsilon,
                                                                               1.0 + clip_high))
                    * resp_policy_mask).sum() / resp_policy_mask.sum().clamp(min=1) + kl_sign * args.kl_coef * kl_ref_penalty)
    return policy_loss


def main(args):
    if args.ignore_warnings:  # as MiniMind's trainers do
        warnings.filterwarnings("ignore")
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    actor = AutoModelForCausalLM.from_pretrained(args.model_dir)
    ref_model = copy.deepcopy(actor).eval().requires_grad_(False)
    critic = Critic(actor)
    optimizer = torch.optim.AdamW(list(actor.parameters()) + list(critic.parameters()), lr=args.learning_rate)
    ppo_train_epoch(actor, critic, ref_model, tokenizer, optimizer, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="MiniMind-style PPO on the tiny model")
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--mini_batch_size", type=int, default=4)
    parser.add_argument("--ppo_update_iters", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--clip_epsilon", type=float, default=0.2)
    parser.add_argument("--kl_coef", type=float, default=0.02)
    parser.add_argument("--target_kl", type=float, default=0.1)
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--vf_coef", type=float, default=0.5)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--whiten_advantages", action="store_true", help="MiniMind's whitening of the GAE advantages")
    parser.add_argument("--ignore_warnings", action="store_true", help="warnings.filterwarnings('ignore'), as MiniMind")
    parser.add_argument("--loss_form", choices=["per_token", "minimind"], default="per_token",
                        help="per_token: a per_token_loss variable reduced by its masked mean; minimind: the real "
                             "train_ppo.py's one scalar policy_loss (masked mean of the clipped term + kl_coef * "
                             "masked mean of k3)")
    parser.add_argument("--bug", choices=["flip_kl", "recompute_old", "clip_typo", "loss_over_padding"], default=None,
                        help="inject a known bug")
    args = parser.parse_args()
    main(args)
