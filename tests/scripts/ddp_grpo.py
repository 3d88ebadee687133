"""The hand-written GRPO loop under torch.distributed (gloo, CPU), one process per rank.

Run: python -m torch.distributed.run --nproc_per_node 2 tests/scripts/ddp_grpo.py OUT_DIR MODEL_DIR
Each rank samples its own prompts (seed + rank); gradients are averaged by DistributedDataParallel;
each rank writes its own step files into OUT_DIR.
"""

import copy
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracer import Tracer
from tracer.demo import grpo_loop


def main(out_dir: str, model_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    cfg = grpo_loop.GRPOConfig(steps=2, seed=rank)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    ddp = DistributedDataParallel(model)
    with Tracer(out_dir, algorithm="grpo", tokenizer=tokenizer, config=asdict(cfg),
                hyperparameters=grpo_loop.hyperparameters(cfg)) as tr:
        grpo_loop.train(ddp, ref_model, tokenizer, cfg, tr)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
