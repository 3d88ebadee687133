"""What the TRL demos (``grpo_trl``, ``rloo_trl``, ``dpo_trl``, ``grpo_vllm``) share: a quiet CPU
trainer (no reports, no checkpoints, no logs printed), and one run procedure: build the tiny model,
build the trainer, ``tracer.attach`` it, train.

Offline: nothing is downloaded (set ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from tracer.demo.tiny_model import build_tiny_model, torch_threads

log = logging.getLogger(__name__)

# TRL 1.16 reads transformers 5's deprecated `is_gradient_checkpointing` on every step.
TRL_NOISE = r"`is_gradient_checkpointing` is deprecated"


def cpu_config(config_class: type, output_dir: str | os.PathLike, steps: int, seed: int, progress: bool,
               **fields: Any) -> Any:
    """``config_class(...)`` (a TRL config dataclass) for a short CPU run: ``max_steps = steps``, no
    reports, no checkpoints, a log every step (the tracer keeps its numbers: ``scalars/<name>``), no
    gradient checkpointing; ``fields`` on top.

    ``output_dir`` is TRL's scratch directory: nothing is saved there.
    """
    config: dict[str, Any] = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to=[],
        seed=seed,
        max_steps=steps,
        gradient_accumulation_steps=1,
        bf16=False,
        save_strategy="no",
        logging_strategy="steps",  # every step's log (loss, grad_norm, rewards...): kept as the trace's logged scalars
        logging_steps=1,
        disable_tqdm=not progress,
        dataloader_num_workers=0,
    )
    # TRL defaults to checkpointing on; transformers 5.x renamed the flag to activation_checkpointing.
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in config_class.__dataclass_fields__ \
        else "gradient_checkpointing"
    config[checkpointing] = False
    config.update(fields)
    return config_class(**config)


def cpu_trainer(trainer_class: type, config_class: type, model_dir: str | os.PathLike, output_dir: str | os.PathLike,
                steps: int, seed: int, progress: bool, fields: Mapping[str, Any], **trainer_kwargs: Any) -> Any:
    """``trainer_class(model=str(model_dir), args=cpu_config(config_class, ..., **fields), **trainer_kwargs)``:
    a TRL trainer for a short CPU run of the model at ``model_dir`` (passed as a path), without its
    ``PrinterCallback`` (with the progress bar off, nothing is printed)."""
    from transformers.trainer_callback import PrinterCallback

    args = cpu_config(config_class, output_dir, steps, seed, progress, **fields)
    trainer = trainer_class(model=str(model_dir), args=args, **trainer_kwargs)
    trainer.remove_callback(PrinterCallback)
    return trainer


@contextlib.contextmanager
def quiet_loading():
    """Hide transformers' "Loading weights" / "Writing model shards" bars and datasets' ``map``
    bars (TRL tokenizes the preference data in ``DPOTrainer.__init__``); not the training bar."""
    import datasets
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled[0]:
            hf_logging.enable_progress_bar()
        if was_enabled[1]:
            datasets.enable_progress_bars()


def run_traced(out_dir: str | os.PathLike, make_trainer: Callable[..., Any], build: Mapping[str, Any], demo: str,
               steps: int, seed: int, progress: bool, model_dir: str | os.PathLike | None,
               build_model: Callable[..., Any] = build_tiny_model, **trainer_kwargs: Any) -> Path:
    """Build the tiny model, ``make_trainer(model_path, scratch_dir, steps=, seed=, progress=, **trainer_kwargs)``,
    attach the tracer to ``out_dir`` and train on one CPU thread.

    Args:
        build: facts about the model and data for the manifest's ``config.model_build`` (the
            builder, seed and path are added here).
        demo: the dotted name of the demo function, for the manifest.
        model_dir: a tiny model saved by ``build_tiny_model`` (used as it is), or where to build
            one (kept); a temporary directory when None. The manifest's ``config.model_build`` says
            how to rebuild it bit for bit.
        build_model: ``build_model(path, seed=seed)`` builds the model when none is saved there
            (default :func:`~tracer.demo.tiny_model.build_tiny_model`).

    Returns:
        ``Path(out_dir)``.
    """
    from tracer.integrations.trl import attach

    out = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="tracer-trl-demo-") as scratch, torch_threads(1):
        with quiet_loading():
            model_path = Path(model_dir) if model_dir is not None else Path(scratch) / "model"
            if not (model_path / "config.json").is_file():  # a model saved there already is used as it is
                build_model(model_path, seed=seed)
            trainer = make_trainer(model_path, Path(scratch) / "trl", steps=steps, seed=seed, progress=progress,
                                   **trainer_kwargs)
        model_build = {"builder": "tracer.demo.tiny_model.build_tiny_model", "seed": seed,
                       "path": str(model_path) if model_dir is not None else None, **build}
        attach(trainer, out, config={"model_build": model_build, "demo": demo})
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=TRL_NOISE, category=FutureWarning)
            trainer.train()
    log.info("%s trace written to %s", demo, out)
    return out
