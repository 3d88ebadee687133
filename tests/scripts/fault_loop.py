"""A traced synthetic loop whose disk "fills" part way: after step K the process may no longer
write files larger than a few KB (``RLIMIT_FSIZE``, so writes fail with EFBIG, as on a full
disk), or no bytes at all. Run in its own process (the limit is process-wide):

    python tests/scripts/fault_loop.py OUT_DIR      (driven by tests/reliability/test_faults.py)

Prints one JSON object: for each scenario, what the training loop saw (steps it ran, warnings,
the exception strict mode raised and its cause).
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from crash_loop import step_tensors  # noqa: E402  (values derived from the step number)
from tracer import TraceError, TraceWriter  # noqa: E402

STEPS, FULL_AT = 12, 5
SMALL_FILE_LIMIT = 16 * 1024  # a manifest fits, a step file (~40 KB) does not


def limit_file_size(limit: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))


def lift_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


def non_strict(out: Path, limit: int, async_write: bool = True) -> dict:
    """The disk fills at step FULL_AT; the loop runs all STEPS and closes the writer."""
    ran = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = TraceWriter(out, "grpo", hyperparameters={"num_generations": 2}, async_write=async_write)
        for step in range(STEPS):
            if step == FULL_AT:
                writer.flush()
                limit_file_size(limit)
            writer.record(step, step_tensors(step))
            ran += 1
        writer.close()
    lift_limit()
    return {"ran": ran, "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}


def strict(out: Path, async_write: bool) -> dict:
    """Strict mode: the first failed write raises TraceError (from the next call when async)."""
    writer = TraceWriter(out, "grpo", hyperparameters={"num_generations": 2}, strict=True, async_write=async_write)
    result: dict = {"ran": 0}
    try:
        for step in range(STEPS):
            if step == FULL_AT:
                writer.flush()
                limit_file_size(SMALL_FILE_LIMIT)
            writer.record(step, step_tensors(step))
            result["ran"] += 1
        writer.flush()
    except TraceError as err:
        cause = err.__cause__
        result.update(error=str(err), cause=type(cause).__name__, errno=getattr(cause, "errno", None),
                      cause_text=str(cause))
    finally:
        lift_limit()
    return result


def main(out_dir: str) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed by the signal
    root = Path(out_dir)
    report = {
        "non_strict": non_strict(root / "non_strict", SMALL_FILE_LIMIT),
        "non_strict_sync": non_strict(root / "non_strict_sync", SMALL_FILE_LIMIT, async_write=False),
        "nothing_fits": non_strict(root / "nothing_fits", 0),
        "strict_async": strict(root / "strict_async", async_write=True),
        "strict_sync": strict(root / "strict_sync", async_write=False),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
