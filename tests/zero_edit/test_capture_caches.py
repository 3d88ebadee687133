"""The caches and shortcuts of zero-edit capture's training-thread path: each gives what
the code it replaces gave, and each is dropped when what it was made from changes.

* :func:`tracer.zero_edit.frame_lookup.read_indices` / ``read_metadata`` read a name map's sections compiled
  once (``_compiled``): compared with the reading they replace (copied below as ``_reference_*``, the
  code of the commit before) on random frames and callers, and on a map changed in place;
* ``SignatureCache.check(tensors, signature)``: a call-site plan's field signature, memoised by
  identity, gives the entry the tensors' own signature gives (and the mask values are still checked);
* ``MetadataCache``: the step metadata compared in C, re-encoded when a value changes type, sign
  (``0.0`` / ``-0.0``), is a NaN, or the keys change order;
* ``stage`` of CPU fields some of which the capture made (indexed rows): those kept, the others
  copied in one group, in field order, with the bytes of the per-tensor path;
* the step headers of a PPO-like loop whose metadata changes mid-run (``stop_ppo`` appearing, ``args``
  replaced, ``kl_coef`` from 0.0 to -0.0 to an int) hold, step by step, the values set by hand.
"""

from __future__ import annotations

import argparse
import operator
import random
import subprocess
import sys
import textwrap
import warnings
from collections import abc

import pytest
import torch
from safetensors import safe_open

from tracer import Trace
from tracer.zero_edit import frame_lookup
from tracer.record.capture import BufferPool, stage
from tracer.errors import SchemaError
from tracer.zero_edit.frame_lookup import _MISSING, read_indices, read_metadata, resolve_in
from tracer.zero_edit.name_maps import load_name_map
from tracer.record.validation import MetadataCache, SignatureCache
from tracer.format.metadata_codec import encode_metadata
from tracer.zero_edit.watch import Watcher

from tests.fixtures.paths import REPO


# -- the reading replaced, as it was (tracer/zero_edit/frame_lookup.py before call-site plans) --------

def _reference_as_int(value):
    if type(value) is int:
        return value
    if isinstance(value, bool) or value is _MISSING:
        return None
    try:
        return operator.index(value)
    except Exception:  # noqa: BLE001
        return None


def _reference_indices(frame, name_map) -> dict:
    """Key by key, level by level (the callers' scopes as frame_lookup takes them)."""
    out: dict = {}
    heads = frozenset(e.path[0] for exprs in name_map.indices.values() for e in exprs)
    callers = frame_lookup._user_frames(frame, frame_lookup.INDEX_DEPTH)
    next(callers)
    levels = [frame_lookup.scopes_of(frame)]
    for key, exprs in name_map.indices.items():
        level = 0
        while key not in out:
            if level == len(levels):
                caller = next(callers, None)
                if caller is None:
                    break
                levels.append(frame_lookup._caller_scopes(caller, heads))
            local, global_ = levels[level]
            for expr in exprs:
                found = _reference_as_int(resolve_in(expr, local, global_))
                if found is not None:
                    out[key] = found
                    break
            level += 1
    return out


def _reference_metadata(frame, name_map) -> dict:
    out = {}
    local, global_ = frame_lookup.scopes_of(frame)
    for key, exprs in name_map.metadata.items():
        for expr in exprs:
            value = frame_lookup._plain(resolve_in(expr, local, global_))
            if value is not _MISSING:
                out[key] = value
                break
    return out


# -- random frames: the compiled reading against the reference ------------------------------------

NAMES = ["step", "global_step", "epoch", "ppo_epoch", "mb", "micro_batch", "beta", "kl", "args", "cfg"]
VALUES = [lambda r: r.randrange(0, 50), lambda r: True, lambda r: 2.5, lambda r: -0.0, lambda r: float("nan"),
          lambda r: "x", lambda r: torch.tensor(r.randrange(5)), lambda r: torch.tensor([1, 2]),
          lambda r: torch.tensor(0.5), lambda r: None, lambda r: print,
          lambda r: argparse.Namespace(beta=r.choice([0.1, 3, "s"]), kl=torch.tensor(0.25)),
          lambda r: {"beta": r.randrange(3), "step": 7}]


