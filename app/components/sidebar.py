"""The shared sidebar: where traces are looked for (the root), and the run / rank / step file /
sequence choosers, the run's status and auto-refresh. Every page reads the choice with
:func:`current_selection`.

Only traces that resolve inside the root are listed or opened; ``?run=`` in the URL selects a run
and is refused when it leaves the root; without ``step=`` the run opens at its most informative
step (:mod:`app.components.runs`). A finding chosen on the Health page sets the choosers through
:mod:`app.components.token_jump` before they are drawn. A page on which the choosers have no effect
(Runs, which lists every run; Diff, which picks its own two) has them taken off the sidebar; :func:`keep_choices` keeps their values for the next page. A
page that covers the whole run (Rollouts) takes off only the Rank, Step and Sequence choosers
(:func:`hide_step_choosers`), keeping the Run chooser.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from app.components import token_jump, trace_cache, urls
from app.components.safe_trace import OutsideRootError, SafeTrace, inside, resolve_request
from tracer.errors import TraceError
from tracer.format.names import MANIFEST_NAME, STEPS_DIR
from tracer.read import StepKey, find_traces
from tracer.read.run_status import status_text
from tracer.read.step_table import StepTable
from tracer.format.text import clean_str

ROOT_ENV = "TRACER_ROOT"
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "sample_traces"
_SELECTION_STATE = "_tracer_selection"
_URL_APPLIED = "_tracer_url_run"  # the ?run= value already applied to the Run selectbox
_URL_NOTE = "_tracer_url_note"  # why the URL's step could not be shown
_KEPT_STATE = "_tracer_kept_choices"  # the choosers' values while a page hides them
RUN_PARAM = "run"
REFRESH_SECONDS = 2.0
MAX_STEP_OPTIONS = 2_000  # a run with more step files picks a step number, then one of its files
STEP_NUMBER = "step_number"  # the session state of that Step number input
JS_SAFE_INT = 2**53 - 1  # the largest step a Streamlit number input holds (a JavaScript number)
_CHOOSER_KEYS = ("run", "rank", STEP_NUMBER, "step_file", "sequence", "auto_refresh")
_STEP_CHOOSER_KEYS = ("rank", STEP_NUMBER, "step_file", "sequence")
_STEP_SLOT = "_tracer_step_choosers"  # this run's placeholder of the Rank, Step and Sequence choosers


@dataclass(frozen=True)
class Selection:
    """What the sidebar chose: a trace, one of its step files (None while it has none) and a
    sequence of that step (None when no field has a B dim); ``rank`` is the rank filter (None = all
    ranks); ``error`` says why the trace cannot be opened (then ``key`` and ``sequence`` are None)."""

    root: Path
    trace_path: Path
    key: StepKey | None
    sequence: int | None
    rank: int | None = None
    error: str | None = None


def resolve_root(argv: Sequence[str], environ: Mapping[str, str]) -> Path:
    """The directory to look for traces in: ``--root DIR`` among the script arguments (what
    follows ``--`` in ``streamlit run app/streamlit_app.py -- --root DIR``), else the
    ``TRACER_ROOT`` environment variable, else ``sample_traces/`` next to the repository root."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--root")
    try:
        args, _ = parser.parse_known_args(list(argv))
    except SystemExit:  # "--root" without a value: fall back rather than kill the app
        args = argparse.Namespace(root=None)
    if args.root:
        return Path(args.root).expanduser()
    if environ.get(ROOT_ENV):
        return Path(environ[ROOT_ENV]).expanduser()
    return DEFAULT_ROOT


def _candidates(root: Path) -> list[Path]:
    found = find_traces(root) if root.is_dir() else []
    if found:
        return found
    try:
        trace_cache.open_trace(str(root))
    except TraceError:
        return []
    return [root]


