"""``tracer info``: what a trace holds (:func:`trace_info`: a dict, also the ``--json`` output) and
its text form (:func:`print_info`): status, steps and ranks, fields, capture reports, drops, the
overview's per-step curves and the run's recorded and logged scalars in numbers, and, with
``--verify``, each step file's checksum.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any

from tracer.errors import TraceError, TraceFormatError
from tracer.format import turns
from tracer.format.arrays import as_bool
from tracer.format.capture_report import describe_capture_reports, read_capture_reports
from tracer.format.names import MANIFEST_NAME, STEPS_DIR
from tracer.format.run_end import read_ended
from tracer.format.scalar_log import SCALARS_GLOB, read_scalars
from tracer.format.summary import SCALAR_PREFIX, SUMMARY_KEY, named_key, read_summary
from tracer.read.reader import StepKey, Trace
from tracer.read.run_status import STATUS_TEXT, status_text  # noqa: F401  (STATUS_TEXT: the app's)


def verify_trace(trace: Trace, keys: list) -> dict[str, Any]:
    """``info --verify``: every step file's bytes against its recorded checksum
    (``tracer.format.integrity.verify_step_file``). Returns ``{"verified": n, "no_checksum": [paths],
    "corrupt": {path: reason}}``."""
    from tracer.errors import ChecksumError
    from tracer.format.integrity import verify_step_file

    out: dict[str, Any] = {"verified": 0, "no_checksum": [], "corrupt": {}}
    for key in keys:
        try:
            if verify_step_file(key.path) is None:
                out["no_checksum"].append(str(key.path))
            else:
                out["verified"] += 1
        except (ChecksumError, TraceError) as err:
            out["corrupt"][str(key.path)] = str(err)
    return out


def trace_info(path: str | Path, verify: bool = False) -> dict[str, Any]:
    """The facts ``info`` prints, as a JSON-able dict. Every step file's header is read once
    (``Trace.scan``): ``unreadable`` maps each file that cannot be used to the reason, and the
    step lists count only readable step files. With ``verify``, ``integrity`` holds
    :func:`verify_trace` of the readable step files (reads every byte)."""
    trace = Trace(path)
    home = _home_trace(trace)  # a step file in the steps/ folder of a trace: that trace's manifest
    manifest = home.manifest if home is not None else trace.manifest
    status = str(manifest.get("status", "unknown"))
    unreadable = {str(p): why for p, why in trace.scan().items()}
    keys = [k for k in trace.steps() if str(k.path) not in unreadable]
    if not keys and trace.path.is_file():
        raise TraceError(unreadable.get(str(trace.path), f"{trace.path}: no readable step file"))
    fields: dict[str, dict[str, Any]] = {}
    metadata: dict[str, Any] = {}
    if keys:
        metadata = trace.metadata(keys[0])
        metadata.pop(SUMMARY_KEY, None)  # the per-step summaries are under "overview"
        for name, (shape, dtype) in trace.fields(keys[0]).items():
            fields[name] = {"shape": shape, "dtype": dtype}
    return {
        "path": str(trace.path),
        "algorithm": trace.algorithm,
        "manifest_of": str(home.root) if home is not None else None,
        "status": status,
        "status_text": status_text(status, manifest),
        "ended": read_ended(manifest),  # how the writer closed (tracer.format.run_end), None before it did
        "schema_version": manifest.get("schema_version", metadata.get("schema_version")),
        "num_step_files": len(keys),
        "steps": sorted({k.step for k in keys}),
        "inner_steps": sorted({k.inner_step for k in keys}),
        "micro_batches": sorted({k.micro_batch for k in keys}),
        "ranks": sorted({k.rank for k in keys}),
        "dropped_steps": manifest.get("dropped_steps", 0),
        "drops_known": "dropped_steps" in manifest,  # False: no readable manifest (printed "unknown")
        "drops_note": drops_note(home if home is not None else trace, manifest, status),
        "drop_reasons": manifest.get("drop_reasons", []),
        "capture_report": manifest.get("capture_report"),  # rank 0's (the manifest's), as before
        "capture_reports": {str(rank): report for rank, report in  # every rank's, zero-edit tracing only
                            (read_capture_reports(trace.root, manifest) if trace.path.is_dir() else {}).items()},
        "unreadable": unreadable,
        "has_token_strings": trace.tokens is not None,
        "fields": fields,
        "first_step_metadata": metadata,
        **({"integrity": verify_trace(trace, keys)} if verify else {}),
        "turns": turn_facts(trace, keys[0]) if keys else None,
        "overview": _overview(trace, keys),
    }


def info_problem(info: dict[str, Any]) -> str | None:
    """Why ``tracer info`` exits 2 after printing ``info`` (a :func:`trace_info` dict), or None.

    The same rule as ``tracer check``, which exits 2 on a trace that holds step files of which
    none can be read: nothing in it can be summarised, checked or browsed. A trace with no step file
    at all (a writer that has not recorded yet) is not a problem: its manifest is what there is to
    show. With ``--verify`` (``"integrity"`` in ``info``), a step file whose bytes disagree with its
    checksum, or that cannot be read to be verified, is one. Some unreadable step files among
    readable ones are not (exit 0; they are listed under "problems"): the summary of the readable
    ones is what ``info`` is for, and ``tracer check`` exits 1 on them (``trace.unreadable``).
    """
    unreadable = info["unreadable"]
    if unreadable and not info["num_step_files"]:
        return (f"{info['path']}: none of its {_step_files(info['path'], unreadable)} can be read, nothing to "
                f"summarise; the first: {next(iter(unreadable.values()))}")
    integrity = info.get("integrity")
    bad = {**integrity["corrupt"], **unreadable} if integrity is not None else {}
    if bad:
        return (f"{info['path']}: --verify: {_step_files(info['path'], bad)} corrupt or unreadable; "
                f"the first: {next(iter(bad.values()))}")
    return None


def _step_files(root: str, reasons: dict[str, str]) -> str:
    """``2 step file(s) (steps/a.safetensors, steps/b.safetensors)``: the files of ``reasons``
    (path -> reason) counted and named relative to the trace ``root``, five at most."""
    names = [str(Path(p).relative_to(root)) if Path(p).is_relative_to(root) and p != root else p for p in reasons]
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f"{len(names)} step file(s) ({shown})"


def drops_note(trace: Trace, manifest: dict[str, Any], status: str) -> str | None:
    """Why the drop count may not be the manifest's final one: taken from ``manifest.counts`` (the
    manifest could not be rewritten, e.g. a full disk), counted only until the last manifest update
    of a writer that did not close, or not recorded at all. None for a closed writer's manifest."""
    if "dropped_steps" not in manifest:
        return "no drop count recorded (no readable manifest): the number of dropped steps is unknown"
    if status == "running":
        return ("counted until the manifest's last update: the writer did not close (still running, killed, "
                "or its disk full before the trace reserved room for the counts), so later drops are unknown"
                + (f"; {trace.counts_note}" if trace.counts_note else ""))
    return trace.counts_note