def _random_map(r: random.Random):
    pick = lambda: r.sample(NAMES, r.randrange(0, 4)) + r.sample(["args.beta", "cfg.beta", "args.kl", "cfg.step"],
                                                                  r.randrange(0, 2))
    indices = {k: pick() for k in r.sample(["step", "epoch", "inner_step", "micro_batch"], r.randrange(1, 5))}
    metadata = {k: pick() for k in r.sample(["beta", "kl_coef", "early_stop", "gamma"], r.randrange(1, 5))}
    return load_name_map({"indices": indices, "metadata": metadata}, "ppo")


def _nested_frames(r: random.Random, check) -> None:
    """Three nested function frames, each binding random names to random values (some left unbound),
    the innermost calling ``check(frame)``; module globals get some too."""
    g = {"__name__": "user_module", "check": check, "r": r, "VALUES": VALUES, "sys": sys}
    for name in r.sample(NAMES, 3):
        g[name] = r.choice(VALUES)(r)
    source = "def level(depth):\n"
    for name in NAMES:
        source += f"    if r.random() < 0.35:\n        {name} = r.choice(VALUES)(r)\n"
    source += "    if depth == 0:\n        check(sys._getframe())\n    else:\n        level(depth - 1)\n"
    exec(compile(source, "<random frames>", "exec"), g)  # noqa: S102  (built here from fixed names)
    g["level"](2)


@pytest.mark.parametrize("seed", range(60))
def test_indices_and_metadata_are_read_as_the_reading_they_replace(seed):
    r = random.Random(seed)
    for _ in range(5):
        name_map = _random_map(r)

        def check(frame):
            want_i, want_m = _reference_indices(frame, name_map), _reference_metadata(frame, name_map)
            got_i, got_m = read_indices(frame, name_map), read_metadata(frame, name_map)
            assert got_i == want_i and list(got_i) == list(want_i)
            assert list(got_m) == list(want_m)
            for key in want_m:  # NaN != NaN: compare the JSON the header holds
                assert encode_metadata({key: got_m[key]}) == encode_metadata({key: want_m[key]})
                assert type(got_m[key]) is type(want_m[key])

        _nested_frames(r, check)


def test_a_name_map_changed_in_place_or_another_one_is_compiled_again():
    name_map = load_name_map({"indices": {"step": ["a"], "epoch": ["b"]}, "metadata": {"beta": ["x", "y"]}}, "grpo")
    a, b, x, y = 3, 4, 0.5, 0.25  # noqa: F841  (read from this frame)
    frame = sys._getframe()
    assert read_indices(frame, name_map) == {"step": 3, "epoch": 4}
    assert read_metadata(frame, name_map) == {"beta": 0.5}
    expressions = dict(name_map.indices)
    name_map.indices["step"] = expressions["epoch"]  # another expression for a key
    assert read_indices(frame, name_map) == {"step": 4, "epoch": 4}
    del name_map.indices["step"]
    name_map.indices["step"] = expressions["step"]  # the same entries, in another order
    assert list(read_indices(frame, name_map)) == ["epoch", "step"]
    name_map.metadata["beta"] = name_map.metadata["beta"][1:]
    assert read_metadata(frame, name_map) == {"beta": 0.25}
    other = load_name_map({"indices": {"micro_batch": ["b"]}, "metadata": {"gamma": ["y"]}}, "grpo")
    assert read_indices(frame, other) == {"micro_batch": 4} and read_metadata(frame, other) == {"gamma": 0.25}


