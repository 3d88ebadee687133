"""(b) DAPO-style GRPO: left-padded prompts, G samples per prompt, group z-score advantages
(TRL-like: unbiased std, + 1e-4), asymmetric clipping (eps_low 0.2, eps_high 0.28), no KL (beta 0),
token-level loss normalisation (sum over all kept tokens of the batch / their count), two
iterations over each rollout (``for it in ...``: a name the shipped map does not list). Knows nothing
of tracer: traced by ``tracer run``. Environment: BUG=<name> injects one bug (below)."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
from common import PROMPTS, build_tokenizer, encode_prompts, reward_fn, sample

p = argparse.ArgumentParser()
p.add_argument("--num_generations", type=int, default=4)
p.add_argument("--epsilon", type=float, default=0.2)
p.add_argument("--epsilon_high", type=float, default=0.28)
p.add_argument("--beta", type=float, default=0.0)
p.add_argument("--temperature", type=float, default=0.9)
p.add_argument("--num_iterations", type=int, default=2)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--max_new", type=int, default=8)
args = p.parse_args()
BUG = os.environ.get("BUG", "")

gen = torch.Generator().manual_seed(1)
tokenizer = build_tokenizer()
model = common.sft_model(tokenizer, 0)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
G = args.num_generations
prompts = PROMPTS[:4]


def get_per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    L = prompt_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if BUG == 'no_posids':
        position_ids = None  # BUG: left padding shifts the positions (sampler used the right ones)
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids).logits
    logits = logits[:, L - 1:-1, :] / (1.0 if BUG == 'notemp' else args.temperature)
    if BUG == "shift":
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids).logits
        logits = torch.cat([logits[:, L:], logits[:, -1:]], 1) / args.temperature
    return torch.gather(logits.log_softmax(-1), 2, completion_ids.unsqueeze(-1)).squeeze(-1)


for step in range(args.steps):
    model.eval()
    enc = encode_prompts(tokenizer, [q for q in prompts for _ in range(G)])
    prompt_ids, prompt_mask = enc
    with torch.no_grad():
        completion_ids, completion_mask, sampling_logps = sample(
            model, prompt_ids, prompt_mask, args.max_new, args.temperature, gen=gen)
        if BUG == 'cut_real_len':
            # BUG: cut the completion at the first row's real prompt length, not the padded width
            sequences = torch.cat([prompt_ids, completion_ids], 1)
            n = int(prompt_mask[0].sum())
            completion_ids = sequences[:, n:n + completion_ids.shape[1]]
        if BUG == "pad_unmasked":
            completion_mask = torch.ones_like(completion_mask)
        old_per_token_logps = get_per_token_logps(model, prompt_ids, prompt_mask,
                                                  completion_ids, completion_mask)
        rewards = reward_fn(tokenizer, completion_ids, completion_mask)
        grouped = rewards.view(-1, G)
        mean_grouped = grouped.mean(1).repeat_interleave(G)
        std_grouped = grouped.std(1).repeat_interleave(G)
        advantages = (rewards - mean_grouped) / (std_grouped + 1e-4)
        if BUG == "adv_batch_norm":
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    model.train()
    for it in range(args.num_iterations):
        per_token_logps = get_per_token_logps(model, prompt_ids, prompt_mask,
                                              completion_ids, completion_mask)
        if BUG == "old_stale":
            old_per_token_logps = per_token_logps.detach()
        ratio = torch.exp(per_token_logps - old_per_token_logps)
        coef_1 = ratio
        coef_2 = torch.clamp(ratio, 1 - args.epsilon, 1 + (args.epsilon if BUG == 'sym_clip' else args.epsilon_high))
        per_token_loss = -torch.min(coef_1 * advantages.unsqueeze(1),
                                    coef_2 * advantages.unsqueeze(1))
        mask = completion_mask.float()
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        if BUG == 'seq_mean_loss':
            loss = ((per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"step {step} reward {rewards.mean():.3f} loss {loss.item():.4f}")
