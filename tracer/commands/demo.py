"""``tracer demo``: run a tiny real trainer on CPU with the tracer attached (:func:`tracer.demo.runner.run_demo`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

from tracer.errors import TraceError


def main(args: argparse.Namespace) -> int:
    """Check the demo's options against each other and against the installed extras, then run it.

    Raises:
        TraceError: two demo names, ``--steps`` < 1, an option of another demo, a missing extra
            (vLLM, transformers, TRL), or an ``--out`` inside a file.
    """
    if args.name is not None and args.algo is not None and args.name != args.algo:
        raise TraceError(f"demo {args.name} --algo {args.algo}: name one demo, either as `tracer demo {args.name}` "
                         f"or with --algo {args.name}")
    args.algo = args.name or args.algo or "grpo"
    if args.steps < 1:
        raise TraceError(f"--steps must be >= 1, got {args.steps}")
    if args.leak_tool_output and args.algo != "agent":
        raise TraceError(f"--leak-tool-output applies to the agent demo only, not {args.algo}")
    if args.bug is not None and args.algo != "grpo-vllm":
        raise TraceError(f"--bug applies to --algo grpo-vllm only, not {args.algo}")
    if args.rollout != "hf" and args.algo not in ("grpo", "cispo"):
        raise TraceError(f"--rollout {args.rollout} applies to --algo grpo and cispo only, not {args.algo}")
    if (args.algo == "grpo-vllm" or args.rollout == "vllm") and importlib.util.find_spec("vllm") is None:
        what = "--algo grpo-vllm" if args.algo == "grpo-vllm" else "--rollout vllm"
        raise TraceError(f"{what} needs vLLM in this environment: `make .venv-vllm` builds one "
                         "(torch 2.13.0 first, then pip install -e '.[vllm]'); see docs/vllm.md")
    missing = [m for m in ("transformers", "tokenizers")
               + (("trl",) if args.algo.endswith(("-trl", "-vllm")) or args.algo == "agent" else ())
               if importlib.util.find_spec(m) is None]
    if missing:
        raise TraceError(f"--algo {args.algo} needs {', '.join(missing)} (its tiny model is a transformers model"
                         f"{', trained by TRL' if 'trl' in missing else ''}): install the trl extra, "
                         "pip install 'tracer[trl]' (from a checkout: pip install -e '.[trl]')")
    out_path = Path(args.out)
    blocker = next((p for p in (out_path, *out_path.parents) if (p.exists() or p.is_symlink()) and not p.is_dir()),
                   None)
    if blocker is not None:
        what = "a link to nothing" if blocker.is_symlink() and not blocker.exists() else "a file"
        raise TraceError(f"--out {args.out}: {blocker} is {what}, not a folder; pass a folder for the demo's "
                         "trace (and its tiny model)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tracer.demo.runner import run_demo

    out = run_demo(args.algo, args.out, steps=args.steps, seed=args.seed, progress=True, bug=args.bug,
                   rollout=args.rollout, leak_tool_output=args.leak_tool_output)
    print(f"wrote trace to {out}; browse it with: python -m tracer view {out}")
    return 0
