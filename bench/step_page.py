"""The Step page at 256 x 1024 tokens: the server-side time of the whole page (every token of the
step read, filtered, sorted, one page of the table, the heatmap and the histograms built) against
the Tokens page of one sequence of the same step, both through Streamlit's ``AppTest`` (the real
page scripts, no browser). Also what is sent to the browser: the table page and the two figures.

    python -m bench.step_page

Cold: the first run (reads the step file); warm: a rerun (a widget changed; the step's frame is
cached). Target: a warm rerun of the Step page within 2 s on this 2-core machine (interactive).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import grpo_step_tensors, machine, median
from tracer.record.writer import TraceWriter

REPO = Path(__file__).resolve().parents[1]
B, T = 256, 1024


def write_trace(root: Path) -> Path:
    """One GRPO step of B x T with a quarter of each row masked (padding), plus entropy and sampler logprobs."""
    tensors = grpo_step_tensors(B, T, seed=0)
    keep = torch.arange(T).expand(B, T) < (T - torch.randint(0, T // 2, (B, 1), generator=torch.Generator().manual_seed(1)))
    tensors["completion_mask"] = keep
    tensors["sampler_logprobs"] = tensors["old_logprobs"] + 0.01 * torch.randn(B, T)
    tensors["entropy"] = torch.rand(B, T) * 3
    run = root / "big"
    hyper = {"num_generations": 8, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, "beta": 0.04,
             "loss_reduction": "sequence_mean"}
    with TraceWriter(run, "grpo", hyperparameters=hyper, async_write=False) as writer:
        writer.record(0, tensors, inner_step=1)
    return run


def _app(root: Path):
    from streamlit.testing.v1 import AppTest

    os.environ["TRACER_ROOT"] = str(root)
    at = AppTest.from_file(str(REPO / "app" / "streamlit_app.py"), default_timeout=600)
    at.query_params.update({"run": "big", "step": "0", "inner": "1", "seq": "0"})
    return at


def time_page(root: Path, page: str, rounds: int = 3) -> dict[str, float]:
    """Cold (first) and warm (median rerun) seconds of one page; the app's caches are cleared first."""
    from app.components import trace_cache

    trace_cache.clear_caches()
    at = _app(root).run()
    t0 = time.perf_counter()
    at.switch_page(f"app_pages/{page}.py").run()
    cold = time.perf_counter() - t0
    assert not at.exception, [e.value for e in at.exception]
    warm = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        at.run()
        warm.append(time.perf_counter() - t0)
    sent = sum(len(c.proto.spec) for c in at.get("plotly_chart"))
    sent += sum(len(d.proto.arrow_data.data) for d in at.dataframe)
    return {"cold_s": cold, "warm_s": median(warm), "sent_mb": sent / 1e6}


def measure() -> dict[str, float]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_trace(root)
        step = time_page(root, "step")
        tokens = time_page(root, "tokens")
    return {**{f"step_{k}": v for k, v in step.items()}, **{f"tokens_{k}": v for k, v in tokens.items()},
            "warm_ratio": step["warm_s"] / tokens["warm_s"], "cold_ratio": step["cold_s"] / tokens["cold_s"]}


def main() -> None:
    print(f"Machine: {machine()}")
    r = measure()
    print(json.dumps(r, indent=2))
    print(f"Step page, {B} x {T} tokens: cold {r['step_cold_s']:.2f} s, warm rerun {r['step_warm_s']:.2f} s, "
          f"{r['step_sent_mb']:.2f} MB sent; Tokens page (one sequence): cold {r['tokens_cold_s']:.2f} s, "
          f"warm {r['tokens_warm_s']:.2f} s; ratio warm {r['warm_ratio']:.1f}x, cold {r['cold_ratio']:.1f}x")


if __name__ == "__main__":
    main()