def discover_traces(root: Path) -> list[Path]:
    """Traces at or under ``root`` (``find_traces``) that resolve inside it; ``root`` itself counts
    when it is a trace, including a step directory without manifest or a single step file."""
    return [p for p in _candidates(root) if inside(p, root)]


def refused_traces(root: Path) -> list[Path]:
    """The traces found at or under ``root`` through a link that leaves it (never listed, never opened)."""
    return [p for p in _candidates(root) if not inside(p, root)]


def view_command(directory: Path | str) -> str:
    """The command that opens the viewer on ``directory`` (``tracer view`` takes the path as its
    argument), quoted for a POSIX shell."""
    return f"python -m tracer view {shlex.quote(str(directory))}"


def _link_targets(refused: list[Path]) -> Path:
    """One directory holding every trace the links in ``refused`` point to (their common parent;
    the trace itself when there is one)."""
    targets = [str(p.resolve()) for p in refused]
    return Path(targets[0] if len(targets) == 1 else os.path.commonpath(targets))


def no_trace_message(root: Path, refused: list[Path] | None = None) -> str:
    """What the app says when ``root`` lists no trace (Markdown; paths and commands in code spans):
    it does not exist, holds no trace, or holds only ``refused`` traces (:func:`refused_traces`,
    found when None), links that leave it; each case says the command that opens a trace."""
    refused = refused_traces(root) if refused is None else refused
    how_to_open = (f"open it with `{view_command('DIR')}`, or start the app itself with "
                   f"`streamlit run app/streamlit_app.py -- --root DIR` (or set `{ROOT_ENV}=DIR`).")
    if refused:
        target = _link_targets(refused)
        return (f"The {len(refused)} trace(s) found under `{root}` are links that leave it (named in the sidebar), "
                "and the app opens only traces inside the directory it was started on. To browse them, start "
                f"the viewer on the directory they point to: `{view_command(target)}`.")
    where = "does not exist" if not root.exists() else "holds no trace"
    return (
        f"`{root}` {where}. Expected a trace directory written by tracer (a `{MANIFEST_NAME}` and "
        f"a `{STEPS_DIR}/` folder of `.safetensors` step files), at the root or up to two levels "
        "below it, or a single `.safetensors` step file. Write one with `python -m tracer demo --out DIR` "
        f"or by attaching `TraceWriter` to a trainer, then {how_to_open}"
    )


def _run_label(root: Path, path: Path) -> str:
    """The run's path relative to the root, as printable text (a directory name that is not valid
    UTF-8 shows with U+FFFD instead of breaking the page)."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        return clean_str(str(path))
    return clean_str(str(rel) if str(rel) != "." else f"{path.name} (the root)")


def _step_labels(keys: list[StepKey]) -> list[str]:
    """The Step file chooser's labels of ``keys`` (as :meth:`tracer.read.step_table.StepTable.labels`)."""
    return StepTable.from_keys(keys).labels()


def render_sidebar_header(root: Path) -> list[Path]:
    """Draw the sidebar's title, root and Reload button; return the traces under ``root`` it lists
    (:func:`_listed_traces`, empty when none)."""
    sb = st.sidebar
    sb.title("tracer")
    sb.text(f"root: {root}")
    if sb.button("Reload", help="read the trace again: new steps, manifest status, token strings"):
        trace_cache.clear_caches()
        if "app.components.runs" in sys.modules:  # (imported by the Runs page or by opening a run)
            sys.modules["app.components.runs"].run_status.clear()
    return _listed_traces(root)


def keep_choices(keys: tuple[str, ...] = _CHOOSER_KEYS) -> None:
    """Keep the choosers' values (of ``keys``, every chooser by default) for the next run: called
    when they are taken off the page (a widget not shown loses its state), :func:`render_sidebar`
    puts them back."""
    st.session_state[_KEPT_STATE] = {k: st.session_state[k] for k in keys if k in st.session_state}


