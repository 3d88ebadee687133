"""What the commands that read one trace (``info``, ``check``) say about a path that is a folder of
traces rather than a trace."""

from __future__ import annotations

from pathlib import Path

from tracer.errors import TraceError


def refuse_a_folder_of_traces(path: str, command: str) -> None:
    """A folder that is not a trace but holds some (``runs/``): say which, rather than 'not a trace'.

    Raises:
        TraceError: ``path`` is a folder without ``manifest.json`` or ``steps/`` that holds traces;
            the message names the first five and how to pass one to ``tracer <command>``.
    """
    from tracer.read import find_traces

    folder = Path(path)
    if not folder.is_dir() or (folder / "manifest.json").exists() or (folder / "steps").is_dir():
        return
    inside = [t for t in find_traces(folder) if t != folder]
    if inside:
        shown = ", ".join(str(t) for t in inside[:5]) + (f" and {len(inside) - 5} more" if len(inside) > 5 else "")
        raise TraceError(f"{folder} is a folder of {len(inside)} trace(s), not a trace: pass one of them, "
                         f"e.g. tracer {command} {inside[0]} ({shown})")
