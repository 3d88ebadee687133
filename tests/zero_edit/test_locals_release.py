"""The f_locals snapshots the index lookup takes (tracer/zero_edit/frame_lookup.py's release_locals):
before CPython 3.13 a frame keeps the snapshot its ``f_locals`` made, so a capture that read a frame
(or its caller's, for the ``step``) releases it, and a tensor the loop drops is freed then. The
release leaves what the user's program reads as it was: a ``locals()`` dict the loop holds, names
written into the snapshot by ``exec()`` or ``locals()[k] = v``, and a snapshot held while tracer was
imported under a trace function (coverage, a debugger)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import tracer
from tracer import Trace
from tracer.zero_edit import frame_lookup

from tests.fixtures.paths import REPO


def train_on(weight, rollout) -> None:
    """The backward's frame: no ``step`` here, so the lookup reads the caller's variables."""
    per_token_logps = weight.log_softmax(-1)[..., 0] + 0 * rollout.mean()
    per_token_logps.sum().backward()


def epochs(weight, freed: list) -> None:
    for step in range(3):
        rollout = torch.randn(256, 64)  # the caller's own tensor
        alive = weakref.ref(rollout)
        train_on(weight, rollout)
        del rollout
        freed.append(alive() is None)


def test_a_callers_tensor_is_freed_after_the_backward(tmp_path):
    """CPython before 3.13 keeps a frame's f_locals snapshot on the frame: reading the caller's ``step``
    left the caller's ``rollout`` referenced by it after the loop's ``del rollout`` (until a later read)."""
    if sys.version_info >= (3, 13):
        pytest.skip("f_locals is a write-through proxy from 3.13: no snapshot is kept")
    weight = torch.nn.Parameter(torch.zeros(2, 3, 5))
    with tracer.watch(algo="grpo", out=tmp_path / "t") as w:
        freed = []
        epochs(weight, freed)
    assert w.steps_recorded == 3 and freed == [True, True, True]
    assert [k.step for k in Trace(tmp_path / "t").steps()] == [0, 1, 2]  # the caller's step was read


def test_a_callers_locals_dict_it_keeps_is_left_alone(tmp_path):
    """The release's conditions (frame_lookup.release_locals): a caller holding its ``locals()`` dict keeps it
    as it was; a caller's name written by ``exec()`` stays."""
    if sys.version_info >= (3, 13):
        pytest.skip("f_locals is a write-through proxy from 3.13")

    def caller(weight):
        exec("lr = 0.5")
        kept = locals()
        seen = []
        for step in range(2):
            rollout = torch.ones(2)
            train_on(weight, rollout)
            seen.append((sorted(kept), eval("lr")))
        return seen

    weight = torch.nn.Parameter(torch.zeros(2, 3, 5))
    with tracer.watch(algo="grpo", out=tmp_path / "t") as w:
        seen = caller(weight)
    assert w.steps_recorded == 2
    assert seen == [(["kept", "lr", "rollout", "seen", "step", "weight"], 0.5)] * 2


def test_a_released_snapshot_refreshes_to_the_variables(tmp_path):
    """release_locals sets the snapshot's values to None, keeping its keys (so the next refresh does not
    grow the dict again): a later ``locals()`` in the loop is exactly its bound variables and their
    values, a deleted one absent."""
    if sys.version_info >= (3, 13):
        pytest.skip("f_locals is a write-through proxy from 3.13")
    weight = torch.nn.Parameter(torch.zeros(2, 3, 5))
    seen = {}

    def loop():
        for step in range(2):
            extra = torch.ones(3)
            per_token_logps = weight.log_softmax(-1)[..., 0]
            per_token_logps.sum().backward()
            seen[step] = {k: type(v).__name__ for k, v in locals().items()}
            del extra
            seen[f"del {step}"] = sorted(locals())

    with tracer.watch(algo="grpo", out=tmp_path / "t") as w:
        loop()
    assert w.steps_recorded == 2
    both = {"extra": "Tensor", "per_token_logps": "Tensor", "seen": "dict", "step": "int", "weight": "Parameter"}
    assert seen[0] == seen[1] == both
    assert seen["del 0"] == seen["del 1"] == ["per_token_logps", "seen", "step", "weight"]