def hide_step_choosers() -> None:
    """Take the Rank, Step, Step file and Sequence choosers off the sidebar for this run of a page
    on which they have no effect (Rollouts lists every step file), keeping their values for the
    next page (:func:`keep_choices`); the Run chooser stays. Called by the page, after the sidebar
    is drawn; nothing to do when the sidebar drew no step choosers (a run without step files)."""
    slot = st.session_state.pop(_STEP_SLOT, None)
    if slot is not None:
        slot.empty()
        keep_choices(_STEP_CHOOSER_KEYS)


def _restore_choices() -> None:
    """Give the choosers back the values :func:`keep_choices` kept, where their state is gone."""
    for key, value in st.session_state.pop(_KEPT_STATE, {}).items():
        if key not in st.session_state:
            st.session_state[key] = value


def render_sidebar(root: Path, traces: list[Path], choosers: DeltaGenerator | None = None) -> Selection | None:
    """Draw the run choosers (Run, Rank, Step file, Sequence), the run's status and auto-refresh
    into ``choosers`` (a placeholder under :func:`render_sidebar_header`, emptied on a page where
    they have no effect; the sidebar itself when None) and return the choice; None when ``traces``
    is empty."""
    if not traces:
        return None
    sb = (choosers if choosers is not None else st.sidebar).container()
    st.session_state.pop(_STEP_SLOT, None)  # a placeholder of an earlier run of the app
    _restore_choices()
    refused = not _apply_url_run(root, traces)
    jump = token_jump.pending()
    if jump is not None:
        token_jump.select_run(jump, traces)
    run = sb.selectbox("Run", traces, format_func=lambda p: _run_label(root, p), key="run",
                       on_change=_remember_run, args=(root,))
    try:
        trace = trace_cache.open_trace(str(run))
        table = trace.step_table()  # names and coordinates as arrays: no key per step file is built
        problems = trace.problems()
    except TraceError as err:
        sb.error("This run cannot be opened; pick another one.")
        return Selection(root, run, None, None, error=str(err))
    sb.text(f"{trace.algorithm or 'unknown algorithm'} · {status_text(trace.status, trace.manifest)} · {len(table)} step files")
    _render_status_notes(sb, trace, problems)
    _render_auto_refresh(sb, str(run))
    if jump is not None:
        token_jump.select_step(jump, run, table.keys(), _step_labels)
    else:
        _apply_url_selection(str(run), table)
    step_slot = st.session_state[_STEP_SLOT] = sb.empty()
    chosen = _choose_step(step_slot.container(), root, run, table)
    # a refused ?run= stays in the URL (its message with it) until another run is chosen
    urls.write(urls.selection_params(run_param(root, run), chosen.key, chosen.sequence),
               keep=("run",) if refused else ())
    return chosen


def _apply_url_selection(trace_path: str, table: StepTable) -> None:
    """Point the Rank, Step file and Sequence choosers at the URL's ``step, inner, mb, rank, seq``
    (before they are drawn) when the URL names a selection the app did not write itself; a URL
    naming ``run=`` without ``step=`` opens the run's most informative step
    (:func:`app.components.runs.informative_index`)."""
    wanted = urls.pending()
    if wanted is None:
        return
    params = urls.parse(wanted)
    if "step" not in params:
        if RUN_PARAM in wanted and len(table):
            _open_informative_step(trace_path, table)
        return
    keys = table.keys()
    match = [k for k in keys if k.step == params["step"] and all(  # an absent coordinate: the first file
        name not in params or getattr(k, attr) == params[name]
        for name, attr in (("inner", "inner_step"), ("mb", "micro_batch"), ("rank", "rank")))]
    if not match:  # shown until another step file is chosen
        named = ", ".join(f"{name} {params[name]}" for name in ("step", "inner", "mb", "rank") if name in params)
        st.session_state[_URL_NOTE] = f"The URL names {named}, which this run has no step file for; showing another step."
        return
    st.session_state.pop(_URL_NOTE, None)
    key = match[0]
    if len({k.rank for k in keys}) > 1:
        st.session_state["rank"] = None  # all ranks, so that the step file is listed
    st.session_state["step_file"] = _step_labels(keys)[keys.index(key)]
    if "seq" in params:
        st.session_state["sequence"] = params["seq"]
    else:
        st.session_state.pop("sequence", None)


