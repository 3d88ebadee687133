"""Hostile traces (each under 1 MB) read by every tool, with a time and memory limit per case.

    python tests/scripts/hostile_campaign.py [--app] [--json]
    python tests/scripts/hostile_campaign.py --bounds [CASE...]   # the issue-48 classes, a process per tool

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


# -- issue 48: wrong JSON types, one huge token, huge metadata, a disk that fills -----------------------
#
# Each tool runs on each of these inputs in its own process (forked from a worker that has done the
# imports), so a traceback on stderr, the exit code, the wall and CPU time and the peak resident
# memory (os.wait4's ru_maxrss) are the command's own. tests/reliability/test_hostile_bounds_campaign.py
# holds every (input, tool) pair to BOUNDS_TIME_LIMIT_S, BOUNDS_CPU_LIMIT_S and BOUNDS_MEMORY_LIMIT_MB.
# The CPU limit is what catches a slow path on a loaded machine: before issue 48, check on the
# 100,000-key trace took 8.5 s of CPU, info 3.2 s, the reader 2.1 s.

BOUNDS_TIME_LIMIT_S = 10.0
BOUNDS_CPU_LIMIT_S = 2.0  # the "within 2 s"; the largest after the fixes is 0.6 s
BOUNDS_MEMORY_LIMIT_MB = 500.0  # peak resident set of the process, imports (~300 MB) included
BOUNDS_TOOLS = ("info", "info --json", "check", "diff", "reader")
_HARD_STOP_RSS_MB = 2048.0  # a child past this is killed at once (the pair then fails the memory budget)


def _wrong_values() -> dict:
    """One value of each wrong JSON type per key (shared with test_manifest_field_types.py)."""
    from tests.reliability.test_manifest_field_types import WRONG_VALUES
    return WRONG_VALUES


def _manifest_wrong(kind: str) -> Callable[[Path], None]:
    def make(out: Path) -> None:
        from tracer.format.counts import reserve_counts, write_counts
        from tracer.format.integrity import _MANIFEST_TYPES

        value = _wrong_values()[kind]
        _manifest(out, {key: value for key in _MANIFEST_TYPES})
        _bounds_step(out)
        # manifest.counts (read when newer than the manifest's revision, which is wrong here): valid
        # counts, a wrong value where the slot's check does not look (manifest_error)
        reserve_counts(out)
        write_counts(out, {"revision": 1, "status": "finished", "steps_written": 1, "dropped_steps": 2,
                           "skipped_steps": 0, "drop_reasons": ["step 1: disk full"], "manifest_error": value})
    make.__name__ = f"manifest_every_key_{kind}"
    make.__doc__ = f"Every manifest key tracer reads set to the {kind} wrong value; manifest.counts' manifest_error too."
    return make


def manifest_wrong_inside_objects(out: Path) -> None:
    """Wrong values inside the manifest's objects (hyperparameters, config, tokenizer...), the kinds in turn."""
    pick = iter(list(_wrong_values().values()) * 8)

    def inner(names: tuple[str, ...]) -> dict:
        return {name: next(pick) for name in names}

    hyper = ("beta", "num_generations", "clip_epsilon_high", "clip_epsilon_low", "learning_rate", "loss_type",
             "scale_rewards", "epsilon")
    _manifest(out, {"hyperparameters": inner(hyper), "sampling": inner(("every_n_steps", "first_k_sequences")),
                    "producers": inner(("torch",)), "capture": inner(("writer",)),
                    "config": inner(("trainer_args", "diff_change", "trainer", *hyper)),
                    "tokenizer": inner(("class", "name_or_path", "eos_token_id", "pad_token_id")),
                    "capture_report": inner(("backward_calls", "steps_recorded", "drops", "sources"))})
    _bounds_step(out)


