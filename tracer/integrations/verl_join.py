"""Join the driver's rollout files and the workers' micro-batch files of a verl trace into one trace.

Usage::

    python -m tracer.integrations.verl_join $TRACER_DIR            # writes $TRACER_DIR/joined
    python -m tracer check $TRACER_DIR/joined
    python -m tracer view $TRACER_DIR/joined

Needs no verl. Each worker file (``workers/steps/step_S.inner_E.mb_K.rank_R``) becomes one joined file
with the same coordinates; its ``row_ids`` pick the rows of the driver's step-S file
(``rollout/steps/step_S...``), whose per-sequence fields (``rewards``, ``group_ids``, ``advantages``
when the worker has none, ...), prompt fields and per-token fields (``sampler_logprobs``,
``ref_logprobs``, ``token_rewards``, ``values``...) are added, cut to the micro-batch's T (verl pads a
micro-batch to its own longest response; the rows' kept tokens all lie inside it). What the worker
recorded wins where both have a field (it is what the loss saw); the largest |worker old - driver old|
over kept tokens is kept in metadata ``driver_old_logprobs_max_abs_diff`` (0 unless the batch was
changed on its way to the workers). Hyperparameters of the driver (``num_generations``,
``advantage_rule``...) go into the joined manifest; the driver's ``uids`` of the rows into each file.
A worker file without row ids is copied as it is (noted in metadata ``joined = false``).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tracer.errors import TraceError
from tracer.integrations.verl_record import ROLLOUT_DIR, WORKERS_DIR
from tracer.format.names import FORMAT_NAME, MANIFEST_NAME, STEPS_DIR, TOKENS_NAME, step_file_name
from tracer.format.hashing import content_sha256
from tracer.record.manifest import producers
from tracer.format.files import refuse_existing_trace, save_atomic, write_json_atomic
from tracer.read import StepKey, Trace
from tracer.format.schema import SCHEMA_VERSION, normalise_tensors
from tracer.format.metadata_codec import encode_metadata

log = logging.getLogger(__name__)

JOINED_DIR = "joined"
_DRIVER_ONLY_META = ("uids",)


def join(root: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the joined trace of a verl trace root (``rollout/`` + ``workers/``); returns its directory.

    Args:
        root: the ``$TRACER_DIR`` of the run.
        out_dir: where to write; ``root/joined`` by default. Refused when it already holds step files.
    Raises:
        TraceError: ``root`` lacks ``workers/`` or ``rollout/``, a worker's rows are not in the driver's
            step, or the driver keeps tokens beyond the micro-batch's T (the row ids do not match).
    """
    root = Path(root)
    for sub in (ROLLOUT_DIR, WORKERS_DIR):
        if not (root / sub / MANIFEST_NAME).is_file():
            raise TraceError(f"{root / sub}: no {MANIFEST_NAME}; expected the {sub}/ trace written by "
                             "tracer.integrations.verl under $TRACER_DIR")
    rollout, workers = Trace(root / ROLLOUT_DIR), Trace(root / WORKERS_DIR)
    out = Path(out_dir) if out_dir is not None else root / JOINED_DIR
    refuse_existing_trace(out)
    (out / STEPS_DIR).mkdir(parents=True, exist_ok=True)
    driver_keys = {k.step: k for k in rollout.steps()}
    algorithm = rollout.algorithm or workers.algorithm or "grpo"
    cached: tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None = None
    written = 0
    for key in workers.steps():
        tensors, meta = workers.load_step(key), workers.metadata(key)
        if "row_ids" in tensors and key.step in driver_keys:
            if cached is None or cached[0] != key.step:
                dkey = driver_keys[key.step]
                cached = (key.step, rollout.load_step(dkey), rollout.metadata(dkey))
            tensors, meta = _joined(key, tensors, meta, cached[1], cached[2])
        else:
            meta = {**meta, "joined": False}
        _write(out, key, algorithm, tensors, meta)
        written += 1
    _write_manifest(out, rollout, workers, algorithm, written)
    if (rollout.root / TOKENS_NAME).is_file():
        shutil.copyfile(rollout.root / TOKENS_NAME, out / TOKENS_NAME)
    return out


