"""Hostile traces (each under 1 MB) read by every tool, with a time and memory limit per case.

    python tests/scripts/hostile_campaign.py [--app] [--json]

Each generator writes one small trace whose files are valid JSON / safetensors but hostile:
zero-byte tensors with huge shapes, token strings that cost much more memory than their size,
lone surrogates and null characters in text, B = 0 steps. Each tool (``info``, ``check``, ``diff``,
the reader's tables, the views and, with ``--app``, every app page) reads it. A tool must either
serve the trace or refuse it with a TraceError; any other exception is a crash. Time and peak
memory (resident set, measured with ``/proc/self/clear_refs``) are recorded per (case, tool).
The address space is capped at 2 GiB above what the imports use, so a regression fails with a
MemoryError here instead of taking the machine down.

tests/reliability/test_hostile_campaign.py runs it and holds every case to 5 s and 500 MB.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tracer import cli, views  # noqa: E402
from tracer.errors import TraceError  # noqa: E402
from tracer.format.names import MANIFEST_NAME, STEPS_DIR, TOKENS_NAME, step_file_name  # noqa: E402
from tracer.read.reader import Trace  # noqa: E402

TIME_LIMIT_S = 5.0
MEMORY_LIMIT_MB = 500.0
HEADROOM_BYTES = 2 * 2**30  # address space allowed above the imports (a hard stop, not the limit)
GRPO_META = {"algorithm": "grpo", "num_generations": "2", "step": "0", "inner_step": "0",
             "micro_batch": "0", "rank": "0", "schema_version": '"1"'}


# -- generators: each writes one trace directory ----------------------------------------------------


def _manifest(out: Path, extra: dict | None = None, raw: str | None = None) -> None:
    (out / STEPS_DIR).mkdir(parents=True, exist_ok=True)
    text = raw if raw is not None else json.dumps({"format": "tracer-trace", "schema_version": "1",
                                                   "algorithm": "grpo", "status": "finished",
                                                   "tokenizer": {"eos_token_id": 1, "pad_token_id": 0},
                                                   **(extra or {})})
    (out / MANIFEST_NAME).write_text(text, encoding="utf-8")


def _step(out: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None, step: int = 0) -> None:
    save_file(tensors, str(out / STEPS_DIR / step_file_name(step)), metadata={**GRPO_META, **(meta or {})})


def _healthy(b: int = 4, t: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(b, t, generator=g)
    return {"prompt_ids": torch.randint(2, 12, (b, 3), generator=g), "prompt_mask": torch.ones(b, 3, dtype=torch.bool),
            "completion_ids": torch.randint(2, 12, (b, t), generator=g),
            "completion_mask": torch.ones(b, t, dtype=torch.bool), "policy_logprobs": lp, "old_logprobs": lp.clone(),
            "ratio": torch.ones(b, t), "rewards": torch.arange(b, dtype=torch.float32),
            "advantages": torch.zeros(b), "group_ids": torch.arange(b) // 2}


def _empty_fields(b: int, t: int, with_prompt: bool = True) -> dict[str, torch.Tensor]:
    out = {"completion_ids": torch.empty(b, t, dtype=torch.int64), "completion_mask": torch.empty(b, t, dtype=torch.bool),
           "policy_logprobs": torch.empty(b, t), "old_logprobs": torch.empty(b, t), "ratio": torch.empty(b, t)}
    if with_prompt:
        out.update(prompt_ids=torch.empty(b, 3 if t else 0, dtype=torch.int64),
                   prompt_mask=torch.empty(b, 3 if t else 0, dtype=torch.bool))
    return out


def huge_b_zero_t(out: Path) -> None:
    """[1e8, 0] completion fields: no bytes, 1e8 rows."""
    _manifest(out)
    _step(out, _empty_fields(10**8, 0, with_prompt=False))


def zero_b_huge_t(out: Path) -> None:
    """[0, 1e9] completion fields: no bytes, T = 1e9."""
    _manifest(out)
    _step(out, _empty_fields(0, 10**9, with_prompt=False))


def zero_b_huge_prompt(out: Path) -> None:
    """[0, 1e9] prompt fields next to B = 0 completion fields."""
    _manifest(out)
    _step(out, {**_empty_fields(0, 5, with_prompt=False), "prompt_ids": torch.empty(0, 10**9, dtype=torch.int64),
                "prompt_mask": torch.empty(0, 10**9, dtype=torch.bool), "rewards": torch.empty(0),
                "advantages": torch.empty(0)})


def huge_rewards_rows(out: Path) -> None:
    """[B] fields of 1e8 zero-width components: reward_components [1e8, 0] (groups view)."""
    _manifest(out)
    _step(out, {"rewards": torch.empty(0), "reward_components": torch.empty(0, 10**9)})


def huge_extra_field(out: Path) -> None:
    """A non-canonical field of shape [2**40, 0] next to a healthy step."""
    _manifest(out)
    _step(out, {**_healthy(), "my_debug": torch.empty(2**40, 0)})


def b_zero(out: Path) -> None:
    """A healthy-looking GRPO step with B = 0 (every [B, ...] field empty)."""
    _manifest(out)
    _step(out, {**_empty_fields(0, 5), "rewards": torch.empty(0), "advantages": torch.empty(0),
                "group_ids": torch.empty(0, dtype=torch.int64)})
    _step(out, _healthy(), step=1)


def tokens_dense(out: Path) -> None:
    """tokens.json of ~1 MB: 240k one-character strings."""
    _manifest(out)
    _step(out, _healthy())
    (out / TOKENS_NAME).write_text('{"tokens": [' + ",".join(['"a"'] * 240_000) + "]}")


def tokens_nested(out: Path) -> None:
    """tokens.json of ~1 MB of empty lists and objects (each 2 to 3 bytes, ~60 bytes in Python)."""
    _manifest(out)
    _step(out, _healthy())
    (out / TOKENS_NAME).write_text('{"tokens": [' + ",".join(["[]", "{}"] * 170_000) + "]}")


def tokens_too_many(out: Path) -> None:
    """tokens.json with 2.2 million empty strings (6.6 MB, over the entry limit)."""
    _manifest(out)
    _step(out, _healthy())
    (out / TOKENS_NAME).write_text('{"tokens": [' + ",".join(['""'] * 2_200_000) + "]}")


def surrogate_metadata(out: Path) -> None:
    """Step metadata holding a JSON-escaped lone surrogate, in a value and in a list."""
    _manifest(out)
    _step(out, _healthy(), meta={"note": '"\\ud800"', "reward_component_names": '["\\udfff", "b"]'})


def surrogate_manifest(out: Path) -> None:
    """A manifest whose config key and value hold lone surrogates."""
    _manifest(out, raw='{"format": "tracer-trace", "algorithm": "grpo", "status": "finished", '
                       '"config": {"\\ud800key": "\\udc00"}, "created": "\\ud83d"}')
    _step(out, _healthy())


def surrogate_tokens(out: Path) -> None:
    """tokens.json whose strings are lone surrogates (and one valid pair)."""
    _manifest(out)
    _step(out, _healthy())
    (out / TOKENS_NAME).write_text('{"tokens": [' + ",".join(['"\\ud800"', '"\\udfffx"', '"\\ud83d\\ude00"'] * 4) + "]}")


def null_text(out: Path) -> None:
    """Null characters in token strings, metadata and the manifest."""
    _manifest(out, {"config": {"a\u0000b": "c\u0000"}})
    _step(out, _healthy(), meta={"note": '"x\\u0000y"'})
    (out / TOKENS_NAME).write_text(json.dumps({"tokens": [f"t\u0000{i}" for i in range(12)]}))


def component_collision(out: Path) -> None:
    """reward_component_names that collide with the groups view's own columns."""
    _manifest(out)
    tensors = _healthy()
    tensors["reward_components"] = torch.full((4, 2), 0.25)
    _step(out, tensors, meta={"reward_component_names": '["reward", "advantage"]'})


