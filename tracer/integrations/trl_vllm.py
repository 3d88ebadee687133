"""What TRL's ``GRPOTrainer`` does with a vLLM engine's logprobs, for the trace (written against
TRL 1.16 with ``use_vllm=True``).

:class:`~tracer.integrations.trl_grpo.GRPOTraceHook` calls the two functions here; everything
specific to vLLM lives in this module.

Facts from TRL 1.16's ``grpo_trainer.py`` (``_generate_and_score_completions``):

- The engine's logprob of each sampled token comes back as ``sampling_per_token_logps`` ``[B, T]``
  (recorded as ``sampler_logprobs`` by the GRPO hook). In colocate mode TRL builds the engine with
  ``logprobs_mode="processed_logprobs"``: logprobs after temperature and top-p/top-k.
- With ``vllm_importance_sampling_correction`` (on by default) TRL always computes
  ``old_per_token_logps`` and the importance-sampling ratio of the rollout, ``d = (old - sampler) *
  mask`` (NaN -> 0), then ``exp(d)`` per token (``token_*`` modes, ``[B, T]``) or ``exp(sum_t d)``
  per sequence (``sequence_*`` modes, ``[B, 1]``; a *sum*, the product of the token ratios: trl#5814).
  ``*_truncate`` clamps it to ``[clip_min, clip_max]``; ``*_mask`` sets it to 0 outside. The result,
  ``inputs["importance_sampling_ratio"]``, multiplies ``per_token_loss``.
- TRL logs ``sampling/sampling_logp_difference/mean`` = mean of ``|old - sampler|`` over kept
  tokens (``completion_mask * tool_mask``) whose difference is not NaN.

- Colocate mode samples with ``vllm.SamplingParams(n=1, repetition_penalty, temperature, top_p,
  top_k, min_p, max_tokens, logprobs)`` read from ``trainer.vllm_generation``, updated by
  ``generation_kwargs`` (which can add ``presence_penalty`` / ``frequency_penalty`` or override any of
  them); vLLM then normalises them (greedy sampling, ``temperature < 1e-5``, turns truncation off).
  The settings in effect are those of that object, not ``GRPOConfig``'s fields.

Recorded: ``is_weights`` ``[B, T]`` (token modes) or ``sequence_is_weights`` ``[B]`` (sequence
modes), TRL's weights *after* its truncation or masking; and the correction settings as
hyperparameters (``sampler_engine``, ``is_correction``, ``is_mode``, ``is_clip_min``,
``is_clip_max``, ``sampler_logprobs_mode``, ``sampler_dtype``), with the engine's sampling settings
(:data:`SAMPLING_KEYS`: ``sampler_temperature``, ``sampler_top_p``, ...). The raw ratio ``exp(old - sampler)`` is not stored:
it follows from ``old_logprobs`` and ``sampler_logprobs`` (:func:`tracer.formulas.sampler_log_ratio`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch

__all__ = ["IS_RATIO_KEY", "SAMPLING_KEYS", "sampler_hyperparameters", "is_weight_tensors", "engine_logprobs_mode",
           "engine_dtype", "engine_sampling_params", "sampling_settings"]

log = logging.getLogger(__name__)

IS_RATIO_KEY = "importance_sampling_ratio"  # TRL's key in the rollout dict / loss inputs
# vllm.SamplingParams attribute -> step metadata key (the sampler's settings in effect)
SAMPLING_KEYS = {"temperature": "sampler_temperature", "top_p": "sampler_top_p", "top_k": "sampler_top_k",
                 "min_p": "sampler_min_p", "repetition_penalty": "sampler_repetition_penalty",
                 "presence_penalty": "sampler_presence_penalty", "frequency_penalty": "sampler_frequency_penalty"}


def _engine_config(trainer: Any, name: str) -> Any:
    """``llm.llm_engine.model_config.<name>`` of the colocated engine, None when unreadable (server mode)."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    try:
        return getattr(llm.llm_engine.model_config, name)
    except AttributeError:
        return None


def engine_logprobs_mode(trainer: Any) -> str | None:
    """The ``logprobs_mode`` of the colocated vLLM engine (``"processed_logprobs"`` as TRL builds
    it, ``"raw_logprobs"`` ...), read from the engine itself; None when there is no colocated
    engine (server mode)."""
    mode = _engine_config(trainer, "logprobs_mode")
    return None if mode is None else str(getattr(mode, "value", mode))


