"""``python -m tracer demo --algo ALGO``: one entry for every demo trainer.

Hand-written loops (the seed's, traced through ``tracer.Tracer``): ``ppo``, ``grpo``, ``cispo``,
``dpo``. TRL trainers (traced through ``tracer.attach``): ``grpo-trl``, ``rloo-trl``, ``dpo-trl``, and
``grpo-vllm`` (TRL GRPO sampling with a colocated vLLM engine; needs the ``vllm`` extra), and
``agent`` (TRL GRPO with ``tools=``: multi-turn tool-calling episodes, :mod:`tracer.demo.agent_trl`).
All run on CPU in seconds on a tiny model built locally (``tracer.demo.tiny_model``).
"""

from __future__ import annotations

from pathlib import Path

from tracer.format.files import refuse_existing_trace

HAND_WRITTEN = ("ppo", "grpo", "cispo", "dpo")
TRL = ("grpo-trl", "rloo-trl", "dpo-trl")
VLLM = ("grpo-vllm",)  # TRL GRPO sampling with a colocated vLLM engine: needs the `vllm` extra
AGENT = "agent"  # TRL GRPO with tools=[add]: multi-turn tool-calling episodes
DEMO_ALGOS = HAND_WRITTEN + TRL + VLLM + (AGENT,)
ROLLOUTS = ("hf", "vllm")  # who samples in the hand-written grpo / cispo loop


def run_demo(algo: str, out_dir: str | Path, steps: int = 2, seed: int = 0, progress: bool = True,
             model_dir: str | Path | None = None, bug: str | None = None, rollout: str = "hf",
             leak_tool_output: bool = False) -> Path:
    """Run the demo trainer ``algo`` for ``steps`` optimizer steps and trace it into ``out_dir``.

    Args:
        algo: one of ``DEMO_ALGOS``.
        model_dir: a tiny model saved by ``build_tiny_model``; when None one is built into
            ``out_dir/model`` so that the trace carries the model that produced it (~0.2 MB; ~1 MB
            with the head_dim-64 shape that ``grpo-vllm`` needs).
        bug: ``grpo-vllm`` only: an injected sampler/trainer mismatch (``raw-logprobs`` or ``top-p``,
            :data:`tracer.demo.grpo_vllm.BUGS`).
        rollout: ``grpo`` / ``cispo`` only: ``hf`` (the policy's ``generate``) or ``vllm`` (a
            colocated vLLM engine synced each step; needs the ``vllm`` extra).
        leak_tool_output: ``agent`` only: leave the tool results in the loss
            (:func:`tracer.demo.agent_trl.leak_tool_output`).
    Raises:
        ValueError: unknown ``algo``, ``bug`` given for another demo or unknown, ``rollout`` unknown
            or given for another demo, ``leak_tool_output`` for another demo than ``agent``.
        TraceError: ``out_dir`` already holds a trace.
    """
    if algo not in DEMO_ALGOS:
        raise ValueError(f"unknown demo algorithm {algo!r}; choose one of {list(DEMO_ALGOS)}")
    if bug is not None and algo not in VLLM:
        raise ValueError(f"--bug applies to {list(VLLM)} only, not {algo!r}")
    if rollout not in ROLLOUTS or (rollout != "hf" and algo not in ("grpo", "cispo")):
        raise ValueError(f"--rollout {rollout!r}: choose one of {list(ROLLOUTS)}; 'vllm' applies to grpo and cispo")
    if leak_tool_output and algo != AGENT:
        raise ValueError(f"leak_tool_output applies to {AGENT!r} only, not {algo!r}")
    engine_shape = algo in VLLM or rollout == "vllm"
    refuse_existing_trace(out_dir)
    if algo == AGENT:
        from tracer.demo.agent_trl import run_agent_demo

        return run_agent_demo(out_dir, steps=steps, seed=seed, progress=progress,
                              model_dir=model_dir if model_dir is not None else Path(out_dir) / "model",
                              leak=leak_tool_output)
    if model_dir is None:
        from tracer.demo.tiny_model import VLLM_SHAPE, build_tiny_model

        model_dir = build_tiny_model(Path(out_dir) / "model", seed=seed, shape=VLLM_SHAPE if engine_shape else None)
    if algo in VLLM:
        from tracer.demo.grpo_vllm import run_grpo_vllm_demo

        return run_grpo_vllm_demo(out_dir, steps=steps, seed=seed, progress=progress, model_dir=model_dir, bug=bug)
    if algo in TRL:
        return _run_trl(algo, out_dir, steps, seed, progress, model_dir)
    return _run_loop(algo, out_dir, steps, seed, progress, model_dir, rollout)


def _run_trl(algo: str, out_dir, steps: int, seed: int, progress: bool, model_dir) -> Path:
    if algo == "grpo-trl":
        from tracer.demo.grpo_trl import run_grpo_demo

        return run_grpo_demo(out_dir, steps=steps, seed=seed, progress=progress, model_dir=model_dir)
    if algo == "rloo-trl":
        from tracer.demo.rloo_trl import run_rloo_demo

        return run_rloo_demo(out_dir, steps=steps, seed=seed, progress=progress, model_dir=model_dir)
    from tracer.demo.dpo_trl import run_dpo_demo

    return run_dpo_demo(out_dir, steps=steps, seed=seed, progress=progress, model_dir=model_dir)


def _run_loop(algo: str, out_dir, steps: int, seed: int, progress: bool, model_dir, rollout: str = "hf") -> Path:
    from tqdm.auto import tqdm

    bar = tqdm(total=steps, desc=f"demo {algo}", unit="step", disable=not progress)
    try:
        if algo == "ppo":
            from tracer.demo import ppo_loop

            return ppo_loop.run(out_dir, ppo_loop.PPOConfig(steps=steps, seed=seed), model_dir, bar)
        if algo == "dpo":
            from tracer.demo import dpo_loop

            return dpo_loop.run(out_dir, dpo_loop.DPOConfig(steps=steps, seed=seed), model_dir, bar)
        from tracer.demo import grpo_loop

        cfg = grpo_loop.GRPOConfig(loss_type=algo, steps=steps, seed=seed, rollout=rollout)
        return grpo_loop.run(out_dir, cfg, model_dir, bar)
    finally:
        bar.close()
