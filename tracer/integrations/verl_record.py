"""What the verl hooks record (:mod:`tracer.integrations.verl` installs them; the facts from verl's
source are in its docstring). Pure torch: verl objects are read by duck typing (``DataProto.batch`` /
``non_tensor_batch``, TensorDict ``keys()`` / ``get``), so the join and the tests of this module need
no verl.

:class:`DriverRecorder` writes one rollout file per step (the whole batch, rank 0) and tags the rows
with ``tracer_row_ids``; :class:`WorkerRecorder` writes one file per micro-batch of its rank, with
the coordinates it works out from the row ids (step, epoch, mini-batch, position).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Mapping

import torch

from tracer import formulas
from tracer.errors import TraceError
from tracer.format.schema import TOKEN_ADVANTAGES
from tracer.record.writer import TraceWriter

log = logging.getLogger(__name__)

ROW_ID_KEY = "tracer_row_ids"
ROW_STRIDE = 1 << 32  # row id = step * ROW_STRIDE + row of the driver's batch
ROLLOUT_DIR, WORKERS_DIR = "rollout", "workers"

# verl loss_agg_mode -> SPEC loss_reduction (token-sum modes have no SPEC name: kept as verl's)
LOSS_REDUCTION = {"token-mean": "token_mean", "seq-mean-token-mean": "sequence_mean",
                  "seq-mean-token-sum-norm": "constant"}
# verl adv_estimator -> SPEC algorithm of the trace
_ALGORITHM = {"gae": "ppo", "rloo": "rloo", "rloo_vectorized": "rloo"}


def _name(value: Any) -> str:
    return str(getattr(value, "value", value))


def sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
    """verl's token-level ``[B, T]`` advantages as ``[B]`` when every kept token of a row holds the same
    value (GRPO/RLOO broadcast a scalar), read on the first kept token; None otherwise (GAE). A row
    without kept tokens gets 0."""
    keep = mask.bool()
    first = keep.float().argmax(dim=1)  # (B,)
    per_row = advantages.gather(1, first.unsqueeze(1)).squeeze(1)  # (B,)
    same = (advantages == per_row.unsqueeze(1)) | ~keep
    if not bool(same.all()):
        return None
    return torch.where(keep.any(dim=1), per_row, torch.zeros_like(per_row))


def _fit(tensor: torch.Tensor, T: int, fill: float | int = 0) -> torch.Tensor:
    """``[B, T']`` (padded or nested) as ``[B, T]``: nested padded, then cut or right-padded with ``fill``."""
    if tensor.is_nested:
        tensor = torch.nested.to_padded_tensor(tensor, fill)
    if tensor.shape[1] >= T:
        return tensor[:, :T]
    pad = torch.full((tensor.shape[0], T - tensor.shape[1]), fill, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, pad], dim=1)


