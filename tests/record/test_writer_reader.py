"""TraceWriter -> files -> Trace round trips, atomic files, schema errors, write failures."""

import json
import os
import warnings

import pytest
import torch

from tracer import SchemaError, Trace, TraceError, TraceFormatError, TraceWriter
from tracer.format.schema import METADATA_KEYS
from tracer.record.writer import MANIFEST_NAME, STEPS_DIR, step_file_name

from tests.fixtures.paths import SAMPLES

B, T, L = 4, 5, 3


def grpo_tensors(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    completion_ids = torch.tensor([[5, 6, 1, 0, 0], [7, 7, 7, 7, 7], [5, 1, 0, 0, 0], [6, 6, 6, 1, 0]])
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    policy = -torch.rand(B, T, generator=g)
    return {
        "prompt_ids": torch.tensor([[0, 3, 4], [3, 4, 4], [0, 0, 3], [3, 3, 4]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]]),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "policy_logprobs": policy.to(dtype),
        "old_logprobs": (policy - 0.01).to(dtype),
        "rewards": torch.tensor([1.0, 0.0, 0.5, 0.5]),
        "advantages": torch.tensor([1.0, -1.0, 0.0, 0.0]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "reward_components": torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.5, 0.0], [0.25, 0.25]]),
    }


ALL_METADATA = {
    "num_generations": 2, "clip_epsilon_low": 0.2, "clip_epsilon_high": 0.28, "beta": 0.04, "kl_coef": 0.1,
    "gamma": 1.0, "lam": 0.95, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "loss_reduction": "sequence_mean",
    "reward_component_names": ["accuracy", "length"], "old_logprobs_source": "recorded", "trl_loss_type": "grpo",
    "advantage_rule": "group_zscore", "gradient_accumulation_steps": 4, "kl_in_reward": True, "kl_estimator": "k1",
    "micro_batch_counted": True, "rows_before_cut": 16,
    "role_names": ["system", "user", "assistant", "tool"], "advantage_assignment": "episode",
    "mask_reason_names": ["kept", "prompt", "padding", "after_eos", "truncated", "tool_output", "environment"],
    "is_correction": True, "is_mode": "token_mask", "is_clip_min": 0.8, "is_clip_max": 1.25,
    "is_sequence_aggregation": "sum", "is_weights_source": "recorded", "trainer_version": 12, "max_policy_lag": 2,
}


def test_round_trip_dtypes_and_every_metadata_key(tmp_path):
    tensors = {
        "f32": torch.tensor([1.5, -2.25], dtype=torch.float32),
        "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "f16": torch.tensor([1.5, -2.25], dtype=torch.float16),
        "flags": torch.tensor([True, False]),
        "ids": torch.tensor([3, 2**40], dtype=torch.int64),
    }
    with TraceWriter(tmp_path / "run", "grpo", hyperparameters=ALL_METADATA) as writer:
        writer.record(7, tensors, inner_step=1, micro_batch=2)
    trace = Trace(tmp_path / "run")
    (key,) = trace.steps()
    assert (key.step, key.inner_step, key.micro_batch, key.rank) == (7, 1, 2, 0)
    got = trace.load_step(key)
    for name, tensor in tensors.items():  # non-canonical fields keep their dtype and values exactly
        assert got[name].dtype == tensor.dtype
        assert torch.equal(got[name], tensor)
    meta = trace.metadata(key)
    for k, v in ALL_METADATA.items():
        assert meta[k] == v
    assert meta["step"] == 7 and meta["inner_step"] == 1 and meta["micro_batch"] == 2
    assert meta["algorithm"] == "grpo" and meta["schema_version"] == "1" and meta["world_size"] == 1
    assert meta["source_dtype"] == "bfloat16,float16,float32"
    assert set(METADATA_KEYS) <= set(meta)  # every SPEC section 4 key survives the round trip
    assert trace.status == "finished"


