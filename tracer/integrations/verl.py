"""Trace verl's PPO/GRPO trainer (written against verl 0.9.1): import this module in every verl process.

Usage (nothing in the training script changes)::

    export TRACER_DIR=/shared/traces/run1                   # shared storage every node can write
    export VERL_USE_EXTERNAL_MODULES=tracer.integrations.verl
    python -m verl.trainer.main_ppo ... actor_rollout_ref.actor.policy_loss.loss_mode=tracer_vanilla
    python -m tracer.integrations.verl_join $TRACER_DIR    # afterwards: joined trace in $TRACER_DIR/joined

Facts from verl 0.9.1's source that shape the trace (docs/verl.md says what was run and what was not):

- ``verl/__init__.py`` imports every module named in ``VERL_USE_EXTERNAL_MODULES`` (comma-separated) in
  every process that imports verl: the driver (``TaskRunner``) and each Ray worker. Ray carries the
  variable (and ``TRACER_DIR``) to workers through the runtime environment.
- Worker side, ``verl/workers/utils/losses.py`` ``ppo_loss(config, model_output, data)`` runs once per
  micro-batch. It looks the policy loss up by name at call time
  (``core_algos.get_policy_loss_fn(config.policy_loss.loss_mode)``) and calls it with keyword arguments
  ``old_log_prob``, ``log_prob``, ``advantages``, ``response_mask`` (all ``[B, T]``, T padded to the
  micro-batch), ``loss_agg_mode``, ``config`` (``ActorConfig``) and ``rollout_is_weights``; it returns
  ``(pg_loss, metrics)``. ``core_algos.register_policy_loss(name)`` adds a loss to that registry: this
  module registers ``tracer_<name>`` for every registered ``<name>``, which records, then returns what
  ``<name>`` returns, unchanged. The micro-batch ``data`` (a TensorDict with ``prompts``, ``responses``,
  ``attention_mask``, every key of the driver's batch, and ``dp_size`` / ``global_batch_size`` /
  ``update_lr_scheduler``) is seen by wrapping ``ppo_loss`` itself, replaced on its module right after
  ``verl.workers.utils.losses`` is imported (``engine_workers`` binds the name afterwards).
- verl's GRPO advantages are token-level ``[B, T]``: ``(r - mean_g) / (std_g + 1e-6)`` with Bessel's
  std (``torch.std``), 0 / 1 for a group of one, times ``response_mask``; ``uid`` (a string per row,
  ``non_tensor_batch``) names the group; rows of a group need not be consecutive. The trace stores
  ``advantages [B]`` (the value on the first kept token; it is the same on every kept token) and
  declares ``advantage_rule = "verl_grpo"`` (checked by ``recompute.advantages``).
- Driver side, ``verl/trainer/ppo/ray_trainer.py`` ``compute_advantage(data, adv_estimator, gamma, lam,
  num_repeat, norm_adv_by_std_in_grpo, config)`` runs in the driver on the whole step's ``DataProto``
  (``prompts``, ``responses``, ``response_mask``, ``token_level_scores`` / ``token_level_rewards``,
  ``old_log_probs``, ``ref_log_prob``, ``rollout_log_probs``, ``values``; ``uid``). ``fit`` calls the
  module-level name, and ``trainer/ppo/v1/utils.py`` binds it at import: the wrapper replaces it as
  soon as ``ray_trainer`` is imported. The wrapper records one rollout file per step and adds one int64
  tensor, ``tracer_row_ids [B]`` (step << 32 | row), to the returned batch; ``_update_actor`` sends the
  whole batch to the workers (``to_tensordict``), so each micro-batch carries its rows' ids through
  verl's shuffling, mini-batch and dynamic-batch splits. That is how the join finds the rollout rows
  of a worker's micro-batch. (verl's v1 trainer writes back only named fields to TransferQueue: there
  row ids do not travel, worker files keep only call-order coordinates.)
- Optimizer steps: ``train_mini_batch`` splits the worker's rows into mini-batches of
  ``global_batch_size / dp_size`` rows, for ``ppo_epochs`` epochs, one optimizer step per mini-batch.
  Only the micro-batches of the first mini-batch of the first epoch are on-policy (``fresh_rollouts``);
  there ``log_prob`` must equal ``old_log_prob`` (verl#2305, #6280 report ratio != 1 at the end of
  micro-batches). A row seen again marks the next epoch (``inner_step``).
- ``pg_loss`` is aggregated over the *global* mini-batch (``batch_num_tokens``, ``dp_size``), not the
  micro-batch, so it is stored as the extra field ``verl_pg_loss``, not as the canonical ``loss``.
  The policy losses aggregate with ``core_algos.agg_loss(loss_mat, loss_mask, loss_agg_mode,
  **config.global_batch_info)``, looked up in ``core_algos``'s globals at call time: this module wraps
  it, and the call a tracing loss makes gives ``verl_pg_losses [B, T]`` (the per-token loss) and the
  aggregation in effect.
- Declared vs in effect. verl reads a setting in one place and uses it in another, so a trace keeps
  both: ``declared_<key>`` is what a config object says (worker: the ``ActorConfig`` ``ppo_loss``
  received; driver: the ``AlgoConfig`` passed to ``compute_advantage`` as ``config``, which ``fit``
  reads its arguments from), ``<key>`` what the call used (the policy loss's ``loss_agg_mode`` and
  ``config`` arguments, the mode ``agg_loss`` was called with; ``compute_advantage``'s own
  ``adv_estimator`` / ``norm_adv_by_std_in_grpo`` / ``gamma`` / ``lam`` arguments). ``tracer check``
  (:mod:`tracer.checks.effective_config`) compares both with what the tensors show.

Files (each a trace of its own; :mod:`tracer.integrations.verl_join` merges them)::

    $TRACER_DIR/rollout/steps/step_S.inner_0.mb_0.rank_0.safetensors   driver, one per step
    $TRACER_DIR/workers/steps/step_S.inner_E.mb_K.rank_R.safetensors   worker rank R, K-th micro-batch

Canonical names (SPEC section 10): ``rollout_log_probs`` → ``sampler_logprobs``, ``old_log_probs`` →
``old_logprobs``, ``ref_log_prob`` → ``ref_logprobs``, ``response_mask`` → ``completion_mask``,
``uid`` → ``group_ids`` (int64, numbered by first appearance; the strings are kept in metadata
``uids``), ``log_prob`` → ``policy_logprobs``. Tracing never stops training: a failure is counted in
the manifest and warned about (``TRACER_STRICT=1`` raises instead).
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import logging
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable


from tracer.errors import TraceError
from tracer.integrations import verl_record

log = logging.getLogger(__name__)

__all__ = ["PREFIX", "ROW_ID_KEY", "TRACE_DIR_ENV", "install", "register_tracing_losses", "trace_dir"]

TRACE_DIR_ENV = "TRACER_DIR"
TOKENIZER_ENV = "TRACER_TOKENIZER"  # a tokenizer path (the model's): token text and EOS/pad ids in the trace
STRICT_ENV = "TRACER_STRICT"
PREFIX = "tracer_"
ROW_ID_KEY = verl_record.ROW_ID_KEY
_LOSSES_MODULE = "verl.workers.utils.losses"
_TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"
_V1_UTILS_MODULE = "verl.trainer.ppo.v1.utils"

_context = threading.local()  # the micro-batch TensorDict ppo_loss is working on
_state: dict[str, Any] = {"worker": None, "driver": None, "installed": False}
_lock = threading.Lock()


def trace_dir() -> Path | None:
    """The trace root: ``$TRACER_DIR``, else the directory given to :func:`install`; None = tracing off."""
    value = os.environ.get(TRACE_DIR_ENV) or _state.get("out_dir")
    return Path(value) if value else None


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0", "false", "False")


# -- worker side: the tracing policy losses -----------------------------------------------------


def register_tracing_losses() -> list[str]:
    """Register ``tracer_<name>`` for every policy loss in verl's registry (idempotent).

    Returns the names registered by this call. A loss registered later (a user's own) gets its
    tracing twin on the next call; :func:`install` makes one at import time.
    """
    from verl.trainer.ppo import core_algos

    added = []
    for name, fn in list(core_algos.POLICY_LOSS_REGISTRY.items()):
        if name.startswith(PREFIX) or PREFIX + name in core_algos.POLICY_LOSS_REGISTRY:
            continue
        core_algos.register_policy_loss(PREFIX + name)(_tracing_loss(name, fn))
        added.append(PREFIX + name)
    return added


def _lazy_lookup(original: Callable) -> Callable:
    """``core_algos.get_policy_loss_fn`` that creates ``tracer_<name>`` for a loss registered after import."""

    @functools.wraps(original)
    def get_policy_loss_fn(name):
        from verl.trainer.ppo import core_algos

        registry = core_algos.POLICY_LOSS_REGISTRY
        if isinstance(name, str) and name.startswith(PREFIX) and name not in registry and name[len(PREFIX):] in registry:
            register_tracing_losses()
        return original(name)

    return _marked(get_policy_loss_fn)


def _tracing_loss(name: str, fn: Callable) -> Callable:
    """``fn`` wrapped: call it with the arguments verl passes, keep the ``agg_loss`` calls it makes,
    record, return its result unchanged."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        previous, _context.agg_calls = getattr(_context, "agg_calls", None), []
        try:
            result = fn(*args, **kwargs)
            agg_calls = _context.agg_calls
        finally:
            _context.agg_calls = previous
        try:
            bound = inspect.signature(fn).bind(*args, **kwargs)
            bound.apply_defaults()
            recorder = _recorder("worker")
            if recorder is not None:
                recorder.record(name, dict(bound.arguments), result, getattr(_context, "data", None),
                                agg_calls=agg_calls, declared=getattr(_context, "config", None))
        except Exception as err:  # tracing must never stop training
            _failed("worker", err)
        return result

    return _marked(traced)


def _traced_agg_loss(original: Callable) -> Callable:
    """``core_algos.agg_loss`` that, inside a tracing loss, keeps the arguments it was called with and
    its result (what the policy loss aggregated, and how); a plain pass-through everywhere else."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def agg_loss(*args, **kwargs):
        result = original(*args, **kwargs)
        calls = getattr(_context, "agg_calls", None)
        if calls is not None:
            try:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                calls.append({**bound.arguments, "result": result})
            except TypeError:  # a call verl itself would have refused
                pass
        return result

    return _marked(agg_loss)


def _traced_ppo_loss(original: Callable) -> Callable:
    """verl's ``ppo_loss`` with its micro-batch ``data`` and its ``config`` (the worker's ``ActorConfig``,
    what the run declares) kept where the tracing loss can read them."""

    @functools.wraps(original)
    def ppo_loss(config, model_output, data, *args, **kwargs):
        previous = getattr(_context, "data", None), getattr(_context, "config", None)
        _context.data, _context.config = data, config
        try:
            return original(config, model_output, data, *args, **kwargs)
        finally:
            _context.data, _context.config = previous

    return _marked(ppo_loss)


# -- driver side: compute_advantage ---------------------------------------------------------------


def _traced_compute_advantage(original: Callable) -> Callable:
    """``ray_trainer.compute_advantage`` that records the rollout and tags rows with their ids."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compute_advantage(*args, **kwargs):
        data = original(*args, **kwargs)
        try:
            recorder = _recorder("driver")
            if recorder is not None:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                arguments = dict(bound.arguments)
                arguments.pop("data", None)
                recorder.record(data, arguments)
        except Exception as err:
            _failed("driver", err)
        return data

    return _marked(compute_advantage)


