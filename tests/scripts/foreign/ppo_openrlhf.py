"""(a) OpenRLHF-style PPO: separate critic, KL (k1) folded into the per-token reward, GAE,
advantages whitened over the masked tokens of the whole rollout, several PPO epochs over
minibatches, clipped value loss. Explicit API (tracer.Tracer + record per minibatch).
``python ppo_openrlhf.py OUT``; environment: BUG=<name> injects one bug (below), KLR=1 records
kl_in_reward = true, OMIT_KLCOEF=1 records no kl_coef."""
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (PROMPTS, Critic, build_model, build_tokenizer, encode_prompts, reward_fn,
                    sample)
import common
def token_logprobs(model, pi, pm, ci, ca, temp=1.0):
    if BUG == 'shift':
        L = pi.shape[1]
        ids = torch.cat([pi, ci], 1); attn = torch.cat([pm, ca.long()], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        logits = torch.cat([logits[:, L:], logits[:, -1:]], 1).float() / temp  # BUG: off by one
        return torch.log_softmax(logits, -1).gather(-1, ci[..., None]).squeeze(-1)
    if BUG == 'notemp':
        temp = 1.0
    return common.token_logprobs(model, pi, pm, ci, ca, temp)

import tracer
BUG = os.environ.get('BUG', '')

OUT = sys.argv[1]
gen = torch.Generator().manual_seed(0)
tok = build_tokenizer()
V = len(tok)
actor = common.sft_model(tok, 0)
ref = copy.deepcopy(actor).eval()
if BUG == 'ref_is_actor':
    ref = actor  # BUG: reference model shares the actor's weights (moves with it)
critic = Critic(V, 1)
opt_a = torch.optim.Adam(actor.parameters(), lr=3e-3)
opt_c = torch.optim.Adam(critic.parameters(), lr=3e-3)
gamma, lam, eps, vclip, kl_coef = 1.0, 0.95, 0.2, 0.2, 0.05
ppo_epochs, mb_size, T = 2, 3, 8
TEMP = 0.7 if BUG == 'notemp' else 1.0
prompt_ids, prompt_mask = encode_prompts(tok, PROMPTS)
B, L = prompt_ids.shape

writer = tracer.Tracer(OUT, algorithm="ppo", tokenizer=tok,
                       hyperparameters={"gamma": gamma, "lam": lam, "clip_epsilon_low": eps,
                                        "clip_epsilon_high": eps,
                                        "loss_reduction": "token_mean", "temperature": TEMP,
                                        "advantage_rule": "gae_whitened",
                                        **({} if os.environ.get("OMIT_KLCOEF") else {"kl_coef": kl_coef}), **({"kl_in_reward": True} if os.environ.get("KLR") else {})})
for step in range(3):
    actor.eval()
    with torch.no_grad():
        seq, action_mask, sampler_lp = sample(actor, prompt_ids, prompt_mask, T, TEMP, gen=gen)
        action_mask = action_mask.float()
        old_lp = token_logprobs(actor, prompt_ids, prompt_mask, seq, action_mask, TEMP)
        ref_lp = token_logprobs(ref, prompt_ids, prompt_mask, seq, action_mask, TEMP)
        ids = torch.cat([prompt_ids, seq], 1)
        attn = torch.cat([prompt_mask, action_mask.long()], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        # value of the state before each action token: hidden state at L-1 .. L+T-2
        values = critic(ids, attn, pos)[:, L - 1:-1]
        if not os.environ.get('VALUES_UNMASKED'):
            values = values * action_mask
        r = reward_fn(tok, seq, action_mask)
        # per-token reward: -kl_coef * k1 on every action, sequence reward on the last action
        kl = (old_lp - ref_lp) * action_mask
        if BUG == 'kl_sign':
            kl = -kl  # BUG: KL sign flipped in the reward
        token_rewards = -kl_coef * kl
        if BUG == 'no_reward_kl':
            token_rewards = torch.zeros_like(kl)  # BUG: kl_coef configured, but the penalty is nowhere
        last = action_mask.sum(1).long() - 1
        if BUG == 'reward_last_col':
            token_rewards[:, -1] += r  # BUG: last column, even when padded
        else:
            token_rewards[torch.arange(B), last] += r
        # GAE (OpenRLHF get_advantages_and_returns)
        lastgaelam = torch.zeros(B)
        adv_rev = []
        for t in reversed(range(T)):
            nextv = values[:, t + 1] * action_mask[:, t + 1] if t < T - 1 else torch.zeros(B)
            if BUG == 'gae_bootstrap_pad':
                nextv = values[:, t + 1] if t < T - 1 else torch.zeros(B)  # BUG: bootstraps from the value at a pad slot
            delta = (token_rewards[:, t] + gamma * nextv - values[:, t]) * action_mask[:, t]
            lastgaelam = (delta + gamma * lam * lastgaelam) * action_mask[:, t]
            adv_rev.append(lastgaelam)
        raw_adv = torch.stack(adv_rev[::-1], 1)
        returns = raw_adv + values
        # whiten over the kept tokens of the whole rollout (OpenRLHF normalize)
        n = action_mask.sum()
        mean = (raw_adv * action_mask).sum() / n
        var = ((raw_adv - mean).pow(2) * action_mask).sum() / n
        advantages = (raw_adv - mean) * var.clamp(min=1e-8).rsqrt()
    actor.train()
    for ppo_epoch in range(ppo_epochs):
        perm = torch.randperm(B, generator=gen)
        for mb in range(B // mb_size):
            inds = perm[mb * mb_size:(mb + 1) * mb_size]
            m = action_mask[inds]
            if BUG == 'pad_unmasked':
                m = torch.ones_like(m)  # BUG: padding after EOS enters the loss
            logp = token_logprobs(actor, prompt_ids[inds], prompt_mask[inds], seq[inds], m, TEMP)
            old = old_lp[inds]
            if BUG == 'old_alias':
                old = logp.detach()  # BUG: old recomputed from the current policy
            if BUG == 'old_is_ref':
                old = ref_lp[inds]  # BUG: ratio against the reference logprobs
            ratio = torch.exp(logp - old)
            A = advantages[inds]
            surr1 = ratio * A
            surr2 = ratio.clamp(1 - eps, 1 + eps) * A
            per_token_loss = -torch.min(surr1, surr2)
            if BUG == 'kl_twice':  # BUG: the KL penalty of the rewards added to the loss as well (k3)
                d = ref_lp[inds] - logp
                per_token_loss = per_token_loss + kl_coef * (torch.exp(d) - d - 1)
            loss = (per_token_loss * m).sum() / m.sum()
            writer.record(step, {
                "completion_ids": seq[inds], "completion_mask": m,
                "prompt_ids": prompt_ids[inds], "prompt_mask": prompt_mask[inds],
                "policy_logprobs": logp, "old_logprobs": old, "ref_logprobs": ref_lp[inds],
                "sampler_logprobs": sampler_lp[inds],
                "values": values[inds], "returns": returns[inds],
                "token_rewards": token_rewards[inds], "rewards": r[inds], "advantages": A,
                "row_ids": inds, "ratio": ratio, "per_token_loss": per_token_loss, "loss": loss,
            }, inner_step=ppo_epoch, micro_batch=mb)
            opt_a.zero_grad()
            loss.backward()
            opt_a.step()
            # critic: clipped value loss
            v = critic(ids[inds], attn[inds], pos[inds])[:, L - 1:-1]
            v_clip = values[inds] + (v - values[inds]).clamp(-vclip, vclip)
            vl = torch.max((v - returns[inds]) ** 2, (v_clip - returns[inds]) ** 2)
            vloss = 0.5 * (vl * m).sum() / m.sum()
            opt_c.zero_grad()
            vloss.backward()
            opt_c.step()
    print(f"step {step} reward {r.mean():.3f} loss {loss.item():.4f}")
writer.close()