def test_release_locals_lets_go_of_the_values_and_keeps_the_keys():
    """The snapshot a capture took, released: every value None (no tensor kept alive), keys unchanged."""
    if sys.version_info >= (3, 13):
        pytest.skip("f_locals is a write-through proxy from 3.13")
    release = frame_lookup.release_locals

    def body():
        rollout = torch.randn(4, 4)
        alive = weakref.ref(rollout)
        frame = sys._getframe()
        local = frame.f_locals
        keys = sorted(local)
        release(frame, local)
        values = list(local.values())
        del local, rollout
        return keys, values, alive() is None

    keys, values, freed = body()
    assert keys == ["alive", "frame", "release", "rollout"]
    assert values == [None] * 4 and freed


# -- the f_locals release leaves what the user's program reads as it was -----------------------


def test_names_written_into_the_locals_snapshot_by_exec_stay_there(tmp_path):
    """CPython before 3.13: ``exec()`` in a function (a config file read with ``exec(open(f).read())``)
    and ``locals()[k] = v`` write into the frame's f_locals snapshot, and later ``locals()`` / ``eval()``
    calls still see those names (they are no variables: refreshing the snapshot leaves them). Emptying
    the snapshot after a capture lost them: KeyError / NameError in the user's loop."""
    def loop():
        exec("lr = 0.5")
        locals()["note"] = "kept"
        weight = torch.nn.Parameter(torch.zeros(2, 3))
        seen = []
        for step in range(3):
            per_token_logps = torch.log_softmax(weight, dim=-1)
            per_token_logps.sum().backward()
            seen.append((locals().get("lr"), locals().get("note"), eval("lr")))
        return seen

    if sys.version_info >= (3, 13):
        pytest.skip("f_locals is a write-through proxy from 3.13: exec() cannot add names to a function")
    assert loop() == [(0.5, "kept", 0.5)] * 3  # the loop on its own
    with tracer.watch(algo="grpo", out=tmp_path / "t") as w:
        seen = loop()
    assert w.steps_recorded == 3 and seen == [(0.5, "kept", 0.5)] * 3


HELD_SNAPSHOT = textwrap.dedent("""
    import sys
    def trace(frame, event, arg):  # a Python trace function on tracer's own files only, as
        return trace if "{sep}tracer{sep}" in frame.f_code.co_filename else None  # coverage --timid --source=tracer
    sys.settrace(trace)
    import torch, tracer
    sys.settrace(None)

    def loop(held):
        weight = torch.nn.Parameter(torch.zeros(2, 3))
        per_token_logps = torch.log_softmax(weight, dim=-1)
        held.append(locals())  # the loop keeps its locals() dict (one reference more)
        per_token_logps.sum().backward()

    held = []
    with tracer.watch(algo="grpo", out=sys.argv[1]) as w:
        loop(held)
    assert w.steps_recorded == 1
    print(sorted(held[0]))
""")


def test_a_held_locals_dict_is_kept_when_tracer_was_imported_under_a_trace_function(tmp_path):
    """The release tells a snapshot nothing else holds by its reference count, measured once at import.
    Measured while a Python trace function ran (coverage's Python tracer, a debugger), that count came
    out one higher, and a locals() dict the loop kept was then emptied under it."""
    if sys.version_info >= (3, 13):
        pytest.skip("f_locals is a proxy from 3.13: nothing is released")
    script = tmp_path / "held.py"
    script.write_text(HELD_SNAPSHOT.format(sep=os.sep))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "t")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['held', 'per_token_logps', 'weight']"
