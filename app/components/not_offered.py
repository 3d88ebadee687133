"""The page a link to a page not offered for the chosen run opens (``/groups`` of a PPO run,
``/mismatch`` of a run without ``sampler_logprobs``): which page, why (the reason comes from
:func:`app.components.navigation.not_offered_reason`), and links to the pages the run has, with the
URL's selection kept. The entry script registers one hidden ``st.Page`` per such page, at that
page's own URL path, so that Streamlit's generic "Page not found" never shows for them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import streamlit as st

from app.components import urls
from app.components.navigation import PageSpec


def not_offered_page(spec: PageSpec, reason: str, offered: Sequence[PageSpec]) -> Callable[[], None]:
    """A callable for ``st.Page`` drawing the explanation for ``spec`` (``reason``) and a link to each
    page of ``offered``."""

    def not_offered() -> None:
        st.title(f"{spec.title}: not offered for this run")
        st.warning(f"/{spec.url_path} is not offered for this run. {reason}", icon=":material/visibility_off:")
        st.markdown("The pages this run has:")
        for page in offered:
            st.page_link(page.path, label=page.title, icon=page.icon, query_params=urls.current())

    return not_offered
