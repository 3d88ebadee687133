"""Property-based: mutate the header of a valid step file; everything that reads traces either
reads it or raises TraceFormatError (never another exception), and never hangs (a watchdog ends
the run with a traceback if one example takes minutes). The mutations and the readers exercised
are in tests/scripts/fuzz_headers.py, which also runs a larger seeded campaign for RELIABILITY.md.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.paths import SCRIPTS

_spec = importlib.util.spec_from_file_location("fuzz_headers", SCRIPTS / "fuzz_headers.py")
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

PAYLOAD = fuzz.valid_payload()
END = fuzz.header_end(PAYLOAD)
WATCHDOG_S = 240
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)  # a hang kills the run loudly
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def trace_dir():
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp) / "run"


def outcome(trace_dir: Path, payload: bytes) -> str:
    fuzz.write_step(trace_dir, payload)
    return fuzz.exercise(trace_dir)  # raises anything that is not a TraceFormatError


def test_the_unmutated_file_reads(trace_dir):
    assert outcome(trace_dir, PAYLOAD) == "read"


@SETTINGS
@given(edits=st.lists(st.tuples(st.integers(0, END - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_replaced_header_bytes(trace_dir, edits):
    outcome(trace_dir, fuzz.replace_bytes(PAYLOAD, edits))


@SETTINGS
@given(edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 9)), min_size=1, max_size=4))
def test_changed_digits_in_shapes_and_offsets(trace_dir, edits):
    outcome(trace_dir, fuzz.replace_digits(PAYLOAD, edits))


@SETTINGS
@given(k=st.integers(0, 63), new=st.integers(0, len(fuzz.DTYPES) - 1))
def test_swapped_dtype_names(trace_dir, k, new):
    outcome(trace_dir, fuzz.replace_dtype(PAYLOAD, k, new))


@SETTINGS
@given(length=st.integers(0, 2**64 - 1), cut=st.integers(0, len(PAYLOAD)))
def test_any_length_prefix_and_truncation(trace_dir, length, cut):
    payload = length.to_bytes(8, "little") + PAYLOAD[8:]
    outcome(trace_dir, payload[:cut] if cut < len(PAYLOAD) else payload)


# -- hostile shapes: zero-byte tensors with huge dims -------------------------------------

_SHAPED_FIELDS = ("completion_ids", "completion_mask", "policy_logprobs", "prompt_ids", "rewards",
                  "advantages", "reward_components", "my_extra")
_HUGE = st.sampled_from([0, 1, 3, 10**3, 10**6, 10**8, 10**9, 2**40])


def _peak_rss_kb() -> int:
    return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0])


@settings(max_examples=150, deadline=5000, derandomize=True, database=None,  # 5 s per example
          suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.dictionaries(st.sampled_from(_SHAPED_FIELDS),
                              st.lists(_HUGE, min_size=1, max_size=3).filter(lambda s: 0 in s), min_size=1))
def test_zero_byte_tensors_of_any_shape_cost_little(trace_dir, shapes):
    """Every reader, the checks and info on a step file of zero-byte tensors with huge dims: within
    5 s (hypothesis' deadline) and 500 MB of resident memory above the start."""
    import json
    import struct

    dtype = {"completion_ids": "I64", "prompt_ids": "I64", "completion_mask": "BOOL"}
    header = {n: {"dtype": dtype.get(n, "F32"), "shape": s, "data_offsets": [0, 0]} for n, s in shapes.items()}
    header["__metadata__"] = {"algorithm": "grpo", "num_generations": "2", "step": "3"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    fuzz.write_step(trace_dir, struct.pack("<Q", len(text)) + text)  # a safetensors file of zero-byte tensors
    start_kb = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak
    fuzz.exercise(trace_dir)
    assert _peak_rss_kb() - start_kb < 500 * 1024
