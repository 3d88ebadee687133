"""(d) GRPO with a reference KL in the loss (beta 0.04, k3), gradient accumulation over
micro-batches (one optimizer step per pass over the rollout), response mask cut from the full
attention mask, old logprobs recomputed under no_grad with the same weights before the first pass,
population-std group z-score, sequence-mean loss. Explicit API: one record per micro-batch.
``python grpo_accum.py OUT``; environment: MB=<rows per micro-batch>, KL_EST=k2 (verl's "mse" KL in the
loss), KL_EST_META=<name> (record kl_estimator = name), BUG=<name> injects one bug (below)."""
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
from common import PROMPTS, build_tokenizer, encode_prompts, reward_fn, sample
import tracer

OUT = sys.argv[1]
BUG = os.environ.get("BUG", "")
MB = int(os.environ.get("MB", "4"))  # micro-batch rows
G, EPS, BETA, TEMP, T, ITERS = 4, 0.2, 0.04, 1.0, 8, 2
gen = torch.Generator().manual_seed(3)
tok = build_tokenizer()
model = common.sft_model(tok, 0)
ref_model = copy.deepcopy(model).eval()
opt = torch.optim.AdamW(model.parameters(), lr=5e-3)


def per_token_logps(m, input_ids, attention_mask, L):
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = m(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits
    logits = logits[:, L - 1:-1].float() / TEMP
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, L:, None]).squeeze(-1)


writer = tracer.Tracer(OUT, algorithm="grpo", tokenizer=tok, hyperparameters={
    "num_generations": G, "beta": BETA, "clip_epsilon_low": EPS, "clip_epsilon_high": EPS,
    "loss_reduction": "sequence_mean", "temperature": TEMP, "advantage_rule": "group_zscore"})
for step in range(3):
    model.eval()
    prompt_ids, prompt_mask = encode_prompts(tok, [q for q in PROMPTS[:4] for _ in range(G)])
    L = prompt_ids.shape[1]
    with torch.no_grad():
        completion_ids, resp_attn, sampler_lp = sample(model, prompt_ids, prompt_mask, T, TEMP, gen=gen)
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attention_mask = torch.cat([prompt_mask, resp_attn], 1)
        response_mask = attention_mask[:, L:].bool()  # response-only mask from the attention mask
        if BUG == "prompt_in_mask":
            # BUG: loss mask taken from the whole attention mask, then the last T columns of the
            # shifted (input-position) view: the last prompt token enters, EOS is dropped
            response_mask = attention_mask[:, L - 1:-1].bool()
        old_logps = per_token_logps(model, input_ids, attention_mask, L)
        ref_logps = per_token_logps(ref_model, input_ids, attention_mask, L)
        rewards = reward_fn(tok, completion_ids, response_mask)
        rg = rewards.view(-1, G)
        advantages = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, unbiased=False, keepdim=True) + 1e-4)).view(-1)
    group_ids = torch.arange(len(rewards)) // G
    model.train()
    n_mb = len(rewards) // MB
    for inner in range(ITERS):
        opt.zero_grad()
        for mb in range(n_mb):
            sl = slice(mb * MB, (mb + 1) * MB)
            logp = per_token_logps(model, input_ids[sl], attention_mask[sl], L)
            old = old_logps[sl]
            if BUG == "stale_old" and inner == 0:
                old = old_prev[sl] if step > 0 else old  # BUG: old logprobs of the previous rollout's model
            ref = ref_logps[sl]
            m = response_mask[sl].float()
            ratio = torch.exp(logp - old)
            A = advantages[sl, None]
            d = ref - logp
            k3 = torch.exp(d) - d - 1
            if BUG == "kl_swap":
                k3 = torch.exp(-d) + d - 1  # BUG: KL(ref||policy) estimator, arguments swapped
            pg = torch.min(ratio * A, ratio.clamp(1 - EPS, 1 + EPS) * A)
            if os.environ.get('KL_EST') == 'k2':
                k3 = 0.5 * (logp - ref) ** 2  # verl kl_loss_type='mse' (k2) in the loss
            per_token_loss = -(pg - BETA * k3)
            if BUG == "kl_sign":
                per_token_loss = -(pg + BETA * k3)  # BUG: KL penalty sign flipped (rewards drift)
            loss = ((per_token_loss * m).sum(1) / m.sum(1).clamp(min=1)).mean() / n_mb
            writer.record(step, {
                "prompt_ids": prompt_ids[sl], "prompt_mask": prompt_mask[sl],
                "completion_ids": completion_ids[sl], "completion_mask": m,
                "policy_logprobs": logp, "old_logprobs": old, "ref_logprobs": ref,
                "sampler_logprobs": sampler_lp[sl], "ratio": ratio,
                **({} if os.environ.get("KL_EST") else {"ref_kl_k3": k3}),
                "rewards": rewards[sl], "advantages": advantages[sl], "group_ids": group_ids[sl],
                "per_token_loss": per_token_loss, "loss": loss,
            }, inner_step=inner, micro_batch=mb, metadata={"loss_scale": 1.0 / n_mb,
                                                           "gradient_accumulation_steps": n_mb,
                                                           **({"kl_estimator": os.environ["KL_EST_META"]}
                                                              if os.environ.get("KL_EST_META") else {})})
            loss.backward()
        opt.step()
    old_prev = old_logps
    if BUG == "ref_sync":
        ref_model.load_state_dict(model.state_dict())  # BUG: reference synced to the policy each step
    print(f"step {step} reward {rewards.mean():.3f}")
writer.close()