# -- this process's recorders -----------------------------------------------------------------------

# side -> the recorder it writes with, made from the trace root at its first record
_RECORDERS: dict[str, Callable[[Path], verl_record.WorkerRecorder | verl_record.DriverRecorder]] = {
    "worker": lambda root: verl_record.WorkerRecorder(root / verl_record.WORKERS_DIR, strict=_strict()),
    "driver": lambda root: verl_record.DriverRecorder(root / verl_record.ROLLOUT_DIR, strict=_strict(),
                                                      tokenizer=_tokenizer()),
}


def _recorder(side: str) -> verl_record.WorkerRecorder | verl_record.DriverRecorder | None:
    """The recorder of ``side`` (``"worker"`` or ``"driver"``), made once per process; None when tracing is off."""
    root = trace_dir()
    if root is None:
        return None
    with _lock:
        if _state[side] is None:
            _state[side] = _RECORDERS[side](root)
        return _state[side]


def _tokenizer() -> Any:
    """``install(tokenizer=...)``, else the tokenizer at ``$TRACER_TOKENIZER`` (loaded once), else None."""
    if _state.get("tokenizer") is None and os.environ.get(TOKENIZER_ENV):
        from transformers import AutoTokenizer

        _state["tokenizer"] = AutoTokenizer.from_pretrained(os.environ[TOKENIZER_ENV])
    return _state.get("tokenizer")