def turn_facts(trace: Trace, key: StepKey) -> dict[str, Any] | None:
    """Turns and roles of one step file's rows (SPEC.md section 4, tracer/format/turns.py), or None for a
    single-turn step: ``recorded`` (turn_ids / token_roles / mask_reasons that the file holds),
    ``episodes`` (rows), ``turns`` (min / mean / max assistant turns per row), ``roles`` (per role:
    tokens and trained tokens; ``assistant`` and ``environment`` read from the mask when no roles are
    recorded) and ``not_trained`` (masked tokens per reason)."""
    present = trace.fields(key)
    if "completion_ids" not in present or "completion_mask" not in present:
        return None
    wanted = ["completion_ids", "completion_mask"] + [f for f in turns.TURN_FIELDS if f in present]
    data = trace.load_step(key, wanted, derive=False, as_numpy=True)  # numpy: tracer info imports no torch
    ids, keep = data["completion_ids"], as_bool(data["completion_mask"])
    if ids.ndim != 2 or ids.shape != keep.shape:
        return None
    metadata = trace.metadata(key)
    recorded = [f for f in turns.TURN_FIELDS if f in data and data[f].shape == ids.shape]
    layout = turns.read_layout(ids, keep, data, metadata, trace.tokens, trace.eos_token_id, trace.pad_token_id)
    counts = turns.turn_count(layout.turn_ids)  # (B,)
    if layout.source == "mask" and not bool((counts > 1).any()) and not recorded:
        return None
    roles = layout.roles
    by_role: dict[str, dict[str, int]] = {}
    reasons: dict[str, int] = {}
    reason_names = turns.reason_names(metadata)
    for b in range(ids.shape[0]):
        row_keep = keep[b].tolist()
        row_turns = layout.turn_ids[b].tolist()
        row_roles = roles[b].tolist() if roles is not None else None
        for span in turns.row_spans(row_turns, row_roles, row_keep, layout.role_names):
            entry = by_role.setdefault(span.role or turns.PROMPT, {"tokens": 0, "trained": 0})
            entry["tokens"] += span.length
            entry["trained"] += span.kept
        row_reasons = (turns.recorded_mask_reasons(data["mask_reasons"][b].tolist(), reason_names)
                       if "mask_reasons" in recorded else
                       turns.infer_mask_reasons(ids[b].tolist(), row_keep, trace.eos_token_id, trace.pad_token_id,
                                                row_turns, row_roles, layout.role_names))
        for reason in row_reasons:
            if reason != turns.KEPT:
                reasons[reason] = reasons.get(reason, 0) + 1
    return {"step_file": key.label, "recorded": recorded, "source": layout.source, "episodes": int(ids.shape[0]),
            "turns": {"min": int(counts.min()), "mean": float(counts.astype("float32").mean()),
                      "max": int(counts.max())},
            "roles": by_role, "not_trained": reasons}


