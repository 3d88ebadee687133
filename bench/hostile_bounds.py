"""Reading cost of the issue-48 hostile traces: wrong JSON types in the manifest, one 1 MB token,
100,000 metadata keys (1.4 MB step files) and, under the limits, 9,900 keys per file.

Each trace is built in a temporary folder; ``tracer info`` and ``tracer check`` run in this process
(imports done first, so the figures are the command's own), the reader's token table is timed with
its resident-memory growth (psutil). Run: ``.venv/bin/python -m bench.hostile_bounds``.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import save_file

from tracer import Trace
from tracer.cli import main
from tracer.format.names import MANIFEST_NAME, STEPS_DIR, TOKENS_NAME, step_file_name

META = {"algorithm": "grpo", "num_generations": "2"}


def _step(B: int = 8, T: int = 64) -> dict[str, torch.Tensor]:
    return {"completion_ids": torch.zeros(B, T, dtype=torch.int64), "completion_mask": torch.ones(B, T, dtype=torch.bool),
            "policy_logprobs": torch.full((B, T), -1.0), "old_logprobs": torch.full((B, T), -1.0),
            "advantages": torch.zeros(B), "group_ids": torch.arange(B) // 2}


def _trace(root: Path, name: str, manifest: dict | None = None, meta: dict | None = None,
           tokens: list[str] | None = None, steps: int = 1) -> Path:
    run = root / name
    (run / STEPS_DIR).mkdir(parents=True)
    (run / MANIFEST_NAME).write_text(json.dumps({"algorithm": "grpo", "status": "finished", **(manifest or {})}))
    if tokens is not None:
        (run / TOKENS_NAME).write_text(json.dumps({"tokens": tokens}))
    for step in range(steps):
        save_file(_step(), str(run / STEPS_DIR / step_file_name(step)), metadata={**META, "step": str(step), **(meta or {})})
    return run


def _command(*argv: str) -> tuple[int, float]:
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(list(argv))
    return code, time.perf_counter() - start


def main_bench() -> None:
    process = psutil.Process()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cases = {
            "drop_reasons [{'a': 1}, [1, [2]]]": _trace(root, "drops", {"drop_reasons": [{"a": 1}, [1, [2]]],
                                                                       "dropped_steps": 2}),
            "one 1 MB token, 512 tokens": _trace(root, "token", tokens=["x" * 2**20, "a"]),
            "100,000 metadata keys x 3 files": _trace(root, "keys", meta={f"k{i:06d}": "1" for i in range(100_000)},
                                                      steps=3),
            "9,900 metadata keys x 3 files": _trace(root, "keys10k", meta={f"k{i:05d}": "v" * 130 for i in range(9_900)},
                                                    steps=3),
        }
        _command("info", str(cases["drop_reasons [{'a': 1}, [1, [2]]]"]))  # imports and first-use costs
        print("| trace | file size | info | check | reader |")
        print("|---|---|---|---|---|")
        for label, run in cases.items():
            size = max(p.stat().st_size for p in run.rglob("*") if p.is_file())
            info_code, info_s = _command("info", str(run))
            check_code, check_s = _command("check", str(run))
            trace = Trace(run)
            key = trace.steps()[0]
            rss = process.memory_info().rss
            start = time.perf_counter()
            try:
                trace.token_table(key)
                reader = "token table"
            except Exception as err:  # noqa: BLE001 - the refusal is the answer
                reader = type(err).__name__
            reader_s = time.perf_counter() - start
            grown = (process.memory_info().rss - rss) / 2**20
            decodes = getattr(trace.__dict__.get("_metadata_cache"), "decodes", "-")
            print(f"| {label} | {size / 2**20:.2f} MB | exit {info_code}, {info_s:.2f} s | exit {check_code}, "
                  f"{check_s:.2f} s | {reader} {reader_s:.2f} s, +{grown:.0f} MB, {decodes} decodes |")


if __name__ == "__main__":
    main_bench()