def test_a_namespace_registered_as_a_mapping_is_read_as_one():
    """``args.beta`` of a Namespace: getattr; once ``Mapping.register(Namespace)`` is run (an ABC's
    cache token changes), ``beta in args`` then ``args["beta"]``, as ``isinstance`` says (a fresh
    interpreter: the registration cannot be undone)."""
    code = textwrap.dedent("""
        import argparse, sys
        from collections import abc
        from tracer.zero_edit.frame_lookup import resolve_in
        from tracer.zero_edit.name_maps import parse_expression
        class Keyed(argparse.Namespace):
            pass
        args = argparse.Namespace(beta=0.5)
        expr = parse_expression("args.beta", "test")
        assert resolve_in(expr, {"args": args}, {}) == 0.5
        abc.Mapping.register(argparse.Namespace)
        argparse.Namespace.__getitem__ = lambda self, key: "by key"
        assert resolve_in(expr, {"args": args}, {}) == "by key"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


# -- the field signature a plan hands to record ----------------------------------------------------

def _signature(tensors):
    return tuple([(n, t.shape, t.dtype, t.device) for n, t in tensors.items()])


def test_a_given_signature_gives_the_entry_of_the_tensors_own_and_masks_are_still_checked():
    cache = SignatureCache("grpo")
    small = {"policy_logprobs": torch.zeros(2, 3), "completion_mask": torch.ones(2, 3)}
    large = {"policy_logprobs": torch.zeros(4, 3, dtype=torch.bfloat16), "completion_mask": torch.ones(4, 3)}
    given_small, given_large = _signature(small), _signature(large)
    assert cache.check(small, given_small) == "float32"
    assert cache.check(small, given_small) == "float32"  # remembered: the last entry given
    assert cache.check(large, given_large) == "bfloat16,float32"  # another tuple: its own entry, not the last one's
    assert cache.check(small, given_small) == "float32"
    assert set(cache) == {given_small, given_large} and cache.last == given_small
    bad = {"policy_logprobs": torch.zeros(2, 3), "completion_mask": torch.full((2, 3), 2.0)}
    with pytest.raises(SchemaError, match="completion_mask"):  # a float mask's values: checked every time
        cache.check(bad, given_small)


def test_group_key_is_the_cached_signature_of_a_step_on_one_cpu_or_cuda_device(monkeypatch):
    """``group_key`` (the staging buffers' key, :func:`tracer.record.capture.stage`) is the step's signature
    when the signature is cached and every tensor is on the CPU; ``None`` for a step across two devices,
    for one wholly on a device that is neither the CPU nor CUDA (``meta``), and for a signature past
    the cache's bound (not cached: nothing keys a buffer group by it). The one-CUDA-device case needs
    a GPU: ``tests/reliability/test_bad_tensors.py``'s CUDA tests."""
    from tracer.record import validation as record_checks

    cache = SignatureCache("grpo")
    cpu = {"policy_logprobs": torch.zeros(2, 3), "completion_mask": torch.ones(2, 3, dtype=torch.bool)}
    for _ in range(2):  # checked, then served from the cache: the same key
        cache.check(cpu)
        assert cache.group_key == _signature(cpu) and cache.group_key is cache.last
    mixed = {"policy_logprobs": torch.zeros(2, 3), "completion_mask": torch.ones(2, 3, dtype=torch.bool, device="meta")}
    meta = {k: v.to("meta") for k, v in cpu.items()}
    for step in (mixed, meta):
        for _ in range(2):
            cache.check(step)
            assert cache.last == _signature(step) and cache.group_key is None
    cache.check(cpu, _signature(cpu))  # a signature the caller passes: the same rule
    assert cache.group_key == _signature(cpu)
    monkeypatch.setattr(record_checks, "MAX_SIGNATURES", len(cache))
    other = {"policy_logprobs": torch.zeros(5, 3), "completion_mask": torch.ones(5, 3, dtype=torch.bool)}
    cache.check(other)
    assert cache.last == _signature(other) and cache.group_key is None
    cache.check(cpu)  # one cached before the bound keeps its key
    assert cache.group_key == _signature(cpu)


# -- the step metadata compared in C --------------------------------------------------------------

@pytest.mark.parametrize("before, after, same", [
    ({"beta": 0.1, "k": 3}, {"beta": 0.1, "k": 3}, True),
    ({"beta": 0.1, "k": 3}, {"beta": 0.1, "k": 3.0}, False),  # 3 == 3.0, another type
    ({"beta": 0.1, "k": 1}, {"beta": 0.1, "k": True}, False),
    ({"beta": 0.0}, {"beta": -0.0}, False),  # 0.0 == -0.0, JSON writes them apart
    ({"beta": -0.0}, {"beta": -0.0}, True),
    ({"beta": float("nan")}, {"beta": float("nan")}, False),  # never equal: encoded again
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}, True),  # the same keys and values (the encoding of the first)
    ({"a": 1}, {"a": 1, "b": 2}, False),
])
def test_metadata_is_encoded_again_exactly_when_it_changes(before, after, same):
    cache = MetadataCache()
    first = cache.encoded(before)
    assert first == encode_metadata(before)
    again = cache.encoded(after)
    assert (again is first) is same
    assert {k: again[k] for k in after} == encode_metadata(after)