def describe_turns(facts: dict[str, Any] | None) -> list[str]:
    """``tracer info``'s lines about turns and roles (:func:`turn_facts`); none for a single-turn trace."""
    if not facts:
        return []
    t = facts["turns"]
    source = (f"recorded: {', '.join(facts['recorded'])}" if facts["recorded"] else
              "roles read from the chat template's markers: no turn_ids or token_roles recorded"
              if facts.get("source") == "chat_template" else "read from the mask: no turn_ids or token_roles recorded")
    lines = [f"turns ({facts['step_file']}): {facts['episodes']} episodes, {t['min']}..{t['max']} assistant turns "
             f"each (mean {t['mean']:.2f}); {source}"]
    roles = ", ".join(f"{role} {v['tokens']} tokens ({v['trained']} trained)" for role, v in facts["roles"].items())
    lines.append(f"roles: {roles}")
    if facts["not_trained"]:
        lines.append("not trained: " + ", ".join(f"{n} {r}" for r, n in sorted(facts["not_trained"].items(),
                                                                                 key=lambda kv: -kv[1])))
    return lines


def _home_trace(trace: Trace) -> Trace | None:
    """The trace a single step file belongs to: the file sits in ``steps/`` of a directory holding a
    manifest (SPEC.md section 5); None otherwise, or when that directory cannot be opened as a trace."""
    folder = trace.path.parent
    if not trace.path.is_file() or folder.name != STEPS_DIR or not (folder.parent / MANIFEST_NAME).is_file():
        return None
    try:
        return Trace(folder.parent)
    except TraceError:
        return None


OVERVIEW_COLUMNS = ("kept_tokens", "mean_ratio", "ratio_max", "mean_ref_kl_k3", "mean_approx_kl_k2", "mean_mismatch",
                    "mean_reward", "mean_advantage", "clip_fraction", "nonfinite_kept")