CASES: dict[str, Callable[[Path], None]] = {f.__name__: f for f in (
    huge_b_zero_t, zero_b_huge_t, zero_b_huge_prompt, huge_rewards_rows, huge_extra_field, b_zero, tokens_dense,
    tokens_nested, tokens_too_many, surrogate_metadata, surrogate_manifest, surrogate_tokens, null_text,
    component_collision)}


# -- tools ------------------------------------------------------------------------------------------


def _cli(*argv: str) -> None:
    """Run the CLI with a strict UTF-8 stdout (what a terminal or a pipe is): unprintable text fails."""
    buf = io.BytesIO()
    out = io.TextIOWrapper(buf, encoding="utf-8", errors="strict")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(list(argv))
    out.flush()
    if code not in (0, 1, 2):
        raise AssertionError(f"exit code {code}")


def _tables(path: Path) -> None:
    trace = Trace(path)
    for key in trace.steps():
        for fn in (lambda: trace.token_table(key), lambda: trace.token_table(key, 0)):
            try:
                fn().to_string()
            except (TraceError, IndexError):
                pass
    trace.step_summary().to_string()


def _views(path: Path) -> None:
    trace = Trace(path)
    for key in trace.steps():
        for fn in (lambda: views.group_frame(trace, key), lambda: views.group_completions(trace, key, 0)):
            try:
                fn().to_string()
            except (TraceError, KeyError):
                pass
    try:
        views.zero_variance_shares(trace).to_string()
    except TraceError:
        pass


