"""The bundled comparable pair for ``tracer diff`` and the app's Diff page.

``python -m tracer.demo.diff_pair sample_traces`` (``make sample-diff-pair``) runs the hand-written
GRPO loop (``tracer.demo.grpo_loop``: 3 steps, seed 0, the same tiny model) twice:

- ``grpo-diff-baseline``: the loop as it is;
- ``grpo-diff-scorer-clip``: the same loop with one documented change to the reward function: the
  scorer's score is clipped to ±2 instead of ±3 (``GRPOConfig.scorer_clip``).

Step 0 samples the same prompts and completions in both runs, so the first divergence is the rewards
of the completions the scorer rated above 2 (and their components); everything downstream follows
from them: those groups' advantages, the per-token loss, and from step 0's first update on, the
weights, so the policy logprobs of the next pass and the later steps' completions.
``tracer diff sample_traces/grpo-diff-baseline sample_traces/grpo-diff-scorer-clip`` names
``rewards`` as the cause. The variant's manifest config names its baseline (``diff_baseline``, a
path relative to the trace) and the change (``diff_change``): the app's Diff page opens on such a pair.
"""

from __future__ import annotations

import argparse
from pathlib import Path

BASELINE, VARIANT = "grpo-diff-baseline", "grpo-diff-scorer-clip"
CHANGE = {"scorer_clip": 2.0}  # the one change of the variant (baseline: GRPOConfig's 3.0)


def write_pair(root: str | Path, steps: int = 3, seed: int = 0, progress: bool = False) -> tuple[Path, Path]:
    """Write the baseline and the variant trace under ``root``; returns their paths.

    Raises:
        TraceError: either directory already holds a trace.
    """
    from tracer.demo import grpo_loop
    from tracer.demo.tiny_model import build_tiny_model
    from tracer.record.writer import refuse_existing_trace

    root = Path(root)
    out = []
    declared = {"diff_baseline": f"../{BASELINE}", "diff_change": "scorer_clip 3.0 -> 2.0 (the reward function)"}
    for name, change, config in ((BASELINE, {}, {}), (VARIANT, CHANGE, declared)):
        refuse_existing_trace(root / name)
        model_dir = build_tiny_model(root / name / "model", seed=seed)
        cfg = grpo_loop.GRPOConfig(steps=steps, seed=seed, **change)
        out.append(grpo_loop.run(root / name, cfg, model_dir, config=config))
    return out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tracer.demo.diff_pair", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="directory to write the two traces into (e.g. sample_traces)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_pair(args.root, args.steps, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
