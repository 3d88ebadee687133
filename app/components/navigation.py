"""Which pages the navigation shows for a run: the algorithm's own view (PPO, groups, DPO) next to
the pages every run has. Pure: the entry script turns the specs into ``st.Page`` objects."""

from __future__ import annotations

from dataclasses import dataclass

from tracer.views import GROUPED_ALGORITHMS


@dataclass(frozen=True)
class PageSpec:
    """One page: its file under ``app/``, title, icon, and the algorithms it is for (None = all)."""

    path: str
    title: str
    icon: str
    algorithms: tuple[str, ...] | None = None


PAGES: tuple[PageSpec, ...] = (
    PageSpec("app_pages/tokens.py", "Tokens", ":material/table_rows:"),
    PageSpec("app_pages/ppo.py", "PPO: GAE and early stop", ":material/timeline:", ("ppo",)),
    PageSpec("app_pages/groups.py", "Groups", ":material/group_work:", GROUPED_ALGORITHMS),
    PageSpec("app_pages/dpo.py", "DPO pairs", ":material/compare_arrows:", ("dpo",)),
    PageSpec("app_pages/mismatch.py", "Mismatch", ":material/compare:", ("ppo", "grpo", "cispo", "rloo")),
    PageSpec("app_pages/steps.py", "Steps", ":material/show_chart:"),
    PageSpec("app_pages/health.py", "Health", ":material/health_and_safety:"),
    PageSpec("app_pages/diff.py", "Diff", ":material/difference:"),
    PageSpec("app_pages/overview.py", "Overview", ":material/info:"),
)
DEFAULT_PAGE = PAGES[0].path


def _known(algorithm: str | None) -> bool:
    return any(algorithm in (spec.algorithms or ()) for spec in PAGES)


def pages_for(algorithm: str | None) -> list[PageSpec]:
    """The pages for a run of ``algorithm``: the common ones and that algorithm's view. A run whose
    algorithm is unknown (a bare step file without metadata) gets every page; each algorithm page
    says what it needs when the run lacks it."""
    if not _known(algorithm):
        return list(PAGES)
    return [spec for spec in PAGES if spec.algorithms is None or algorithm in spec.algorithms]


def hidden_pages_note(algorithm: str | None) -> str | None:
    """One plain-text line naming the algorithm pages left out for this run, or None."""
    hidden = [spec.title for spec in PAGES if spec not in pages_for(algorithm)]
    if not hidden:
        return None
    return f"Hidden for a {algorithm} run: " + ", ".join(hidden) + "."