def _overview(trace: Trace, keys: list[StepKey]) -> dict[str, Any]:
    """First, last, min and max of the non-NaN values of a few per-step summary columns over the
    readable step files ``keys`` (in step order), and of the run's scalars (:func:`_scalars`): each
    file's summary from its header (decoded once
    by ``Trace.scan``; no pandas, no torch), else computed from its tensors
    (:meth:`tracer.read.overview.TraceOverview.step_summary`'s way, imports torch: traces written
    before summaries were stored); a file that cannot be summarised is left out, and so is a column
    with no value."""
    rows: list[dict[str, Any]] = []
    steps: list[int] = []  # the step number of each row
    counts = {"header": 0, "tensors": 0}
    for key in sorted(keys, key=lambda k: (k.step, k.inner_step, k.micro_batch, k.rank)):
        try:
            summary = read_summary(trace.metadata(key))
            source = "header"
            if summary is None:
                summary, source = trace.overview._step_summary_of(key), "tensors"
        except TraceFormatError:
            continue
        counts[source] += 1
        rows.append(summary)
        steps.append(key.step)
    columns: dict[str, dict[str, Any]] = {}
    for col in OVERVIEW_COLUMNS:
        values = [row[col] for row in rows if row.get(col) is not None and row[col] == row[col]]  # not NaN
        if values:
            columns[col] = _first_last(values)
    return {"from_headers": counts["header"], "from_tensors": counts["tensors"], "columns": columns,
            "scalars": _scalars(trace, steps, rows)}


def _first_last(values: list) -> dict[str, Any]:
    return {"first": _json_number(values[0]), "last": _json_number(values[-1]),
            "min": _json_number(min(values)), "max": _json_number(max(values))}


