"""Big GRPO traces for the viewer benchmark (``bench/viewer_browser.py``), written once by the real
``TraceWriter`` and cached under a directory keyed by a version string, so that later runs reuse
them (a 2,000-step trace of 64 x 256 tokens is ~2 GB and takes minutes to write on 2 cores).

Every step holds the canonical GRPO fields of SPEC section 4 with realistic values: left-padded
prompts (``prompt_ids``, ``prompt_mask`` [B, L]), completions of varying length that end in EOS and
then padding (``completion_ids``, ``completion_mask`` [B, T]), ``policy_logprobs``,
``old_logprobs`` (= policy: inner step 0 on fresh rollouts), ``ref_logprobs``, ``sampler_logprobs``
(old - sampler ~ 0.01 nats), ``entropy`` and the derived ``ratio``,
``ref_kl_k3``, ``approx_kl_k2``, ``per_token_loss`` (``tracer.formulas``), ``rewards`` and
``reward_components`` [B, F], group z-score ``advantages`` and ``group_ids`` (G = 8). A few
distinct steps are generated and rotated (the values do not change the timing; the files do
differ: each step's metadata and checksum are its own). The tokenizer is a 4,096-word toy
vocabulary, so ``tokens.json`` exists and token ids show as text.

    python -m bench.viewer_traces [--steps 200] [--B 64] [--T 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from tracer import formulas
from tracer.record.writer import TraceWriter

VERSION = "v2"  # bump when the generated content changes: the cache is keyed by it
CACHE = Path(os.environ.get("TRACER_BENCH_CACHE", Path(tempfile.gettempdir()) / "tracer-viewer-bench"))
L, F, G, VOCAB = 64, 3, 8, 4096
PAD, EOS = 0, 1
HYPER = {"num_generations": G, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28, "beta": 0.04,
         "loss_reduction": "sequence_mean", "temperature": 1.0}


class WordTokenizer:
    """The part of a tokenizer that TraceWriter reads: 4,096 word-like token strings."""

    name_or_path = "bench-words"
    eos_token_id = EOS
    pad_token_id = PAD
    padding_side = "left"

    def __init__(self) -> None:
        syllables = ["ka", "to", "ri", "ne", "mu", "sa", "lo", "vi", "de", "pa", "qu", "zo", "xe", "bu", "fi", "gh"]
        words = [" " + a + b + c for a in syllables for b in syllables for c in syllables]  # 4,096
        self.vocab = ["<pad>", "<eos>", *words[: VOCAB - 2]]

    def __len__(self) -> int:
        return len(self.vocab)

    def batch_decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return ["".join(self.vocab[i] for i in row) for row in ids]


def step_tensors(B: int, T: int, seed: int) -> dict[str, torch.Tensor]:
    """One GRPO step of ``B`` sequences (``B // G`` prompts x G generations) and ``T`` completion
    positions, every canonical field of a GRPO step with realistic values (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(L // 4, L + 1, (B // G, 1), generator=g).repeat_interleave(G, 0)  # (B, 1)
    prompt_mask = torch.arange(L).expand(B, L) >= L - prompt_len  # (B, L) left padding
    prompt_ids = torch.randint(2, VOCAB, (B // G, L), generator=g).repeat_interleave(G, 0)
    prompt_ids = torch.where(prompt_mask, prompt_ids, PAD)
    length = torch.randint(T // 8, T + 1, (B, 1), generator=g)  # (B, 1) tokens up to and including EOS
    pos = torch.arange(T).expand(B, T)  # (B, T)
    completion_mask = pos < length
    completion_ids = torch.randint(2, VOCAB, (B, T), generator=g)
    completion_ids = torch.where(pos == length - 1, EOS, torch.where(completion_mask, completion_ids, PAD))
    sampler = -torch.empty(B, T).exponential_(1.5, generator=g).clamp(min=1e-3, max=12.0)  # (B, T) nats < 0
    old = (sampler + 0.01 * torch.randn(B, T, generator=g)).clamp(max=-1e-4)  # the trainer's recomputation
    policy = old.clone()  # inner step 0, fresh rollouts: the policy has not moved yet (ratio 1)
    ref = (policy + 0.1 * torch.randn(B, T, generator=g)).clamp(max=-1e-4)
    components = torch.stack([torch.randint(0, 2, (B,), generator=g).float(),  # correctness
                              0.5 * torch.rand(B, generator=g),  # format
                              -0.001 * length[:, 0].float()], dim=1)  # (B, F) length penalty
    rewards = components.sum(1)  # (B,)
    grouped = rewards.view(B // G, G)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, unbiased=False, keepdim=True) + 1e-4)).view(B)
    group_ids = torch.arange(B) // G
    zero = torch.zeros(B, T)
    masked = lambda t: torch.where(completion_mask, t, zero)  # noqa: E731  values at padding: 0
    policy, old, ref, sampler = masked(policy), masked(old), masked(ref), masked(sampler)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "policy_logprobs": policy, "old_logprobs": old, "ref_logprobs": ref, "sampler_logprobs": sampler,
        "entropy": masked(3 * torch.rand(B, T, generator=g)),
        "ratio": formulas.ratio(policy, old), "ref_kl_k3": formulas.ref_kl_k3(policy, ref),
        "approx_kl_k2": formulas.approx_kl_k2(policy, old),
        "per_token_loss": masked(formulas.grpo_per_token_loss(policy, old, advantages, 0.2, 0.28, 0.04, ref)),
        "rewards": rewards, "reward_components": components, "advantages": advantages, "group_ids": group_ids,
    }


def trace_path(steps: int, B: int, T: int) -> Path:
    """Where the cached trace of this shape lies (``<cache>/<version>/grpo_<steps>x<B>x<T>``)."""
    return CACHE / VERSION / f"grpo_{steps}x{B}x{T}"


def ensure(steps: int, B: int = 64, T: int = 256, log=None) -> Path:
    """The cached trace of ``steps`` steps of B x T, written first when it is not there (a ``done``
    marker says a previous write finished; a half-written one is removed and written again)."""
    out = trace_path(steps, B, T)
    if (out / ".done").is_file():
        return out
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    variants = [step_tensors(B, T, seed) for seed in range(8)]
    with TraceWriter(out, "grpo", tokenizer=WordTokenizer(), hyperparameters=HYPER, max_queue_steps=8) as writer:
        for step in range(steps):
            writer.record(step, variants[step % len(variants)])
    (out / ".done").write_text(f"{VERSION} {steps}x{B}x{T} written in {time.perf_counter() - t0:.0f} s\n")
    if log is not None:
        log(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--T", type=int, default=256)
    args = parser.parse_args()
    print(ensure(args.steps, args.B, args.T, log=print))


if __name__ == "__main__":
    main()