def _open_informative_step(trace_path: str, table: StepTable) -> None:
    """Point the Step file chooser at the run's first step file with an error (and the sequence
    the error names), else at its last step (:mod:`app.components.runs`); every rank listed.
    :mod:`app.components.runs` is imported here, not at the top: it imports the checks (and torch),
    which a URL naming its step never needs."""
    from app.components import runs

    status = runs.known_status(trace_path)
    index = runs.informative_index(table.coordinates, status)
    if len(np.unique(table.coordinates[:, 3])) > 1:
        st.session_state["rank"] = None  # all ranks, so that the step file is listed
    st.session_state["step_file"] = table.labels()[index]
    sequence = status.first_error_sequence if status is not None and status.first_error is not None else None
    if sequence is not None and tuple(table.coordinates[index].tolist()) == status.first_error:
        st.session_state["sequence"] = sequence
    else:
        st.session_state.pop("sequence", None)
    st.session_state.pop(_URL_NOTE, None)


def _listed_traces(root: Path) -> list[Path]:
    """The traces under ``root`` (:func:`discover_traces`); a warning names those reached through
    a link that leaves the root (never listed, never opened)."""
    candidates = _candidates(root)
    refused = [p for p in candidates if not inside(p, root)]
    if refused:
        st.sidebar.warning(f"{len(refused)} trace(s) under the root are links that leave it: not listed.")
        st.sidebar.text(printable("\n".join(str(p) for p in refused[:10])))
    return [p for p in candidates if p not in refused]


def _choose_step(sb: DeltaGenerator, root: Path, run: Path, table: StepTable) -> Selection:
    """The Rank (with several ranks), Step file and Sequence choosers of ``run`` (``table``: its
    step files; only the chosen one's :class:`StepKey` is built), drawn in ``sb``."""
    ranks = np.unique(table.coordinates[:, 3]).tolist()
    rank = None
    if len(ranks) > 1:
        rank = sb.selectbox("Rank", [None, *ranks], key="rank", format_func=_rank_label,
                            help="show the step files of one rank, or of all ranks")
        if rank is not None:
            table = table.take(np.flatnonzero(table.coordinates[:, 3] == rank))
    if not len(table):
        return Selection(root, run, None, None, rank)
    table, labels = _step_file_choices(sb, table)
    if st.session_state.get("step_file") not in labels:
        st.session_state.pop("step_file", None)
    if _URL_NOTE in st.session_state:
        sb.warning(st.session_state[_URL_NOTE])
    label = sb.selectbox("Step file", labels, key="step_file",
                         on_change=lambda: st.session_state.pop(_URL_NOTE, None),
                         help="step · inner step (PPO epoch / GRPO iteration) · micro-batch · rank")
    key = table.key(labels.index(label))
    try:
        seq_labels = trace_cache.sequence_labels(str(run), str(key.path), trace_cache.file_id(key.path))
    except TraceError as err:
        sb.error("This step file cannot be read; pick another one.")
        sb.text(str(err))
        seq_labels = []
    sequence = None
    if st.session_state.get("sequence") not in range(len(seq_labels)):
        st.session_state.pop("sequence", None)  # a URL's or another step's row this step lacks
    if seq_labels:
        sequence = sb.selectbox("Sequence", range(len(seq_labels)), format_func=seq_labels.__getitem__,
                                key="sequence")
    return Selection(root, run, key, sequence, rank)


