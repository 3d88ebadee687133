"""Pure builders of the Rollouts page: one row per completion of every step file
(``tracer.read.rollouts.rollout_frame``), filtered, searched, sorted and cut into pages, with the
count of ``tracer check`` findings at each row and the link that opens the row's tokens.

The page's state lives in the URL (:class:`RolloutQuery`: ``sort, dir, search, page, step_min,
step_max, reward_min, reward_max, group_id, flagged, first_pass``; names no other page uses, so that a page's
parameter left in the URL, such as the Step page's ``q``, is not read as a search), so that a copied link reopens the same table.
No Streamlit and no RL maths here: the per-row numbers come from ``tracer.read``, the findings from
``tracer.checks`` (through the Health page's findings frame, :func:`app.components.health.findings_frame`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from collections.abc import Mapping

import pandas as pd

from app.components.urls import link
from tracer.checks import ERROR, WARNING

PAGE_SIZE = 50  # rows sent to the browser per page
NOT_CHECKED = "not checked"
FINDINGS = "findings"  # the column of counts: errors and warnings of tracer check located at the row
TOKENS_LINK = "tokens"  # the column of links to the row on the Tokens page
# Where a row lies: its step file's coordinates and its row in the file.
ROW_KEY = ("step", "inner_step", "micro_batch", "rank", "seq")
# Display order of the fixed columns; reward components (``reward/<name>``) follow ``reward``.
LEADING = ("step", "inner_step", "micro_batch", "rank", "seq", "group", "reward")
TRAILING = ("length", "advantage", "mean_ratio", "mean_ref_kl_k3", "mean_abs_mismatch", "mean_entropy", FINDINGS,
            "text")
COLUMN_HELP = {
    "inner_step": "PPO epoch / GRPO iteration (0 = first pass over fresh rollouts)",
    "micro_batch": "micro-batch of the step file", "seq": "row of the step file",
    "group": "group id (G completions of one prompt); -1 when none",
    "reward": "recorded reward of the completion (rewards [B])",
    "length": "kept completion tokens (completion_mask)",
    "advantage": "recorded advantage (GRPO: per sequence; PPO: mean over kept tokens)",
    "mean_ratio": "mean importance ratio exp(policy - old) over kept tokens",
    "mean_ref_kl_k3": "mean k3 estimate of KL(policy || ref) over kept tokens (nats)",
    "mean_abs_mismatch": "mean |old_logprobs - sampler_logprobs| over kept tokens (nats)",
    "mean_entropy": "mean entropy of the policy over kept tokens (nats)",
    FINDINGS: "errors and warnings of tracer check located at this row (step file and sequence)",
    "text": ("token strings of the kept completion tokens joined as the model reads them (no mark between "
             "tokens, so the search finds the text as written); a long text ends in … (cut where the trace "
             "stores it); the row's link opens its tokens one by one"),
}


@dataclass(frozen=True)
class RolloutQuery:
    """What the table shows: filters, full-text search, sort and page. Every field has a URL
    parameter (:data:`PARAMS`); the defaults show every row in file order, page 1.

    Attributes:
        sort: column to sort by; None keeps file order (step, inner step, micro-batch, rank, row).
        descending: sort direction (``dir=desc``).
        search: case-insensitive literal substring of ``text``; "" matches every row.
        page: 1-based page number.
        step_min, step_max: inclusive step range; None = open.
        reward_min, reward_max: inclusive reward range; None = open (a bound drops NaN rewards).
        group: only rows of this group id (``group_id``).
        flagged: only rows with at least one finding (needs the findings counted).
        first_pass: only the rows of the first inner step (:func:`first_pass_rows`): a run that
            trains on its rollouts for several PPO epochs / GRPO iterations records each completion
            once per inner step; this lists each once.
    """

    sort: str | None = None
    descending: bool = False
    search: str = ""
    page: int = 1
    step_min: int | None = None
    step_max: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    group: int | None = None
    flagged: bool = False
    first_pass: bool = False

    @classmethod
    def from_params(cls, params: Mapping[str, str]) -> RolloutQuery:
        """The query named by URL parameters; a malformed value is left at its default."""
        ints = {name: _number(params.get(param), int) for name, param in
                (("page", "page"), ("step_min", "step_min"), ("step_max", "step_max"), ("group", "group_id"))}
        floats = {name: _number(params.get(name), float) for name in ("reward_min", "reward_max")}
        page = ints.pop("page")
        return cls(sort=params.get("sort") or None, descending=params.get("dir") == "desc",
                   search=params.get("search") or "", page=page if page is not None and page >= 1 else 1,
                   flagged=params.get("flagged") == "1", first_pass=params.get("first_pass") == "1",
                   **ints, **floats)

    def to_params(self) -> dict[str, str | None]:
        """Every URL parameter of the query: its text, or None where the default applies (to remove)."""
        default = RolloutQuery()
        out: dict[str, str | None] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            param = PARAM_OF[field.name]
            if value == getattr(default, field.name):
                out[param] = None
            elif field.name == "descending":
                out[param] = "desc"
            elif field.name in ("flagged", "first_pass"):
                out[param] = "1"
            elif isinstance(value, float):
                out[param] = f"{value:g}"
            else:
                out[param] = str(value)
        return out

    def filters(self) -> RolloutQuery:
        """The query without its sort and page: what decides which rows are shown (a change of it
        goes back to page 1)."""
        return replace(self, sort=None, descending=False, page=1)


PARAM_OF = {"sort": "sort", "descending": "dir", "search": "search", "page": "page", "step_min": "step_min",
            "step_max": "step_max", "reward_min": "reward_min", "reward_max": "reward_max", "group": "group_id",
            "flagged": "flagged", "first_pass": "first_pass"}
PARAMS = tuple(PARAM_OF.values())  # the page's own URL parameters (urls.PAGE_PARAMS["rollouts"])


def _number(text: str | None, kind: type):
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        return None
    return value if not (isinstance(value, float) and not math.isfinite(value)) else None


def select_rollouts(frame: pd.DataFrame, query: RolloutQuery) -> pd.DataFrame:
    """The rows of ``frame`` (``rollout_frame``) that pass ``query``'s filters and search, sorted by
    ``query.sort`` (stable: ties keep file order; NaN last in either direction). The flagged filter
    needs a :data:`FINDINGS` column of counts; without one (or with NaN: not checked) it keeps every row. Never mutates ``frame``.

    Raises:
        KeyError: ``query.sort`` is not a column of ``frame``.
    """
    keep = pd.Series(True, index=frame.index)
    if query.step_min is not None:
        keep &= frame["step"] >= query.step_min
    if query.step_max is not None:
        keep &= frame["step"] <= query.step_max
    if query.reward_min is not None:
        keep &= frame["reward"] >= query.reward_min
    if query.reward_max is not None:
        keep &= frame["reward"] <= query.reward_max
    if query.group is not None:
        keep &= frame["group"] == query.group
    if query.first_pass:
        keep &= first_pass_rows(frame)
    if query.flagged and FINDINGS in frame and frame[FINDINGS].notna().all():  # counted (not NaN: not checked)
        keep &= frame[FINDINGS] > 0
    if query.search:
        keep &= frame["text"].fillna("").str.contains(query.search, case=False, regex=False)
    shown = frame[keep.to_numpy(dtype=bool)]
    if query.sort is None:
        return shown
    if query.sort not in frame:
        raise KeyError(f"no column {query.sort!r} to sort by; columns: {list(frame.columns)}")
    return shown.sort_values(query.sort, ascending=not query.descending, kind="stable", na_position="last")


def first_pass_rows(frame: pd.DataFrame) -> pd.Series:
    """Boolean per row of ``frame`` (``rollout_frame``): whether it lies in the first inner step (the
    lowest ``inner_step`` the run recorded: 0 when the first pass was traced). A run that trains
    several epochs / iterations on one batch of rollouts records the same completions at every inner
    step: a hand-written PPO loop under one step number (inner steps 0, 1, 2 of step 7), TRL's
    GRPOTrainer with ``num_iterations=2`` under consecutive step numbers (step 0 inner 0, step 1
    inner 1: its step counts optimizer steps). Either way these rows are each completion once."""
    if frame.empty or "inner_step" not in frame:
        return pd.Series(True, index=frame.index)
    return frame["inner_step"] == frame["inner_step"].min()


def pass_count(frame: pd.DataFrame) -> int:
    """How many distinct inner steps ``frame`` records (1 when no completion is trained on twice)."""
    if frame.empty or "inner_step" not in frame:
        return 1
    return int(frame["inner_step"].nunique())


def page_count(rows: int, size: int = PAGE_SIZE) -> int:
    """Pages of ``size`` rows needed for ``rows`` rows (1 for an empty table)."""
    return max(1, -(-rows // size))


def page_rows(frame: pd.DataFrame, page: int, size: int = PAGE_SIZE) -> tuple[pd.DataFrame, int]:
    """Rows ``(page - 1) * size`` to ``page * size`` of ``frame`` and the page shown: ``page``
    clamped to ``1 .. page_count``."""
    page = min(max(1, page), page_count(len(frame), size))
    return frame.iloc[(page - 1) * size: page * size], page


def row_finding_counts(rollouts: pd.DataFrame, findings: pd.DataFrame) -> pd.Series:
    """Per row of ``rollouts``: how many errors and warnings of ``findings`` (the Health page's
    findings frame of ``tracer check``) name its step file and sequence. Findings about a whole
    step file or the whole trace (no sequence), info and skipped ones are not counted. int64,
    indexed like ``rollouts``."""
    located = findings[findings["severity"].isin([ERROR, WARNING]) & findings["sequence"].notna()
                       & findings["step"].notna()]
    if located.empty or rollouts.empty:
        return pd.Series(0, index=rollouts.index, dtype="int64")
    where = located[["step", "inner_step", "micro_batch", "rank", "sequence"]].astype("int64")
    counts = where.groupby(list(where.columns)).size()
    counts.index = counts.index.set_names(list(ROW_KEY))
    keys = pd.MultiIndex.from_frame(rollouts[list(ROW_KEY)].astype("int64"))
    return pd.Series(counts.reindex(keys, fill_value=0).to_numpy(), index=rollouts.index, dtype="int64")


def tokens_params(run_label: str, row: Mapping) -> dict[str, str]:
    """The sidebar's selection parameters (``run, step, inner, mb, rank, seq``) of ``row`` (a
    rollouts row): what opens it on the Tokens page."""
    return {"run": run_label, "step": str(int(row["step"])), "inner": str(int(row["inner_step"])),
            "mb": str(int(row["micro_batch"])), "rank": str(int(row["rank"])), "seq": str(int(row["seq"]))}


def tokens_link(run_label: str, row: Mapping) -> str:
    """The relative link that opens ``row`` on the Tokens page:
    ``tokens?run=…&step=…&inner=…&mb=…&rank=…&seq=…``."""
    return link("tokens", tokens_params(run_label, row))


def shown_columns(frame: pd.DataFrame) -> list[str]:
    """The columns the table shows, in display order: those of :data:`LEADING`, the reward
    components, :data:`TRAILING`; a column no row records (every value NaN, every group -1) is left
    out (not :data:`FINDINGS`: NaN there means not checked), and so are ``micro_batch`` and ``rank`` when the run has only one of each."""
    components = [c for c in frame.columns if c.startswith("reward/")]
    order = [*LEADING, *components, *TRAILING]
    out = []
    for name in order:
        if name not in frame:
            continue
        column = frame[name]
        if name in ("micro_batch", "rank") and column.nunique() <= 1:
            continue
        if name == "group" and bool((column < 0).all()):  # no groups recorded (PPO): -1 everywhere
            continue
        if name != FINDINGS and pd.api.types.is_float_dtype(column) and column.isna().all():
            continue
        out.append(name)
    return out


def display_rows(rows: pd.DataFrame, columns: list[str], run_label: str, checked: bool) -> pd.DataFrame:
    """One page of rows as the table shows them: ``columns`` (:func:`shown_columns`), the findings
    column as text (:data:`NOT_CHECKED` when the checks have not run) and, first (in view before the
    wide text), a :data:`TOKENS_LINK` column. A new frame; ``rows`` is not changed."""
    out = rows[[c for c in columns if c != FINDINGS and c in rows]].copy()
    if "text" in out and "text_truncated" in rows:
        out["text"] = [t + "…" if cut else t for t, cut in zip(out["text"], rows["text_truncated"].fillna(False))]
    if FINDINGS in columns:
        at = columns.index(FINDINGS)
        values = rows[FINDINGS].astype("int64").astype(str) if checked and FINDINGS in rows else NOT_CHECKED
        out.insert(min(at, len(out.columns)), FINDINGS, values)
    out.insert(0, TOKENS_LINK, [tokens_link(run_label, row) for row in rows[list(ROW_KEY)].to_dict("records")])
    return out.reset_index(drop=True)


class RolloutStore:
    """The rollout frames of the last few runs read, shared by every session (the page holds one
    in ``st.cache_resource``), keyed by what identifies a run's content: its path and a digest of
    its step file names (a new step file makes a new key). Least recently used dropped first.
    Frames are shared: never mutate one."""

    def __init__(self, max_entries: int = 4) -> None:
        self.max_entries = max_entries
        self._frames: dict[tuple, pd.DataFrame] = {}

    def get(self, key: tuple) -> pd.DataFrame | None:
        frame = self._frames.pop(key, None)
        if frame is not None:
            self._frames[key] = frame  # most recently used last
        return frame

    def put(self, key: tuple, frame: pd.DataFrame) -> None:
        self._frames.pop(key, None)
        self._frames[key] = frame
        while len(self._frames) > self.max_entries:
            self._frames.pop(next(iter(self._frames)))

    def clear(self) -> None:
        self._frames.clear()


def size_text(size: int) -> str:
    """``790 MB``, ``12.3 MB``, ``0.03 MB``: a size in megabytes (10**6 bytes) to 3 significant digits."""
    return f"{size / 1e6:.3g} MB"


def summary_text(shown: int, total: int, page: int, pages: int, size: int = PAGE_SIZE) -> str:
    """``rows 51-100 of 1,234 shown (128,000 in the run) · page 2 of 25``."""
    first, last = (page - 1) * size + 1, min(page * size, shown)
    rows = f"rows {first:,}-{last:,} of {shown:,}" if shown else "no row"
    return f"{rows} shown ({total:,} in the run) · page {page} of {pages}"
