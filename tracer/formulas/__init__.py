"""The RL maths of the seed (SPEC.md section 3), once: a package (the next commit splits
:mod:`tracer.formulas.logprobs`, the former ``tracer/formulas.py``, into themed submodules)."""

from tracer.formulas.logprobs import *  # noqa: F401,F403
from tracer.formulas.logprobs import _NUMPY_DTYPES, _clip_fractions_host  # noqa: F401
