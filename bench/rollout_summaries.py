"""What the per-row (rollout) summaries cost the writer thread and the disk: one GRPO step of B rows x
T completion tokens (the issue's 64 x 256), its row statistics and texts computed as the writer does
(:meth:`tracer.record.step_writer.StepWriter._summarise_rows` -> :func:`tracer.formulas.rows.row_statistics`,
:func:`tracer.format.rollout_store.completion_text`) and its line (:func:`tracer.format.rollout_store.line_of`),
against the step file's own size and the step summary's time. Then ``Trace.rollouts()`` of a run of
S such steps from the summaries and from the tensors.

    .venv/bin/python -m bench.rollout_summaries [--rows 64] [--tokens 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import random
import string
import tempfile
import time
from pathlib import Path

import torch

from tracer.format import rollout_store
from tracer.format.rollout_store import ROLLOUT_GLOB
from tracer.formulas import rows as row_formulas
from tracer.formulas import summaries
from tracer.formulas.derived import derive_fields
from tracer.read import Trace
from tracer.record.writer import TraceWriter


def _step(B: int, T: int, V: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    policy = -3 * torch.rand(B, T, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return {"completion_ids": torch.randint(0, V, (B, T), generator=g), "completion_mask": mask,
            "policy_logprobs": policy, "old_logprobs": policy + 0.01 * torch.randn(B, T, generator=g),
            "ref_logprobs": policy + 0.1 * torch.randn(B, T, generator=g),
            "sampler_logprobs": policy + 0.02 * torch.randn(B, T, generator=g),
            "entropy": torch.rand(B, T, generator=g), "rewards": torch.rand(B, generator=g),
            "reward_components": torch.rand(B, 2, generator=g), "advantages": torch.randn(B, generator=g),
            "group_ids": torch.arange(B) // 8}


def _best(fn, repeat: int = 20) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    B, T, V = args.rows, args.tokens, 50_000
    rng = random.Random(0)
    vocabulary = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 7))) for _ in range(V)]
    g = torch.Generator().manual_seed(0)
    tensors = _step(B, T, V, g)
    meta = {"num_generations": 8, "reward_component_names": ["format", "answer"], "clip_epsilon_low": 0.2,
            "clip_epsilon_high": 0.2}
    data = {**tensors, **derive_fields(tensors, meta)}
    shown = rollout_store.shown_tokens(vocabulary)

    def rows():
        stats = row_formulas.row_statistics(data, meta)
        texts = [rollout_store.completion_text(shown, ids) for ids in row_formulas.kept_ids(data)]
        return rollout_store.line_of("step.safetensors", (0, 0, 0, 0), 1, stats, [t for t, _ in texts],
                                     [c for _, c in texts], meta["reward_component_names"])

    row_s = _best(rows)
    summary_s = _best(lambda: summaries.compute_summaries([(data, meta)]))
    line = rows()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        with TraceWriter(root, "grpo", hyperparameters=meta, vocabulary=vocabulary) as w:
            for step in range(args.steps):
                w.record(step, _step(B, T, V, g))
        step_bytes = sum(p.stat().st_size for p in (root / "steps").iterdir()) / args.steps
        store_bytes = sum(p.stat().st_size for p in root.glob(ROLLOUT_GLOB))
        from_summary = _best(lambda: Trace(root).rollouts(), repeat=3)
        for path in root.glob(ROLLOUT_GLOB):
            path.unlink()
        from_tensors = _best(lambda: Trace(root).rollouts(), repeat=1)
    print(f"one step of {B} rows x {T} tokens:")
    print(f"  rollout line: {len(line.encode()):,} bytes ({len(line.encode()) / step_bytes:.1%} of the step file's "
          f"{step_bytes:,.0f} bytes)")
    print(f"  writer thread: row statistics + texts + line {row_s * 1e3:.2f} ms (the step summary: "
          f"{summary_s * 1e3:.2f} ms)")
    print(f"{args.steps} steps: rollouts file {store_bytes / 2**20:.1f} MiB; Trace.rollouts() {from_summary:.2f} s "
          f"from the summaries, {from_tensors:.2f} s from the tensors ({args.steps * B:,} rows)")


if __name__ == "__main__":
    main()