def _app(path: Path) -> None:
    import os

    from streamlit.testing.v1 import AppTest

    os.environ["TRACER_ROOT"] = str(path)
    at = AppTest.from_file(str(REPO / "app" / "streamlit_app.py"), default_timeout=60).run()
    pages = ["tokens", "groups", "steps", "health", "diff", "overview"]
    for page in pages:
        at.switch_page(f"app_pages/{page}.py").run()
        if at.exception:
            raise AssertionError(f"page {page}: {at.exception[0].value}")


TOOLS: dict[str, Callable[[Path], None]] = {
    "info": lambda p: _cli("info", str(p)), "info --json": lambda p: _cli("info", "--json", str(p)),
    "check": lambda p: _cli("check", str(p)), "diff": lambda p: _cli("diff", str(p), str(p)),
    "tables": _tables, "views": _views,
}


# -- measurement ------------------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def measure(fn: Callable[[], None]) -> dict:
    """Run ``fn``; its outcome (ok / crash: ...), seconds and peak resident memory above the start."""
    start_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM, the peak resident set
    t0 = time.perf_counter()
    try:
        fn()
        outcome = "ok"
    except TraceError:
        outcome = "ok"  # refused with a clear error
    except BaseException as err:  # noqa: BLE001  (the campaign reports every other exception)
        outcome = f"crash: {type(err).__name__}: {str(err)[:200]}"
        if "--trace" in sys.argv:
            traceback.print_exc()
    seconds = time.perf_counter() - t0
    peak_mb = max(0, _status_kb("VmHWM") - start_kb) / 1024
    return {"outcome": outcome, "seconds": round(seconds, 3), "peak_mb": round(peak_mb, 1)}


def _jobs(app: bool, only: list[str] | None) -> list[tuple[str, str]]:
    tools = [*TOOLS, *(["app"] if app else [])]
    return [(case, tool) for case in CASES if not only or case in only for tool in tools]


def worker(jobs: list[tuple[str, str]]) -> None:
    """Run ``jobs`` in this process, one JSON line per result on stdout (the parent reads them)."""
    vm = _status_kb("VmSize") * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM_BYTES, resource.RLIM_INFINITY))
    tools = {**TOOLS, "app": _app}
    made: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, tool in jobs:
            if case not in made:
                made[case] = Path(tmp) / case
                CASES[case](made[case])
            path = made[case]
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            result = {"case": case, "tool": tool, "bytes": size, **measure(lambda: tools[tool](path))}
            sys.__stdout__.write("RESULT " + json.dumps(result) + "\n")
            sys.__stdout__.flush()


def run(app: bool = False, only: list[str] | None = None, worker_timeout_s: float = 600) -> list[dict]:
    """Every (case, tool) result: case, tool, bytes, outcome, seconds, peak_mb. The jobs run in a
    worker process; when it dies (a native abort, the kernel's OOM killer) or hangs, the job it was
    on is a crash and a new worker takes the rest."""
    pending, results = _jobs(app, only), []
    while pending:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(pending)], capture_output=True,
                              text=True, timeout=worker_timeout_s, check=False)
        done = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        results += done
        pending = pending[len(done):]
        if pending:
            tail = (proc.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1][:160]
            case, tool = pending.pop(0)
            results.append({"case": case, "tool": tool, "bytes": 0, "seconds": float("nan"), "peak_mb": float("nan"),
                            "outcome": f"crash: the process died (exit {proc.returncode}): {tail}"})
    return results


def summary(results: list[dict]) -> dict:
    over = [r for r in results if not r["seconds"] <= TIME_LIMIT_S or not r["peak_mb"] <= MEMORY_LIMIT_MB]
    return {"cases": len({r["case"] for r in results}), "runs": len(results),
            "crashes": sum(r["outcome"] != "ok" for r in results), "over_limits": len(over),
            "max_seconds": max((r["seconds"] for r in results if r["seconds"] == r["seconds"]), default=0),
            "max_peak_mb": max((r["peak_mb"] for r in results if r["peak_mb"] == r["peak_mb"]), default=0)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker([tuple(job) for job in json.loads(argv[1])])
        return 0
    only = [a for a in argv if not a.startswith("--")] or None
    results = run(app="--app" in argv, only=only)
    if "--json" in argv:
        print(json.dumps({"results": results, "summary": summary(results)}))
        return 0
    for r in results:
        flag = "" if r["outcome"] == "ok" and r["seconds"] <= TIME_LIMIT_S and r["peak_mb"] <= MEMORY_LIMIT_MB else "  <--"
        print(f"{r['case']:22s} {r['tool']:12s} {r['bytes']:9d} B {r['seconds']:7.2f} s {r['peak_mb']:8.1f} MB "
              f"{r['outcome'][:90]}{flag}")
    print(json.dumps(summary(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
