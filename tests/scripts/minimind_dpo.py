"""DPO written the way MiniMind's trainer/train_dpo.py is (seed lesson 25): chosen and rejected
stacked in one batch (x, y, mask), per-token policy_log_probs / ref_log_probs, summed under the mask
inside dpo_loss. It knows nothing of tracer: tests trace it with `python -m tracer run --algo dpo`.

Numerically it is tracer/demo/dpo_loop.py (same seed, same pairs).

``--bug ref_is_policy`` injects reference aliasing: the reference model is the policy object itself
(``ref_model = model`` instead of a frozen deep copy), so the reference forward scores with the
weights being trained, every DPO logit is 0 and the loss stays at log 2.
"""

import argparse
import copy
import random

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracer.demo.dpo_loop import encode_side, preference_pairs


def logits_to_log_probs(logits, labels):
    log_probs = F.log_softmax(logits, dim=2)
    return torch.gather(log_probs, dim=2, index=labels.unsqueeze(2)).squeeze(-1)


def dpo_loss(ref_log_probs, policy_log_probs, mask, beta):
    ref_log_probs = (ref_log_probs * mask).sum(dim=1)
    policy_log_probs = (policy_log_probs * mask).sum(dim=1)
    batch_size = ref_log_probs.shape[0]
    chosen_ref_log_probs = ref_log_probs[: batch_size // 2]
    reject_ref_log_probs = ref_log_probs[batch_size // 2 :]
    chosen_policy_log_probs = policy_log_probs[: batch_size // 2]
    reject_policy_log_probs = policy_log_probs[batch_size // 2 :]
    pi_logratios = chosen_policy_log_probs - reject_policy_log_probs
    ref_logratios = chosen_ref_log_probs - reject_ref_log_probs
    logits = pi_logratios - ref_logratios
    loss = -F.logsigmoid(beta * logits)
    return loss.mean()


def pad_to(t, width, value):
    return F.pad(t, (0, width - t.shape[1]), value=value)


def train_epoch(model, ref_model, tokenizer, optimizer, args):
    rng = random.Random(args.seed)
    model.train()
    for step in range(args.steps):
        prompts, chosen, rejected = zip(*preference_pairs(args.batch_size, rng))
        c_ids, c_att, c_mask = encode_side(tokenizer, list(prompts), list(chosen))
        r_ids, r_att, r_mask = encode_side(tokenizer, list(prompts), list(rejected))
        S = max(c_ids.shape[1], r_ids.shape[1])
        pad = tokenizer.pad_token_id
        c_ids, r_ids = pad_to(c_ids, S, pad), pad_to(r_ids, S, pad)
        x_chosen, y_chosen, mask_chosen = c_ids[:, :-1], c_ids[:, 1:], pad_to(c_mask, S, 0)[:, 1:]
        x_rejected, y_rejected, mask_rejected = r_ids[:, :-1], r_ids[:, 1:], pad_to(r_mask, S, 0)[:, 1:]
        attention = torch.cat([pad_to(c_att, S, 0), pad_to(r_att, S, 0)])[:, :-1]
        x = torch.cat([x_chosen, x_rejected], dim=0)  # (2B, S - 1)
        y = torch.cat([y_chosen, y_rejected], dim=0)
        mask = torch.cat([mask_chosen, mask_rejected], dim=0)
        with torch.no_grad():
            ref_logits = ref_model(input_ids=x, attention_mask=attention).logits
        ref_log_probs = logits_to_log_probs(ref_logits, y)  # (2B, S - 1)
        logits = model(input_ids=x, attention_mask=attention).logits
        policy_log_probs = logits_to_log_probs(logits, y)
        loss = dpo_loss(ref_log_probs, policy_log_probs, mask, beta=args.beta)
        loss = loss / args.accumulation_steps  # as MiniMind's train_dpo.py: the optimizer steps every N batches
        loss.backward()
        if (step + 1) % args.accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: dpo loss {loss.item():.4f}")


def main(args):
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    if args.bug == "ref_is_policy":
        ref_model = model  # the bug: the reference is the policy being trained
    else:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    train_epoch(model, ref_model, tokenizer, optimizer, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="MiniMind-style DPO on the tiny model")
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--accumulation_steps", type=int, default=1, help="MiniMind's gradient accumulation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bug", choices=("ref_is_policy",), default=None,
                        help="inject a bug: ref_is_policy = the reference model is the policy object")
    args = parser.parse_args()
    main(args)
