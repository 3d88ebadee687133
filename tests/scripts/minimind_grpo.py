"""GRPO / CISPO written the way MiniMind's trainer/train_grpo.py is (seed lesson 25): G samples per
prompt, group-normalised rewards, the seed's variable names (per_token_logps, old_per_token_logps,
ref_per_token_logps, completion_mask, kl_div, per_token_kl, ratio). It knows nothing of tracer:
tests trace it with `python -m tracer run --algo grpo ... -- minimind_grpo.py`.

Numerically it is tracer/demo/grpo_loop.py (same seed, same order of random draws).
`--crash_at_step N` raises at the start of step N (a script that fails mid-run).
"""

import argparse
import copy
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracer.demo import rollout as ro


def grpo_train_epoch(model, ref_model, tokenizer, optimizer, args):
    rng = random.Random(args.seed)
    for step in range(args.steps):
        if step == args.crash_at_step:
            raise RuntimeError(f"reward server went away at step {step}")
        prompts = ro.arithmetic_prompts(args.num_prompts, rng)
        model.eval()
        rollout_result = ro.rollout(model, tokenizer, prompts, args.num_generations, args.max_new_tokens,
                                    args.temperature)
        outputs, full_mask = rollout_result.input_ids, rollout_result.attention_mask  # (B, L + R)
        prompt_ids, prompt_mask = rollout_result.prompt_ids, rollout_result.prompt_mask  # (B, L)
        completion_ids = rollout_result.completion_ids  # (B, R)
        completion_mask = rollout_result.completion_mask  # (B, R)
        old_per_token_logps = rollout_result.old_logprobs  # (B, R)
        prompt_len = prompt_ids.size(1)

        completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        reward_components = ro.reward_components(rollout_result.prompts, completions)  # (B, F)
        rewards = reward_components.sum(dim=1)  # (B,)
        grouped_rewards = rewards.view(-1, args.num_generations)
        mean_r = grouped_rewards.mean(dim=1).repeat_interleave(args.num_generations)
        std_r = grouped_rewards.std(dim=1, unbiased=False).repeat_interleave(args.num_generations)
        advantages = (rewards - mean_r) / (std_r + 1e-4)  # (B,)

        with torch.no_grad():
            ref_per_token_logps = ro.completion_logprobs(ref_model, outputs, full_mask, prompt_len, args.temperature)
        model.train()
        for inner_step in range(args.num_iterations):
            train_temperature = 1.0 if args.bug == "no_temp_train" else args.temperature  # bug: logits not / T
            per_token_logps = ro.completion_logprobs(model, outputs, full_mask, prompt_len, train_temperature)
            kl_div = ref_per_token_logps - per_token_logps
            per_token_kl = torch.exp(kl_div) - kl_div - 1
            ratio = torch.exp(per_token_logps - old_per_token_logps)
            if args.loss_type == "cispo":
                clamped_ratio = torch.clamp(ratio, max=args.epsilon_high).detach()
                per_token_loss = -(clamped_ratio * advantages.unsqueeze(1) * per_token_logps - args.beta * per_token_kl)
            else:
                clip_high = 2.0 if args.bug == "clip_typo" else args.epsilon  # bug: 1 + 2.0 typed for 1 + 0.2
                clipped_ratio = torch.clamp(ratio, 1 - args.epsilon, 1 + clip_high)
                per_token_loss1 = ratio * advantages.unsqueeze(1)
                per_token_loss2 = clipped_ratio * advantages.unsqueeze(1)
                kl_sign = -1.0 if args.bug == "flip_kl" else 1.0  # bug: the KL penalty subtracted
                beta = 10 * args.beta if args.bug == "beta_x10" else args.beta  # bug: 0.4 typed for 0.04
                per_token_loss = -(torch.min(per_token_loss1, per_token_loss2) - kl_sign * beta * per_token_kl)
            if args.bug == "loss_over_padding":  # bug: the mean over all B x T positions, padding included
                policy_loss = per_token_loss.mean()
            else:
                policy_loss = ((per_token_loss * completion_mask).sum(dim=1)
                               / completion_mask.sum(dim=1).clamp(min=1)).mean()
            loss = policy_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        print(f"step {step}: reward {rewards.mean().item():.3f}")


def main(args):
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    grpo_train_epoch(model, ref_model, tokenizer, optimizer, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="MiniMind-style GRPO / CISPO on the tiny model")
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--loss_type", choices=["grpo", "cispo"], default="grpo")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--num_prompts", type=int, default=2)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--num_iterations", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--epsilon_high", type=float, default=5.0)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crash_at_step", type=int, default=-1)
    parser.add_argument("--bug", choices=["flip_kl", "clip_typo", "loss_over_padding", "beta_x10", "no_temp_train"], default=None,
                        help="inject a known bug (flip_kl, clip_typo, beta_x10: the grpo loss only; no_temp_train: the "
                             "training forward leaves out the sampling temperature)")
    args = parser.parse_args()
    main(args)
