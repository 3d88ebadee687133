"""Shared pieces of the benchmarks: the machine description, timing helpers, a GRPO-shaped step."""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time

import torch


def machine() -> str:
    """One line describing where the numbers were measured."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"Python {platform.python_version()}, {gpu}")


def file_create_us(directory: str | None = None, files: int = 200) -> float:
    """Median microseconds to create (and close) one empty file in a new folder under ``directory``
    (default: the temp folder, ``TMPDIR``): the file system's part of every step file. On this
    project's VMs it is anything from 7 us (/dev/shm) to 700 us (ext4, some folders, some hours), so
    a writer's cost is only comparable between runs with this figure beside it."""
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        times = []
        for i in range(files):
            t0 = time.perf_counter()
            os.close(os.open(os.path.join(tmp, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def trace_dir_line(directory: str | None = None) -> str:
    """Where the benchmark's traces go and what a file costs there (:func:`file_create_us`)."""
    where = directory or tempfile.gettempdir()
    return (f"traces under {where}: creating a file there costs {file_create_us(directory):.0f} us "
            "(set TMPDIR=/dev/shm to leave the disk out)")


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def grpo_step_tensors(B: int, T: int, L: int = 32, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """The tensors a GRPO step records (14 fields, [B, T] float32 mostly), with realistic values:
    logprobs in [-3, 0], derived fields computed from them by tracer.formulas."""
    from tracer import formulas

    g = torch.Generator(device="cpu").manual_seed(seed)
    policy = -3 * torch.rand(B, T, generator=g)
    old = policy + 0.05 * torch.randn(B, T, generator=g)
    ref = policy + 0.1 * torch.randn(B, T, generator=g)
    advantages = torch.randn(B, generator=g)
    t = {
        "prompt_ids": torch.randint(0, 32000, (B, L), generator=g),
        "prompt_mask": torch.ones(B, L, dtype=torch.bool),
        "completion_ids": torch.randint(0, 32000, (B, T), generator=g),
        "completion_mask": torch.ones(B, T, dtype=torch.bool),
        "policy_logprobs": policy,
        "old_logprobs": old,
        "ref_logprobs": ref,
        "ratio": formulas.ratio(policy, old),
        "ref_kl_k3": formulas.ref_kl_k3(policy, ref),
        "approx_kl_k2": formulas.approx_kl_k2(policy, old),
        "per_token_loss": formulas.grpo_per_token_loss(policy, old, advantages, 0.2, 0.2, 0.04, ref),
        "rewards": torch.rand(B, generator=g),
        "advantages": advantages,
        "group_ids": torch.arange(B) // 8,
    }
    return {k: v.to(device) for k, v in t.items()}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
