"""One traced TRL GRPO run with the colocated vLLM engine, for tests/vllm_engine (run as a subprocess:
one engine per process). Besides the trace it saves, independently of the tracer, what vLLM returned
(``vllm_outputs.json``: every ``LLM.generate`` call's completion ids and the logprob vLLM gave each
sampled token; ``sampling_params.json``: the settings of the ``SamplingParams`` each call was given) and TRL's own logged metrics (``log_history.json``, logging every step).

    python tests/vllm_engine/engine_run.py OUT_DIR [--steps N] [--is-mode MODE] [--bug BUG] [--engine-dtype DTYPE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import tracer
from tracer.demo import grpo_vllm
from tracer.demo.tiny_model import VLLM_SHAPE, build_tiny_model, torch_threads
from tracer.demo.vllm_cpu import engine_environment, keep_cpu_linear_weights


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")


def capture_generate(llm, calls: list, params: list) -> None:
    """Wrap ``llm.generate`` on the instance: keep each call's outputs as plain lists, and the
    sampling settings of the ``SamplingParams`` it was given."""
    original = llm.generate

    def generate(*args, **kwargs):
        given = kwargs.get("sampling_params")
        params.append({name: getattr(given, name) for name in SAMPLING_FIELDS})
        outputs = original(*args, **kwargs)
        calls.append([{"prompt_ids": list(o.prompt_token_ids), "completion_ids": list(c.token_ids),
                       "logprobs": [step[token].logprob for step, token in zip(c.logprobs, c.token_ids)]}
                      for o in outputs for c in o.outputs])
        return outputs

    llm.generate = generate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--is-mode", default=grpo_vllm.IS_MODE)
    parser.add_argument("--bug", default=None)
    parser.add_argument("--engine-dtype", default=None, help="the engine's dtype (default: TRL's, vLLM's auto)")
    args = parser.parse_args()
    out = Path(args.out)
    engine_environment()
    calls: list = []
    params: list = []
    with tempfile.TemporaryDirectory() as scratch, keep_cpu_linear_weights(), torch_threads(1):
        model = build_tiny_model(Path(scratch) / "model", seed=0, shape=VLLM_SHAPE)
        trainer = grpo_vllm.make_trainer(model, Path(scratch) / "trl", steps=args.steps, seed=0, progress=False,
                                         bug=args.bug, engine_dtype=args.engine_dtype,
                                         vllm_importance_sampling_mode=args.is_mode,
                                         logging_strategy="steps", logging_steps=1)
        capture_generate(trainer.vllm_generation.llm, calls, params)
        tracer.attach(trainer, out / "trace")
        trainer.train()
    (out / "vllm_outputs.json").write_text(json.dumps(calls))
    (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    (out / "sampling_params.json").write_text(json.dumps(params))


if __name__ == "__main__":
    main()
