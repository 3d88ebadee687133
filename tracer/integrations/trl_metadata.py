"""What a TRL trainer's configuration means in trace terms: algorithm, step metadata (SPEC.md
section 4 keys plus TRL's own) and the run config kept in the manifest. Read off TRL 1.16's
``GRPOTrainer``, ``RLOOTrainer`` and ``DPOTrainer`` attributes (``grpo_trainer.py``,
``rloo_trainer.py``, ``dpo_trainer.py``, each ``__init__``)."""

from __future__ import annotations

from typing import Any, Mapping

#: TRL ``loss_type`` -> canonical ``loss_reduction`` (SPEC.md section 4), from ``_compute_loss``:
#: grpo/sapo: per-sequence masked mean, then mean over sequences.
#: bnpo: masked mean over the micro-batch's tokens. dapo/cispo/vespo: masked token sum divided by
#: the loss-token count of the generation batch (``num_items_in_batch``, recorded per step), i.e. a
#: token mean over the generation batch. dr_grpo: masked sum / (B * max_completion_length).
#: luspo: masked sum / B. The two constant divisors are recorded as ``loss_constant_divisor``.
LOSS_REDUCTION_BY_LOSS_TYPE = {
    "grpo": "sequence_mean",
    "sapo": "sequence_mean",
    "bnpo": "token_mean",
    "dapo": "token_mean",
    "cispo": "token_mean",
    "vespo": "token_mean",
    "dr_grpo": "constant",
    "luspo": "constant",
}
# GRPOConfig fields copied into the manifest (JSON scalars only).
_CONFIG_KEYS = (
    "seed", "learning_rate", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
    "steps_per_generation", "generation_batch_size", "num_generations", "num_iterations",
    "max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "beta",
    "epsilon", "epsilon_high", "delta", "loss_type", "scale_rewards", "importance_sampling_level",
    "mask_truncated_completions", "top_entropy_quantile", "use_vllm", "bf16", "fp16",
    "multi_objective_aggregation", "off_policy_mask_threshold", "shuffle_dataset", "normalize_advantages",
    "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
)
# DPOConfig fields copied into the manifest (JSON scalars only; ``loss_type`` is a list, kept in metadata).
DPO_CONFIG_KEYS = (
    "seed", "learning_rate", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "beta",
    "max_length", "truncation_mode", "precompute_ref_log_probs", "f_divergence_type", "f_alpha_divergence_coef",
    "label_smoothing", "ld_alpha", "use_weighting", "sync_ref_model", "bf16", "fp16", "shuffle_dataset",
)


def algorithm_of(trainer: Any) -> str:
    """``cispo`` for TRL's CISPO loss, ``rloo`` for an RLOO trainer, else ``grpo``."""
    if getattr(trainer, "loss_type", None) == "cispo":
        return "cispo"
    return "rloo" if "RLOO" in type(trainer).__name__ else "grpo"


def tokenizer_of(trainer: Any) -> Any:
    """The text tokenizer of the trainer (a multimodal processor's inner tokenizer)."""
    tok = getattr(trainer, "_tokenizer", None) or getattr(trainer, "processing_class", None)
    return getattr(tok, "tokenizer", tok)  # a multimodal processor holds its tokenizer


def _policy_gradient_hyperparameters(trainer: Any) -> dict[str, Any]:
    """Step metadata shared by TRL's GRPO and RLOO trainers: group size, β, clipping, sampling."""
    args = trainer.args
    return {
        "num_generations": trainer.num_generations,
        "beta": float(trainer.beta),
        "clip_epsilon_low": float(trainer.epsilon_low),
        "clip_epsilon_high": float(trainer.epsilon_high),
        "temperature": float(trainer.temperature),
        "top_p": float(args.top_p) if args.top_p is not None else None,
        "top_k": int(args.top_k or 0),
        "min_p": _float_or_none(getattr(args, "min_p", None)),
        "repetition_penalty": float(getattr(args, "repetition_penalty", 1.0) or 1.0),
    }


def _batching_hyperparameters(trainer: Any) -> dict[str, Any]:
    """Step metadata shared by TRL's GRPO and RLOO trainers: reward functions, reuse of a rollout, batching."""
    args = trainer.args
    return {
        "reward_component_names": list(trainer.reward_func_names),
        "reward_weights": [float(w) for w in trainer.reward_weights.tolist()],
        "num_iterations": trainer.num_iterations,
        "steps_per_generation": args.steps_per_generation,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "max_completion_length": trainer.max_completion_length,
    }