def test_a_key_of_a_str_subclass_is_encoded_again():
    class Key(str):
        pass

    cache = MetadataCache()
    first = cache.encoded({"beta": 1})
    assert cache.encoded({Key("beta"): 1}) is not first


# -- staging: the capture's own rows kept, the other fields copied as one group --------------------

def test_the_rows_a_capture_made_are_kept_and_the_others_copied_in_field_order():
    pool = BufferPool()
    base = torch.arange(24.0).reshape(6, 4)
    rows = base[torch.tensor([0, 2])]  # made by the capture: kept
    view = base[:2]  # a view: copied although owned
    grad = torch.zeros(2, 4, requires_grad=True) + 1  # owned but part of a graph: copied
    other = torch.full((2, 4), 7.0)
    tensors = {"advantages": rows, "returns": view, "policy_logprobs": grad, "values": other,
               "rewards": torch.ones(2)}
    owned = {"advantages", "returns", "policy_logprobs", "rewards"}
    key = _signature(tensors)
    staged, event, buffers, nbytes = stage(tensors, pool, owned, reuse=True, group_key=key)
    assert list(staged) == list(tensors) and event is None
    assert staged["advantages"] is rows and staged["rewards"] is tensors["rewards"]
    for name in ("returns", "policy_logprobs", "values"):
        assert staged[name].data_ptr() != tensors[name].data_ptr() and not staged[name].requires_grad
        assert torch.equal(staged[name], tensors[name].detach()) and staged[name].is_contiguous()
    assert nbytes == sum(t.nbytes for t in tensors.values())
    per_tensor, _, _, per_tensor_bytes = stage(tensors, BufferPool(), owned, reuse=True)
    assert nbytes == per_tensor_bytes and all(torch.equal(per_tensor[n], staged[n]) for n in tensors)
    pool.give(buffers)
    again, _, buffers2, _ = stage(tensors, pool, owned, reuse=True, group_key=key)
    assert [again[n].data_ptr() for n in ("returns", "values")] == [staged[n].data_ptr() for n in ("returns", "values")]
    pool.give(buffers2)
    fewer = {**tensors, "advantages": rows.t().contiguous().t()}  # no longer contiguous: copied, another group
    third, _, _, _ = stage(fewer, pool, owned, reuse=True, group_key=key)
    assert third["advantages"] is not fewer["advantages"] and torch.equal(third["advantages"], rows)
    assert third["values"].data_ptr() != staged["values"].data_ptr()  # not the group of a kept advantages


# -- a loop whose step metadata changes: the headers, step by step ---------------------------------

def _metadata_loop(kl_values: list) -> None:
    """PPO-shaped: ``stop_ppo`` appears at step 2 (then wins over ``early_stop``), ``args`` is replaced
    at step 3 by a Namespace with another ``kl_coef``; the rows taken by ``inds``."""
    weight = torch.nn.Parameter(torch.zeros(4, 3))
    advantages = torch.arange(12.0).reshape(4, 3)
    args = argparse.Namespace(kl_coef=kl_values[0], gamma=1.0)
    early_stop = False
    for step in range(len(kl_values)):
        if step == 3:
            args = argparse.Namespace(kl_coef=kl_values[3], gamma=0.5)
        else:
            args.kl_coef = kl_values[step]
        if step >= 2:
            stop_ppo = step == 4  # noqa: F841  (read by name)
        inds = torch.tensor([step % 4, (step + 1) % 4])
        mb_resp_logp = weight[inds].log_softmax(-1)
        loss = -(mb_resp_logp * advantages[inds]).mean()
        loss.backward()
        assert early_stop is False


