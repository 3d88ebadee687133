"""Rollouts from a vLLM engine for the hand-written GRPO loop (``python -m tracer demo --algo grpo
--rollout vllm``), like the SGLang path of MiniMind's ``rollout_engine.py`` (seed section 4.3): the
engine samples the completions and returns each sampled token's logprob; the loop then scores the
same tokens with its own model (``old_logprobs``, under no_grad, as TRL does) and traces both, the
engine's as ``sampler_logprobs``.

The engine runs in this process (``vllm.LLM``, the ``external_launcher`` executor that TRL's colocate
mode uses) on the CPU build with :mod:`tracer.demo.vllm_cpu`'s settings and workaround; before every
rollout the policy's weights are loaded into it (``model.load_weights``, as TRL's ``sync_weights``)
and its prefix cache is reset. Logprobs are vLLM's ``processed_logprobs`` (after temperature).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from tracer.demo import rollout as ro
from tracer.integrations import trl_vllm

__all__ = ["VLLMSampler"]


class VLLMSampler:
    """A colocated vLLM engine serving the loop's rollouts; use as a context manager (the CPU
    workaround stays in place while the engine lives).

    Attributes:
        llm: the ``vllm.LLM``.
        logprobs_mode: the engine's logprobs mode (``"processed_logprobs"``).
        settings: the sampler's settings in effect at the last ``generate`` call, as step metadata
            (``sampler_temperature``, ``sampler_top_p``, ... read from the ``SamplingParams`` passed,
            :func:`tracer.integrations.trl_vllm.sampling_settings`; ``sampler_dtype`` and
            ``sampler_logprobs_mode`` from the engine); ``{}`` before the first rollout.
    """

    logprobs_mode = "processed_logprobs"
    dtype = "float32"  # as the loop's model (vLLM's "auto" would run a float32 model in bfloat16)

    def __init__(self, model_dir: str | os.PathLike, seed: int = 0, max_model_len: int = 128) -> None:
        from tracer.demo.vllm_cpu import engine_environment, keep_cpu_linear_weights

        engine_environment()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(keep_cpu_linear_weights())
        from vllm import LLM

        self.llm = LLM(model=str(Path(model_dir)), dtype=self.dtype, seed=seed, max_model_len=max_model_len,
                       max_num_batched_tokens=4096, distributed_executor_backend="external_launcher",
                       logprobs_mode=self.logprobs_mode)
        self.settings: dict = {}

    def __enter__(self) -> "VLLMSampler":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load ``model``'s current parameters into the engine (TRL's colocate ``sync_weights``)."""
        engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for name, param in model.named_parameters():
            engine_model.load_weights([(name, param.detach())])
        self.llm.reset_prefix_cache()

    @torch.no_grad()
    def rollout(self, model, tokenizer, prompts: list[str], num_generations: int, max_new_tokens: int,
                temperature: float) -> ro.Rollout:
        """Sync ``model`` into the engine, sample ``num_generations`` completions per prompt
        (consecutive rows) with it, and return them with the engine's logprobs
        (``sampler_logprobs``) and ``model``'s own (``old_logprobs``, same temperature).
        Completions are right-padded; the mask keeps every sampled token (EOS included)."""
        from vllm import SamplingParams

        self.sync_weights(model)
        repeated = [p for p in prompts for _ in range(num_generations)]
        enc = tokenizer(repeated, return_tensors="pt", padding=True, padding_side="left")
        prompt_ids, prompt_mask = enc["input_ids"], enc["attention_mask"].bool()  # (B, L)
        requests = [{"prompt_token_ids": row[mask].tolist()} for row, mask in zip(prompt_ids, prompt_mask)]
        params = SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_new_tokens, logprobs=0)
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        config = self.llm.llm_engine.model_config
        self.settings = {**trl_vllm.sampling_settings(params), "sampler_dtype": str(config.dtype).removeprefix("torch."),
                         "sampler_logprobs_mode": str(getattr(config.logprobs_mode, "value", config.logprobs_mode))}
        sampled = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]
        T = max(len(ids) for ids, _ in sampled)
        B = len(sampled)
        completion_ids = torch.full((B, T), tokenizer.pad_token_id, dtype=torch.int64)
        completion_mask = torch.zeros(B, T, dtype=torch.bool)
        sampler_logprobs = torch.zeros(B, T, dtype=torch.float32)
        for b, (ids, logprobs) in enumerate(sampled):
            completion_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            completion_mask[b, : len(ids)] = True
            sampler_logprobs[b, : len(ids)] = torch.tensor([step[t].logprob for step, t in zip(logprobs, ids)])
        L = prompt_ids.shape[1]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
        old_logprobs = ro.completion_logprobs(model, torch.cat([prompt_ids, completion_ids], dim=1), attention_mask,
                                              L, temperature) * completion_mask  # (B, T)
        group_ids = torch.arange(len(prompts)).repeat_interleave(num_generations)
        return ro.Rollout(repeated, prompt_ids, prompt_mask, completion_ids, completion_mask, old_logprobs, group_ids,
                          sampler_logprobs=sampler_logprobs)