class _Recorder:
    """A lazily created :class:`TraceWriter` (the algorithm is known at the first record) and failure counting."""

    def __init__(self, out_dir: os.PathLike, strict: bool, tokenizer: Any = None) -> None:
        self.out_dir, self.strict, self.tokenizer = out_dir, strict, tokenizer
        self.writer: TraceWriter | None = None
        self.failures = 0
        self.disabled: str | None = None  # why the trace could not be opened: nothing more is recorded

    def _writer(self, algorithm: str, hyperparameters: Mapping[str, Any], config: Mapping[str, Any]) -> TraceWriter:
        if self.writer is None:
            try:
                self.writer = TraceWriter(self.out_dir, algorithm, hyperparameters=hyperparameters, config=config,
                                          strict=self.strict, tokenizer=self.tokenizer)
            except Exception as err:  # e.g. the directory holds an earlier run: one warning, then quiet
                self.disabled = f"{type(err).__name__}: {err}"
                raise
        return self.writer

    def count_failure(self, err: Exception) -> None:
        self.failures += 1
        reason = f"{type(err).__name__}: {err}"
        if self.writer is not None:
            self.writer.count_drop(reason)
        log.debug("tracer (verl) capture failure", exc_info=err)
        warnings.warn(f"tracer: could not record a verl step ({self.failures} failures so far): {reason}. "
                      "Training continues; set TRACER_STRICT=1 to raise instead.", RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class DriverRecorder(_Recorder):
    """Records the output of ``compute_advantage`` (the whole step's ``DataProto``) as one step file.

    Fields: ``prompt_ids`` / ``prompt_mask`` ``[B, L]``, ``completion_ids`` / ``completion_mask`` ``[B, T]``,
    ``rewards [B]`` (``token_level_rewards.sum(-1)``, what verl's estimators score), ``token_rewards``,
    ``advantages`` (``[B]``, or ``[B, T]`` for GAE), ``old_logprobs``, ``ref_logprobs``,
    ``sampler_logprobs``, ``values`` / ``returns`` (PPO), ``group_ids`` and ``row_ids`` ``[B]`` int64.
    """

    def __init__(self, out_dir: os.PathLike, strict: bool = False, tokenizer: Any = None) -> None:
        super().__init__(out_dir, strict, tokenizer)
        self.step = 0

    def record(self, data: Any, arguments: Mapping[str, Any]) -> None:
        """Record ``data`` (the DataProto compute_advantage returns) and add ``tracer_row_ids`` to it."""
        if self.disabled:
            return
        batch, non_tensor = data.batch, getattr(data, "non_tensor_batch", {}) or {}
        step, B = self.step, int(batch["responses"].shape[0])
        self.step += 1
        row_ids = torch.arange(B, dtype=torch.int64) + step * ROW_STRIDE  # (B,)
        batch[ROW_ID_KEY] = row_ids.to(batch["responses"].device)  # travels to the workers with the batch
        estimator = _name(arguments.get("adv_estimator"))
        algorithm = _ALGORITHM.get(estimator, "grpo")
        tensors, uids = self._tensors(batch, non_tensor, algorithm, row_ids)
        meta = {**self._metadata(arguments, estimator, uids), **_declared_algorithm(arguments.get("config")),
                **_kl_in_reward(batch), **_meta_info_temperature(data)}
        writer = self._writer(algorithm, {k: v for k, v in meta.items() if k != "uids"},
                              {"framework": "verl", "role": "driver"})
        writer.record(step, tensors, metadata={**meta, "verl_role": "driver"})  # the settings of this call

    @staticmethod
    def _tensors(batch: Any, non_tensor: Mapping[str, Any], algorithm: str,
                 row_ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[str] | None]:
        responses, mask = batch["responses"], batch["response_mask"].bool()  # (B, T)
        prompts = batch["prompts"]  # (B, L), left-padded
        L = prompts.shape[1]
        rewards = batch["token_level_rewards"]  # (B, T)
        tensors = {"prompt_ids": prompts, "prompt_mask": batch["attention_mask"][:, :L].bool(),
                   "completion_ids": responses, "completion_mask": mask, "token_rewards": rewards,
                   "rewards": rewards.sum(dim=-1), "row_ids": row_ids}
        renamed = {"old_log_probs": "old_logprobs", "ref_log_prob": "ref_logprobs",
                   "rollout_log_probs": "sampler_logprobs", "values": "values"}
        keys = set(batch.keys())
        tensors.update({new: batch[old] for old, new in renamed.items() if old in keys})
        advantages = batch["advantages"]  # (B, T)
        per_row = None if algorithm == "ppo" else sequence_advantages(advantages, mask)
        if algorithm == "ppo":
            tensors["advantages"] = advantages
            if "returns" in keys:
                tensors["returns"] = batch["returns"]
        elif per_row is not None:
            tensors["advantages"] = per_row
        else:
            tensors[TOKEN_ADVANTAGES] = advantages
        if "token_level_scores" in keys:
            tensors["verl_scores"] = batch["token_level_scores"].sum(dim=-1)  # before any KL-in-reward
        uids = None
        if "uid" in non_tensor:
            uids = [str(u) for u in list(non_tensor["uid"])]
            numbers: dict[str, int] = {}
            tensors["group_ids"] = torch.tensor([numbers.setdefault(u, len(numbers)) for u in uids], dtype=torch.int64)
        return {k: v.detach() for k, v in tensors.items()}, uids

    @staticmethod
    def _metadata(arguments: Mapping[str, Any], estimator: str, uids: list[str] | None) -> dict[str, Any]:
        norm = bool(arguments.get("norm_adv_by_std_in_grpo", True))
        meta: dict[str, Any] = {"adv_estimator": estimator, "num_generations": int(arguments.get("num_repeat") or 1),
                                "gamma": float(arguments.get("gamma", 1.0)), "lam": float(arguments.get("lam", 1.0)),
                                "norm_adv_by_std_in_grpo": norm, "uids": uids}
        correction = getattr(arguments.get("config"), "rollout_correction", None)
        rejection = getattr(correction, "rollout_rs", None)
        if rejection:  # rows verl rejected have an empty response_mask on purpose (rollout_corr_helper)
            meta["rollout_rs"] = str(rejection)
        meta.update(_rollout_correction(correction))
        if estimator in ("grpo", "grpo_vectorized"):
            meta["advantage_rule"] = "verl_grpo" if norm else "group_mean"  # mean-centred only (Dr. GRPO)
            meta["advantage_std"] = "unbiased"
        elif estimator not in _ALGORITHM:  # REINFORCE++, ReMax, OPO, GPG, pass@k...: verl's own rule, named
            meta["advantage_rule"] = f"{formulas.VERL_RULE_PREFIX}{estimator}"  # so no check takes it for a GRPO z-score
        return meta


def _rollout_correction(correction: Any) -> dict[str, Any]:
    """verl's rollout correction as ``fit`` ran it (``algorithm.rollout_correction``, a
    ``RolloutCorrectionConfig``; verl 0.9.1 ``trainer/config/algorithm.py``): ``rollout_is`` (``token`` |
    ``sequence``; absent when verl computes no IS weights), ``rollout_is_threshold`` (a float upper cap,
    or verl's ``"lower_upper"`` string: IcePop), ``rollout_is_batch_normalize`` (bool) and
    ``rollout_rs_threshold`` (rejection sampling's threshold, float or string), which
    ``sampler.is_weights`` reads through :func:`tracer.formulas.importance.declared_correction`. Empty
    when the run has no rollout correction (``algorithm.rollout_correction`` None)."""
    if correction is None:
        return {}
    meta: dict[str, Any] = {}
    rollout_is = getattr(correction, "rollout_is", None)
    if rollout_is:
        threshold = getattr(correction, "rollout_is_threshold", 2.0)
        meta["rollout_is"] = str(rollout_is)
        meta["rollout_is_threshold"] = threshold if isinstance(threshold, str) else float(threshold)
        meta["rollout_is_batch_normalize"] = bool(getattr(correction, "rollout_is_batch_normalize", False))
    rs_threshold = getattr(correction, "rollout_rs_threshold", None)
    if getattr(correction, "rollout_rs", None) and rs_threshold is not None:
        meta["rollout_rs_threshold"] = rs_threshold if isinstance(rs_threshold, str) else float(rs_threshold)
    return meta


def _declared_algorithm(config: Any) -> dict[str, Any]:
    """What the ``AlgoConfig`` passed to ``compute_advantage`` as ``config`` declares (``fit`` reads the
    call's arguments from it): ``declared_adv_estimator``, ``declared_norm_adv_by_std_in_grpo``,
    ``declared_gamma`` / ``declared_lam``, ``declared_use_kl_in_reward``, ``declared_kl_penalty`` and the
    KL controller's ``declared_kl_coef``. Empty when no config was passed."""
    get = getattr(config, "get", None)
    if get is None:
        return {}
    meta: dict[str, Any] = {}
    if get("adv_estimator", None) is not None:
        meta["declared_adv_estimator"] = _name(get("adv_estimator"))
    meta["declared_norm_adv_by_std_in_grpo"] = bool(get("norm_adv_by_std_in_grpo", True))  # fit's default
    for key in ("gamma", "lam"):
        if isinstance(get(key, None), (int, float)):
            meta[f"declared_{key}"] = float(get(key))
    if get("use_kl_in_reward", None) is not None:
        meta["declared_use_kl_in_reward"] = bool(get("use_kl_in_reward"))
    if get("kl_penalty", None) is not None:
        meta["declared_kl_penalty"] = str(get("kl_penalty"))
    coef = getattr(get("kl_ctrl", None), "get", lambda *_: None)("kl_coef", None)
    if isinstance(coef, (int, float)):
        meta["declared_kl_coef"] = float(coef)
    return meta


def _kl_in_reward(batch: Any) -> dict[str, Any]:
    """``use_kl_in_reward`` in effect: True when ``token_level_rewards`` differ from ``token_level_scores`` on a
    kept token (``apply_kl_penalty`` subtracted a KL term; verl copies the scores otherwise), with the
    largest |difference| as ``kl_in_reward_max_abs``; empty when the scores are not in the batch."""
    if "token_level_scores" not in set(batch.keys()):
        return {}
    keep = batch["response_mask"].bool()
    gap = (batch["token_level_rewards"].double() - batch["token_level_scores"].double()).abs()[keep]
    gap = gap[torch.isfinite(gap)]
    largest = float(gap.max()) if gap.numel() else 0.0
    return {"use_kl_in_reward": largest > 0.0, "kl_in_reward_max_abs": largest}


def _meta_info_temperature(data: Any) -> dict[str, Any]:
    """``declared_temperature``: ``meta_info["temperature"]`` of the driver's batch (``fit`` sets it from
    ``rollout.temperature``; the workers' forward divides the logits by what reaches them)."""
    value = (getattr(data, "meta_info", None) or {}).get("temperature")
    return {"declared_temperature": float(value)} if isinstance(value, (int, float)) else {}


class WorkerRecorder(_Recorder):
    """Records each call of a ``tracer_<name>`` policy loss on this worker rank as one step file.

    Coordinates: ``step`` = the driver's step (from the row ids), ``inner_step`` = the epoch over these
    rollouts, ``micro_batch`` = the call's index within the step on this rank. Metadata ``mini_batch``,
    ``micro_batch_in_mini_batch`` and ``fresh_rollouts`` (first mini-batch of the first epoch: no
    optimizer step has used the rollouts yet). Without row ids (no driver hook) every call is its own
    step in call order and only the first call counts as fresh.
    """

    def __init__(self, out_dir: os.PathLike, strict: bool = False) -> None:
        super().__init__(out_dir, strict)
        self.calls = 0
        self._step: int | None = None
        self._epoch = self._rows_in_epoch = self._call_in_step = 0
        self._mini_batch = self._in_mini_batch = -1
        self._seen: set[int] = set()

    def record(self, loss_mode: str, arguments: Mapping[str, Any], result: Any, data: Any,
               agg_calls: list[Mapping[str, Any]] | None = None, declared: Any = None) -> None:
        """Record one policy-loss call: ``arguments`` as the loss received them, ``result`` = (pg_loss, metrics),
        ``data`` the micro-batch TensorDict of ``ppo_loss`` (None when the loss was called directly),
        ``agg_calls`` the ``core_algos.agg_loss`` calls the loss made (arguments and ``result``),
        ``declared`` the ``ActorConfig`` ``ppo_loss`` received (None: the loss's own ``config``)."""
        if self.disabled:
            return
        policy, old = arguments["log_prob"].detach(), arguments["old_log_prob"].detach()  # (B, T)
        mask = arguments["response_mask"].bool()
        B, T = policy.shape
        config = arguments.get("config")
        tensors = {"policy_logprobs": policy, "old_logprobs": old, "completion_mask": mask,
                   "ratio": formulas.ratio(policy.float(), old.float()),
                   "approx_kl_k2": formulas.approx_kl_k2(policy.float(), old.float())}
        per_row = sequence_advantages(arguments["advantages"].detach(), mask)
        if per_row is not None:
            tensors["advantages"] = per_row
        else:
            tensors["token_advantages"] = arguments["advantages"].detach()
        if arguments.get("rollout_is_weights") is not None:
            tensors["rollout_is_weights"] = arguments["rollout_is_weights"].detach()
        pg_loss = result[0] if isinstance(result, tuple) else result
        if isinstance(pg_loss, torch.Tensor) and pg_loss.numel() == 1:
            tensors["verl_pg_loss"] = pg_loss.detach().reshape(())
        call = _pg_loss_call(agg_calls or [], pg_loss, (B, T))
        if call is not None:
            tensors["verl_pg_losses"] = call["loss_mat"].detach()
        row_ids = self._from_batch(data, T, tensors) if data is not None else None
        position = self._position(row_ids, data)
        meta = {**position, **_loss_metadata(loss_mode, arguments.get("loss_agg_mode"), config, data),
                **_in_effect(call, arguments.get("loss_agg_mode"), config, declared if declared is not None else config,
                             data)}
        algorithm = "cispo" if loss_mode == "cispo" else "grpo"
        writer = self._writer(algorithm, {}, {"framework": "verl", "role": "worker"})
        step, epoch, call = meta.pop("step"), meta.pop("epoch"), meta.pop("call_in_step")
        writer.record(step, tensors, inner_step=epoch, micro_batch=call, metadata=meta)

    @staticmethod
    def _from_batch(data: Any, T: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Ids, prompts, reference and sampler logprobs of the micro-batch from ``ppo_loss``'s ``data``."""
        keys = set(data.keys())
        if "responses" in keys:
            tensors["completion_ids"] = _fit(data["responses"], T)
        if "prompts" in keys and not data["prompts"].is_nested:
            prompts = data["prompts"]
            tensors["prompt_ids"] = prompts
            if "attention_mask" in keys and not data["attention_mask"].is_nested:
                tensors["prompt_mask"] = data["attention_mask"][:, : prompts.shape[1]].bool()
        for old, new in (("ref_log_prob", "ref_logprobs"), ("rollout_log_probs", "sampler_logprobs")):
            if old in keys:
                tensors[new] = _fit(data[old].detach(), T)
        if "ref_logprobs" in tensors:
            tensors["ref_kl_k3"] = formulas.ref_kl_k3(tensors["policy_logprobs"].float(), tensors["ref_logprobs"].float())
        if ROW_ID_KEY not in keys:
            return None
        row_ids = data[ROW_ID_KEY].detach().cpu().to(torch.int64)  # (B,)
        tensors["row_ids"] = row_ids % ROW_STRIDE
        return row_ids

    def _position(self, row_ids: torch.Tensor | None, data: Any) -> dict[str, Any]:
        """Step, epoch, mini-batch and freshness of this call (see the class docstring)."""
        self.calls += 1
        if row_ids is None:
            return {"step": self.calls - 1, "epoch": 0, "call_in_step": 0, "fresh_rollouts": self.calls == 1,
                    "positions_from": "call_order"}
        steps = torch.unique(row_ids // ROW_STRIDE).tolist()
        if len(steps) != 1:
            raise TraceError(f"one micro-batch holds rows of driver steps {steps}; expected one step")
        rows = (row_ids % ROW_STRIDE).tolist()
        if steps[0] != self._step:
            self._step, self._epoch, self._rows_in_epoch, self._call_in_step = steps[0], 0, 0, 0
            self._mini_batch, self._in_mini_batch, self._seen = -1, -1, set()
        if self._seen.intersection(rows):  # a row seen again: the next epoch over these rollouts
            self._epoch, self._rows_in_epoch, self._seen = self._epoch + 1, 0, set()
            self._mini_batch = -1
        per_mini_batch = _rows_per_mini_batch(data)
        mini_batch = self._rows_in_epoch // per_mini_batch if per_mini_batch else None
        if mini_batch != self._mini_batch:
            self._mini_batch, self._in_mini_batch = mini_batch, -1
        self._in_mini_batch += 1
        self._seen.update(rows)
        self._rows_in_epoch += len(rows)
        call, self._call_in_step = self._call_in_step, self._call_in_step + 1
        fresh = None if mini_batch is None else (self._epoch == 0 and mini_batch == 0)
        return {"step": steps[0], "epoch": self._epoch, "call_in_step": call, "mini_batch": mini_batch,
                "micro_batch_in_mini_batch": self._in_mini_batch, "rows_per_mini_batch": per_mini_batch,
                "fresh_rollouts": fresh, "positions_from": "row_ids"}


def _get(data: Any, key: str) -> Any:
    if data is None or key not in set(data.keys()):
        return None
    value = data[key]
    return getattr(value, "data", value) if not isinstance(value, torch.Tensor) else value


def _rows_per_mini_batch(data: Any) -> int | None:
    """Rows of one optimizer step on this rank: ``global_batch_size / dp_size`` of the micro-batch data."""
    size, dp = _get(data, "global_batch_size"), _get(data, "dp_size")
    if isinstance(size, torch.Tensor):
        size = int(size)
    if isinstance(size, int) and size > 0:
        return max(size // int(dp or 1), 1)
    return None


def _pg_loss_call(calls: list[Mapping[str, Any]], pg_loss: Any, shape: tuple[int, int]) -> Mapping[str, Any] | None:
    """The ``agg_loss`` call whose result the policy loss returned as ``pg_loss`` (the same tensor, else the
    same value), over a ``[B, T]`` loss of the micro-batch's shape; None when there is no such call."""
    calls = [c for c in calls if isinstance(c.get("loss_mat"), torch.Tensor) and tuple(c["loss_mat"].shape) == shape]
    same = [c for c in calls if c["result"] is pg_loss]
    if not same and isinstance(pg_loss, torch.Tensor):
        same = [c for c in calls if isinstance(c["result"], torch.Tensor) and c["result"].shape == pg_loss.shape
                and bool(torch.equal(c["result"].detach(), pg_loss.detach()))]
    return same[-1] if same else None


def _number(value: Any) -> Any:
    """A scalar (int, float, one-element tensor) as a Python number; None for anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


_CLIP_KEYS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
_DECLARED_KEYS = ("loss_agg_mode", *_CLIP_KEYS, "entropy_coeff", "use_kl_loss", "kl_loss_type", "kl_loss_coef",
                  "loss_scale_factor")


def _in_effect(call: Mapping[str, Any] | None, agg_argument: Any, config: Any, declared: Any,
               data: Any) -> dict[str, Any]:
    """The settings in effect at the call next to the declared ones (module docstring of
    :mod:`tracer.integrations.verl`): ``loss_agg_mode`` = the mode of the ``agg_loss`` call that gave
    ``pg_loss`` (else the argument), ``loss_agg_mode_argument`` = what the policy loss received,
    ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size`` / ``loss_scale_factor`` as ``agg_loss`` got
    them, ``clip_ratio*`` of the loss's ``config``, ``temperature`` of the micro-batch; and
    ``declared_<key>`` of the ``ActorConfig`` ``ppo_loss`` received."""
    meta: dict[str, Any] = {"loss_agg_mode_argument": str(agg_argument)}
    if call is not None:
        meta["loss_agg_mode"] = str(call["loss_agg_mode"])
        meta["loss_reduction"] = LOSS_REDUCTION.get(meta["loss_agg_mode"], f"verl:{meta['loss_agg_mode']}")
        meta["pg_losses_from"] = "agg_loss"
        for key in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor"):
            if _number(call.get(key)) is not None:
                meta[key] = _number(call.get(key))
    get = getattr(config, "get", None)
    if get is not None:
        for key in _CLIP_KEYS:
            if _number(get(key, None)) is not None:
                meta[key] = float(get(key))
        if meta.get("loss_scale_factor") is None and _number(get("loss_scale_factor", None)) is not None:
            meta["loss_scale_factor"] = _number(get("loss_scale_factor", None))
    declared_get = getattr(declared, "get", None)
    if declared_get is not None:
        for key in _DECLARED_KEYS:
            value = declared_get(key, None)
            if value is not None and isinstance(value, (str, int, float, bool)):
                meta[f"declared_{key}"] = value
    temperature = _number(_get(data, "temperature"))
    if temperature is not None:
        meta["temperature"] = float(temperature)
    return meta


def _loss_metadata(loss_mode: str, agg_mode: Any, config: Any, data: Any) -> dict[str, Any]:
    """Loss mode, reduction, clip epsilons and KL-loss settings from verl's ``ActorConfig``."""
    agg = str(agg_mode)
    meta: dict[str, Any] = {"verl_role": "worker", "loss_mode": loss_mode, "loss_agg_mode": agg,
                            "loss_reduction": LOSS_REDUCTION.get(agg, f"verl:{agg}")}
    get = getattr(config, "get", None)
    if get is None:
        return meta
    clip = get("clip_ratio", None)
    low, high = get("clip_ratio_low", None), get("clip_ratio_high", None)
    if loss_mode != "cispo" and clip is not None:
        meta["clip_epsilon_low"] = float(low if low is not None else clip)
        meta["clip_epsilon_high"] = float(high if high is not None else clip)
    if get("use_kl_loss", False):
        meta["beta"], meta["kl_loss_type"] = float(get("kl_loss_coef", 0.0)), str(get("kl_loss_type", ""))
    for key in ("ppo_epochs", "entropy_coeff"):
        if get(key, None) is not None:
            meta[key] = get(key)
    for key in ("dp_size", "global_batch_size", "batch_num_tokens"):
        value = _get(data, key)
        if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1):
            meta[key] = value if not isinstance(value, torch.Tensor) else value.item()
    return meta
