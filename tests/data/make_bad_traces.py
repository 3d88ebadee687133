"""Regenerate tests/data/bad_traces/: small hand-made traces and step files that are broken on
purpose (truncated, corrupt or hostile), each listed with what is wrong in bad_traces/README.md.

    python tests/data/make_bad_traces.py            (from the repository root)

Deterministic: the same bytes every run (fixed tensors, fixed manifest, no timestamps).
tests/reliability/test_corrupt.py reads the corpus and :data:`CASES` (what each file should give).
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import torch
from safetensors.torch import save

HERE = Path(__file__).resolve().parent
OUT = HERE / "bad_traces"
if str(HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[1]))

from tracer.format.names import step_file_name  # noqa: E402
from tracer.format.metadata_codec import encode_metadata  # noqa: E402

VOCAB = ["<pad>", "<eos>", "Hello", " world", "<script>alert(1)</script>", "<b>", " yes", " no"]
B, T = 2, 4
GOOD_STEPS = (0, 30)  # readable step files on both sides of the bad ones in mixed/

# mixed/steps/: step number -> (what is wrong, readable?). Readable files are odd but usable: the
# reader serves them and the checks report what they find.
CASES: dict[int, tuple[str, bool]] = {
    1: ("truncated: the last 10 bytes of tensor data are cut off", False),
    2: ("flipped bytes in the JSON header (two bytes XOR 0xFF): not valid JSON", False),
    3: ("the 8-byte header length claims 2**62 bytes", False),
    4: ("the 8-byte header length is larger than the file (but under any cap)", False),
    5: ("completion_ids stored as F32 (a token id field must be an integer)", False),
    6: ("policy_logprobs has T = 3 while completion_ids has T = 4", False),
    7: ("policy_logprobs is 1-d [B] instead of [B, T]", False),
    8: ("empty file (0 bytes)", False),
    9: ("a text file with a .safetensors name", False),
    10: ("header is valid JSON but not a safetensors tensor table", False),
    11: ("a tensor's data offsets point past the end of the data", False),
    12: ("a tensor of unknown dtype 'Q9'", False),
    13: ("completion_mask stored as F8_E4M3 (an 8-bit float torch stores but a mask must not be)", False),
    14: ("not a trace: tensors of a model checkpoint (weight, bias), no canonical field", True),
    15: ("metadata values that are not JSON where JSON is expected (num_generations 'two', "
         "clip_epsilon_low '{oops', reward_component_names '[unclosed')", True),
    16: ("a metadata value nested 5000 deep ([[[[...]]]]), which overflows a recursive JSON parser", True),
    17: ("completion_mask is a float mask holding 0.5 (a mask holds only 0 and 1): header fine, data refused", False),
    18: ("metadata that claims another step (step 999), an unknown algorithm 'sarsa', rank '[1, 2]', "
         "world_size 'x'", True),
}
LEFTOVERS = {  # files in mixed/steps/ that a reader must not list as steps at all
    f"{step_file_name(19)}.partial": "a half-written step file left by a crash (the writer's temporary name)",
    ".tmpA1b2C3": "safetensors' own temporary file left by a crash",
}
OTHER_TRACES: dict[str, str] = {  # directory -> what is wrong; each also holds one good step file
    "manifest_missing": "no manifest.json (steps only)",
    "manifest_malformed": "manifest.json is not JSON ('{\"algorithm\": \"grpo\",' cut short)",
    "manifest_not_object": "manifest.json is a JSON list, not an object",
    "manifest_wrong_types": "manifest keys of the wrong JSON type (algorithm 5, hyperparameters a list, "
                            "dropped_steps 'many', config 'x', tokenizer.eos_token_id '1')",
    "manifest_tokenizer_string": "manifest tokenizer is the string 'gpt2', not an object",
    "manifest_deep": "manifest.json nested 5000 deep",
    "tokens_malformed": "tokens.json holds {\"tokens\": \"abc\"} (not a list)",
    "tokens_not_strings": "tokens.json holds numbers and objects among the token strings",
}
SINGLE_FILES: dict[str, str] = {  # single step files given directly to info/check/diff
    "truncated.safetensors": "truncated step file (tensor data cut short)",
    "huge_header.safetensors": "header length of 2**62 bytes",
    "not_a_trace.safetensors": "a model checkpoint's tensors, no canonical field (readable, nothing to check)",
}


def good_tensors(step: int) -> dict[str, torch.Tensor]:
    """One GRPO step of B = 2, T = 4 whose values are derived from ``step``."""
    completion_ids = torch.tensor([[2, 4, 1, 0], [6, 5, 7, 1]])  # (B, T); row 0 holds the <script> token
    completion_mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    policy = -torch.arange(B * T, dtype=torch.float32).reshape(B, T) / 10 - step  # (B, T) nats
    return {
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "policy_logprobs": policy, "old_logprobs": policy.clone(),
        "ratio": torch.ones(B, T), "rewards": torch.tensor([1.0, 0.0]), "advantages": torch.tensor([1.0, -1.0]),
        "group_ids": torch.tensor([0, 0]),
    }


def metadata(step: int, **extra: object) -> dict[str, str]:
    return encode_metadata({"schema_version": "1", "algorithm": "grpo", "step": step, "inner_step": 0,
                            "micro_batch": 0, "rank": 0, "world_size": 1, "num_generations": 2,
                            "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.2, **extra})


def saved(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    """safetensors bytes with the header's keys sorted (safetensors orders metadata by a hash map,
    which differs between processes; sorted, the corpus is the same bytes every run)."""
    header, data = split(save(tensors, metadata=meta))
    return join(header, data)


def step_bytes(step: int, tensors: dict[str, torch.Tensor] | None = None, **meta: object) -> bytes:
    return saved(good_tensors(step) if tensors is None else tensors, metadata(step, **meta))


def split(payload: bytes) -> tuple[dict, bytes]:
    """(parsed JSON header, tensor data) of a safetensors payload."""
    (n,) = struct.unpack("<Q", payload[:8])
    return json.loads(payload[8:8 + n]), payload[8 + n:]


def join(header: dict | str, data: bytes) -> bytes:
    """A safetensors payload from a header (dict, or raw text) and data; the header is padded to 8."""
    text = (header if isinstance(header, str) else json.dumps(header, sort_keys=True)).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def retyped(step: int, name: str, dtype: str) -> bytes:
    """A step file whose field ``name`` claims ``dtype`` (of the same byte width, so offsets stay valid)."""
    header, data = split(step_bytes(step))
    header[name]["dtype"] = dtype
    return join(header, data)


def bad_step(step: int) -> bytes:
    good = step_bytes(step)
    header, data = split(good)
    if step == 1:
        return good[:-10]
    if step == 2:
        out = bytearray(good)
        out[8], out[20] = out[8] ^ 0xFF, out[20] ^ 0xFF
        return bytes(out)
    if step == 3:
        return struct.pack("<Q", 2**62) + good[8:]
    if step == 4:
        return struct.pack("<Q", len(good)) + good[8:]
    if step == 5:
        tensors = good_tensors(step)
        tensors["completion_ids"] = tensors["completion_ids"].float()
        return step_bytes(step, tensors)
    if step == 6:
        tensors = good_tensors(step)
        tensors["policy_logprobs"] = tensors["policy_logprobs"][:, :3].contiguous()
        return step_bytes(step, tensors)
    if step == 7:
        tensors = good_tensors(step)
        tensors["policy_logprobs"] = tensors["policy_logprobs"][:, 0].contiguous()
        return step_bytes(step, tensors)
    if step == 8:
        return b""
    if step == 9:
        return b"hello, I am not a safetensors file\n"
    if step == 10:
        return join({"hello": "world", "numbers": [1, 2, 3]}, b"")
    if step == 11:
        header["ratio"]["data_offsets"] = [len(data) - 4, len(data) + 28]
        return join(header, data)
    if step == 12:
        header["ratio"]["dtype"] = "Q9"
        return join(header, data)
    if step == 13:
        tensors = good_tensors(step)
        tensors["completion_mask"] = tensors["completion_mask"].to(torch.uint8)
        header, data = split(step_bytes(step, tensors))
        header["completion_mask"]["dtype"] = "F8_E4M3"
        return join(header, data)
    if step == 14:
        return saved({"weight": torch.ones(3, 2), "bias": torch.zeros(3)}, {"format": "pt"})
    if step == 15:
        return saved(good_tensors(step), {**metadata(step), "num_generations": "two", "clip_epsilon_low": "{oops",
                                          "reward_component_names": "[unclosed"})
    if step == 16:
        return step_bytes(step, nested="[" * 5000 + "]" * 5000)
    if step == 17:
        tensors = good_tensors(step)
        tensors["completion_mask"] = torch.tensor([[1.0, 0.5, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
        return step_bytes(step, tensors)
    if step == 18:
        return saved(good_tensors(step), {**metadata(step), "step": "999", "algorithm": "sarsa", "rank": "[1, 2]",
                                          "world_size": "x"})
    raise ValueError(step)


def manifest(**extra: object) -> dict:
    return {"format": "tracer-trace", "schema_version": "1", "algorithm": "grpo", "status": "running",
            "world_size": 1, "hyperparameters": {"num_generations": 2}, "config": {},
            "tokenizer": {"class": "Toy", "eos_token_id": 1, "pad_token_id": 0}, "dropped_steps": 0, **extra}


def write_trace(root: Path, manifest_text: str | None, tokens_text: str | None, steps: dict[str, bytes]) -> None:
    (root / "steps").mkdir(parents=True)
    if manifest_text is not None:
        (root / "manifest.json").write_text(manifest_text)
    if tokens_text is not None:
        (root / "tokens.json").write_text(tokens_text)
    for name, payload in steps.items():
        (root / "steps" / name).write_bytes(payload)


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    tokens = json.dumps({"tokens": VOCAB})
    good = {step_file_name(s): step_bytes(s) for s in GOOD_STEPS}
    steps = {**good, **{step_file_name(s): bad_step(s) for s in CASES}}
    steps.update({name: step_bytes(19)[:100] for name in LEFTOVERS})
    write_trace(OUT / "mixed", json.dumps(manifest(), indent=1), tokens, steps)
    one = {step_file_name(0): step_bytes(0)}
    texts = {
        "manifest_missing": None,
        "manifest_malformed": '{"algorithm": "grpo",',
        "manifest_not_object": "[1, 2, 3]",
        "manifest_wrong_types": json.dumps(manifest(algorithm=5, hyperparameters=[1, 2], dropped_steps="many",
                                                    config="x", tokenizer={"class": "Toy", "eos_token_id": "1"})),
        "manifest_tokenizer_string": json.dumps(manifest(tokenizer="gpt2")),
        "manifest_deep": "[" * 5000 + "]" * 5000,
    }
    for name in OTHER_TRACES:
        text = texts.get(name, json.dumps(manifest()))
        token_text = {"tokens_malformed": '{"tokens": "abc"}',
                      "tokens_not_strings": json.dumps({"tokens": ["<pad>", 1, {"x": 2}, None]})}.get(name, tokens)
        write_trace(OUT / name, text, token_text, one)
    (OUT / "single").mkdir()
    (OUT / "single" / "truncated.safetensors").write_bytes(step_bytes(3)[:-10])
    (OUT / "single" / "huge_header.safetensors").write_bytes(struct.pack("<Q", 2**62) + step_bytes(3)[8:])
    (OUT / "single" / "not_a_trace.safetensors").write_bytes(bad_step(14))
    write_readme()


def write_readme() -> None:
    lines = ["# Bad traces (made by tests/data/make_bad_traces.py; do not edit by hand)", "",
             "Each file is broken on purpose. The reader, `info`, `check` and `diff` must say which file",
             "and why, keep serving the other steps, never hang and never crash "
             "(tests/reliability/test_corrupt.py).", "",
             "## mixed/ (good steps 0 and 30 around the bad ones; manifest status 'running')", ""]
    for step, (what, readable) in CASES.items():
        kind = "readable, odd" if readable else "unreadable"
        lines.append(f"- `mixed/steps/{step_file_name(step)}` ({kind}): {what}")
    for name, what in LEFTOVERS.items():
        lines.append(f"- `mixed/steps/{name}` (not listed): {what}")
    lines += ["", "## Other traces (each also holds one good step file)", ""]
    lines += [f"- `{name}/`: {what}" for name, what in OTHER_TRACES.items()]
    lines += ["", "## Single step files", ""]
    lines += [f"- `single/{name}`: {what}" for name, what in SINGLE_FILES.items()]
    (OUT / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
