"""The writer's contract on odd input found by adversarial testing: caller mistakes raise a clear
SchemaError/TraceError; nothing is silently overwritten; hostile metadata never crashes a reader."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from safetensors.torch import save_file

from tracer import SchemaError, Trace, TraceError, TraceWriter
from tracer.cli import main
from tracer.format.metadata_codec import encode_metadata


def tensors():
    return {"completion_ids": torch.zeros(2, 3, dtype=torch.long), "completion_mask": torch.ones(2, 3),
            "policy_logprobs": torch.zeros(2, 3)}


def test_recording_the_same_step_twice_is_refused(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo") as w:
        w.record(5, tensors())
        with pytest.raises(SchemaError, match="step 5 was already recorded"):
            w.record(5, tensors())
        w.record(5, tensors(), micro_batch=1)  # a second micro-batch of the step is fine
    assert len(Trace(tmp_path / "run").steps()) == 2


@pytest.mark.parametrize("step, shown", [(3.7, "3.7 (float)"), ("3", "'3' (str)"), (None, "None (NoneType)"),
                                         (-1, "-1 (int)"), (10**20, "100000000000000000000 (int)")])
def test_step_must_be_a_non_negative_integer(tmp_path, step, shown):
    with TraceWriter(tmp_path / "run", "grpo") as w:
        with pytest.raises(SchemaError, match=re.escape(f"step must be an integer in [0, 2**62), got {shown}")):
            w.record(step, tensors())
        w.record(np.int64(2), tensors(), micro_batch=torch.tensor(1))  # numpy / torch integers are fine
    (key,) = Trace(tmp_path / "run").steps()
    assert (key.step, key.micro_batch) == (2, 1)


def test_reserved_names_are_refused(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo") as w:
        with pytest.raises(SchemaError, match="'__metadata__' is reserved by safetensors"):
            w.record(0, {**tensors(), "__metadata__": torch.zeros(2)})
        with pytest.raises(SchemaError, match=r"metadata keys \['algorithm', 'step'\] are set by the writer"):
            w.record(0, tensors(), metadata={"step": 9, "algorithm": "ppo"})
        with pytest.raises(SchemaError, match="step metadata of .* bytes exceeds"):
            w.record(0, tensors(), metadata={"note": "x" * (5 * 2**20)})


def test_integer_masks_must_hold_only_0_and_1(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo") as w:
        bad = {**tensors(), "completion_mask": torch.tensor([[1, 2, 0], [1, 1, -1]])}
        with pytest.raises(SchemaError, match=r"field 'completion_mask': a mask must hold only 0 and 1.*\[2, -1\]"):
            w.record(0, bad)


def test_numpy_and_path_hyperparameters_and_config_are_stored(tmp_path):
    hp = {"num_generations": np.int64(4), "beta": np.float32(0.5), "gammas": (1.0, 0.9)}
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters=hp, config={"out": Path("/x"), "obj": object()}) as w:
        w.record(0, tensors())
    trace = Trace(tmp_path / "run")
    meta = trace.metadata(trace.steps()[0])
    assert meta["num_generations"] == 4 and meta["beta"] == 0.5 and meta["gammas"] == [1.0, 0.9]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["config"]["out"] == "/x" and manifest["config"]["obj"].startswith("<object object")


def test_a_non_json_hyperparameter_is_refused_at_construction(tmp_path):
    with pytest.raises(SchemaError, match="metadata key 'schedule': value .* is not JSON"):
        TraceWriter(tmp_path / "run", "grpo", hyperparameters={"schedule": lambda step: 0.1})


def test_two_writers_on_one_directory_and_rank(tmp_path):
    first = TraceWriter(tmp_path / "run", "grpo")
    with pytest.raises(TraceError, match="another writer is already writing rank 0 of this trace"):
        TraceWriter(tmp_path / "run", "grpo")
    first.record(0, tensors())
    first.close()
    # another process while this one holds the lock
    holder = TraceWriter(tmp_path / "other", "grpo")
    code = (f"from tracer import TraceWriter\nTraceWriter({str(tmp_path / 'other')!r}, 'grpo')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "another writer is already writing rank 0" in proc.stderr
    holder.close()


def test_a_failed_tokens_file_does_not_stop_training(tmp_path):
    class Tok:
        eos_token_id, pad_token_id = 1, 0

        def __len__(self):
            return 3

        def batch_decode(self, seqs, **_):
            return ["a", "b", "c"]

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tokens.json").mkdir()  # cannot be replaced by a file
    with pytest.warns(RuntimeWarning, match="could not write .*tokens.json"):
        w = TraceWriter(tmp_path / "run", "grpo", tokenizer=Tok())
    w.record(0, tensors())
    w.close()
    assert len(Trace(tmp_path / "run").steps()) == 1
    (tmp_path / "strict").mkdir()
    (tmp_path / "strict" / "tokens.json").mkdir()
    with pytest.raises(TraceError, match="could not write .*tokens.json"):
        TraceWriter(tmp_path / "strict", "grpo", tokenizer=Tok(), strict=True)


@pytest.mark.parametrize("meta", [{"step": "NaN"}, {"inner_step": "1e400"}, {"step": "2.5"}])
def test_hostile_integer_metadata_never_crashes_the_reader(tmp_path, meta, capsys):
    path = tmp_path / "one.safetensors"
    save_file(tensors() | {"completion_mask": torch.ones(2, 3, dtype=torch.bool)}, path,
              metadata={"algorithm": "grpo", **meta})
    trace = Trace(path)
    (key,) = trace.steps()
    assert key.step == 0 and key.inner_step == 0  # the odd value is not invented into a coordinate
    assert main(["info", str(path)]) == 0
    assert main(["check", str(path)]) in (0, 1)
    assert main(["diff", str(path), str(path)]) == 0


def test_a_closed_trace_keeps_no_lock_file(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo") as w:
        assert (tmp_path / "run" / ".writer.rank_0.lock").exists()
        w.record(0, tensors())
    assert not (tmp_path / "run" / ".writer.rank_0.lock").exists()


def test_a_forked_child_leaves_its_parents_trace_alone(tmp_path):
    script = f"""