def test_canonical_fields_normalised_on_disk(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        writer.record(0, grpo_tensors(torch.bfloat16))
    trace = Trace(tmp_path / "run")
    fields = trace.fields(trace.steps()[0])
    assert fields["policy_logprobs"] == ([B, T], "F32")  # float32 on disk by default
    assert fields["completion_mask"] == ([B, T], "BOOL")  # 0/1 int mask -> bool
    assert fields["group_ids"] == ([B], "I64")
    assert fields["prompt_ids"] == ([B, L], "I64")


def test_keep_source_dtype(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo", keep_source_dtype=True) as writer:
        writer.record(0, grpo_tensors(torch.bfloat16))
    trace = Trace(tmp_path / "run")
    assert trace.fields(trace.steps()[0])["policy_logprobs"][1] == "BF16"
    assert trace.metadata(trace.steps()[0])["source_dtype"] == "bfloat16,float32"


def test_load_sequence_reads_one_row(tmp_path):
    tensors = grpo_tensors()
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        writer.record(0, tensors)
    trace = Trace(tmp_path / "run")
    row = trace.load_sequence(trace.steps()[0], 2)
    assert torch.equal(row["completion_ids"], tensors["completion_ids"][2])
    assert torch.equal(row["policy_logprobs"], tensors["policy_logprobs"][2])
    assert float(row["rewards"]) == 0.5
    with pytest.raises(IndexError, match="sequence 9 out of range"):
        trace.load_sequence(trace.steps()[0], 9)


def test_token_table_marks_prompt_padding_and_after_eos(tmp_path):
    class Tok:  # a transformers-like tokenizer: batch_decode + ids
        eos_token_id, pad_token_id = 1, 0

        def __len__(self):
            return 8

        def batch_decode(self, seqs, **_):
            return ["<pad>", "<eos>", "a", "b", "c", "d", "e", "<b>"][: len(seqs)]

    with TraceWriter(tmp_path / "run", "grpo", tokenizer=Tok()) as writer:
        writer.record(0, grpo_tensors())
    trace = Trace(tmp_path / "run")
    table = trace.token_table(trace.steps()[0], sequence=0)
    prompt = table[table.section == "prompt"]
    completion = table[table.section == "completion"]
    assert prompt.mask_reason.tolist() == ["prompt_padding", "prompt", "prompt"]
    assert prompt.token_text.tolist() == ["<pad>", "b", "c"]
    # row 0: ids [5, 6, 1(eos), 0, 0], mask [1, 1, 1, 0, 0] -> the EOS is kept, the pads after it are not
    assert completion.mask_reason.tolist() == ["kept", "kept", "kept", "after_eos", "after_eos"]
    assert completion.token_text.tolist() == ["d", "e", "<eos>", "<pad>", "<pad>"]
    assert completion.advantages.tolist() == [1.0] * T  # [B] advantages broadcast over T
    whole = trace.token_table(trace.steps()[0])
    assert len(whole) == B * (L + T)


def test_step_file_appears_only_when_complete(tmp_path, monkeypatch):
    writer = TraceWriter(tmp_path / "run", "grpo")
    final = tmp_path / "run" / STEPS_DIR / step_file_name(0)
    seen = []
    real_replace = os.replace

    def spy(src, dst):  # observe the state just before the rename
        if str(dst) == str(final):
            seen.append((os.path.exists(final), os.path.getsize(src), Trace(tmp_path / "run").steps()))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    path = writer.record(0, grpo_tensors())
    writer.flush()  # the background thread has written the file
    (existed, size, listed), = seen
    assert not existed and listed == []  # the reader saw nothing while the bytes were being written
    assert size == os.path.getsize(path)
    assert not list((tmp_path / "run" / STEPS_DIR).glob("*.partial"))


def test_partial_files_are_never_listed(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        writer.record(0, grpo_tensors())
    (tmp_path / "run" / STEPS_DIR / (step_file_name(1) + ".partial")).write_bytes(b"\x00" * 10)
    assert [k.step for k in Trace(tmp_path / "run").steps()] == [0]


def test_shape_error_names_field_expected_actual_and_fix(tmp_path):
    writer = TraceWriter(tmp_path / "run", "grpo")
    bad = grpo_tensors()
    bad["rewards"] = torch.zeros(B, 1)
    with pytest.raises(SchemaError, match=r"field 'rewards': expected shape \[B\], got \[4, 1\]; record rewards as a 1-d"):
        writer.record(0, bad)


def test_dimension_disagreement_names_both_fields(tmp_path):
    writer = TraceWriter(tmp_path / "run", "grpo")
    bad = grpo_tensors()
    bad["policy_logprobs"] = torch.zeros(B, T + 1)
    with pytest.raises(SchemaError, match="field 'policy_logprobs': dimension T is 6, but field 'completion_ids' has T = 5"):
        writer.record(0, bad)


def test_dtype_errors(tmp_path):
    writer = TraceWriter(tmp_path / "run", "grpo")
    bad = grpo_tensors()
    bad["completion_ids"] = bad["completion_ids"].float()
    with pytest.raises(SchemaError, match="field 'completion_ids': expected an integer tensor"):
        writer.record(0, bad)
    bad = grpo_tensors()
    bad["completion_mask"] = bad["completion_mask"] * 0.5
    with pytest.raises(SchemaError, match=r"field 'completion_mask': a mask must hold only 0 and 1.*\[0.5"):
        writer.record(0, bad)


def test_unwritable_directory_drops_steps_and_training_goes_on(tmp_path):
    writer = TraceWriter(tmp_path / "run", "grpo")
    writer.record(0, grpo_tensors())
    writer.flush()  # step 0 is on disk before the directory goes away
    steps_dir = tmp_path / "run" / STEPS_DIR
    os.rename(steps_dir, tmp_path / "moved")  # works as root too, unlike chmod
    steps_dir.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match=r"dropped a step \(1 so far\)"):
        writer.record(1, grpo_tensors())
        writer.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer.record(2, grpo_tensors())
        writer.flush()
    writer.close()
    manifest = json.loads((tmp_path / "run" / MANIFEST_NAME).read_text())
    assert manifest["dropped_steps"] == 2 and len(manifest["drop_reasons"]) == 2
    assert manifest["status"] == "finished"
    moved = Trace(tmp_path / "moved" / "step_00000000.inner_0.mb_0.rank_0.safetensors")
    assert moved.load_step(moved.steps()[0])["rewards"].tolist() == [1.0, 0.0, 0.5, 0.5]  # not damaged


def test_strict_mode_raises_on_write_failure(tmp_path):
    writer = TraceWriter(tmp_path / "run", "grpo", strict=True)
    steps_dir = tmp_path / "run" / STEPS_DIR
    steps_dir.rmdir()
    steps_dir.write_text("not a directory")
    writer.record(0, grpo_tensors())  # staged; the background write fails
    with pytest.raises(TraceError, match=r"writing .* failed: .*step_00000000"):
        writer.flush()
    sync = TraceWriter(tmp_path / "sync", "grpo", strict=True, async_write=False)
    (tmp_path / "sync" / STEPS_DIR).rmdir()
    (tmp_path / "sync" / STEPS_DIR).write_text("not a directory")
    with pytest.raises(TraceError, match=r"writing .* failed"):  # writing inside record raises at once
        sync.record(0, grpo_tensors())


def test_existing_trace_is_not_overwritten(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        writer.record(0, grpo_tensors())
    with pytest.raises(TraceError, match="already holds a trace"):
        TraceWriter(tmp_path / "run", "grpo")


def test_reader_errors_say_what_was_expected(tmp_path):
    with pytest.raises(TraceFormatError, match="does not exist: expected a trace directory"):
        Trace(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFormatError, match="is not a trace: expected manifest.json"):
        Trace(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(TraceFormatError, match="expected a trace directory or a .safetensors step file"):
        Trace(tmp_path / "notes.txt")


def test_single_step_file_is_a_trace(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "one.safetensors"
    save_file({"completion_ids": torch.tensor([[1, 2]]), "policy_logprobs": torch.tensor([[-0.5, -1.0]])}, path,
              metadata={"step": "3", "algorithm": "grpo"})
    trace = Trace(path)
    (key,) = trace.steps()
    assert key.step == 3 and trace.algorithm == "grpo"
    assert trace.token_table(key).token_text.tolist() == ["<id 1>", "<id 2>"]


def test_keyword_record_style_of_the_explicit_api(tmp_path):
    import tracer

    with tracer.Tracer(tmp_path / "run", algorithm="ppo") as tr:
        tr.record(step=2, inner_step=1, micro_batch=3,
                  completion_ids=torch.zeros(2, 3, dtype=torch.long),
                  advantages=torch.zeros(2, 3), row_ids=torch.tensor([4, 1]))
    (key,) = Trace(tmp_path / "run").steps()
    assert (key.step, key.inner_step, key.micro_batch) == (2, 1, 3)
    assert Trace(tmp_path / "run").load_step(key)["row_ids"].tolist() == [4, 1]


def test_advantages_rank_depends_on_algorithm(tmp_path):
    # PPO advantages are per token [B, T]; GRPO advantages are per sequence [B]
    with pytest.raises(SchemaError, match=r"field 'advantages': expected shape \[B, T\], got \[2\]"):
        TraceWriter(tmp_path / "ppo", "ppo").record(0, advantages=torch.zeros(2))
    with pytest.raises(SchemaError, match=r"field 'advantages': expected shape \[B\], got \[2, 3\]"):
        TraceWriter(tmp_path / "grpo", "grpo").record(0, advantages=torch.zeros(2, 3))


def test_dpo_record_missing_one_side(tmp_path):
    writer = TraceWriter(tmp_path / "run", "dpo")
    with pytest.raises(SchemaError, match="DPO record has 'chosen_policy_logprobs' but not 'rejected_policy_logprobs'"):
        writer.record(0, chosen_policy_logprobs=torch.zeros(2, 3), chosen_mask=torch.ones(2, 3),
                      rejected_mask=torch.ones(2, 3))


def test_unknown_algorithm_and_empty_record(tmp_path):
    with pytest.raises(TraceError, match=r"algorithm 'ppo2' is not one of \['ppo', 'grpo', 'cispo', 'rloo', 'dpo'\]"):
        TraceWriter(tmp_path / "a", "ppo2")
    with pytest.raises(TraceError, match=r"record\(step=0\) got no tensors"):
        TraceWriter(tmp_path / "b", "grpo").record(0)


def test_fields_sharing_memory_are_written(tmp_path):
    policy = torch.tensor([[-0.5, -1.0]])
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        # old aliases policy, and ratio is a view of the same storage: both must still be recorded
        writer.record(0, policy_logprobs=policy, old_logprobs=policy, ratio=policy[:, :])
    data = Trace(tmp_path / "run").load_step(Trace(tmp_path / "run").steps()[0])
    assert torch.equal(data["old_logprobs"], policy) and torch.equal(data["ratio"], policy)


def test_step_key_finds_a_step_without_listing(tmp_path):
    with TraceWriter(tmp_path / "run", "grpo") as writer:
        writer.record(3, grpo_tensors(), inner_step=1)
    trace = Trace(tmp_path / "run")
    key = trace.step_key(3, inner_step=1)
    assert key == trace.steps()[0]
    assert trace.load_sequence(key, 0)["rewards"].item() == 1.0
    with pytest.raises(TraceFormatError, match="no step file for step 4, inner step 0"):
        trace.step_key(4)


def test_a_step_file_in_a_traces_steps_folder_reads_that_traces_token_strings(tmp_path):
    """A single step file opened on its own (``tracer view <file>``) shows token text, not ``<id N>``,
    when it sits in the ``steps/`` folder of a trace holding ``tokens.json``; a copy elsewhere has none."""
    import shutil

    from tracer.read import Trace

    trace = Trace(SAMPLES / "grpo-tiny")
    key = trace.steps()[0]
    single = Trace(key.path)
    assert single.tokens == trace.tokens and trace.tokens
    ids = trace.load_step(key)["completion_ids"][0].tolist()
    assert single.token_text(ids) == trace.token_text(ids)
    assert not any(t.startswith("<id ") for t in single.token_text(ids))
    alone = tmp_path / key.path.name
    shutil.copy(key.path, alone)
    assert Trace(alone).tokens is None
