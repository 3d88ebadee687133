"""The app's root URL (``/``): the Tokens page itself (also served at ``/tokens``), run in place
rather than by a redirect, so that a choice made while the page loads is never undone."""

import runpy
from pathlib import Path

from app.components.navigation import DEFAULT_PAGE

runpy.run_path(str(Path(__file__).resolve().parents[1] / DEFAULT_PAGE), run_name="__main__")
