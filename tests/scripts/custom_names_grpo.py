"""A GRPO loop whose names MiniMind's map does not know (logp_new, logp_frozen, keep, seq_adv,
update, sweep...): traced with `tracer run --map custom_names.toml`. Its maths is tracer.formulas,
in the order of tracer/demo/grpo_loop.py, so its trace equals the demo's for the same seed.
"""

import argparse
import copy
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracer import formulas
from tracer.demo import rollout as ro


def train(policy, frozen, tok, cfg):
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    rng = random.Random(cfg.seed)
    for update in range(cfg.updates):
        questions = ro.arithmetic_prompts(cfg.prompts, rng)
        policy.eval()
        sampled = ro.rollout(policy, tok, questions, cfg.group_size, cfg.max_new_tokens, 1.0)
        texts = tok.batch_decode(sampled.completion_ids, skip_special_tokens=True)
        seq_reward = ro.reward_components(sampled.prompts, texts).sum(dim=1)
        seq_adv = formulas.group_advantages(seq_reward, cfg.group_size)
        width = sampled.prompt_ids.shape[1]
        with torch.no_grad():
            logp_frozen = ro.completion_logprobs(frozen, sampled.input_ids, sampled.attention_mask, width, 1.0)
        policy.train()
        keep = sampled.completion_mask
        for sweep in range(cfg.sweeps):
            logp_new = ro.completion_logprobs(policy, sampled.input_ids, sampled.attention_mask, width, 1.0)
            tok_loss = formulas.grpo_per_token_loss(logp_new, sampled.old_logprobs, seq_adv, cfg.clip, cfg.clip,
                                                    cfg.kl_weight, logp_frozen)
            objective = formulas.sequence_mean_loss(tok_loss, keep)
            opt.zero_grad(set_to_none=True)
            objective.backward()
            opt.step()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group_size", type=int, default=4)
    parser.add_argument("--sweeps", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--kl_weight", type=float, default=0.04)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    cfg = parser.parse_args()
    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(cfg.model_dir)
    policy = AutoModelForCausalLM.from_pretrained(cfg.model_dir)
    frozen = copy.deepcopy(policy).eval().requires_grad_(False)
    train(policy, frozen, tok, cfg)