def hyperparameters_of(trainer: Any) -> dict[str, Any]:
    """Step metadata of a ``GRPOTrainer`` that is the same for every step (SPEC.md section 4 keys + TRL extras)."""
    loss_type = getattr(trainer, "loss_type", getattr(trainer.args, "loss_type", None))
    return {
        **_policy_gradient_hyperparameters(trainer),
        "loss_reduction": LOSS_REDUCTION_BY_LOSS_TYPE.get(loss_type),
        "loss_type": loss_type,
        **_batching_hyperparameters(trainer),
        "importance_sampling_level": getattr(trainer, "importance_sampling_level", None),
        "scale_rewards": getattr(trainer, "scale_rewards", None),
        "multi_objective_aggregation": getattr(trainer, "multi_objective_aggregation", None),
        "advantage_std": "unbiased",  # trl.trainer.utils.nanstd applies Bessel's correction
        "entropy_coef": float(getattr(trainer, "entropy_coef", 0.0) or 0.0),
        "use_bias_correction_kl": bool(getattr(trainer.args, "use_bias_correction_kl", False)),
        "vllm_importance_sampling_correction": bool(getattr(trainer, "use_vllm", False)
                                                    and getattr(trainer, "vllm_importance_sampling_correction", False)),
        # the options that change which tokens and ratios the loss keeps (the checks that recompute
        # the loss skip, or read the mask rule, by them; TRL 1.16 grpo_trainer.py _compute_loss)
        "delta": _float_or_none(getattr(trainer.args, "delta", None)),
        "top_entropy_quantile": float(getattr(trainer, "top_entropy_quantile", 1.0)),
        "off_policy_mask_threshold": _float_or_none(getattr(trainer, "off_policy_mask_threshold", None)),
        "mask_truncated_completions": bool(getattr(trainer, "mask_truncated_completions", False)),
        "logprob_source": "trl_fused_lm_head",
    }


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def rloo_hyperparameters_of(trainer: Any) -> dict[str, Any]:
    """Step metadata of an ``RLOOTrainer`` (TRL 1.16 ``rloo_trainer.py``).

    ``advantage_rule``: ``rloo_kl`` when β > 0 (leave-one-out on ``rewards - β·Σ_t(old - ref)``, the
    k1 KL of the rollout-time policy against the reference summed over the completion mask), else
    ``rloo``; the rewards are clipped to ``reward_clip_range`` first and the advantages re-normalised
    over the generation batch when ``normalize_advantages``. ``importance_ratio = "sequence_sum"``:
    the loss clips one ratio per sequence, ``exp(Σ_t policy - Σ_t old)`` (field ``sequence_ratio``);
    ``loss_reduction = "sequence_mean"``: the per-sequence loss is averaged over the micro-batch.
    """
    clip_range = getattr(trainer, "reward_clip_range", None)
    return {
        **_policy_gradient_hyperparameters(trainer),
        "loss_reduction": "sequence_mean",
        **_batching_hyperparameters(trainer),
        "advantage_rule": "rloo_kl" if float(trainer.beta) != 0.0 else "rloo",
        "reward_kl_estimator": "k1_old_ref_sum",
        "normalize_advantages": bool(getattr(trainer, "normalize_advantages", False)),
        "reward_clip_range": [float(x) for x in clip_range] if clip_range else None,
        "importance_ratio": "sequence_sum",
        "mask_truncated_completions": bool(getattr(trainer, "mask_truncated_completions", False)),
        "logprob_source": "trl_fused_lm_head",
    }


def dpo_hyperparameters_of(trainer: Any) -> dict[str, Any]:
    """Step metadata of a ``DPOTrainer`` (TRL 1.16 ``dpo_trainer.py``): ``beta``, ``loss_type`` (TRL's
    list joined with commas, e.g. ``"sigmoid"``), ``loss_weights``, ``loss_reduction``
    (``sequence_mean``: the per-pair loss is averaged over the micro-batch's pairs) and the options
    that change which sequence logprobs the loss sees."""
    loss_types = list(getattr(trainer, "loss_types", None) or getattr(trainer.args, "loss_type", None) or [])
    weights = getattr(trainer, "loss_weights", None)
    return {
        "beta": float(trainer.beta),
        "loss_type": ",".join(str(t) for t in loss_types),
        "loss_weights": [float(w) for w in weights] if weights else None,
        "loss_reduction": "sequence_mean",
        "f_divergence_type": str(getattr(trainer, "f_divergence_type", "reverse_kl")),
        "label_smoothing": float(getattr(trainer, "label_smoothing", 0.0) or 0.0),
        "ld_alpha": getattr(trainer, "ld_alpha", None),
        "use_weighting": bool(getattr(trainer, "use_weighting", False)),
        "precompute_ref_log_probs": bool(getattr(trainer, "precompute_ref_logps", False)),
        # how each side was cut to max_length (masks.dpo_rule reads where each side's prompt went)
        "truncation_mode": getattr(trainer.args, "truncation_mode", None),
        "max_length": getattr(trainer.args, "max_length", None),
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "logprob_source": "trl_fused_lm_head",
    }


