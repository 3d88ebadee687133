"""Mutate the header of a valid step file and read the result with everything that reads traces.

    python tests/scripts/fuzz_headers.py [N] [SEED]     (default 5000 files, seed 0)

Prints how many mutated files were read fine and how many were refused, by the reason of the
TraceFormatError; exits 1 if anything else was raised (any other exception is a bug). The test
tests/reliability/test_fuzz.py drives the same :func:`exercise` with hypothesis.
"""

from __future__ import annotations

import collections
import random
import re
import struct
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tracer import Trace, TraceFormatError, TraceWriter  # noqa: E402
from tracer.checks import run_checks  # noqa: E402
from tracer.cli import trace_info  # noqa: E402
from tracer.read.trace_info import trace_info
from tracer.format.names import STEPS_DIR, step_file_name  # noqa: E402

STEP_NAME = step_file_name(3)
DTYPES = [b"F32", b"F16", b"BF16", b"F64", b"I64", b"I32", b"I16", b"I8", b"U8", b"BOOL", b"U16", b"U32",
          b"U64", b"F8_E4M3", b"F8_E5M2", b"C64", b"XX"]
REASONS = [  # (kind, pattern of the TraceFormatError message), first match wins
    ("header length does not fit the file", r"header claims \d+ bytes"),
    ("header over the size cap", r"exceeds the \d+ bytes"),
    ("file too short", r"too short"),
    ("header not UTF-8", r"invalid UTF-8|utf-8"),
    ("header not JSON / not a tensor table", r"invalid JSON|expected value|EOF|key must be a string|trailing"),
    ("data offsets or sizes wrong", r"offset|not fully covered|overflow|invalid shape"),
    ("wrong dtype for a field", r"is stored as"),
    ("wrong shape for a field", r"expected shape|dimension \w+ is"),
    ("mask value not 0/1", r"is a mask but holds"),
    ("tensor data unreadable", r"could not read tensor data"),
]


@lru_cache(maxsize=1)
def valid_payload() -> bytes:
    """A step file written by TraceWriter: GRPO, B = 4, T = 5, L = 3, with metadata."""
    g = torch.Generator().manual_seed(0)
    policy = -torch.rand(4, 5, generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        with TraceWriter(Path(tmp) / "run", "grpo", hyperparameters={"num_generations": 2, "beta": 0.04,
                                                                     "clip_epsilon_low": 0.2,
                                                                     "clip_epsilon_high": 0.2}) as writer:
            writer.record(3, {
                "prompt_ids": torch.tensor([[0, 3, 4], [3, 4, 4], [0, 0, 3], [3, 3, 4]]),
                "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]]),
                "completion_ids": torch.tensor([[5, 6, 1, 0, 0], [7, 7, 7, 7, 7], [5, 1, 0, 0, 0], [6, 6, 6, 1, 0]]),
                "completion_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]),
                "policy_logprobs": policy, "old_logprobs": policy - 0.01, "ratio": torch.exp(torch.full((4, 5), 0.01)),
                "rewards": torch.tensor([1.0, 0.0, 0.5, 0.5]), "advantages": torch.tensor([1.0, -1.0, 0.0, 0.0]),
                "group_ids": torch.tensor([0, 0, 1, 1]),
            })
        return (Path(tmp) / "run" / STEPS_DIR / STEP_NAME).read_bytes()


def header_end(payload: bytes) -> int:
    return 8 + struct.unpack("<Q", payload[:8])[0]


def replace_bytes(payload: bytes, edits: list[tuple[int, int]]) -> bytes:
    """``edits``: (position within the 8-byte length + header, new byte value)."""
    out = bytearray(payload)
    end = header_end(payload)
    for pos, value in edits:
        out[pos % end] = value
    return bytes(out)


def replace_digits(payload: bytes, edits: list[tuple[int, int]]) -> bytes:
    """Change the k-th digit of the JSON header (shapes, offsets, numbers) to another digit."""
    out = bytearray(payload)
    digits = [i for i in range(8, header_end(payload)) if 48 <= out[i] <= 57]
    for k, value in edits:
        out[digits[k % len(digits)]] = 48 + value % 10
    return bytes(out)


def replace_dtype(payload: bytes, k: int, new: int) -> bytes:
    """Give the k-th tensor of the header another dtype name (the header length is fixed up)."""
    end = header_end(payload)
    header = payload[8:end]
    spots = [m for m in re.finditer(rb'"dtype":"([A-Z0-9_]+)"', header)]
    m = spots[k % len(spots)]
    header = header[:m.start(1)] + DTYPES[new % len(DTYPES)] + header[m.end(1):]
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + payload[end:]


def classify(err: TraceFormatError) -> str:
    text = str(err)
    return next((kind for kind, pattern in REASONS if re.search(pattern, text)), f"other: {text[-80:]}")


def exercise(trace_dir: Path) -> str:
    """Read the trace with every reader entry point, the checks and ``info``; returns "read" or
    the kind of the first TraceFormatError. Any other exception propagates (a bug)."""
    refused: list[str] = []

    def attempt(fn, *args, allow_index_error=False):
        try:
            return fn(*args)
        except TraceFormatError as err:
            refused.append(classify(err))
        except IndexError:  # B = 0 after a mutation: no row 0 (documented for load_sequence)
            if not allow_index_error:
                raise
        return None

    trace = attempt(Trace, trace_dir)
    if trace is None:
        return refused[0]
    for key in trace.steps():
        for fn in (trace.metadata, trace.fields, trace.load_step, trace.token_table):
            attempt(fn, key)
        attempt(trace.load_sequence, key, 0, allow_index_error=True)
        attempt(trace.token_table, key, 0, allow_index_error=True)
    trace.scan()
    trace.step_summary()
    attempt(run_checks, trace)
    trace_info(trace_dir)
    return refused[0] if refused else "read"


def write_step(trace_dir: Path, payload: bytes) -> None:
    (trace_dir / STEPS_DIR).mkdir(parents=True, exist_ok=True)
    (trace_dir / STEPS_DIR / STEP_NAME).write_bytes(payload)


def main(n: int = 5000, seed: int = 0) -> int:
    rng = random.Random(seed)
    payload = valid_payload()
    end = header_end(payload)
    counts: collections.Counter[str] = collections.Counter()
    by_mutation: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(tmp) / "run"
        for i in range(n):
            kind = ("bytes", "digits", "dtype")[i % 3]
            edits = [(rng.randrange(end), rng.randrange(256)) for _ in range(rng.randint(1, 8))]
            mutated = (replace_bytes(payload, edits) if kind == "bytes" else replace_digits(payload, edits)
                       if kind == "digits" else replace_dtype(payload, rng.randrange(64), rng.randrange(64)))
            write_step(trace_dir, mutated)
            outcome = exercise(trace_dir)
            counts[outcome] += 1
            by_mutation[kind][outcome] += 1
    print(f"{n} mutated step files (seed {seed}): byte replacements, digit changes, dtype swaps in the header")
    for outcome, count in counts.most_common():
        print(f"  {count:6d}  {outcome}")
    for kind, sub in by_mutation.items():
        print(f"  {kind}: " + ", ".join(f"{o} {c}" for o, c in sub.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:3])))
