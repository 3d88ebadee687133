"""What a step check sees: one step file's tensors and metadata, the options of the run, the
tolerances for the step's dtype, and a helper that builds a located :class:`Finding`.

Hyperparameters come from the step metadata (SPEC.md section 4 keys), then from the manifest's
``hyperparameters``. Tolerances follow the loosest float dtype the step went through: the
``source_dtype`` metadata (comma-separated), an optional ``model_dtype`` key, and the stored dtypes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch

from tracer.checks.catalogue import HEALTH_DEFAULTS, HEALTH_THRESHOLDS, threshold_problem
from tracer.checks.finding import Finding, Skip, not_applicable
from tracer.errors import TraceError
from tracer.format import turns
from tracer.read import StepKey, Trace


@dataclass(frozen=True)
class Tolerance:
    """Tolerances for one dtype.

    Attributes:
        identity_atol: per-token |policy - old| (nats) allowed at the first inner step.
        mean_ratio: allowed |mean ratio - 1| at the first inner step (SPEC: 1e-3 for float32).
        atol, rtol: recorded derived tensor vs its recomputation from recorded inputs.
        loss_rtol: recorded scalar loss vs its recomputation (relative, plus ``atol``).
    """

    identity_atol: float
    mean_ratio: float
    atol: float
    rtol: float
    loss_rtol: float


# Ordered from strictest to loosest; a step takes the loosest dtype it went through.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(identity_atol=1e-6, mean_ratio=1e-6, atol=1e-9, rtol=1e-7, loss_rtol=1e-6),
    "float32": Tolerance(identity_atol=1e-3, mean_ratio=1e-3, atol=1e-5, rtol=1e-4, loss_rtol=1e-3),
    "float16": Tolerance(identity_atol=1e-2, mean_ratio=5e-3, atol=1e-3, rtol=1e-2, loss_rtol=1e-2),
    "bfloat16": Tolerance(identity_atol=5e-2, mean_ratio=1e-2, atol=1e-2, rtol=2e-2, loss_rtol=2e-2),
}
_DTYPE_ALIASES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                  "double": "float64", "float": "float32", "half": "float16"}


def loosest_dtype(names: list[str]) -> str:
    """The loosest known float dtype among ``names`` (``float32`` when none is known)."""
    order = list(TOLERANCES)
    known = [_DTYPE_ALIASES.get(n, n.removeprefix("torch.")) for n in names]
    known = [n for n in known if n in TOLERANCES] or ["float32"]
    return max(known, key=order.index)


@dataclass
class CheckOptions:
    """Options of one ``check`` run.

    The ``health`` thresholds (``tracer check --threshold NAME=VALUE``, names in :data:`HEALTH_THRESHOLDS`)
    mark a run that is not broken but drifting; each default is chosen from published practice, so a
    healthy run stays well below it. A step-file value warns when the run stays past it (at two or
    more steps, or at its last step; the clip fraction at any step file; ``tracer.checks.health``):

    Attributes:
        sampler_ratio_bound: C; a token whose ``exp(old - sampler)`` lies outside [1/C, C] counts
            as a sampler/trainer mismatch.
        worst_tokens: how many worst tokens a finding lists in its details.
        ref_kl_max: ``ref_kl``: mean k3 KL to the reference per kept token (nats) above which a step
            file warns. 2.0 nats per token: published runs log 0.001-0.1 nats per token (GRPO/verl at
            β = 0.001-0.04; TRL's adaptive KL controller targets 6 nats per *sequence*, Ziegler et al.
            2019), and the tiny-model runs at learning rate 1e-2 that tests/checks/test_minimind_configs.py
            sweeps as healthy reach 1.5.
        clip_fraction_max: ``clip_fraction``: share of kept tokens whose gradient the clip removes (ratio
            past the bound on the side the advantage pushes, ``tracer info``'s clip_fraction) in one step
            file after the first update on a rollout, above which it warns (any one file). 0.5: PPO's
            clip fraction sits at 0.05-0.2 in healthy runs (Engstrom et al. 2020, "Implementation
            Matters"; cleanrl's ``clipfrac`` logs) and reaches 0.29 on the 14-token minibatches of
            sample_traces/ppo-tiny; past half, the trust region removes most of the update. Not judged
            under a clip range tighter than :data:`TIGHT_CLIP` on either side, which binds on most
            tokens by design.
        sampler_gap_max: ``sampler_gap``: mean |old - sampler| over kept tokens (nats, TRL's
            ``sampling/sampling_logp_difference/mean``) above which a step file warns. 0.1 nats: fp32
            vLLM vs trainer measures ~0.005 here; bf16 engines 0.01-0.05 (Yao et al. 2025, "Your
            efficient RL framework secretly brings you off-policy RL training").
        entropy_floor: ``entropy_floor``: mean token entropy (nats) under which a run whose first
            step file was above it has collapsed. 0.05 nats: the entropy-collapse regime of Cui et al.
            2025 ("The Entropy Mechanism of RL for Reasoning LMs"), where the policy is nearly greedy.
        entropy_drop: ``entropy_drop``: share of the first step file's mean entropy lost (0.9 = the
            entropy fell below a tenth of its first value) that counts as collapse (Cui et al. 2025;
            DAPO's clip-higher, Yu et al. 2025, exists to prevent it).
        reward_flat_share: ``reward_flat``: share of a step file's groups with zero reward std (all G
            rewards equal) at or above which it warns. 1.0: every group flat, so the reward gives the
            step no signal (DAPO's dynamic sampling drops such groups).
    """

    sampler_ratio_bound: float = 2.0
    worst_tokens: int = 5
    ref_kl_max: float = HEALTH_DEFAULTS["ref_kl_max"]
    clip_fraction_max: float = HEALTH_DEFAULTS["clip_fraction_max"]
    sampler_gap_max: float = HEALTH_DEFAULTS["sampler_gap_max"]
    entropy_floor: float = HEALTH_DEFAULTS["entropy_floor"]
    entropy_drop: float = HEALTH_DEFAULTS["entropy_drop"]
    reward_flat_share: float = HEALTH_DEFAULTS["reward_flat_share"]

    def with_thresholds(self, thresholds: dict[str, float]) -> "CheckOptions":
        """A copy with the ``health`` thresholds named by their :data:`HEALTH_THRESHOLDS` names (or
        attribute names) set. Raises TraceError for an unknown name or a value out of its range."""
        changes = {}
        for name, value in thresholds.items():
            value = float(value)
            problem = threshold_problem(name, value)
            if problem is not None:
                raise TraceError(problem)
            changes[HEALTH_THRESHOLDS.get(name, name)] = value
        return replace(self, **changes)


# A clip epsilon under this is tighter than PPO practice (0.1-0.3; 0.2 in Schulman et al. 2017): such a
# trust region binds on most tokens by design (the tight-clip runs of tests/checks/test_minimind_configs.py
# remove the gradient of up to all the tokens of a minibatch), so health.clip_fraction does not judge it.
TIGHT_CLIP = 0.1
# ``tracer check --threshold NAME=VALUE`` names -> CheckOptions attributes (the ``health`` family)


_REQUIRED = object()
# TRL options whose names and meaning are the same in the manifest's config.trainer_args (TRL's
# GRPOConfig / DPOConfig, copied by tracer.integrations.trl_metadata) as in step metadata: read there when the
# step metadata lacks them (traces recorded before the integration put them in metadata).
TRAINER_ARG_KEYS = frozenset({"delta", "top_entropy_quantile", "off_policy_mask_threshold",
                              "mask_truncated_completions", "importance_sampling_level", "min_p",
                              "repetition_penalty", "truncation_mode", "max_length", "sync_ref_model",
                              "ref_model_mixup_alpha", "ref_model_sync_steps"})


CHECK_MEMO_PREFIX = "_tracer_check_"  # attributes of a Trace that memoise work for one run of the checks


def check_memo(trace: Trace, name: str) -> dict:
    """A dict memoising ``name`` on ``trace`` for the current run of the checks (what several step
    files ask about their neighbours: a step's passes, rows, where the run puts its KL penalty);
    :func:`tracer.checks.runner.run_checks` empties them at its start, so a live trace checked again
    sees the files written meanwhile."""
    return trace.__dict__.setdefault(CHECK_MEMO_PREFIX + name, {})


def clear_check_memos(trace: Trace) -> None:
    """Forget every :func:`check_memo` of ``trace``."""
    for name in [n for n in trace.__dict__ if n.startswith(CHECK_MEMO_PREFIX)]:
        del trace.__dict__[name]


def step_memo(ctx: StepContext, name: str) -> dict:
    """A dict memoising ``name`` on one step file's context, for an answer several checks of that file
    ask (where the run puts its KL penalty). Like :func:`check_memo`, and forgotten with the context's
    by :func:`clear_step_memos`: the live guard clears both before each check, so that a check whose
    answer came from the run's other files (read while working it out) is listed as depending on them,
    whichever check asked first."""
    return ctx.__dict__.setdefault(CHECK_MEMO_PREFIX + name, {})


def clear_step_memos(ctx: StepContext) -> None:
    """Forget every :func:`step_memo` of ``ctx``."""
    for name in [n for n in ctx.__dict__ if n.startswith(CHECK_MEMO_PREFIX)]:
        del ctx.__dict__[name]


class StepHeader:
    """What a step file's header says: ``key``, ``metadata``, ``algorithm`` and :meth:`hyper`, without
    reading its tensors (trace-level checks that only need to know which steps to look at)."""

    def __init__(self, trace: Trace, key: StepKey) -> None:
        self.trace = trace
        self.key = key
        self.metadata: dict[str, Any] = trace.metadata(key)
        self.algorithm: str = str(self.metadata.get("algorithm") or trace.manifest.get("algorithm") or "")

    def hyper(self, name: str, default: Any = _REQUIRED) -> Any:
        """Hyperparameter ``name`` from step metadata, then the manifest's ``hyperparameters``, then
        (only the :data:`TRAINER_ARG_KEYS`) the manifest's ``config.trainer_args``; Skip when absent
        and no default is given."""
        if name in self.metadata and self.metadata[name] is not None:
            return self.metadata[name]
        manifest_h = self.trace.manifest.get("hyperparameters") or {}
        if name in manifest_h and manifest_h[name] is not None:
            return manifest_h[name]
        if name in TRAINER_ARG_KEYS:  # a trace recorded before the TRL integration put them in metadata
            config = self.trace.manifest.get("config")
            trainer_args = config.get("trainer_args") if isinstance(config, dict) else None
            if isinstance(trainer_args, dict) and trainer_args.get(name) is not None:
                return trainer_args[name]
        if default is _REQUIRED:
            raise Skip(f"needs metadata key {name!r} (SPEC.md section 4), which this step does not record")
        return default

    def accumulation_steps(self) -> int:
        """``gradient_accumulation_steps`` (:meth:`hyper`): micro-batches (or batches) per optimizer step;
        1 when absent or not a positive integer."""
        value = self.hyper("gradient_accumulation_steps", None)
        try:
            return max(int(value), 1) if value is not None else 1
        except (TypeError, ValueError):
            return 1

    def rows_cut(self, rows: int) -> int | None:
        """The step's B before the writer's ``first_k_sequences`` kept this file's ``rows`` sequences
        (metadata ``rows_before_cut``, which the writer records when it drops rows), when rows were
        dropped: the trainer's scalar ``loss`` was then taken over rows the file does not hold. None
        when nothing was cut (or a trace written before the writer recorded it)."""
        before = self.metadata.get("rows_before_cut")
        if isinstance(before, int) and not isinstance(before, bool) and before > rows:
            return before
        return None

    def flag(self, name: str) -> bool | None:
        """Hyperparameter ``name`` (:meth:`hyper`) as a bool: a bool as it is, a number 1 / other, a text
        ``true`` / ``1`` / ``yes`` (any case) True and any other text False; None when not recorded."""
        value = self.hyper(name, None)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, (int, float)):
            return value == 1
        return str(value).strip().lower() in ("true", "1", "1.0", "yes")

    def kl_coef(self) -> float | None:
        """The KL penalty's coefficient: hyperparameter ``kl_coef``, else ``beta`` (TRL's name), as a
        float; None when neither is set, or the value is 0, a bool or not a number."""
        value = self.hyper("kl_coef", None)
        value = value if value is not None else self.hyper("beta", None)
        if value is None or isinstance(value, bool):
            return None
        try:
            coef = float(value)
        except (TypeError, ValueError):
            return None
        return coef or None

    def declared_dtypes(self) -> list[str]:
        """The float dtypes the step's metadata declares (``source_dtype``, ``model_dtype``: comma lists)."""
        return [p.strip() for k in ("source_dtype", "model_dtype") for p in str(self.metadata.get(k, "")).split(",")
                if p.strip()]

    def pass_keys(self) -> list[StepKey]:
        """The step files of this file's pass over its rollout: the same step, inner step and rank,
        every micro-batch (this one included), in micro-batch order. The trace's files are grouped
        once per run of the checks (:func:`check_memo`)."""
        passes = check_memo(self.trace, "passes")
        if not passes:
            for key in self.trace.steps():
                passes.setdefault((key.step, key.inner_step, key.rank), []).append(key)
            for keys in passes.values():
                keys.sort(key=lambda k: k.micro_batch)
        return passes.get((self.key.step, self.key.inner_step, self.key.rank), [self.key])


class StepContext(StepHeader):
    """One step file opened for checking: ``data`` (all tensors), ``metadata``, ``options``."""

    def __init__(self, trace: Trace, key: StepKey, options: CheckOptions | None = None) -> None:
        super().__init__(trace, key)
        self.options = options or CheckOptions()
        self.data: dict[str, torch.Tensor] = trace.load_step(key)
        self.derived: set[str] = set(trace.derived_fields(key))  # added by the reader (tracer.formulas.derived)
        stored = [str(t.dtype).removeprefix("torch.") for t in self.data.values() if t.is_floating_point()]
        self.dtype = loosest_dtype(self.declared_dtypes() + stored)
        self.tol = TOLERANCES[self.dtype]
        self._turns: turns.Layout | None = None

    # -- inputs -------------------------------------------------------------------------------

    def has(self, *fields: str) -> bool:
        return all(f in self.data for f in fields)

    def require(self, *fields: str) -> list[torch.Tensor]:
        """The tensors ``fields`` (floats as float32 or wider); raises Skip naming those missing."""
        missing = [f for f in fields if f not in self.data]
        if missing:
            raise Skip(f"needs field{'s' if len(missing) > 1 else ''} {', '.join(missing)}, "
                       "which these do not record")
        return [self.tensor(f) for f in fields]

    def require_recorded(self, *fields: str) -> list[torch.Tensor]:
        """:meth:`require`, and a :func:`~tracer.checks.finding.not_applicable` Skip when a field was
        derived by the reader: a check that tests the recorded tensor against its formula has no recorded
        tensor to test (what the trainer computed from it is tested where it is used, the loss)."""
        derived = [f for f in fields if f in self.derived]
        if derived:
            raise not_applicable(f"{', '.join(derived)} not recorded: the reader derives it from the recorded inputs "
                                 "with tracer.formulas, so there is no recorded value to test")
        return self.require(*fields)

    def tensor(self, name: str) -> torch.Tensor:
        t = self.data[name]
        return t.float() if t.is_floating_point() and t.dtype != torch.float64 else t

    def mask(self, name: str = "completion_mask") -> torch.Tensor:
        """A ``[B, T]`` bool mask; raises Skip when absent."""
        (m,) = self.require(name)
        return m.bool()

    def old_logprobs(self) -> torch.Tensor:
        """``old_logprobs``; ``policy_logprobs`` when metadata says old is the detached policy
        (``old_logprobs_source == "policy_detached"``, ratio 1 by construction); else Skip."""
        if "old_logprobs" in self.data:
            return self.tensor("old_logprobs")
        if self.metadata.get("old_logprobs_source") == "policy_detached" and "policy_logprobs" in self.data:
            return self.tensor("policy_logprobs")
        raise Skip("needs field old_logprobs (or metadata old_logprobs_source = 'policy_detached')")

    def cispo_ratio_max(self) -> float:
        """CISPO's upper bound on the ratio: metadata ``cispo_epsilon_high`` when recorded (the
        hand-written loops, which store ``clip_epsilon_high`` = bound - 1), else ``clip_epsilon_high``
        itself (SPEC section 3 ``clamp(ratio, max=ε_high)``, TRL ``clamp(coef_1, max=epsilon_high)``)."""
        bound = self.hyper("cispo_epsilon_high", None)
        return float(bound if bound is not None else self.hyper("clip_epsilon_high"))

    @property
    def eos_token_id(self) -> int | None:
        eos = self.trace.eos_token_id
        return int(eos) if eos is not None else self.metadata.get("eos_token_id")

    @property
    def pad_token_id(self) -> int | None:
        pad = self.trace.pad_token_id
        return int(pad) if pad is not None else self.metadata.get("pad_token_id")

    def turn_layout(self) -> turns.Layout:
        """The step's turns and roles (:func:`tracer.format.turns.read_layout`: recorded, read from the
        chat template's markers, or turns read from the mask). Skip without ``completion_ids`` and
        ``completion_mask``."""
        if self._turns is None:
            ids, keep = self.data.get("completion_ids"), self.data.get("completion_mask")
            if ids is None or keep is None:
                raise Skip("needs completion_ids and completion_mask (the token ids were not recorded)")
            self._turns = turns.read_layout(ids, keep.bool(), self.data, self.metadata, self.trace.tokens,
                                            self.eos_token_id, self.pad_token_id)
        return self._turns

    def episode_rows(self) -> list[int] | None:
        """Per-turn rows (SPEC.md section 4): the first row of each episode, in order, when rows
        share ``episode_ids`` values; None when every row is its own episode."""
        ids = self.data.get("episode_ids")
        if ids is None or ids.dim() != 1:
            return None
        seen: dict[int, int] = {}
        for row, episode in enumerate(ids.tolist()):
            seen.setdefault(episode, row)
        return list(seen.values()) if len(seen) < ids.numel() else None

    def episode_view(self) -> "StepContext":
        """This step with one row per episode (the first row of each, :meth:`episode_rows`): the view
        the per-sequence checks of rewards, groups and advantages judge, since one episode's reward and
        advantage are copied to each of its turns' rows. ``self`` when every row is an episode."""
        rows = self.episode_rows()
        if rows is None:
            return self
        B = self.data["episode_ids"].shape[0]
        index = torch.tensor(rows, dtype=torch.long)
        view = copy.copy(self)
        view.data = {name: (t[index] if t.dim() >= 1 and t.shape[0] == B else t) for name, t in self.data.items()}
        view._turns = None
        return view

    @property
    def packed_rows(self) -> bool:
        """The completion rows may hold their prompt ahead of the answer: ``turn_ids`` recorded, or no
        ``prompt_ids`` recorded beside the completion (MiniMind's packed ``input_ids[:, 1:]``)."""
        return "turn_ids" in self.data or "prompt_ids" not in self.data

    # -- output -------------------------------------------------------------------------------

    def finding(
        self,
        check: str,
        severity: str,
        message: str,
        sequence: int | None = None,
        token: int | None = None,
        field: str | None = None,
        ids_field: str = "completion_ids",
        **details: Any,
    ) -> Finding:
        """A Finding located in this step; token id and text are read from ``ids_field``."""
        token_id = token_text = None
        ids = self.data.get(ids_field)
        if sequence is not None and token is not None and ids is not None and ids.dim() == 2:
            if 0 <= sequence < ids.shape[0] and 0 <= token < ids.shape[1]:
                token_id = int(ids[sequence, token])
                if self.trace.tokens is not None:
                    token_text = self.trace.token_text([token_id])[0]
        k = self.key
        return Finding(check=check, severity=severity, message=message, step=k.step, inner_step=k.inner_step,
                       micro_batch=k.micro_batch, rank=k.rank, sequence=sequence, token=token,
                       token_id=token_id, token_text=token_text, field=field, path=str(k.path),
                       details=details)


def where_text(sequence: int | None, token: int | None) -> str:
    """``seq 1, token 3`` (the parts that are known)."""
    parts = []
    if sequence is not None:
        parts.append(f"seq {sequence}")
    if token is not None:
        parts.append(f"token {token}")
    return ", ".join(parts)


def first_true(flags: torch.Tensor) -> tuple[int, ...] | None:
    """Index of the first True of a bool tensor in row-major order, or None."""
    idx = flags.nonzero()
    return tuple(int(i) for i in idx[0]) if len(idx) else None


def worst_positions(score: torch.Tensor, keep: torch.Tensor, n: int) -> list[tuple[int, int]]:
    """(sequence, token) of the ``n`` largest ``score`` values among kept positions, largest first."""
    flat = torch.where(keep, score, torch.full_like(score, float("-inf"))).reshape(-1)
    count = min(n, int(keep.sum()))
    if count == 0:
        return []
    top = torch.topk(flat, count).indices.tolist()
    T = score.shape[1]
    return [(i // T, i % T) for i in top]


def loss_scales(ctx: StepContext) -> list[float]:
    """The factors the recorded loss may carry besides its reduction: metadata ``loss_scale`` when
    recorded; else 1 and, with ``gradient_accumulation_steps`` > 1 recorded, ``1 / steps`` (a loop
    that backpropagates ``loss / accumulation_steps`` and records that, as MiniMind's trainers do)."""
    if ctx.hyper("loss_scale", None) is not None:
        return [float(ctx.hyper("loss_scale"))]
    steps = ctx.accumulation_steps()
    return [1.0] if steps <= 1 else [1.0, 1.0 / steps]


# Step metadata / hyperparameters that name an inference engine or a correction for one: any of them
# set means the rollouts came from a sampler other than the trainer's forward.
ENGINE_KEYS = ("rollout_engine", "vllm_mode", "is_correction", "vllm_importance_sampling_correction", "rollout_is")
SAMPLER_FIELDS = ("sampler_logprobs", "is_weights", "sequence_is_weights")


def engine_sampled(ctx: StepContext) -> bool:
    """Whether an inference engine (vLLM, SGLang…) sampled this run's rollouts, by what the run
    recorded: metadata ``use_vllm`` true, or any of :data:`ENGINE_KEYS` set, on this step or in the
    run's hyperparameters; or any of :data:`SAMPLER_FIELDS` in this step file or in any step file of
    the run (headers only, read once per run of the checks). False means the policy generated its
    own rollouts as far as the trace says (TRL with ``use_vllm = False``, a hand-written loop calling
    ``model.generate``): no sampler to compare with the trainer, so the sampler checks raise
    :func:`tracer.checks.finding.not_applicable`. (A declared importance-sampling correction counts as
    an engine here; the coverage's ``engine`` condition, :func:`tracer.checks.runner.step_conditions`,
    is narrower, so that such a run's missing ``sampler_logprobs`` is named once, by the correction's
    class.)"""
    if ctx.flag("use_vllm") or any(ctx.hyper(k, None) not in (None, False, "", "none") for k in ENGINE_KEYS):
        return True
    if any(ctx.has(f) for f in SAMPLER_FIELDS):
        return True
    memo = check_memo(ctx.trace, "sampler_fields_recorded")
    if "value" not in memo:
        found = False
        for key in ctx.trace.steps():
            try:
                names = ctx.trace.fields(key)
            except (TraceError, OSError, ValueError):
                continue  # an unreadable header is reported by the reader's own finding
            if any(f in names for f in SAMPLER_FIELDS):
                found = True
                break
        memo["value"] = found
    return memo["value"]


NO_ENGINE = ("no inference engine sampled this run as far as it records (use_vllm false or unset, no rollout_engine, "
             "no sampler_logprobs in any step file): the policy generated its rollouts, so there is no sampler to "
             "compare with; a run sampled by vLLM or SGLang records sampler_logprobs to be checked")