# step metadata key -> the trainer attribute TRL 1.16 reads at the call (_compute_loss, _generate_and_score_completions)
_IN_EFFECT_ATTRIBUTES = {"loss_type": "loss_type", "beta": "beta", "clip_epsilon_low": "epsilon_low",
                         "clip_epsilon_high": "epsilon_high", "importance_sampling_level": "importance_sampling_level",
                         "scale_rewards": "scale_rewards", "temperature": "temperature",
                         "num_generations": "num_generations", "mask_truncated_completions": "mask_truncated_completions"}
# step metadata key -> the GRPOConfig field that declares it (epsilon_high None = epsilon, TRL's own resolution)
_DECLARED_ARGS = {"loss_type": "loss_type", "beta": "beta", "clip_epsilon_low": "epsilon",
                  "clip_epsilon_high": "epsilon_high", "importance_sampling_level": "importance_sampling_level",
                  "scale_rewards": "scale_rewards", "temperature": "temperature", "num_generations": "num_generations",
                  "mask_truncated_completions": "mask_truncated_completions", "top_p": "top_p", "top_k": "top_k",
                  "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "do_sample")


def settings_in_effect(trainer: Any) -> dict[str, Any]:
    """The settings a TRL GRPO/RLOO trainer uses at this call, beside those its config declares.

    ``<key>``: the trainer's own attribute, which ``_compute_loss`` and the logprob scoring read
    (``loss_type``, ``beta``, ``clip_epsilon_low`` / ``_high`` = ``epsilon_low`` / ``_high``,
    ``importance_sampling_level``, ``scale_rewards``, ``temperature``, ``num_generations``,
    ``mask_truncated_completions``) and ``steps_per_generation`` (read from ``args`` at the call);
    ``generation_<key>``: the ``GenerationConfig`` transformers' ``generate`` samples with
    (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``do_sample``; TRL
    builds it from the config's fields, then ``generation_kwargs`` override them; absent with vLLM);
    ``declared_<key>``: the ``GRPOConfig`` / ``RLOOConfig`` field (``epsilon_high`` None resolved to
    ``epsilon`` as TRL's ``__init__`` does). Scalars only; unreadable attributes are left out.
    Source: TRL 1.16 ``grpo_trainer.py`` ``__init__`` (``generation_kwargs.update(args.generation_kwargs)``).
    """
    args = trainer.args
    meta: dict[str, Any] = {}
    for key, attr in _IN_EFFECT_ATTRIBUTES.items():
        value = getattr(trainer, attr, None)
        if _scalar(value):
            meta[key] = value
    if _scalar(getattr(args, "steps_per_generation", None)):
        meta["steps_per_generation"] = args.steps_per_generation
    generation = getattr(trainer, "generation_config", None)
    if generation is not None and not getattr(trainer, "use_vllm", False):
        for key in _GENERATION_KEYS:
            value = getattr(generation, key, None)
            if _scalar(value):
                meta[f"generation_{key}"] = value
    for key, field in _DECLARED_ARGS.items():
        value = getattr(args, field, None)
        if key == "clip_epsilon_high" and value is None:
            value = getattr(args, "epsilon", None)
        if _scalar(value):
            meta[f"declared_{key}"] = value
    return meta


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool))


def run_config_of(trainer: Any, extra: Mapping[str, Any] | None,
                  keys: tuple[str, ...] = _CONFIG_KEYS) -> dict[str, Any]:
    """The manifest's ``config``: trainer class, model path, the TRL arguments ``keys`` that shape
    the trace (JSON scalars only), then ``extra`` on top."""
    args = trainer.args
    model_config = getattr(getattr(trainer, "model", None), "config", None)
    config: dict[str, Any] = {
        "trainer": type(trainer).__name__,
        "model": getattr(model_config, "_name_or_path", None),
        "trainer_args": {k: getattr(args, k) for k in keys
                         if isinstance(getattr(args, k, None), (str, int, float, bool))},
    }
    config.update(dict(extra or {}))
    return config
