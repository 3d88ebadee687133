"""Which pages the navigation shows for a run: the algorithm's own view (PPO, groups, DPO) next to
the pages every run has, less a page whose field the run does not record (Mismatch without
``sampler_logprobs``); the sidebar names what is hidden and why, and a link to a hidden page
(``/groups`` of a PPO run) opens a page saying why it is not offered (:func:`not_offered_reason`)
instead of Streamlit's "Page not found". Pure: the entry script turns the specs into ``st.Page``
objects."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tracer.views import GROUPED_ALGORITHMS


@dataclass(frozen=True)
class PageSpec:
    """One page: its file under ``app/``, title, icon, the algorithms it is for (None = all), its
    URL path (``/tokens``, ``/step``…) and the fields it shows (a run recording none is not offered it)."""

    path: str
    title: str
    icon: str
    algorithms: tuple[str, ...] | None = None
    url_path: str = ""
    needs: tuple[str, ...] = ()


PAGES: tuple[PageSpec, ...] = (
    PageSpec("app_pages/tokens.py", "Tokens", ":material/table_rows:", url_path="tokens"),
    PageSpec("app_pages/rollouts.py", "Rollouts", ":material/list:", ("ppo", "grpo", "cispo", "rloo"), "rollouts"),
    PageSpec("app_pages/conversation.py", "Conversation", ":material/forum:", ("ppo", "grpo", "cispo", "rloo"),
             "conversation"),
    PageSpec("app_pages/step.py", "Step", ":material/grid_on:", ("ppo", "grpo", "cispo", "rloo"), "step"),
    PageSpec("app_pages/ppo.py", "PPO: GAE and early stop", ":material/timeline:", ("ppo",), "ppo"),
    PageSpec("app_pages/groups.py", "Groups", ":material/group_work:", GROUPED_ALGORITHMS, "groups"),
    PageSpec("app_pages/dpo.py", "DPO pairs", ":material/compare_arrows:", ("dpo",), "dpo"),
    PageSpec("app_pages/mismatch.py", "Mismatch", ":material/compare:", ("ppo", "grpo", "cispo", "rloo"), "mismatch",
             needs=("sampler_logprobs",)),
    PageSpec("app_pages/steps.py", "Steps", ":material/show_chart:", url_path="steps"),
    PageSpec("app_pages/health.py", "Health", ":material/health_and_safety:", url_path="health"),
    PageSpec("app_pages/diff.py", "Diff", ":material/difference:", url_path="diff"),
    PageSpec("app_pages/overview.py", "Overview", ":material/info:", url_path="overview"),
)
DEFAULT_PAGE = PAGES[0].path  # a run's first page (Tokens, at /tokens)
# The app's root URL (``/``): every run under the root, whatever run the sidebar shows.
RUNS_PAGE = PageSpec("app_pages/runs.py", "Runs", ":material/folder_open:")
# Pages on which the sidebar's run choosers have no effect (they are hidden there).
RUN_FREE_PAGES = frozenset({"diff"})


def _known(algorithm: str | None) -> bool:
    return any(algorithm in (spec.algorithms or ()) for spec in PAGES)


def pages_for(algorithm: str | None, recorded: Collection[str] | None = None) -> list[PageSpec]:
    """The pages for a run of ``algorithm``: the common ones and that algorithm's view. A run whose
    algorithm is unknown (a bare step file without metadata) gets every page; each algorithm page
    says what it needs when the run lacks it. With ``recorded`` (the fields the run's step files
    hold), a page whose ``needs`` are not all recorded is left out; None (not known): kept."""
    specs = list(PAGES) if not _known(algorithm) else [
        spec for spec in PAGES if spec.algorithms is None or algorithm in spec.algorithms]
    if recorded is None:
        return specs
    return [spec for spec in specs if set(spec.needs) <= set(recorded)]


def hidden_pages_note(algorithm: str | None, recorded: Collection[str] | None = None) -> str | None:
    """Plain text naming the pages left out for this run and why (its algorithm, or a field it does
    not record), or None."""
    by_algorithm = [spec.title for spec in PAGES if spec not in pages_for(algorithm)]
    by_field = [spec for spec in pages_for(algorithm) if spec not in pages_for(algorithm, recorded)]
    parts = [f"Hidden for a {algorithm} run: " + ", ".join(by_algorithm) + "."] if by_algorithm else []
    parts += [f"Hidden for this run: {spec.title} (no {', '.join(spec.needs)} in the first or the selected "
              "step file)." for spec in by_field]
    return " ".join(parts) or None


def not_offered_reason(spec: PageSpec, algorithm: str | None, recorded: Collection[str] | None = None) -> str:
    """Why ``spec`` is not among :func:`pages_for` ``(algorithm, recorded)``: the algorithms it is
    for, or the fields it shows that the run does not record (plain text, one sentence or two)."""
    if spec not in pages_for(algorithm):
        return (f"The {spec.title} page is for {', '.join(spec.algorithms or ())} runs; this run's algorithm "
                f"is {algorithm}.")
    missing = sorted(set(spec.needs) - set(recorded or ()))
    return (f"The {spec.title} page shows {', '.join(spec.needs)}, which this run does not record (no "
            f"{', '.join(missing)} in the first or the selected step file).")