def _failed(side: str, err: Exception) -> None:
    recorder = _state.get(side)
    if _strict():
        raise err if isinstance(err, TraceError) else TraceError(f"tracer ({side}): {type(err).__name__}: {err}")
    if recorder is not None:
        recorder.count_failure(err)
    else:
        warnings.warn(f"tracer ({side}): could not record: {type(err).__name__}: {err}. Training continues.",
                      RuntimeWarning, stacklevel=3)


# -- installing -----------------------------------------------------------------------------------


def _marked(wrapper: Callable) -> Callable:
    """``wrapper`` marked as tracer's, so that no function is wrapped twice."""
    wrapper.__tracer_wrapper__ = True
    return wrapper


def _is_marked(fn: Any) -> bool:
    return getattr(fn, "__tracer_wrapper__", False)


def _wrap_once(owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """``owner.<name> = wrap(owner.<name>)`` unless ``owner.<name>`` is tracer's wrapper already."""
    original = getattr(owner, name)
    if not _is_marked(original):
        setattr(owner, name, wrap(original))


def _patch_losses(module: Any) -> None:
    _wrap_once(module, "ppo_loss", _traced_ppo_loss)


def _patch_trainer(module: Any) -> None:
    _wrap_once(module, "compute_advantage", _traced_compute_advantage)
    v1 = sys.modules.get(_V1_UTILS_MODULE)  # imported before us: it holds the unwrapped name
    if v1 is not None and not _is_marked(v1.compute_advantage):
        v1.compute_advantage = module.compute_advantage


_PATCHES = {_LOSSES_MODULE: _patch_losses, _TRAINER_MODULE: _patch_trainer}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Patches a verl module right after it executes, before any importer binds its names."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, _PATCHES[fullname])
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[Any], None]) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


def install(out_dir: str | os.PathLike | None = None, tokenizer: Any = None) -> None:
    """Register the tracing losses and the driver hook (idempotent; runs when this module is imported).

    Args:
        out_dir: trace root when ``$TRACER_DIR`` is not set (the environment wins).
        tokenizer: the run's tokenizer, for token text and EOS/pad ids (else ``$TRACER_TOKENIZER``).
    """
    if out_dir is not None:
        _state["out_dir"] = os.fspath(out_dir)
    if tokenizer is not None:
        _state["tokenizer"] = tokenizer
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
    register_tracing_losses()
    from verl.trainer.ppo import core_algos

    _wrap_once(core_algos, "get_policy_loss_fn", _lazy_lookup)  # before losses.py binds it
    _wrap_once(core_algos, "agg_loss", _traced_agg_loss)  # the policy losses look it up at call time
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
    if trace_dir() is None:
        log.warning("tracer: %s is not set; the tracer_* losses run untraced", TRACE_DIR_ENV)


def finish() -> None:
    """Close this process's trace writers (also done at interpreter exit)."""
    for side in ("worker", "driver"):
        recorder = _state.get(side)
        if recorder is not None:
            recorder.close()
        _state[side] = None


install()