import json, os, sys
from pathlib import Path
from tracer import TraceWriter
root = Path({str(tmp_path / 'run')!r})
w = TraceWriter(root, "grpo")
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: the child's atexit hook must not close the parent's writer
os.waitpid(pid, 0)
print(json.loads((root / "manifest.json").read_text())["status"], (root / ".writer.rank_0.lock").exists())
try:
    TraceWriter(root, "grpo")
    print("second writer accepted")
except Exception as err:
    print(type(err).__name__)
w.close()
print(json.loads((root / "manifest.json").read_text())["status"])
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["running", "True", "TraceError", "finished"], proc.stderr


def test_a_float_key_holding_a_huge_integer_is_kept_as_text(tmp_path, capsys):
    path = tmp_path / "one.safetensors"
    save_file(tensors() | {"completion_mask": torch.ones(2, 3, dtype=torch.bool)}, path,
              metadata={"algorithm": "grpo", "beta": "1" + "0" * 400})
    trace = Trace(path)
    assert trace.metadata(trace.steps()[0])["beta"] == "1" + "0" * 400
    assert main(["info", str(path)]) == 0


def test_a_numpy_array_hyperparameter_becomes_a_list(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters={"reward_weights": np.arange(3) / 2}) as w:
        w.record(0, tensors())
    trace = Trace(tmp_path / "run")
    assert trace.metadata(trace.steps()[0])["reward_weights"] == [0.0, 0.5, 1.0]


@given(st.one_of(st.integers(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True)))
def test_scalar_metadata_is_encoded_exactly_as_json_dumps_writes_it(value):
    assert encode_metadata({"k": value}) == {"k": json.dumps(value, allow_nan=True)}


@pytest.mark.parametrize("fsync_steps", [False, True])
def test_step_files_are_fsynced_only_when_asked_and_complete_either_way(tmp_path, monkeypatch, fsync_steps):
    """An fsync per step file costs a loop of small steps several percent on virtualised disks, so it
    is opt-in (``fsync_steps=True``); either way every file is renamed into place complete."""
    import tracer.format.files as files_module

    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(files_module.os, "fsync", counting_fsync)
    root = tmp_path / "run"
    with TraceWriter(root, "grpo", fsync_steps=fsync_steps) as writer:
        for step in range(3):
            writer.record(step, policy_logprobs=-torch.rand(2, 3), completion_mask=torch.ones(2, 3, dtype=torch.bool))
    step_syncs = [p for p in synced if "/steps/" in p]
    assert len(step_syncs) == (3 if fsync_steps else 0), step_syncs
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["capture"]["fsync_steps"] is fsync_steps
    trace = Trace(root)
    assert len(trace.steps()) == 3 and not list((root / "steps").glob("*.partial"))
    for key in trace.steps():
        assert trace.load_step(key)["policy_logprobs"].shape == (2, 3)


def test_a_writer_that_fails_to_open_leaves_the_rank_free_for_the_next(tmp_path):
    """A mistake caught while the writer opens (here a tokenizer of no known kind, after the rank's
    lock was taken) raises, and the lock goes with it: the corrected call on the same folder works."""
    root = tmp_path / "run"
    with pytest.raises(TraceError, match="has neither batch_decode nor decode_batch"):
        TraceWriter(root, "grpo", tokenizer=object())
    with TraceWriter(root, "grpo") as writer:
        writer.record(0, policy_logprobs=-torch.rand(2, 3), completion_mask=torch.ones(2, 3, dtype=torch.bool))
    assert writer.steps_written == 1


def test_an_unknown_when_full_is_refused_when_the_writer_opens(tmp_path):
    with pytest.raises(TraceError, match="when_full='explode' is not 'block'"):
        TraceWriter(tmp_path / "run", "grpo", when_full="explode")
    assert not (tmp_path / "run").exists()  # refused before anything was made
