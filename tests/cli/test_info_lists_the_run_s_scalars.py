"""``tracer info`` lists the scalars a run recorded with its steps (``record(..., scalars=...)``, in the step
files' summary headers) and logged after them (``log_scalars``: ``scalars.rank_N.jsonl``), each with its
first, last, min and max value in step order and how many values there are; a step's recorded value
wins over its logged one, as on the Steps page. Read from headers and the log: no torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from tracer.cli import main
from tracer.record.writer import TraceWriter

from tests.fixtures.paths import REPO
from tests.fixtures.toy_traces import ToyTokenizer, healthy_step_tensors

PROBE = """
import json, runpy, sys
sys.argv = ["tracer", "info", {path!r}, "--json"]
try:
    runpy.run_module("tracer", run_name="__main__", alter_sys=True)
except SystemExit as stop:
    assert stop.code in (0, None), stop.code
print("\\n@@" + json.dumps({{"torch": "torch" in sys.modules}}))
"""


def write_run(root):
    """Three steps: grad_norm 0.5, NaN, 2.5 and learning_rate 1e-3 recorded with each; reward_mean
    logged after steps 0 and 2 (0.25, 0.75); grad_norm also logged after step 0 (9.0), which the
    recorded 0.5 overrides."""
    with TraceWriter(root, algorithm="grpo", tokenizer=ToyTokenizer(), async_write=False) as writer:
        for step, grad_norm in enumerate((0.5, math.nan, 2.5)):
            writer.record(step, healthy_step_tensors(seed=step, inner_step=0),
                          scalars={"grad_norm": grad_norm, "learning_rate": 1e-3})
        writer.log_scalars(0, {"reward_mean": 0.25, "grad_norm": 9.0})
        writer.log_scalars(2, {"reward_mean": 0.75})
    return root


def test_info_json_and_table_list_recorded_and_logged_scalars(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert main(["info", str(run), "--json"]) == 0
    scalars = json.loads(capsys.readouterr().out)["overview"]["scalars"]
    assert scalars == {
        # NaN at step 1 is counted, not a first/last/min/max
        "scalars/grad_norm": {"first": 0.5, "last": 2.5, "min": 0.5, "max": 2.5, "count": 3},
        "scalars/learning_rate": {"first": 1e-3, "last": 1e-3, "min": 1e-3, "max": 1e-3, "count": 3},
        "scalars/reward_mean": {"first": 0.25, "last": 0.75, "min": 0.25, "max": 0.75, "count": 2},
    }
    assert main(["info", str(run)]) == 0
    out = capsys.readouterr().out
    assert "scalars (recorded with the steps, logged after them)" in out
    row = next(line for line in out.splitlines() if "scalars/reward_mean" in line)
    assert [cell.strip() for cell in row.strip("│┃ ").split("│")] == ["scalars/reward_mean", "0.25", "0.75", "0.25",
                                                                      "0.75", "2"]


def test_info_on_a_step_file_lists_its_recorded_scalars_only(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    step_file = sorted((run / "steps").glob("*.safetensors"))[2]
    assert main(["info", str(step_file), "--json"]) == 0
    scalars = json.loads(capsys.readouterr().out)["overview"]["scalars"]
    assert scalars == {"scalars/grad_norm": {"first": 2.5, "last": 2.5, "min": 2.5, "max": 2.5, "count": 1},
                       "scalars/learning_rate": {"first": 1e-3, "last": 1e-3, "min": 1e-3, "max": 1e-3, "count": 1}}


def test_info_reads_the_scalars_without_torch(tmp_path):
    run = write_run(tmp_path / "run")
    done = subprocess.run([sys.executable, "-c", PROBE.format(path=str(run))], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    info_text, probe = done.stdout.rsplit("\n@@", 1)
    assert json.loads(probe) == {"torch": False}
    assert json.loads(info_text)["overview"]["scalars"]["scalars/reward_mean"]["count"] == 2