def _zero_step(b: int = 8, t: int = 64) -> dict[str, torch.Tensor]:
    return {"prompt_ids": torch.zeros(b, 3, dtype=torch.int64), "prompt_mask": torch.ones(b, 3, dtype=torch.bool),
            "completion_ids": torch.zeros(b, t, dtype=torch.int64),
            "completion_mask": torch.ones(b, t, dtype=torch.bool), "policy_logprobs": torch.full((b, t), -1.0),
            "old_logprobs": torch.full((b, t), -1.0), "rewards": torch.zeros(b), "advantages": torch.zeros(b),
            "group_ids": torch.arange(b) // 2}


def _bounds_step(out: Path, step: int = 0, meta: dict[str, str] | None = None) -> None:
    """A step like the healthy trace's (B = 8, T = 64, metadata as the writer writes it), so that
    ``diff`` against it compares the fields instead of refusing other batch sizes."""
    _step(out, _zero_step(), meta={"schema_version": "1", "step": str(step), **(meta or {})}, step=step)


def one_huge_token(out: Path) -> None:
    """tokens.json whose token 0 is 1 MiB of text; every one of the 8 x (3 + 64) ids is 0."""
    _manifest(out)
    _bounds_step(out)
    (out / TOKENS_NAME).write_text(json.dumps({"tokens": ["x" * 2**20, "a"]}))


def metadata_100k_keys(out: Path) -> None:
    """3 step files (1.4 MB each) whose header holds 100,000 metadata keys (over the 10,000 limit)."""
    _manifest(out)
    for step in range(3):
        _bounds_step(out, step, {f"k{i:06d}": "1" for i in range(100_000)})


def metadata_9900_keys(out: Path) -> None:
    """3 step files (1.35 MB each) with 9,900 metadata keys of 130 characters (allowed)."""
    _manifest(out)
    for step in range(3):
        _bounds_step(out, step, {f"k{i:05d}": "v" * 130 for i in range(9_900)})


def disk_filled(out: Path) -> Path:
    """A trace whose own step files filled a 1 MiB tmpfs (mounted at ``out``: root only) to 0 bytes
    free while a thread writer recorded 60 steps; returns the trace (``out / "run"``)."""
    import os

    from tests.reliability.test_disk_full_counts import fill_disk

    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"cannot mount a tmpfs at {out}: {done.stderr.strip()}")
    _MOUNTED.append(out)
    fill_disk(out / "run", "thread")
    free = os.statvfs(out).f_bavail
    if free != 0:
        raise AssertionError(f"the step files left {free} blocks free on the 1 MiB tmpfs; expected 0")
    return out / "run"


_MOUNTED: list[Path] = []


def unmount_all() -> None:
    while _MOUNTED:
        subprocess.run(["umount", "-l", str(_MOUNTED.pop())], check=False)


def can_mount() -> bool:
    import os
    import shutil
    return os.geteuid() == 0 and shutil.which("mount") is not None


BOUNDS_CASES: dict[str, Callable[[Path], Path | None]] = {f.__name__: f for f in (
    *(_manifest_wrong(kind) for kind in sorted(_wrong_values())), manifest_wrong_inside_objects, one_huge_token,
    metadata_100k_keys, metadata_9900_keys, disk_filled)}


def make_bounds_inputs(root: Path, only: list[str] | None = None) -> tuple[Path, dict[str, Path]]:
    """Write a healthy trace and each bounds case under ``root``: (healthy, {case: trace}). The disk
    case is left out unless this process may mount a tmpfs; call unmount_all() when done."""
    healthy = root / "healthy"
    _manifest(healthy)
    for step in range(3):
        _bounds_step(healthy, step)
    made = {}
    for case, make in BOUNDS_CASES.items():
        if (only and case not in only) or (case == "disk_filled" and not can_mount()):
            continue
        made[case] = make(root / case) or root / case
    return healthy, made


def _bounds_tool(tool: str, path: Path, healthy: Path) -> int:
    """``tool`` on ``path``, as its command would run it: the exit code (a traceback goes to stderr)."""
    if tool == "reader":
        trace = Trace(path)
        try:
            for key in trace.steps()[:3]:
                trace.token_table(key).to_string()
        except TraceError as err:
            print(f"tracer: {err}", file=sys.stderr)
            return 2
        return 0
    argv = {"info": ["info", str(path)], "info --json": ["info", "--json", str(path)],
            "check": ["check", str(path)], "diff": ["diff", str(healthy), str(path)]}[tool]
    return cli.main(argv)


def _bounds_child(tool: str, path: Path, healthy: Path, out_file: str, err_file: str) -> None:
    """In the forked child: stdout and stderr to files (strict UTF-8, as a pipe), run, exit with the code."""
    import os

    for fd, name in ((1, out_file), (2, err_file)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8", errors="strict")  # noqa: SIM115
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), encoding="utf-8",  # noqa: SIM115
                                  errors="backslashreplace")
    try:
        code = _bounds_tool(tool, path, healthy)
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:  # noqa: BLE001 - what the interpreter would do: print it, exit 1
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


def _rss_mb(pid: int) -> float:
    try:
        return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024
    except (OSError, AttributeError):
        return 0.0