def test_step_headers_follow_metadata_that_changes_mid_run(tmp_path):
    kl_values = [0.0, -0.0, 0.5, 2, 2.0, float("nan")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Watcher("ppo", tmp_path / "t", nothing_traced="ignore") as watcher:
            watcher.plan_differences = []
            _metadata_loop(kl_values)
    assert watcher.plan_differences == [] and watcher.plans.hits >= 4
    trace = Trace(tmp_path / "t")
    headers = [trace.metadata(k) for k in trace.steps()]
    assert [h["early_stop"] for h in headers] == [False, False, False, False, True, False]
    assert [h["gamma"] for h in headers] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]
    raw = []  # the header text the writer encoded (the reader decodes kl_coef as a float)
    for key in trace.steps():
        with safe_open(str(key.path), "pt") as fh:
            raw.append(fh.metadata()["kl_coef"])
    assert raw == ["0.0", "-0.0", "0.5", "2", "2.0", "NaN"]
    for key, h in zip(trace.steps(), headers):
        rows = trace.load_step(key)["advantages"]
        assert rows.tolist() == [[3.0 * r, 3.0 * r + 1, 3.0 * r + 2] for r in (key.step % 4, (key.step + 1) % 4)]


# -- a plan's signature, and a field derived later -------------------------------------------------

def _groups_appear_loop() -> None:
    """GRPO-shaped: ``num_generations`` is bound from step 2 on, so from then on ``group_ids`` is
    derived (rows 0-1 one prompt, 2-3 the next), a field the plan's signature does not hold."""
    weight = torch.nn.Parameter(torch.zeros(4, 3))
    for step in range(4):
        if step >= 2:
            num_generations = 2  # noqa: F841  (read by name)
        per_token_logps = weight.log_softmax(-1)
        per_token_logps.sum().backward()


def test_a_field_derived_after_the_plan_was_made_is_in_the_signature_record_checks(tmp_path):
    with Watcher("grpo", tmp_path / "t", nothing_traced="ignore") as watcher:
        watcher.plan_differences = []
        _groups_appear_loop()
    assert watcher.plan_differences == [] and watcher.plans.hits == 3
    trace = Trace(tmp_path / "t")
    groups = [trace.load_step(k, derive=False).get("group_ids") for k in trace.steps()]
    assert groups[:2] == [None, None] and [g.tolist() for g in groups[2:]] == [[0, 0, 1, 1]] * 2
    signatures = list(watcher.writer._checks.signatures)
    assert len(signatures) == 2 and [len(s) for s in signatures] == [1, 2]


def test_pinned_and_plain_buffer_groups_of_one_key_are_kept_apart():
    """A pinned group handed back is never taken for plain buffers of the same field signature, and
    each kind counts under its own idle limit. Pinned memory needs CUDA, so the pinned group here
    holds plain memory, made as take_group makes a pinned one: the pool's bookkeeping is what is tested."""
    from tracer.record.capture import BufferGroup, BufferPool

    pool = BufferPool()
    sources = [torch.zeros(3, 4), torch.zeros(3, dtype=torch.int64)]  # 48 + 24 bytes
    pinned = BufferGroup((("sig",), True), [torch.empty_like(t) for t in sources])
    pool.give([(pinned, True)])
    assert pool._idle_bytes == {False: 0, True: 72}
    plain = pool.take_group(("sig",), sources)
    assert plain is not pinned and pool._idle_bytes == {False: 0, True: 72}  # a new plain group
    pool.give([(plain, False)])
    assert pool._idle_bytes == {False: 72, True: 72}
    assert pool.take_group(("sig",), sources, pinned=True) is pinned  # no allocation: the idle pinned group
    assert pool.take_group(("sig",), sources) is plain and pool._idle_bytes == {False: 0, True: 0}