def _scalars(trace: Trace, steps: list[int], rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{"scalars/<name>": {first, last, min, max, count}}`` of the run's per-step scalars, in step
    order, NaN left out: those recorded with each step file (its summary ``rows``, ``steps`` their
    step numbers) and those logged after their step (:mod:`tracer.format.scalar_log`), a step's
    recorded value winning over its logged one as in ``Trace.step_summary``; ``count`` is how many
    values were recorded or logged, NaN included."""
    series: dict[str, list[tuple[int, float]]] = {}
    recorded: set[tuple[str, int]] = set()
    for step, row in zip(steps, rows):
        for key, value in row.items():
            if key.startswith(SCALAR_PREFIX):
                series.setdefault(key, []).append((step, value))
                recorded.add((key, step))
    if trace.path.is_dir():
        for step, values in sorted(read_scalars(sorted(trace.root.glob(SCALARS_GLOB))).items()):
            for name, value in values.items():
                key = SCALAR_PREFIX + name
                if named_key(key) and (key, step) not in recorded:
                    series.setdefault(key, []).append((step, value))
    out = {}
    for key, points in series.items():
        values = [v for _, v in sorted(points, key=lambda p: p[0]) if v == v]  # stable: file order within a step
        out[key] = {**(_first_last(values) if values else dict.fromkeys(("first", "last", "min", "max"))),
                    "count": len(points)}
    return out


def _json_number(value: Any) -> float | int | None:
    value = value.item() if hasattr(value, "item") else value
    return None if isinstance(value, float) and value != value else value


def print_info(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()

    def say(text: str, **kw: Any) -> None:  # text from the trace's files is data, never rich markup
        console.print(text, markup=False, highlight=False, soft_wrap=True, **kw)

    steps = info["steps"]
    span = f"{steps[0]}..{steps[-1]} ({len(steps)} steps)" if steps else "none"
    console.print(info["path"], style="bold", markup=False)
    if info.get("manifest_of"):
        say(f"a step file of the trace {info['manifest_of']} (status and drops from its manifest)")
    say(f"algorithm: {info['algorithm']}   status: {info['status_text']}   schema: {info['schema_version']}")
    say(f"steps: {span}   step files: {info['num_step_files']}   inner steps: {info['inner_steps']}   "
        f"ranks: {info['ranks']}   dropped: {info['dropped_steps'] if info.get('drops_known', True) else 'unknown'}")
    if info.get("drops_note"):
        say(f"drop count: {info['drops_note']}")
    for line in describe_drops(info["dropped_steps"], info["drop_reasons"]):
        say(line)
    for line in describe_capture_reports(info.get("capture_reports") or {}, info["ranks"]):
        say(line)
    for line in describe_turns(info.get("turns")):
        say(line)
    if info["fields"]:
        table = Table(title="fields (first readable step file)")
        for col in ("field", "shape", "dtype"):
            table.add_column(col)
        for name, spec in info["fields"].items():
            table.add_row(Text(name), str(spec["shape"]), Text(spec["dtype"]))
        console.print(table)
    else:
        say("fields: none (no readable step file)")
    overview = info.get("overview") or {}
    if overview.get("columns"):
        table = Table(title=f"per-step summaries ({overview['from_headers']} from headers, "
                            f"{overview['from_tensors']} from tensors)")
        for col in ("summary", "first", "last", "min", "max"):
            table.add_column(col)
        for name, stats in overview["columns"].items():
            table.add_row(name, *(f"{stats[k]:.4g}" if stats[k] is not None else "nan" for k in ("first", "last", "min", "max")))
        console.print(table)
    scalars = overview.get("scalars") or {}
    if scalars:
        table = Table(title="scalars (recorded with the steps, logged after them)")
        table.add_column("scalar", overflow="fold")  # long logged names (rewards/<func>/mean) whole
        for col in ("first", "last", "min", "max", "values"):
            table.add_column(col)
        for name, stats in scalars.items():
            table.add_row(Text(name), *(f"{stats[k]:.4g}" if stats[k] is not None else "nan"
                                        for k in ("first", "last", "min", "max")), str(stats["count"]))
        console.print(table)
    if info["first_step_metadata"]:
        meta = ", ".join(f"{k}={v}" for k, v in sorted(info["first_step_metadata"].items()))
        say(f"metadata: {meta}")
    integrity = info.get("integrity")
    if integrity is not None:
        bad, unverifiable = integrity["corrupt"], integrity["no_checksum"]
        style = "bold red" if bad else "bold green"
        console.print(f"verify: {integrity['verified']} step files match their checksum, {len(bad)} corrupt, "
                      f"{len(unverifiable)} without a checksum", style=style, markup=False)
        for reason in bad.values():
            say(f"  {reason}")
    if info["unreadable"]:
        console.print(f"problems ({len(info['unreadable'])} files; unreadable step files are left out above):",
                      style="bold red")
        for reason in info["unreadable"].values():
            say(f"  {reason}")


_DROP_WHERE = re.compile(r"^(step \d+(, inner step \d+)?(, micro-batch \d+)?|step_[^\s:]+):\s*")


def drop_kind(reason: str) -> str:
    """What a drop reason says happened, without its step, its numbers in parentheses or a path: ``queue
    full`` of ``step 3, inner step 1: queue full (2 steps, ...)``, ``OSError: [Errno 28] No space left on
    device`` of ``step_00000004....safetensors: OSError: [Errno 28] No space left on device: '/runs/...'``
    (at most 100 characters)."""
    rest = _DROP_WHERE.sub("", reason, count=1)
    return (re.split(r" \(|: ['\"/]", rest, maxsplit=1)[0].strip() or rest)[:100]


def describe_drops(dropped: int, reasons: list[str]) -> list[str]:
    """``tracer info``'s lines on dropped step files: the kinds of the reasons the manifest kept (its
    first ``MAX_DROP_REASONS``) with their counts, then the first and the last reason kept."""
    if not reasons:
        return []
    kinds = collections.Counter(drop_kind(r) for r in reasons)
    kept = f"of the first {len(reasons)}" if len(reasons) < dropped else f"of all {len(reasons)}"
    lines = [f"  drop reasons ({kept}): " + ", ".join(f"{kind} x{n}" for kind, n in kinds.most_common())]
    lines.append(f"  first: {reasons[0]}")
    if len(reasons) > 1:
        lines.append(f"  last kept: {reasons[-1]}")
    return lines
