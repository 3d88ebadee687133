"""What a TRL trainer's configuration means in trace terms: algorithm, step metadata (SPEC.md
section 4 keys plus TRL's own) and the run config kept in the manifest. Read off TRL 1.16's
``GRPOTrainer`` attributes (``grpo_trainer.py``, ``__init__``)."""

from __future__ import annotations

from typing import Any, Mapping

#: TRL ``loss_type`` -> canonical ``loss_reduction`` (SPEC section 4), from ``_compute_loss``:
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
    "multi_objective_aggregation", "off_policy_mask_threshold", "shuffle_dataset",
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


def hyperparameters_of(trainer: Any) -> dict[str, Any]:
    """Step metadata that is the same for every step (SPEC section 4 keys + TRL extras)."""
    args = trainer.args
    loss_type = getattr(trainer, "loss_type", getattr(args, "loss_type", None))
    return {
        "num_generations": trainer.num_generations,
        "beta": float(trainer.beta),
        "clip_epsilon_low": float(trainer.epsilon_low),
        "clip_epsilon_high": float(trainer.epsilon_high),
        "temperature": float(trainer.temperature),
        "top_p": float(args.top_p) if args.top_p is not None else None,
        "top_k": int(args.top_k or 0),
        "loss_reduction": LOSS_REDUCTION_BY_LOSS_TYPE.get(loss_type),
        "loss_type": loss_type,
        "reward_component_names": list(trainer.reward_func_names),
        "reward_weights": [float(w) for w in trainer.reward_weights.tolist()],
        "num_iterations": trainer.num_iterations,
        "steps_per_generation": args.steps_per_generation,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "max_completion_length": trainer.max_completion_length,
        "importance_sampling_level": getattr(trainer, "importance_sampling_level", None),
        "scale_rewards": getattr(trainer, "scale_rewards", None),
        "multi_objective_aggregation": getattr(trainer, "multi_objective_aggregation", None),
        "advantage_std": "unbiased",  # trl.trainer.utils.nanstd applies Bessel's correction
        "logprob_source": "trl_fused_lm_head",
    }


def run_config_of(trainer: Any, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The manifest's ``config``: trainer class, model path, the TRL arguments that shape the
    trace (JSON scalars only), then ``extra`` on top."""
    args = trainer.args
    model_config = getattr(getattr(trainer, "model", None), "config", None)
    config: dict[str, Any] = {
        "trainer": type(trainer).__name__,
        "model": getattr(model_config, "_name_or_path", None),
        "trainer_args": {k: getattr(args, k) for k in _CONFIG_KEYS
                         if isinstance(getattr(args, k, None), (str, int, float, bool))},
    }
    config.update(dict(extra or {}))
    return config
