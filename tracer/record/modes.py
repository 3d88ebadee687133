"""The writer modes and the settings that choose one: ``writer=`` or ``TRACER_WRITER`` (``"thread"``,
``"process"``, or ``"auto"``, the default: :func:`auto_writer`), the writer process's stall limit
(``writer_stall_s=`` or ``TRACER_WRITER_STALL_S``), and the rank a writer writes (torch.distributed,
else torchrun's variables)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from tracer.errors import TraceError

WRITERS = ("auto", "thread", "process")
WRITER_ENV = "TRACER_WRITER"  # auto | thread | process: the writer of TraceWriters that do not name one
STALL_ENV = "TRACER_WRITER_STALL_S"  # seconds: the writer process's stall limit of TraceWriters that do not set one


def distributed_rank() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed, else from torchrun's RANK / WORLD_SIZE variables
    (a writer created before ``init_process_group`` still knows its rank), else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


def writer_mode(writer: str | None) -> str:
    """``writer`` or, when None, the ``TRACER_WRITER`` environment variable, else "auto"."""
    chosen = writer if writer is not None else (os.environ.get(WRITER_ENV) or "auto")
    if chosen not in WRITERS:
        named = f"writer={writer!r}" if writer is not None else f"{WRITER_ENV}={chosen!r}"
        raise TraceError(f"{named} is not one of {list(WRITERS)}; use 'auto' (the default: the writer process "
                         "for CPU tensors when a core is free, else the thread), 'thread' (a writer thread) "
                         "or 'process' (a writer process fed through shared memory)")
    return chosen


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else the count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_writer(cpu_only: bool, platform: str | None = None, cores: int | None = None,
                local_ranks: int | None = None) -> tuple[str, str]:
    """The writer ``writer="auto"`` takes at a trace's first recorded step, and why: ``("process",
    why)`` when every tensor of that step is on the CPU (``cpu_only``), the platform is Linux (the
    writer process's shared ring and its watch on the child read Linux's memfd and /proc) and this
    process may use at least two cores per training process on the machine (``local_ranks``:
    torchrun's ``LOCAL_WORLD_SIZE``, else 1): the training thread then shares the interpreter lock
    with no writer (a zero-edit PPO loop of a tiny model paid 1.04x instead of 1.11x: BENCHMARKS.md,
    "Zero-edit and small loops"). Else ``("thread", why)``: GPU tensors keep the thread's asynchronous
    pinned-memory copy, and a machine with no core to spare gains nothing from a second process.
    ``platform``, ``cores``: ``sys.platform`` and :func:`usable_cores` unless given (tests)."""
    platform = sys.platform if platform is None else platform
    cores = usable_cores() if cores is None else cores
    if local_ranks is None:
        try:
            local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        except ValueError:
            local_ranks = 1
    if not cpu_only:
        return "thread", "auto: a tensor of the first step is not on the CPU"
    if not platform.startswith("linux"):
        return "thread", f"auto: the writer process runs on Linux only (this is {platform})"
    if cores < 2 * local_ranks:
        return "thread", f"auto: {cores} usable core(s) for {local_ranks} training process(es), none to spare"
    return "process", f"auto: CPU tensors, {cores} usable cores for {local_ranks} training process(es)"


def stall_limit(seconds: float | None) -> float | None:
    """``writer_stall_s`` or, when None, the ``TRACER_WRITER_STALL_S`` environment variable, else
    None (:data:`tracer.record.process.lifecycle.STALL_S`); TraceError unless a number > 0."""
    named = f"writer_stall_s={seconds!r}" if seconds is not None else f"{STALL_ENV}={os.environ.get(STALL_ENV)!r}"
    value: Any = seconds if seconds is not None else os.environ.get(STALL_ENV)
    if value is None or value == "":
        return None  # the writer process's own default
    try:
        value = float(value)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:
        raise TraceError(f"{named} is not a number of seconds > 0; it is how long a wait for the writer process "
                         "may hear nothing from it before it is taken for stalled (e.g. 60; inf: wait forever)")
    return value