def bounds_worker(spec: dict) -> None:
    """Fork one child per (case, path, tool) job; one JSON line per result on stdout."""
    import os
    import signal

    # what the tools import, done here once (not in each child): a child's figures are its command's own
    import pandas
    import rich.console

    import tracer.checks.report
    import tracer.diff
    import tracer.read.trace_info

    del pandas, rich, tracer

    healthy = Path(spec["healthy"])
    with tempfile.TemporaryDirectory() as tmp:
        out_file, err_file = str(Path(tmp) / "out"), str(Path(tmp) / "err")
        for case, path, tool in spec["jobs"]:
            sys.stdout.flush()
            t0 = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                _bounds_child(tool, Path(path), healthy, out_file, err_file)
            killed = None
            while True:
                done, status, usage = os.wait4(pid, os.WNOHANG)
                if done:
                    break
                seconds = time.perf_counter() - t0
                if killed is None and (seconds > 2 * BOUNDS_TIME_LIMIT_S or _rss_mb(pid) > _HARD_STOP_RSS_MB):
                    killed = f"killed after {seconds:.1f} s at {_rss_mb(pid):.0f} MB"
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.005)
            seconds = time.perf_counter() - t0
            stderr = Path(err_file).read_text(encoding="utf-8", errors="replace")
            result = {"case": case, "tool": tool, "exit": os.waitstatus_to_exitcode(status),
                      "seconds": round(seconds, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
                      "peak_mb": round(usage.ru_maxrss / 1024, 1),
                      "traceback": "Traceback (most recent call last)" in stderr,
                      "stderr": stderr.strip()[-2000:], "killed": killed}
            sys.stdout.write("RESULT " + json.dumps(result) + "\n")
            sys.stdout.flush()


def run_bounds(healthy: Path, made: dict[str, Path], worker_timeout_s: float = 600) -> list[dict]:
    """Every (case, tool) result for the bounds inputs ``made``, and first for the healthy trace
    (case ``healthy``, the baseline): case, tool, exit, seconds, cpu_s, peak_mb, traceback, stderr,
    killed. When the worker itself dies, the job it was on is reported as a crash (exit None) and a
    new worker takes the rest."""
    cases = {"healthy": healthy, **made}
    pending = [[case, str(path), tool] for case, path in cases.items() for tool in BOUNDS_TOOLS]
    results = []
    while pending:
        spec = {"healthy": str(healthy), "jobs": pending}
        proc = subprocess.run([sys.executable, __file__, "--bounds-worker", json.dumps(spec)], capture_output=True,
                              text=True, timeout=worker_timeout_s, check=False)
        done = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        results += done
        pending = pending[len(done):]
        if pending:
            case, _, tool = pending.pop(0)
            tail = (proc.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1][:160]
            results.append({"case": case, "tool": tool, "exit": None, "seconds": float("nan"), "cpu_s": float("nan"),
                            "peak_mb": float("nan"), "traceback": True,
                            "stderr": f"the worker died (exit {proc.returncode}): {tail}", "killed": None})
    return results


def within_bounds(r: dict) -> bool:
    """Whether a result is within the time, CPU and memory budgets (False for NaN: the worker died)."""
    return (r["seconds"] <= BOUNDS_TIME_LIMIT_S and r["cpu_s"] <= BOUNDS_CPU_LIMIT_S
            and r["peak_mb"] <= BOUNDS_MEMORY_LIMIT_MB)


def bounds_main(only: list[str] | None) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            healthy, made = make_bounds_inputs(Path(tmp), only)
            sizes = {case: max(p.stat().st_size for p in path.rglob("*") if p.is_file())
                     for case, path in {"healthy": healthy, **made}.items()}
            t0 = time.perf_counter()
            results = run_bounds(healthy, made)
            total = time.perf_counter() - t0
        finally:
            unmount_all()
    base = {r["tool"]: r["peak_mb"] for r in results if r["case"] == "healthy"}
    for r in results:
        r["above_healthy_mb"] = round(r["peak_mb"] - base[r["tool"]], 1)
    print("| input | largest file | tool | exit | wall s | CPU s | peak RSS MB | above healthy MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        flag = "" if (r["exit"] in (0, 1, 2) and not r["traceback"] and within_bounds(r)) else " <--"
        print(f"| {r['case']} | {sizes[r['case']] / 2**20:.2f} MB | {r['tool']} | {r['exit']} | {r['seconds']:.2f} | "
              f"{r['cpu_s']:.2f} | {r['peak_mb']:.0f} | {r['above_healthy_mb']:+.0f} |{flag}")
    ok = [r for r in results if r["seconds"] == r["seconds"]]
    print(json.dumps({"inputs": len(made), "runs": len(results), "tracebacks": sum(r["traceback"] for r in results),
                      "bad_exit": sum(r["exit"] not in (0, 1, 2) for r in results),
                      "over_budget": sum(not within_bounds(r) for r in results),
                      "max_seconds": max(r["seconds"] for r in ok), "max_cpu_s": max(r["cpu_s"] for r in ok),
                      "max_peak_mb": max(r["peak_mb"] for r in ok),
                      "max_above_healthy_mb": max(r["above_healthy_mb"] for r in ok), "total_s": round(total, 1)}))
    return 0


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
    if argv[:1] == ["--bounds-worker"]:
        bounds_worker(json.loads(argv[1]))
        return 0
    if "--bounds" in argv:
        return bounds_main([a for a in argv if not a.startswith("--")] or None)
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
