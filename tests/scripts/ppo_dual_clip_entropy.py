"""A hand-written PPO loop with dual clip and an entropy bonus (verl's objective, written out by hand as a
user of plain PyTorch would), on the tiny model, recorded with tracer's explicit API.

Per minibatch: ``r = exp(policy - old)``, ``l = max(-A r, -A clip(r, 1-ε, 1+ε))``, capped at ``-c A`` where
``A < 0`` (dual-clip PPO, ``clip_ratio_c`` = c), plus ``kl_coef * k3``; the policy loss is its masked token
mean, and the loss backpropagated is ``policy_loss - entropy_coef * masked mean of the token entropy`` (verl
0.9.1 ``ppo_loss``). Injected bugs: ``--bug entropy_sign`` (the bonus added: ``+ entropy_coef * H``),
``--bug no_dual_clip`` (the cap left out while ``clip_ratio_c`` is declared).
"""

import argparse
import random

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

import tracer
from tracer.demo import rollout as ro
from tracer.demo.ppo_loop import Critic


def logprobs_and_entropy(model, input_ids, attention_mask, prompt_len, temperature):
    """Completion-token logprobs and entropies (nats), each ``[B, T]``: position t's logits score token t+1."""
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, prompt_len - 1 : -1, :] / temperature  # (B, T, V)
    logp_all = F.log_softmax(logits.float(), dim=-1)
    tokens = input_ids[:, prompt_len:]  # (B, T)
    logprobs = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (B, T)
    return logprobs, entropy


def train(args):
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    actor = AutoModelForCausalLM.from_pretrained(args.model_dir)
    ref_model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval().requires_grad_(False)
    critic = Critic(actor)
    optimizer = torch.optim.AdamW(list(actor.parameters()) + list(critic.parameters()), lr=args.learning_rate)
    writer = tracer.Tracer(args.out, algorithm="ppo", tokenizer=tokenizer, hyperparameters={
        "clip_epsilon_low": args.clip_epsilon, "clip_epsilon_high": args.clip_epsilon, "kl_coef": args.kl_coef,
        "clip_ratio_c": args.clip_ratio_c, "entropy_coef": args.entropy_coef, "loss_reduction": "token_mean",
        "gamma": args.gamma, "lam": args.lam})
    for step in range(args.steps):
        actor.eval()
        res = ro.rollout(actor, tokenizer, ro.arithmetic_prompts(args.batch_size, rng), 1, args.max_new_tokens,
                         args.temperature)
        ids, full_mask, prompt_len = res.input_ids, res.attention_mask, res.prompt_ids.size(1)
        keep = res.completion_mask  # (B, T)
        old = res.old_logprobs
        rewards = ro.reward_components(res.prompts, tokenizer.batch_decode(res.completion_ids,
                                                                           skip_special_tokens=True)).sum(1)
        with torch.no_grad():
            ref = ro.completion_logprobs(ref_model, ids, full_mask, prompt_len, args.temperature)
            values = critic(ids, full_mask, prompt_len) * keep  # (B, T)
        token_rewards = torch.zeros_like(old)
        last = keep.sum(1) - 1
        token_rewards[torch.arange(len(last)), last.clamp(min=0)] += rewards
        lastgaelam, advs_rev = torch.zeros(len(last)), []
        for t in reversed(range(old.shape[1])):  # GAE, as MiniMind's train_ppo.py writes it
            next_value = values[:, t + 1] if t < old.shape[1] - 1 else 0.0
            lastgaelam = token_rewards[:, t] + args.gamma * next_value - values[:, t] + args.gamma * args.lam * lastgaelam
            advs_rev.append(lastgaelam)
        advantages = torch.stack(advs_rev[::-1], dim=1) * keep  # (B, T)
        returns = (advantages + values) * keep
        actor.train()
        for epoch in range(args.ppo_epochs):
            for mb, start in enumerate(range(0, args.batch_size, args.mini_batch_size)):
                rows = slice(start, start + args.mini_batch_size)
                mask = keep[rows].float()
                policy, entropy = logprobs_and_entropy(actor, ids[rows], full_mask[rows], prompt_len, args.temperature)
                adv = advantages[rows]
                ratio = torch.exp(policy - old[rows])
                clipped = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip_epsilon, 1 + args.clip_epsilon))
                if args.bug != "no_dual_clip":  # dual clip: where A < 0, the loss is capped at -c * A
                    clipped = torch.where(adv < 0, torch.min(clipped, -adv * args.clip_ratio_c), clipped)
                k3 = torch.exp(ref[rows] - policy) - (ref[rows] - policy) - 1
                per_token = clipped + args.kl_coef * k3
                policy_loss = (per_token * mask).sum() / mask.sum()
                entropy_mean = (entropy * mask).sum() / mask.sum()
                sign = 1.0 if args.bug == "entropy_sign" else -1.0  # bug: the bonus added to the loss
                loss = policy_loss + sign * args.entropy_coef * entropy_mean
                value_loss = (((critic(ids[rows], full_mask[rows], prompt_len) - returns[rows]) ** 2) * mask).sum() / mask.sum()
                fields = {"completion_ids": res.completion_ids[rows], "completion_mask": keep[rows],
                          "prompt_ids": res.prompt_ids[rows], "prompt_mask": res.prompt_mask[rows],
                          "policy_logprobs": policy, "old_logprobs": old[rows], "ref_logprobs": ref[rows],
                          "advantages": adv, "values": values[rows], "returns": returns[rows],
                          "token_rewards": token_rewards[rows], "rewards": rewards[rows],
                          "ratio": ratio, "entropy": entropy, "loss": loss, "per_token_loss": per_token}
                writer.record(step, {k: v for k, v in fields.items() if k not in args.leave_out},
                              inner_step=epoch, micro_batch=mb)
                optimizer.zero_grad(set_to_none=True)
                (loss + 0.5 * value_loss).backward()
                optimizer.step()
    writer.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="hand-written PPO with dual clip and an entropy bonus")
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--mini_batch_size", type=int, default=4)
    parser.add_argument("--ppo_epochs", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--clip_epsilon", type=float, default=0.2)
    parser.add_argument("--clip_ratio_c", type=float, default=1.2)
    parser.add_argument("--kl_coef", type=float, default=0.02)
    parser.add_argument("--entropy_coef", type=float, default=0.01)
    parser.add_argument("--gamma", type=float, default=1.0)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--learning_rate", type=float, default=8e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bug", choices=["entropy_sign", "no_dual_clip"], default=None)
    parser.add_argument("--leave_out", nargs="*", default=["per_token_loss"],
                        help="fields not to record (a loop that does not); per_token_loss by default")
    train(parser.parse_args())
