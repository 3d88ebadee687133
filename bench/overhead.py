"""Overhead of tracing every step of a CPU training loop shaped like GRPO (B = 32, T = 256).

Interleaved runs of the same loop with and without the tracer (order alternating each round);
the ratio of the median run times is the overhead. Each traced run includes its final close()
(the flush of the last queued steps). Target: <= 1.03.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from bench.common import machine, median, timed
from tracer import formulas
from tracer.record.writer import TraceWriter


def make_model(vocab: int = 512, hidden: int = 64, layers: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return Qwen2ForCausalLM(cfg)


def run_loop(model, optimizer, steps: int, B: int, T: int, L: int, writer: TraceWriter | None, step0: int = 0) -> None:
    """``steps`` steps of the loop; traced into ``writer`` (numbered from ``step0``) when given."""
    g = torch.Generator().manual_seed(1)
    for step in range(step0, step0 + steps):
        input_ids = torch.randint(0, model.config.vocab_size, (B, L + T), generator=g)
        completion_mask = torch.ones(B, T, dtype=torch.bool)
        logits = model(input_ids=input_ids).logits
        policy = formulas.token_logprobs(logits, input_ids, L)  # (B, T)
        old = policy.detach()
        rewards = torch.rand(B, generator=g)
        advantages = formulas.group_advantages(rewards, 8)
        per_token_loss = formulas.grpo_per_token_loss(policy, old, advantages, 0.2, 0.2)
        loss = formulas.sequence_mean_loss(per_token_loss, completion_mask)
        if writer is not None:
            p = policy.detach()
            writer.record(step, prompt_ids=input_ids[:, :L], completion_ids=input_ids[:, L:],
                          completion_mask=completion_mask, policy_logprobs=p, old_logprobs=old,
                          ratio=formulas.ratio(p, old), approx_kl_k2=formulas.approx_kl_k2(p, old),
                          rewards=rewards, advantages=advantages, group_ids=torch.arange(B) // 8,
                          per_token_loss=per_token_loss.detach(), loss=loss.detach())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def measure(rounds: int = 7, steps: int = 10, B: int = 32, T: int = 256, L: int = 32) -> dict:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run_loop(model, optimizer, 2, B, T, L, None)  # warm-up
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                if mode == "off":
                    off.append(timed(run_loop, model, optimizer, steps, B, T, L, None))
                else:
                    def traced(i=r):
                        with TraceWriter(f"{tmp}/run{i}", "grpo", hyperparameters={"num_generations": 8}) as w:
                            run_loop(model, optimizer, steps, B, T, L, w)
                    on.append(timed(traced))
    return {"step_ms_off": 1e3 * median(off) / steps, "step_ms_on": 1e3 * median(on) / steps,
            "ratio": median(on) / median(off), "rounds": rounds, "steps_per_run": steps, "B": B, "T": T}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(machine())
    res = measure(args.rounds)
    print(f"overhead: {res['step_ms_on']:.1f} ms/step traced vs {res['step_ms_off']:.1f} ms/step untraced "
          f"(B={res['B']}, T={res['T']}) -> ratio {res['ratio']:.3f} (target <= 1.03)")