def _step_file_choices(sb: DeltaGenerator, table: StepTable) -> tuple[StepTable, list[str]]:
    """The step files the Step file chooser offers and their labels: every file of ``table``, or,
    on a run of more than :data:`MAX_STEP_OPTIONS` files, those of the step picked in a Step number
    input drawn here (a 10,000-option list would cost the page, and the browser, for each
    option). A Step file label set before the choosers are drawn (the URL, a Health finding)
    moves the number to its step."""
    steps = table.coordinates[:, 0]  # ascending: the table is sorted by coordinates
    if len(table) <= MAX_STEP_OPTIONS or not -JS_SAFE_INT <= steps[0] <= steps[-1] <= JS_SAFE_INT:
        return table, table.labels()  # (a number input holds no step beyond the browser's safe integers)
    wanted, number = st.session_state.get("step_file"), st.session_state.get(STEP_NUMBER)
    if number is None or not steps[0] <= number <= steps[-1]:
        number = st.session_state[STEP_NUMBER] = int(steps[0])
    if wanted is not None and wanted not in _labels_at(table, np.flatnonzero(steps == number)):
        labels = table.labels()  # every label once, only when something outside the choosers set one
        if wanted in labels:
            number = st.session_state[STEP_NUMBER] = int(steps[labels.index(wanted)])
    number = sb.number_input(
        "Step", min_value=int(steps[0]), max_value=int(steps[-1]), step=1, key=STEP_NUMBER,
        on_change=_new_step_number, help=f"{len(table)} step files: pick a step, then one of its files")
    shown = int(steps[min(int(np.searchsorted(steps, number)), len(steps) - 1)])  # the next step with files
    if shown != number:
        sb.caption(f"No step file at step {number}: showing step {shown}.")
    positions = np.flatnonzero(steps == shown)
    return table.take(positions), _labels_at(table, positions)


def _labels_at(table: StepTable, positions: np.ndarray) -> list[str]:
    """The labels of ``table``'s files at ``positions``, as :meth:`StepTable.labels` of the whole table."""
    if table.folder is None:  # user-named files: a label may name its file because of another one
        labels = table.labels()
        return [labels[i] for i in positions.tolist()]
    return table.take(positions).labels()


def _new_step_number() -> None:
    """The Step number's on_change: that step's first file, and no URL note."""
    st.session_state.pop("step_file", None)
    st.session_state.pop(_URL_NOTE, None)


def _rank_label(rank: int | None) -> str:
    return "all ranks" if rank is None else f"rank {rank}"


def printable(text: str) -> str:
    """``text`` safe to send to the browser: a file name that is not valid UTF-8 reaches Python as
    lone surrogates, which cannot be encoded; show those bytes as ``\\xff`` escapes instead."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _render_status_notes(sb: DeltaGenerator, trace: SafeTrace, problems: dict[Path, str]) -> None:
    if trace.path.is_dir() and not (trace.path / MANIFEST_NAME).is_file():
        sb.warning(f"No {MANIFEST_NAME} in this run: its status and tokenizer (EOS and pad ids) are unknown, "
                   "so masked positions cannot say why; the step files are shown with what their headers say.")
    notes = [*getattr(trace, "manifest_notes", []), *filter(None, [getattr(trace, "tokens_problem", None)])]
    if notes:  # a manifest or tokens.json the reader could use only in part (file names inside: plain text)
        sb.warning(f"Part of this run's {MANIFEST_NAME} / token strings was ignored; the steps are still shown.")
        sb.text(printable("\n".join(notes)))
    if trace.status == "running":
        sb.caption("The writer has not closed this run: the trainer crashed or is still writing it. While it "
                   "writes, new steps appear on Reload or with auto-refresh.")
    if problems:
        sb.warning(f"{len(problems)} step file(s) set aside: they cannot be read or leave the trace "
                   "directory. The other steps are shown.")
        with sb.expander("Step files set aside"):
            st.text(printable("\n\n".join(f"{path.name}\n{reason}" for path, reason in problems.items())))


NO_STEP_FILES_YET = "This trace has no step files yet. Press Reload in the sidebar when the trainer has written one."


def stop_without_step_files(trace: SafeTrace) -> None:
    """End the page's run with what stands for its step files when ``trace`` lists none: the step
    files it set aside and why (``SafeTrace.problems``: unreadable, or leaving the trace directory),
    or, when there are none on disk either, that the trainer has written none yet. File names and
    reasons are plain text, never Markdown."""
    problems = trace.problems()
    if not problems:
        st.info(NO_STEP_FILES_YET)
        st.stop()
    st.error(f"None of the {len(problems)} step file{'s' if len(problems) != 1 else ''} of this run can be read: "
             "nothing to show. Each file and why:", icon=":material/error:")
    st.text(printable("\n\n".join(f"{path.name}\n{reason}" for path, reason in problems.items())))
    st.stop()


def live_signature(trace_path: str) -> tuple:
    """What auto-refresh watches: the manifest's modification time and the step file names."""
    try:
        names = trace_cache.step_files(trace_cache.open_trace(trace_path))
    except TraceError as err:
        names = (str(err),)
    return trace_cache.manifest_mtime(trace_path), names


