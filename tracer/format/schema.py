"""The canonical trace format: field specs, metadata keys, and validation (SPEC.md section 4).

Dimensions use one vocabulary (SPEC.md section 2): B sequences in the step, T completion tokens
(right-padded), L prompt tokens (padded), F reward components.

Every mask is ``*_mask`` with True = keep. Logprobs are natural-log (nats), float32 on disk unless
the caller asks to keep the source dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from tracer.errors import SchemaError
from tracer.format.arrays import HeaderTensor, is_bool, is_torch

if TYPE_CHECKING:  # tensors come from the caller: validating a header or a file never imports torch
    import torch

SCHEMA_VERSION = "1"
ALGORITHMS = ("ppo", "grpo", "cispo", "rloo", "dpo")
FLOAT, INT64, BOOL = "float", "int64", "bool"


@dataclass(frozen=True)
class FieldSpec:
    """One canonical field.

    Attributes:
        name: the canonical name, stable across versions.
        dims: dimension names, e.g. ``("B", "T")``.
        kind: ``"float"`` (stored float32 unless the source dtype is kept), ``"int64"`` or ``"bool"``.
        unit: physical unit (``"nats"``, ``"token id"``, ``"reward"``...), ``""`` when unitless.
        description: what the tensor holds.
        required_for: algorithms whose traces must carry the field.
        dims_by_algorithm: per-algorithm overrides of ``dims`` (PPO advantages are per token).
    """

    name: str
    dims: tuple[str, ...]
    kind: str
    unit: str
    description: str
    required_for: frozenset[str] = frozenset()
    dims_by_algorithm: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def dims_for(self, algorithm: str | None) -> tuple[str, ...]:
        """The dims this field has in a trace of ``algorithm``."""
        return tuple(self.dims_by_algorithm.get(algorithm or "", self.dims))


_RL = frozenset({"ppo", "grpo", "cispo", "rloo"})
_GROUPED = frozenset({"grpo", "cispo", "rloo"})
_DPO = frozenset({"dpo"})


def _spec(name, dims, kind, unit, description, required_for=frozenset(), **overrides):
    return FieldSpec(name, tuple(dims), kind, unit, description, frozenset(required_for), overrides)


FIELDS: dict[str, FieldSpec] = {
    s.name: s
    for s in [
        # Per token [B, T]
        _spec("completion_ids", "BT", INT64, "token id", "sampled completion tokens, right-padded", _RL),
        _spec("completion_mask", "BT", BOOL, "", "True where the completion token enters the loss", _RL),
        _spec("policy_logprobs", "BT", FLOAT, "nats", "current policy log p(token) at update time", _RL),
        _spec("old_logprobs", "BT", FLOAT, "nats", "behaviour policy log p(token) at rollout time",
              {"ppo"}),
        _spec("ref_logprobs", "BT", FLOAT, "nats", "frozen reference model log p(token)"),
        _spec("sampler_logprobs", "BT", FLOAT, "nats", "log p(token) reported by the inference engine"),
        _spec("ratio", "BT", FLOAT, "", "importance ratio exp(policy - old)"),
        _spec("ref_kl_k3", "BT", FLOAT, "nats", "k3 estimator of KL(policy || ref): exp(d) - d - 1, d = ref - policy"),
        _spec("approx_kl_k2", "BT", FLOAT, "nats", "k2 estimator 0.5 * (policy - old)^2"),
        _spec("entropy", "BT", FLOAT, "nats", "entropy of the policy's next-token distribution"),
        _spec("values", "BT", FLOAT, "reward", "critic value estimate per token", {"ppo"}),
        _spec("returns", "BT", FLOAT, "reward", "GAE returns = advantages + values", {"ppo"}),
        _spec("token_rewards", "BT", FLOAT, "reward", "per-token reward (PPO: sequence reward on last kept token)"),
        _spec("per_token_loss", "BT", FLOAT, "", "loss per token before reduction"),
        # Importance-sampling correction for the sampler/trainer gap (tracer/formulas/importance.py)
        _spec("is_weights", "BT", FLOAT, "", "importance-sampling weight per token the loss was multiplied by, after "
              "its cap or mask (TRL token modes, verl rollout_is=token); metadata is_mode, is_clip_min, is_clip_max"),
        # Multi-turn / agentic rows (tracer/format/turns.py)
        _spec("turn_ids", "BT", INT64, "", "0 = prompt, k >= 1 = assistant turn k with the tool results and "
              "environment messages answering it, -1 = padding"),
        _spec("token_roles", "BT", INT64, "", "role of each token: index into metadata role_names "
              "(system, user, assistant, tool); -1 = padding"),
        _spec("mask_reasons", "BT", INT64, "", "why each token is or is not in the loss: index into metadata "
              "mask_reason_names (kept, prompt, padding, after_eos, truncated, tool_output, environment, ...)"),
        # Per sequence [B]
        _spec("rewards", "B", FLOAT, "reward", "scalar reward per sequence", _RL),
        _spec("advantages", "B", FLOAT, "", "advantage per sequence (per token for PPO)", _RL, ppo=("B", "T")),
        _spec("group_ids", "B", INT64, "", "prompt group of each row; G consecutive rows share one", _GROUPED),
        _spec("episode_ids", "B", INT64, "", "per-turn rows: rows of one episode share an id (turn_ids says "
              "which turn a row holds)"),
        _spec("row_ids", "B", INT64, "", "index of each row in the rollout batch (maps minibatch rows back)"),
        _spec("sequence_is_weights", "B", FLOAT, "", "importance-sampling weight per sequence the loss was multiplied "
              "by, after its cap or mask (TRL sequence modes, verl rollout_is=sequence)"),
        _spec("policy_version", "B", INT64, "", "policy version (optimizer updates applied) that sampled each row; "
              "policy_lag = metadata trainer_version - policy_version"),
        _spec("reward_components", "BF", FLOAT, "reward", "per reward function, names in metadata"),
        # Scalar []
        _spec("loss", "", FLOAT, "", "the scalar loss the trainer backpropagated, after its reduction"),
        # Prompt [B, L]
        _spec("prompt_ids", "BL", INT64, "token id", "prompt tokens (left-padded when the trainer does so)"),
        _spec("prompt_mask", "BL", BOOL, "", "True on real prompt tokens, False on prompt padding"),
        # DPO [B, T] and [B]
        _spec("chosen_ids", "BT", INT64, "token id", "chosen completion tokens", _DPO),
        _spec("rejected_ids", "BT", INT64, "token id", "rejected completion tokens", _DPO),
        _spec("chosen_mask", "BT", BOOL, "", "True where the chosen token enters the loss", _DPO),
        _spec("rejected_mask", "BT", BOOL, "", "True where the rejected token enters the loss", _DPO),
        _spec("chosen_policy_logprobs", "BT", FLOAT, "nats", "policy log p of chosen tokens", _DPO),
        _spec("rejected_policy_logprobs", "BT", FLOAT, "nats", "policy log p of rejected tokens", _DPO),
        _spec("chosen_ref_logprobs", "BT", FLOAT, "nats", "reference log p of chosen tokens", _DPO),
        _spec("rejected_ref_logprobs", "BT", FLOAT, "nats", "reference log p of rejected tokens", _DPO),
        _spec("dpo_logits", "B", FLOAT, "nats", "(pi_c - pi_r) - (ref_c - ref_r)"),
        _spec("dpo_loss", "B", FLOAT, "", "-logsigmoid(beta * dpo_logits)"),
        _spec("chosen_rewards", "B", FLOAT, "", "implicit reward beta * (pi_c - ref_c)"),
        _spec("rejected_rewards", "B", FLOAT, "", "implicit reward beta * (pi_r - ref_r)"),
    ]
}

# Data-flow order of the fields (SPEC.md section 10): a field is computed from fields of earlier
# stages (and from earlier steps, through the weights), never from later ones. ``tracer diff`` names
# the most upstream diverging field at the earliest step as the cause and groups the others under it.
DATA_FLOW: tuple[tuple[str, ...], ...] = (
    ("prompt_ids", "prompt_mask", "group_ids", "row_ids", "episode_ids", "policy_version"),
    ("completion_ids", "turn_ids", "token_roles", "mask_reasons", "completion_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"),
    ("rewards", "reward_components"),
    ("token_rewards", "values"),
    ("advantages", "returns"),
    ("sampler_logprobs", "old_logprobs", "ref_logprobs", "chosen_ref_logprobs", "rejected_ref_logprobs"),
    ("policy_logprobs", "chosen_policy_logprobs", "rejected_policy_logprobs"),
    ("ratio", "ref_kl_k3", "approx_kl_k2", "entropy", "dpo_logits", "chosen_rewards", "rejected_rewards",
     "is_weights", "sequence_is_weights"),
    ("per_token_loss", "dpo_loss"),
    ("loss",),
)
_FLOW_RANK = {name: (stage, i) for stage, names in enumerate(DATA_FLOW) for i, name in enumerate(names)}


def flow_rank(name: str) -> tuple[int, int]:
    """``(stage, position in the stage)`` of a field in :data:`DATA_FLOW`; fields outside it come
    after every canonical field (``(len(DATA_FLOW), 0)``)."""
    return _FLOW_RANK.get(name, (len(DATA_FLOW), 0))


# Metadata keys (strings in the safetensors header). Value: (python type, description).
METADATA_KEYS: dict[str, tuple[type, str]] = {
    "schema_version": (str, "trace format version"),
    "algorithm": (str, "ppo | grpo | cispo | rloo | dpo"),
    "step": (int, "optimizer step"),
    "inner_step": (int, "PPO epoch / GRPO iteration; 0 = first pass over fresh rollouts"),
    "micro_batch": (int, "micro-batch index within the step"),
    "rank": (int, "data-parallel rank that wrote the file"),
    "world_size": (int, "number of ranks"),
    "num_generations": (int, "G, completions per prompt"),
    "clip_epsilon_low": (float, "lower clip epsilon: ratio clipped at 1 - eps_low"),
    "clip_epsilon_high": (float, "upper clip epsilon: ratio clipped at 1 + eps_high"),
    "beta": (float, "ref-KL coefficient in the loss; the DPO beta for DPO"),
    "kl_coef": (float, "PPO ref-KL coefficient (in the loss; in the rewards when kl_in_reward)"),
    "kl_in_reward": (bool, "the ref-KL penalty is in the rewards (InstructGPT, OpenRLHF, TRL PPOTrainer), "
                           "not the loss: no KL term in per_token_loss"),
    "kl_estimator": (str, "the ref-KL estimator: k1 | k2 | k3 (default k3 in the loss, k1 in the rewards)"),
    "gamma": (float, "GAE discount"),
    "lam": (float, "GAE lambda"),
    "temperature": (float, "sampling temperature applied to logits"),
    "top_p": (float, "nucleus sampling threshold"),
    "top_k": (int, "top-k sampling (0 or -1 = off)"),
    "loss_reduction": (str, "sequence_mean | token_mean | constant"),
    "source_dtype": (str, "dtype of the float tensors before they were stored"),
    "reward_component_names": (list, "names of the F columns of reward_components"),
    "old_logprobs_source": (str, "where old_logprobs came from; 'policy_detached' = ratio is 1 by construction"),
    "advantage_rule": (str, "the advantage rule (tracer.formulas.ADVANTAGE_RULES): gae | gae_whitened | "
                            "group_zscore | group_zscore_unbiased | batch_zscore_unbiased | group_mean | rloo | rloo_kl"),
    "gradient_accumulation_steps": (int, "micro-batches per optimizer step (the first ones see fresh weights)"),
    "rows_before_cut": (int, "the step's B before SamplingPolicy.first_k_sequences kept its first rows"),
    "role_names": (list, "names of the token_roles codes (default system, user, assistant, tool)"),
    "mask_reason_names": (list, "names of the mask_reasons codes (default kept, prompt, padding, after_eos, "
                                "truncated, tool_output, environment; a trainer may add its own)"),
    "advantage_assignment": (str, "multi-turn: 'episode' (one outcome advantage broadcast over every turn) | "
                                  "'turn' (each turn its own advantage)"),
    "is_correction": (bool, "an importance-sampling correction for the sampler/trainer gap multiplies the loss "
                            "(TRL vllm_importance_sampling_correction, verl rollout_is set)"),
    "is_mode": (str, "token_truncate | token_mask | sequence_truncate | sequence_mask (TRL's names; verl's "
                     "rollout_is token/sequence with truncate or mask, IcePop = token_mask with both caps)"),
    "is_clip_min": (float, "lower cap of the importance-sampling weight (mask modes zero the weight below it)"),
    "is_clip_max": (float, "upper cap of the importance-sampling weight (truncate clamps to it, mask zeroes above)"),
    "is_sequence_aggregation": (str, "sequence modes: 'sum' (product of token ratios, TRL, verl) | 'mean' "
                                     "(geometric mean, GSPO-style)"),
    "is_weights_source": (str, "'recorded' (the trainer's own weights) | 'derived' (recomputed by tracer from "
                               "old and sampler logprobs and the recorded mode and caps)"),
    "trainer_version": (int, "the trainer's policy version at this update (optimizer updates applied so far); "
                             "policy_lag = trainer_version - policy_version per row"),
    "max_policy_lag": (int, "the largest policy lag the run declares acceptable (asynchronous / off-policy "
                            "loops); rows beyond it are reported by sampler.policy_lag"),
    "micro_batch_counted": (bool, "tracer.watch numbered this micro-batch by counting backwards (the frame named "
                                  "no micro-batch or inner step): it may be a later pass over the rollout"),
}
LOSS_REDUCTIONS = ("sequence_mean", "token_mean", "constant")


# A DPO trainer that precomputes the reference (TRL's precompute_ref_log_probs) keeps only its
# per-pair sums: a trace then records those [B] fields in place of the per-token ones, with step
# metadata ref_logprobs_source = REF_PRECOMPUTED_SUMS (tracer.integrations.trl_dpo writes them,
# the fields.required check reads them).
REF_SEQUENCE_SUMS = {"chosen_ref_logprobs": "chosen_ref_sequence_logprobs",
                     "rejected_ref_logprobs": "rejected_ref_sequence_logprobs"}
REF_PRECOMPUTED_SUMS = "trl_precomputed_sums"
# An estimator that gives each token its own advantage outside PPO (verl's optimal_token_baseline):
# a [B, T] field of this name stands in for the per-sequence advantages (tracer.integrations.verl_record).
TOKEN_ADVANTAGES = "token_advantages"


def required_fields(algorithm: str) -> list[str]:
    """Canonical fields a trace of ``algorithm`` must carry."""
    return [name for name, spec in FIELDS.items() if algorithm in spec.required_for]


def _check_kind(name: str, spec: FieldSpec, tensor: torch.Tensor) -> None:
    """Dtype kind rules (no data read)."""
    if spec.kind == INT64 and (tensor.is_floating_point() or is_bool(tensor) or tensor.is_complex()):
        raise SchemaError(
            f"field {name!r}: expected an integer tensor (stored as int64), got dtype {tensor.dtype}; "
            "pass the token ids / group ids as an integer tensor"
        )
    if spec.kind == FLOAT and not tensor.is_floating_point():
        raise SchemaError(
            f"field {name!r}: expected a floating-point tensor, got dtype {tensor.dtype}; "
            "pass the float values (logprobs in nats), e.g. tensor.float()"
        )


def check_mask_field(name: str, tensor: torch.Tensor) -> None:
    """A float or integer mask must hold only 0 and 1 (reads the data: call on CPU tensors).
    Raises SchemaError naming the field and the first bad values."""
    if not is_bool(tensor) and not bool(((tensor == 0) | (tensor == 1)).all()):
        bad = tensor[(tensor != 0) & (tensor != 1)][:3].tolist()
        raise SchemaError(
            f"field {name!r}: a mask must hold only 0 and 1 (True = keep), got values {bad}; "
            "pass a bool tensor or a 0/1 tensor"
        )


def _normalise(name: str, spec: FieldSpec | None, tensor: torch.Tensor, keep_source_dtype: bool):
    import torch  # the writer's path: imported already

    # Each conversion only when needed: a tensor already as stored costs no call into torch that
    # releases the interpreter lock (the writer thread shares it with the training loop).
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if spec is not None:
        _check_kind(name, spec, tensor)
        if spec.kind == BOOL:
            if tensor.dtype != torch.bool:
                check_mask_field(name, tensor)
                tensor = tensor != 0
        elif spec.kind == INT64:
            if tensor.dtype != torch.int64:
                tensor = tensor.to(torch.int64)
        elif not keep_source_dtype and tensor.dtype != torch.float32:
            tensor = tensor.to(torch.float32)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _check_dpo_sides(tensors: Mapping[str, torch.Tensor]) -> None:
    """A DPO record holds both sides of every per-side field (chosen_X with rejected_X)."""
    for name in tensors:
        for side, other in (("chosen_", "rejected_"), ("rejected_", "chosen_")):
            if name.startswith(side) and name in FIELDS:
                twin = other + name[len(side):]
                if twin in FIELDS and twin not in tensors:
                    raise SchemaError(
                        f"DPO record has {name!r} but not {twin!r}; record both sides of each pair")


def check_tensors(
    tensors: Mapping[str, torch.Tensor], algorithm: str | None, check_required: bool = False,
    sizes: dict[str, tuple[int, str]] | None = None,
) -> None:
    """Check names, ranks, shared dimension sizes and dtype kinds against the schema, without
    moving data (a float mask's values are checked here only when it is on the CPU).

    ``sizes`` (``{dim: (size, field that set it)}``), when given, holds the dimensions of fields
    checked earlier (the new fields must agree with them) and receives those of ``tensors``: adding
    fields one group at a time costs the new fields only (zero-edit capture). Pass a copy to keep
    the original when the check may fail.

    Raises:
        SchemaError: a non-tensor value, wrong rank, a dimension that disagrees with an earlier
            field (both fields named), a wrong dtype kind, a non-0/1 float mask, a DPO field without
            its other side, or (``check_required``) a missing required field.
    """
    sizes = {} if sizes is None else sizes
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise SchemaError(
                f"field name {name!r} is not allowed: '__metadata__' is reserved by safetensors for the "
                "header and names must be non-empty strings; rename the field")
        if not (isinstance(tensor, HeaderTensor) or is_torch(tensor)):  # a header's field, or a tensor
            raise SchemaError(f"field {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        spec = FIELDS.get(name)
        if spec is None:
            continue
        dims = spec.dims_for(algorithm)
        if tensor.dim() != len(dims):
            expected = "[" + ", ".join(dims) + "]"
            raise SchemaError(
                f"field {name!r}: expected shape {expected}, got {list(tensor.shape)}; "
                f"record {name} as a {len(dims)}-d tensor {expected}"
            )
        for dim, size in zip(dims, tensor.shape):
            if dim in sizes and sizes[dim][0] != size:
                other_size, other = sizes[dim]
                raise SchemaError(
                    f"field {name!r}: dimension {dim} is {size}, but field {other!r} has {dim} = "
                    f"{other_size}; all fields of one step must share B, T, L and F"
                )
            sizes.setdefault(dim, (int(size), name))
        _check_kind(name, spec, tensor)
        if spec.kind == BOOL and not isinstance(tensor, HeaderTensor) and tensor.device.type == "cpu":
            check_mask_field(name, tensor)
    if algorithm == "dpo":
        _check_dpo_sides(tensors)
    if check_required and algorithm:
        missing = [f for f in required_fields(algorithm) if f not in tensors]
        if missing:
            raise SchemaError(f"algorithm {algorithm!r} requires fields {missing}, which were not recorded")


def normalise_tensors(
    tensors: Mapping[str, torch.Tensor], algorithm: str | None, keep_source_dtype: bool = False
) -> dict[str, torch.Tensor]:
    """Tensors as stored on disk: detached, on CPU, contiguous; masks bool; ids int64; floats
    float32 unless ``keep_source_dtype``. Fields outside the schema are kept as they are.

    Raises:
        SchemaError: a dtype kind or mask value the schema refuses.
    """
    return {name: _normalise(name, FIELDS.get(name), t, keep_source_dtype) for name, t in tensors.items()}
