"""The checkout's own ``__main__``: what ``python -m tracer`` runs when Python took this checkout for
the package ``tracer``.

That happens when the repository was cloned into a folder named ``tracer`` and Python runs from its
parent: the current folder (or a script's) comes first on ``sys.path``, and Python imports the clone
folder, which has no ``__init__.py``, as an empty namespace package named ``tracer``, ahead of the
real package in ``<clone>/tracer/`` (and ahead of an editable install's import hook). A script there
then fails with ``AttributeError: module 'tracer' has no attribute 'Tracer'``; no code of tracer runs,
so tracer cannot say why. ``python -m tracer`` can: it finds this file, which says what happened and
exits 2. (A root ``__init__.py`` would catch the script too, but it makes pytest import the checkout
as a package and name every test module ``<clone folder>.tests...``, which breaks the test suite.)

Run as ``python <checkout>``, the checkout is on ``sys.path`` and the real command line runs.
"""

import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent


def shadowing_hint(checkout: Path) -> str:
    """What happened, and what to do, when the checkout folder was imported as the package ``tracer``."""
    return (f"python imported the folder {checkout} as the package 'tracer', but it is a checkout of tracer "
            f"(the package is its subfolder {checkout / 'tracer'}): Python looks in the current folder "
            f"({checkout.parent}) first, and a folder named 'tracer' there shadows the real package. Scripts "
            f"run from {checkout.parent} fail the same way (module 'tracer' has no attribute 'Tracer'). "
            f"Run from another folder (e.g. cd {checkout}), or rename the checkout "
            f"(mv {checkout} {checkout.parent / 'tracer-src'}, then pip install -e {checkout.parent / 'tracer-src'} "
            "if it was installed from there).")


if __spec__ is not None and __spec__.name == "tracer.__main__":  # python -m tracer, from the checkout's parent
    print(f"tracer: error: {shadowing_hint(CHECKOUT)}", file=sys.stderr)
    raise SystemExit(2)

sys.path.insert(0, str(CHECKOUT))
from tracer.cli import main  # noqa: E402  (python <checkout>: the checkout is the folder above the package)

raise SystemExit(main())