def _render_auto_refresh(sb: DeltaGenerator, trace_path: str) -> None:
    on = sb.toggle("Auto-refresh", key="auto_refresh",
                           help=f"check every {REFRESH_SECONDS:g} s for new step files and a changed manifest "
                                "(status), and rerun the app when there are")
    if on:
        with sb:
            _watch(trace_path, live_signature(trace_path))


@st.fragment(run_every=REFRESH_SECONDS)
def _watch(trace_path: str, shown: tuple) -> None:
    if live_signature(trace_path) != shown:
        st.rerun()
    st.caption(f"auto-refresh on: checking every {REFRESH_SECONDS:g} s")


def _apply_url_run(root: Path, traces: list[Path]) -> bool:
    """Select the run named by ``?run=`` in the URL (relative to the root, or absolute) once per
    new value; a path that resolves outside the root is refused with a message (then False)."""
    requested = st.query_params.get(RUN_PARAM)
    if requested is None:
        return True
    try:
        path = resolve_request(root, requested)
    except OutsideRootError as err:
        st.error("Refused the run named in the URL: it lies outside the directory this app was started "
                 "with.", icon=":material/block:")
        st.text(str(err))
        return False
    except TraceError as err:  # a null byte, an unknown ~user...: no path, so no trace under the root
        path, why = None, str(err)
    else:
        why = f"{RUN_PARAM}={requested!r}"
    match = next((t for t in traces if t.resolve() == path), None) if path is not None else None
    if match is None:
        st.error("The run named in the URL is not a trace under the root.", icon=":material/block:")
        st.text(printable(why))
        return False
    # applied once per new value, and again when the chooser's state is gone: a page switched with
    # query_params (a point clicked on the Steps page) finds the chooser reset to the first run
    if st.session_state.get(_URL_APPLIED) != requested or "run" not in st.session_state:
        st.session_state[_URL_APPLIED] = requested
        st.session_state["run"] = match
    return True


def run_param(root: Path, run: Path) -> str:
    """How ``?run=`` names ``run``: its path relative to the root (``.`` for the root itself)."""
    return "." if run == root else _run_label(root, run).removesuffix(" (the root)")


def _remember_run(root: Path) -> None:
    """The run selectbox's on_change: put the chosen run in the URL (``?run=``) to share it."""
    label = run_param(root, st.session_state["run"])
    st.query_params[RUN_PARAM] = label
    urls.drop_sequence_params()  # a token of the run shown before
    st.session_state[_URL_APPLIED] = label


def store_selection(selection: Selection) -> None:
    """Make the sidebar's choice available to the page that runs next."""
    st.session_state[_SELECTION_STATE] = selection


def current_selection() -> Selection:
    """The sidebar's choice of this run of the app (set by the entry script before the page)."""
    return st.session_state[_SELECTION_STATE]