def engine_dtype(trainer: Any) -> str | None:
    """The dtype the colocated engine computes in (``"bfloat16"``, ``"float32"``), None when
    unreadable. TRL passes no dtype, and vLLM's ``dtype="auto"`` runs a float32 model in bfloat16
    on CPU (and GPU) builds, so the engine is usually coarser than an fp32 trainer."""
    dtype = _engine_config(trainer, "dtype")
    return None if dtype is None else str(dtype).removeprefix("torch.")


def engine_sampling_params(trainer: Any) -> Any:
    """The ``vllm.SamplingParams`` TRL 1.16's colocate ``VLLMGeneration.generate`` passes to
    ``LLM.generate``, built the same way from ``trainer.vllm_generation`` (its sampling attributes,
    then ``generation_kwargs``); None in server mode or when unreadable (then the server's request
    carries them and the trainer's own fields are all there is)."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or getattr(generation, "mode", None) != "colocate":
        return None
    try:
        from vllm import SamplingParams

        min_p = generation.min_p
        kwargs = {"n": 1, "repetition_penalty": generation.repetition_penalty, "temperature": generation.temperature,
                  "top_p": generation.top_p, "top_k": generation.top_k, "min_p": 0.0 if min_p is None else min_p,
                  "max_tokens": generation.max_completion_length, "logprobs": generation.logprobs}
        kwargs.update({k: v for k, v in (generation.generation_kwargs or {}).items() if k != "structured_outputs"})
        return SamplingParams(**kwargs)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        log.warning("tracer: could not rebuild the engine's SamplingParams (%s); sampler_* settings not recorded", exc)
        return None


def sampling_settings(params: Any) -> dict[str, Any]:
    """The sampling settings of a ``vllm.SamplingParams`` (or any object with its attributes) as step
    metadata (:data:`SAMPLING_KEYS`): ``sampler_temperature``, ``sampler_top_p``, ``sampler_top_k``
    (vLLM: 0 or -1 = off), ``sampler_min_p`` (0 = off), ``sampler_repetition_penalty`` (1 = off),
    ``sampler_presence_penalty`` and ``sampler_frequency_penalty`` (0 = off); ``{}`` for None.
    Attributes the object lacks are left out."""
    if params is None:
        return {}
    out = {}
    for attr, key in SAMPLING_KEYS.items():
        value = getattr(params, attr, None)
        if value is not None:
            out[key] = int(value) if attr == "top_k" else float(value)
    return out


def sampler_hyperparameters(trainer: Any) -> dict[str, Any]:
    """The engine and TRL's importance-sampling correction settings, as step metadata; ``{}`` when
    the trainer does not sample with vLLM (``use_vllm`` false or absent).

    Keys: ``sampler_engine`` ("vllm"), ``vllm_mode`` (colocate | server), ``is_correction`` (bool),
    ``is_mode`` (token_truncate | token_mask | sequence_truncate | sequence_mask), ``is_clip_min``
    and ``is_clip_max`` (float or None), ``sampler_logprobs_mode`` and ``sampler_dtype`` (the
    engine's, when readable), and the sampling settings in effect (:func:`sampling_settings` of
    :func:`engine_sampling_params`).
    """
    if not getattr(trainer, "use_vllm", False):
        return {}
    args = trainer.args
    out: dict[str, Any] = {
        "sampler_engine": "vllm",
        "vllm_mode": getattr(args, "vllm_mode", None),
        "is_correction": bool(getattr(trainer, "vllm_importance_sampling_correction", False)),
        "is_mode": getattr(trainer, "vllm_importance_sampling_mode", None),
        "is_clip_min": _float_or_none(getattr(trainer, "vllm_importance_sampling_clip_min", None)),
        "is_clip_max": _float_or_none(getattr(trainer, "vllm_importance_sampling_clip_max", None)),
    }
    out["sampler_logprobs_mode"] = engine_logprobs_mode(trainer)
    out["sampler_dtype"] = engine_dtype(trainer)
    out.update(sampling_settings(engine_sampling_params(trainer)))
    return {k: v for k, v in out.items() if v is not None}


def is_weight_tensors(trainer: Any, inputs: Mapping[str, Any],
                      take: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """TRL's importance-sampling weights of the micro-batch, rows put in order by ``take``.

    Returns ``{"is_weights": [B, T]}`` for token modes, ``{"sequence_is_weights": [B]}`` for
    sequence modes (TRL's ``[B, 1]``), ``{}`` when the inputs carry none (no vLLM, or the correction
    off).
    """
    weights = inputs.get(IS_RATIO_KEY)
    if not isinstance(weights, torch.Tensor):
        return {}
    weights = take(weights)
    if str(getattr(trainer, "vllm_importance_sampling_mode", "")).startswith("sequence"):
        return {"sequence_is_weights": weights.reshape(weights.shape[0])}
    return {"is_weights": weights}


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)