def _joined(key: StepKey, worker: dict[str, torch.Tensor], meta: dict[str, Any], driver: dict[str, torch.Tensor],
            driver_meta: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    rows = worker["row_ids"]  # (B,) rows of the driver's batch
    n_driver = int(driver["row_ids"].shape[0])
    if bool((rows < 0).any() or (rows >= n_driver).any()):
        raise TraceError(f"{key.path}: row_ids {rows.tolist()[:8]} are not rows of the driver's step {key.step} "
                         f"(B = {n_driver})")
    T = int(worker["completion_mask"].shape[1])
    beyond = driver["completion_mask"][rows, T:]
    if bool(beyond.any()):
        raise TraceError(f"{key.path}: the driver keeps tokens beyond this micro-batch's T = {T} for rows "
                         f"{rows[beyond.any(dim=1)].tolist()[:8]}; the row ids do not match the rollout")
    out = dict(worker)
    for name, tensor in driver.items():
        if name in out or name == "row_ids":
            continue
        picked = tensor[rows]
        if picked.dim() == 2 and name not in ("prompt_ids", "prompt_mask") and tensor.shape[1] == driver["completion_mask"].shape[1]:
            picked = picked[:, :T]
        out[name] = picked
    if "advantages" in out and "token_advantages" in out and out["advantages"].dim() == 2:
        del out["token_advantages"]
    joined = {**{k: v for k, v in driver_meta.items() if k not in _DRIVER_ONLY_META}, **meta, "joined": True}
    uids = driver_meta.get("uids")
    if isinstance(uids, list) and len(uids) == n_driver:
        joined["uids"] = [uids[r] for r in rows.tolist()]
    if "old_logprobs" in driver:
        keep = worker["completion_mask"].bool()
        gap = (worker["old_logprobs"].double() - driver["old_logprobs"][rows, :T].double()).abs()[keep]
        gap = gap[torch.isfinite(gap)]
        joined["driver_old_logprobs_max_abs_diff"] = float(gap.max()) if gap.numel() else 0.0
    return out, joined


_WRITER_META = ("schema_version", "algorithm", "step", "inner_step", "micro_batch", "rank", "world_size",
                "content_sha256", "nonfinite_fields", "source_dtype")


def _write(out: Path, key: StepKey, algorithm: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    stored = normalise_tensors(tensors, algorithm)
    header = {k: v for k, v in meta.items() if k not in _WRITER_META}
    header.update(schema_version=SCHEMA_VERSION, algorithm=algorithm, step=key.step, inner_step=key.inner_step,
                  micro_batch=key.micro_batch, rank=key.rank, world_size=meta.get("world_size", 1),
                  source_dtype=meta.get("source_dtype", "float32"), content_sha256=content_sha256(stored))
    nonfinite = [n for n, t in stored.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if nonfinite:
        header["nonfinite_fields"] = nonfinite
    save_atomic(out / STEPS_DIR / step_file_name(key.step, key.inner_step, key.micro_batch, key.rank),
                stored, encode_metadata(header))


def _write_manifest(out: Path, rollout: Trace, workers: Trace, algorithm: str, written: int) -> None:
    hyper = {**(workers.manifest.get("hyperparameters") or {}), **(rollout.manifest.get("hyperparameters") or {})}
    manifest = {
        "format": FORMAT_NAME, "schema_version": SCHEMA_VERSION, "algorithm": algorithm,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "producers": producers(),
        "world_size": int(workers.manifest.get("world_size", 1)), "hyperparameters": hyper,
        "config": {"framework": "verl", "joined_from": [str(rollout.root), str(workers.root)],
                   "driver": rollout.manifest.get("config", {}), "workers": workers.manifest.get("config", {})},
        "status": "finished", "steps_written": written, "dropped_steps": 0, "skipped_steps": 0,
        "drop_reasons": [],
    }
    for source in (rollout, workers):
        dropped = source.manifest.get("dropped_steps", 0)
        if isinstance(dropped, int) and dropped:
            manifest["dropped_steps"] += dropped
            manifest["drop_reasons"] += [f"{source.root.name}: {r}" for r in source.manifest.get("drop_reasons", [])]
    if "tokenizer" in rollout.manifest:
        manifest["tokenizer"] = rollout.manifest["tokenizer"]
    write_json_atomic(out / MANIFEST_NAME, manifest)


def main(argv: list[str] | None = None) -> int:
    """``python -m tracer.integrations.verl_join TRACER_DIR [--out DIR]``; exit 2 with the reason on bad input."""
    parser = argparse.ArgumentParser(prog="python -m tracer.integrations.verl_join", description=__doc__.split("\n")[0])
    parser.add_argument("trace_dir", help="the run's $TRACER_DIR (holds rollout/ and workers/)")
    parser.add_argument("--out", default=None, help="output trace directory (default: TRACER_DIR/joined)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = join(args.trace_dir, args.out)
    except TraceError as err:
        log.error("tracer: %s", err)
        return 2
    log.info("joined trace written to %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

