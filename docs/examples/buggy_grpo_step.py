"""One GRPO step with a classic bug: the completion mask keeps the padding after EOS.

    python docs/examples/buggy_grpo_step.py /tmp/buggy      # writes the trace
    python -m tracer check /tmp/buggy                       # finds the bug, exit code 1

Needs only the core install (no TRL, no model). The token ids and logprobs are made up; in your
loop they are the tensors your loss is built from.
"""

import sys

import torch

import tracer
from tracer.formulas import group_advantages

PAD, EOS = 0, 1
out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/buggy"

# 2 prompts x G = 2 completions, T = 6 tokens, right-padded after EOS
completion_ids = torch.tensor([[5, 6, 7, EOS, PAD, PAD],
                               [5, 8, EOS, PAD, PAD, PAD],
                               [9, 9, 6, 7, 5, EOS],
                               [9, 6, EOS, PAD, PAD, PAD]])
completion_mask = torch.ones(4, 6, dtype=torch.bool)   # BUG: should be False after the first EOS
policy_logprobs = -torch.rand(4, 6, generator=torch.Generator().manual_seed(0))
rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])

with tracer.Tracer(out, algorithm="grpo",
                   hyperparameters={"num_generations": 2, "beta": 0.0, "clip_epsilon_low": 0.2,
                                    "clip_epsilon_high": 0.2, "loss_reduction": "sequence_mean",
                                    "eos_token_id": EOS, "pad_token_id": PAD}) as writer:
    writer.record(0, {"completion_ids": completion_ids, "completion_mask": completion_mask,
                      "policy_logprobs": policy_logprobs, "old_logprobs": policy_logprobs.clone(),
                      "rewards": rewards, "advantages": group_advantages(rewards, 2),
                      "group_ids": torch.tensor([0, 0, 1, 1])})
print(f"wrote {out}; now run: python -m tracer check {out}")
