"""Two ranks (torchrun, gloo, CPU) running the hand-written GRPO loop under DDP: each rank writes
its own step files into one trace, and the reader merges them."""

import json
import os
import subprocess
import sys

import torch

from tracer import Trace
from tracer.read.trace_info import trace_info
from tracer.demo.tiny_model import build_tiny_model

from tests.fixtures.paths import SCRIPTS
from tests.fixtures.ports import free_port

SCRIPT = SCRIPTS / "ddp_grpo.py"


def test_two_ranks_write_their_own_files_and_the_reader_merges_them(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    out = tmp_path / "trace"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), str(SCRIPT), str(out), str(model_dir)],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = Trace(out)
    keys = trace.steps()
    # 2 steps x 2 inner steps x 2 ranks, one file each
    assert sorted((k.step, k.inner_step, k.rank) for k in keys) == [
        (s, i, r) for s in (0, 1) for i in (0, 1) for r in (0, 1)]
    for key in keys:
        meta = trace.metadata(key)
        assert meta["rank"] == key.rank and meta["world_size"] == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["status"] == "finished"
    # each rank sampled its own prompts: the two ranks' rollouts differ
    r0 = trace.load_step(next(k for k in keys if (k.step, k.inner_step, k.rank) == (0, 0, 0)))
    r1 = trace.load_step(next(k for k in keys if (k.step, k.inner_step, k.rank) == (0, 0, 1)))
    assert not torch.equal(r0["prompt_ids"], r1["prompt_ids"])
    # merged views: rank is a column of the per-step summary and of the token table; info lists ranks
    summary = trace.step_summary()
    assert sorted(summary["rank"].unique()) == [0, 1] and len(summary) == 8
    table = trace.merged_token_table(step=0, inner_step=0)
    assert sorted(table["rank"].unique()) == [0, 1]
    assert len(table) == sum(len(trace.token_table(k)) for k in keys if (k.step, k.inner_step) == (0, 0))
    assert trace_info(out)["ranks"] == [0, 1]
