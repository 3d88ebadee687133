"""``streamlit`` with a timing log of every script run: run by path (not ``-m``), so that the same
hook times any copy of the app (this checkout's, or main's extracted by ``git archive``) without
touching it.

    TRACER_BENCH_TIMING=runs.jsonl python bench/streamlit_timed.py run app/streamlit_app.py ...

It wraps ``exec_func_with_error_handling``, the call through which Streamlit's ``ScriptRunner``
executes one run of the script (the whole page: entry script, sidebar and page), and appends one
JSON line per run: ``{"session", "start", "end", "fragment", "rerun"}`` (``time.time()`` seconds, so
the browser driver can compare them with its own clock; ``rerun`` when the run was cut short by a
rerun request, ``fragment`` for a fragment-only run such as auto-refresh). With
``TRACER_BENCH_PROFILE=DIR`` each run is also profiled (cProfile) into ``DIR/<start>.prof``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def install(log_path: str) -> None:
    """Wrap the script runner's exec function so that every script run appends a line to ``log_path``."""
    from streamlit.runtime.scriptrunner import script_runner

    inner = script_runner.exec_func_with_error_handling
    lock = threading.Lock()

    profile_dir = os.environ.get("TRACER_BENCH_PROFILE")

    def timed(func, ctx):
        start = time.time()
        if profile_dir:  # one cProfile dump per script run (for finding where the time goes)
            import cProfile

            with cProfile.Profile() as prof:
                result = inner(func, ctx)
            prof.dump_stats(os.path.join(profile_dir, f"{start:.3f}.prof"))
        else:
            result = inner(func, ctx)
        line = {"session": ctx.session_id, "start": start, "end": time.time(),
                "fragment": bool(ctx.fragment_ids_this_run), "rerun": result[2] is not None}
        with lock, open(log_path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        return result

    script_runner.exec_func_with_error_handling = timed


def main() -> None:
    sys.path.pop(0)  # run by path: bench/ is not a place to import modules from
    log_path = os.environ.get("TRACER_BENCH_TIMING")
    if log_path:
        install(log_path)
    from streamlit.web.cli import main as streamlit_main

    sys.argv[0] = "streamlit"
    streamlit_main()


if __name__ == "__main__":
    main()
