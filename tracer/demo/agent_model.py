"""A tiny tool-calling causal LM built locally (no model hub), for the ``agent`` demo: a byte-level
BPE tokenizer with the ChatML tool-calling tokens, TRL's bundled Qwen2.5 chat template (so that
TRL recognises it, sets its response parser and accepts ``tools=``), and a 2-layer
``Qwen2ForCausalLM`` warmed up on conversations where the assistant calls the ``add`` tool, reads
the result and calls it again or answers.

Why each piece:

- The chat template is Qwen2.5's (TRL's bundled ``qwen2_5.jinja``) with the tools preamble cut to a
  line (:data:`CHAT_TEMPLATE`); it passes TRL's ``supports_tool_calling`` and
  ``is_chat_template_prefix_preserving``. TRL picks a tool-call parser only for templates it knows
  by their text, so the tokenizer is saved with TRL's Qwen parser as its ``response_template``.
- ``<|im_end|>`` is the EOS: TRL trims the tool-suffix ids at the EOS (``_get_tool_suffix_ids``)
  and generation stops there, so every assistant turn ends with it. ``<|endoftext|>`` is the pad.
- ``<tool_call>`` … ``</tool_response>`` are added as non-special tokens (as in Qwen2.5's own
  tokenizer), so that decoding keeps them and the response parser sees them.
- A random model never writes ``<tool_call>``; a few hundred next-token steps on rendered
  conversations (a second or two on one CPU thread) make it call the tool in most episodes, not
  always with the right numbers, which gives GRPO rewards that vary within a group.

Deterministic for a given ``seed`` on a given machine; the caller's global RNG is left untouched.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import torch

from tracer.demo.tiny_model import QWEN2_PRETOKENIZE_REGEX, next_token_warm_up, torch_threads

log = logging.getLogger(__name__)

IM_START, IM_END, PAD_TOKEN = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
VOCAB_SIZE = 480
MAX_POSITIONS = 512
WARMUP_STEPS = 500
WARMUP_BATCH = 16
WARMUP_LR = 3e-3
SYSTEM_PROMPT = "You add numbers with the add tool."


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return int(a) + int(b)


def question(numbers: list[int]) -> list[dict[str, str]]:
    """The prompt messages asking for the sum of ``numbers`` (a system and a user message)."""
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "What is " + " + ".join(str(n) for n in numbers) + "?"}]


def solved_episode(numbers: list[int]) -> list[dict[str, Any]]:
    """The whole conversation the warm-up teaches: one ``add`` call per ``+`` (each on the running
    sum and the next number), each answered by a tool message, then the final sum."""
    messages: list[dict[str, Any]] = question(numbers)
    total = numbers[0]
    for n in numbers[1:]:
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": total, "b": n}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        total = add(total, n)
        messages.append({"role": "tool", "name": "add", "content": str(total)})
    messages.append({"role": "assistant", "content": f"The answer is {total}."})
    return messages


def random_numbers(rng: random.Random) -> list[int]:
    """Two or three one-digit numbers (two: 2 assistant turns; three: 3)."""
    return [rng.randrange(10) for _ in range(rng.choice((2, 3)))]


# Qwen2.5's chat template (TRL's bundled ``qwen2_5.jinja``) with its tools preamble (~180 tokens of
# JSON schema and instructions) cut to one line naming the tools: the same ChatML turns, tool calls and
# ``<tool_response>`` blocks, at a third of the length, so the CPU warm-up and rollouts stay short.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.' }}{%- endif %}"
    "{%- if tools %}{{- '\\nTools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def response_template() -> dict:
    """TRL's parser for Qwen-style tool calls (``trl.chat_template_utils.qwen3_template``): TRL
    recognises only its bundled templates by their text, so the tokenizer carries the parser itself."""
    from trl.chat_template_utils import qwen3_template

    return qwen3_template


@functools.lru_cache(maxsize=1)
def _add_schema() -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(add)


def render(messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    """``messages`` rendered with :func:`chat_template` and the ``add`` tool, as text."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=[_add_schema()], chat_template=CHAT_TEMPLATE,
                                        add_generation_prompt=add_generation_prompt)
    return rendered[0]


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts``: ``<|endoftext|>`` (pad, id
    0), ``<|im_start|>``, ``<|im_end|>`` (EOS) special; the four tool tokens added, not special."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [PAD_TOKEN, IM_START, IM_END]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=IM_END,
                                   padding_side="left", model_max_length=MAX_POSITIONS,
                                   clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
                                   response_template=response_template())


def _warm_up(model, tokenizer, texts: list[str], steps: int, generator: torch.Generator) -> float:
    """Next-token training on the rendered conversations (every token; pads ignored); the last loss."""
    return next_token_warm_up(model, tokenizer, texts, steps, generator, WARMUP_BATCH, WARMUP_LR,
                              add_special_tokens=False)


def build_agent_model(out_dir: str | os.PathLike, seed: int = 0, warmup_steps: int = WARMUP_STEPS,
                      episodes: int = 400) -> Path:
    """Train the tokenizer, build and warm up the tiny tool-calling Qwen2 model, ``save_pretrained`` both.

    Args:
        out_dir: directory to write (created; files there are overwritten).
        seed: seeds the warm-up conversations, the model's initialisation and the warm-up batches.
        warmup_steps: next-token steps on the solved conversations (0 = random weights).
        episodes: how many solved conversations to render for the tokenizer and the warm-up.

    Returns:
        ``out_dir`` as a Path, loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``.
    """
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    texts = [render(solved_episode(random_numbers(rng))) for _ in range(episodes)]
    train_tokenizer(texts).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)  # as a trainer will load it (Qwen2 pre-tokenizer rebuilt)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, attention_dropout=0.0)
    with torch.random.fork_rng(devices=[]), torch_threads(1):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        generator = torch.Generator().manual_seed(seed)
        loss = _warm_up(model, tokenizer, texts, warmup_steps, generator) if warmup_steps else float("nan")
    log.info("agent model: %d parameters, warm-up loss %.3f after %d steps",
             sum(p.numel() for p in model.parameters()), loss, warmup_steps)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model.save_pretrained(out)
    (out / "warm_up.json").write_text(json.dumps({"steps": warmup_steps, "loss": loss, "seed": seed}) + "\n")
    return out
