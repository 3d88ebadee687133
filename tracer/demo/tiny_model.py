"""A tiny causal LM built locally (no model hub): a byte-level BPE tokenizer trained on the bundled
``corpus.txt`` and a 2-layer ``Qwen2ForCausalLM`` warmed up on the same corpus for a second or two.

It exists so that the demo and the tests can run a real trainer (TRL's ``GRPOTrainer``) on CPU,
offline, in seconds. It is not a useful model: it has seen ~240 sentences of small-number
arithmetic, so it answers ``"3 + 4 ="`` with a number some of the time, which gives GRPO rewards
that vary within a group.

The build is deterministic for a given ``seed`` on a given machine (torch RNG forked, no threads
race in the tokenizer trainer); the caller's global RNG state is left untouched.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
PAD_TOKEN, EOS_TOKEN = "<pad>", "<|endoftext|>"  # EOS named as Qwen2Tokenizer's default eos/unk
# Qwen2Tokenizer's pre-tokenizer regex (transformers models/qwen2/tokenization_qwen2.py): digits are
# split one by one. transformers 5 loads a saved tokenizer of a ``qwen2`` model as Qwen2Tokenizer,
# which rebuilds this pre-tokenizer whatever tokenizer.json says, so we train with the same one.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
VOCAB_SIZE = 320  # 256 byte symbols + 2 specials + merges
WARMUP_STEPS = 200
WARMUP_BATCH = 32
WARMUP_LR = 3e-3


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with ``torch.set_num_threads(n)``, restoring the old count after.

    A model this small is many times faster on one thread than on two: the per-op thread hand-off
    costs more than the arithmetic (measured: 150 warm-up steps take 1.4 s on 1 thread, 12 s on 2).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def read_corpus(path: str | os.PathLike = CORPUS_PATH) -> list[str]:
    """Sentences of the corpus: one per non-empty line, ``#`` comment lines skipped."""
    with open(path, encoding="utf-8") as fh:
        return [line.rstrip("\n") for line in fh if line.strip() and not line.startswith("#")]


def train_tokenizer(lines: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ``<pad>`` (id 0) and ``<eos>`` (id 1).

    Byte-level so that decoding ids one by one and concatenating gives the same text as decoding
    them together (what the trace's ``tokens.json`` relies on). Prompts are left-padded, as TRL's
    ``GRPOTrainer`` does for generation.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
        model_max_length=128,
        clean_up_tokenization_spaces=False,
    )


# vLLM's CPU attention kernels need head_dim >= 64 (they refuse head_dim 8): the grpo-vllm demo's model.
VLLM_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}


def _tiny_config(tokenizer, **overrides):
    from transformers import Qwen2Config

    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        attention_dropout=0.0,
    )
    return Qwen2Config(**{**fields, **overrides})


def next_token_warm_up(model, tokenizer, texts: list[str], steps: int, generator: torch.Generator, batch: int,
                       lr: float, **encode: object) -> float:
    """Plain next-token training on ``texts`` (right-padded; pads ignored by the loss): ``steps`` AdamW
    steps of ``batch`` texts drawn with ``generator``; returns the last loss. The tiny models' shared
    warm-up (this module's corpus, :mod:`tracer.demo.agent_model`'s conversations); ``encode`` goes to
    the tokenizer call."""
    enc = tokenizer(texts, padding=True, padding_side="right", return_tensors="pt", **encode)
    input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]  # (N, S)
    labels = input_ids.masked_fill(attention_mask == 0, -100)  # (N, S)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        idx = torch.randint(0, input_ids.size(0), (batch,), generator=generator)
        out = model(input_ids=input_ids[idx], attention_mask=attention_mask[idx], labels=labels[idx])
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        loss = out.loss.detach()
    model.eval()
    return float(loss)


def _warm_up(model, tokenizer, lines: list[str], steps: int, generator: torch.Generator) -> float:
    """Next-token training on the corpus (each line + ``<eos>``); returns the last loss."""
    return next_token_warm_up(model, tokenizer, [line + EOS_TOKEN for line in lines], steps, generator,
                              WARMUP_BATCH, WARMUP_LR)


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0, warmup_steps: int = WARMUP_STEPS,
                     shape: dict | None = None) -> Path:
    """Train the tokenizer, build and warm up the tiny Qwen2 model, ``save_pretrained`` both.

    Args:
        out_dir: directory to write (created; files there are overwritten).
        seed: seeds the model's initialisation and the warm-up batches.
        warmup_steps: next-token training steps on the corpus (0 = random weights).
        shape: ``Qwen2Config`` fields that replace the default sizes (e.g. :data:`VLLM_SHAPE`).

    Returns:
        ``out_dir`` as a Path: loadable with ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained`` (float32, vocab ``VOCAB_SIZE``).
    """
    from transformers import AutoTokenizer, GenerationConfig, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = read_corpus()
    train_tokenizer(lines).save_pretrained(out)
    # Warm up with the tokenizer exactly as a trainer will load it from out_dir (see QWEN2_PRETOKENIZE_REGEX).
    tokenizer = AutoTokenizer.from_pretrained(out)
    with torch.random.fork_rng(devices=[]), torch_threads(1):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(_tiny_config(tokenizer, **(shape or {})))
        generator = torch.Generator().manual_seed(seed)
        loss = _warm_up(model, tokenizer, lines, warmup_steps, generator) if warmup_steps else float("nan")
    log.info("tiny model: %d parameters, warm-up loss %.3f after %d steps",
             sum(p.numel() for p in model.parameters()), loss, warmup_steps)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model.save_pretrained(out)
    return out
