"""Not a training script: it scores a sentence and never calls backward (a user who points
`tracer run` at the wrong script). With --sft it takes one supervised step instead, whose frame
holds no RL tensor; with --exit_code N it ends with sys.exit(N)."""

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def evaluate(model, tokenizer, sft):
    input_ids = tokenizer(["1 + 2 = 3"], return_tensors="pt")["input_ids"]
    if sft:
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        return out.loss.item()
    with torch.no_grad():
        return model(input_ids=input_ids, labels=input_ids).loss.item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--sft", action="store_true")
    parser.add_argument("--exit_code", type=int, default=0)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    print(f"loss {evaluate(model, tokenizer, args.sft):.3f}")
    sys.exit(args.exit_code)
