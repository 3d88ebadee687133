"""``tracer view``: serve the web UI (Streamlit, bound to 127.0.0.1) on a trace, a folder of traces
or one step file, after checking what would make the server fail (a missing extra, a path that is
no trace, a busy port); the server's start-up is watched by :func:`tracer.view_server.serve`."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import socket
import sys
from pathlib import Path
from typing import Sequence

from tracer.errors import TraceError


def main(args: argparse.Namespace, app_entry: Path, streamlit_options: Sequence[str]) -> int:
    """Serve ``app_entry`` (the Streamlit app's entry file) with ``streamlit_options`` on
    ``args.path``; the server's exit code (0 on Ctrl+C), 1 when it exits or does not answer during
    start-up.

    Raises:
        TraceError: streamlit or plotly missing, the app's files missing, a path that is neither a
            trace, a folder of traces nor a step file, or a port that is taken.
    """
    from tracer.read import Trace, find_traces

    require_app_dependencies(app_entry)
    root = Path(args.path)
    if not root.exists():
        raise TraceError(f"{root} does not exist: expected a trace directory, a directory of traces or a step file")
    if root.is_dir() and not find_traces(root):
        raise TraceError(
            f"{root} holds no trace: expected a directory with manifest.json and steps/*.safetensors "
            "(written by tracer), or a directory of such directories")
    if root.is_file():
        Trace(root)  # validates a single step file
    require_free_port(args.port)
    # -P (Python 3.11+): the current directory is not put on sys.path, so a click.py there cannot shadow Streamlit's
    isolate = ["-P"] if sys.version_info >= (3, 11) else []
    cmd = [sys.executable, *isolate, "-m", "streamlit", "run", str(app_entry), *streamlit_options,
           "--server.address", "127.0.0.1", "--server.port", str(args.port),
           "--", "--root", str(root.resolve())]
    return serve_app(cmd, args.port, f"tracer: serving {root.resolve()} at http://127.0.0.1:{args.port} "
                     "(Ctrl+C to stop)", start_timeout_s=args.start_timeout)


def require_app_dependencies(app_entry: Path) -> None:
    """Raises TraceError naming the extra to install when streamlit or plotly is missing, or when
    ``app_entry`` is not a file (tracer installed without its ``app/`` folder)."""
    missing = [name for name in ("streamlit", "plotly") if importlib.util.find_spec(name) is None]
    if missing:
        raise TraceError(f"the web UI needs {' and '.join(missing)}, which this environment lacks; "
                         "install the app extra from your checkout of tracer (the web UI lives in its app/ folder): "
                         "pip install -e '.[app]' (the 'tracer' package on PyPI is another project)")
    if not app_entry.is_file():
        raise TraceError(f"the web UI's files are not installed ({app_entry} is missing): the app lives in the "
                         "repository's app/ folder; install tracer from a checkout in editable mode: "
                         "pip install -e '/path/to/tracer[app]'")


def require_free_port(port: int) -> None:
    """Fail before starting Streamlit when 127.0.0.1:``port`` is taken (Streamlit would otherwise
    print a traceback, or silently move to another port). Raises TraceError saying which port to try."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Streamlit's server does
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise TraceError(f"port {port} is in use; pass --port, e.g. --port {port + 1}") from None
            raise TraceError(f"cannot listen on 127.0.0.1:{port} ({err.strerror}); pass another --port") from None


def _echo(line: str) -> None:
    """Pass one line of the server's output on to tracer view's stdout (quietly, if that is gone)."""
    try:
        sys.stdout.write(line)
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


def serve_app(cmd: list[str], port: int, announcement: str, start_timeout_s: float = 60.0) -> int:
    """Run the Streamlit server ``cmd`` (:func:`tracer.view_server.serve`): print ``announcement``
    (the URL) once it answers, then its output; report on stderr, exit code 1, a server that exits
    during start-up or does not answer within ``start_timeout_s`` seconds, with what it printed."""
    import tracer.view_server as view_server

    run = view_server.serve(cmd, port, lambda: print(announcement, flush=True), _echo,
                            start_timeout_s=start_timeout_s)
    if run.state in (view_server.EXITED, view_server.TIMED_OUT):
        what = (f"exited with code {run.code} before it answered" if run.state == view_server.EXITED else
                f"did not answer within {start_timeout_s:g} s (stopped it; a slow machine may need "
                f"--start-timeout {max(2 * start_timeout_s, 120):g})")
        print(f"tracer view: error: the Streamlit server {what} on http://127.0.0.1:{port}{view_server.HEALTH_PATH}; "
              f"it printed:\n{run.printed.rstrip() or '(nothing)'}", file=sys.stderr)
        return 1
    return 0 if run.state == view_server.STOPPED else run.code
