#!/usr/bin/env bash
# verl's GRPO example (GSM8K, Qwen2.5-0.5B-Instruct, vLLM rollout) for a few steps on ONE GPU, with
# tracer attached, then the join and `tracer check`. PREPARED, NOT YET RUN: no session so far had a
# GPU machine (docs/verl.md says what is verified). Expect to fix a config key or two on first run.
#
# Needs: an NVIDIA GPU (>= 24 GB), a venv with verl 0.9.1 + vLLM (`pip install 'verl[vllm]==0.9.1'`)
# and this checkout (`pip install -e '.[verl]'`). Offline machines: stage the model and the data and
# point MODEL / DATA at them.
#
#   MODEL=/models/Qwen2.5-0.5B-Instruct DATA=/data/gsm8k OUT=/tmp/verl-trace bash docs/examples/verl_grpo_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
OUT=${OUT:-/tmp/verl-trace-$(date +%s)}
STEPS=${STEPS:-3}
PYTHON=${PYTHON:-python}

# GSM8K in verl's RL parquet format (what verl's examples/data_preprocess/gsm8k.py writes), unless staged
if [ ! -f "$DATA/train.parquet" ]; then
  mkdir -p "$DATA"
  "$PYTHON" - "$DATA" <<'EOF'
import re, sys
import datasets
out = sys.argv[1]
instruction = "Let's think step by step and output the final answer after \"####\"."
def row(example, idx, split):
    answer = re.search(r"#### (\-?[0-9\.\,]+)", example["answer"]).group(1).replace(",", "")
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": example["question"] + " " + instruction}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": idx}}
ds = datasets.load_dataset("openai/gsm8k", "main")
for split in ("train", "test"):
    ds[split].map(lambda e, i: row(e, i, split), with_indices=True,
                  remove_columns=ds[split].column_names).to_parquet(f"{out}/{split}.parquet")
EOF
fi

export TRACER_DIR="$OUT"
export VERL_USE_EXTERNAL_MODULES=tracer.integrations.verl
export TRACER_TOKENIZER="$MODEL"

"$PYTHON" -m verl.trainer.main_ppo \
  trainer.use_v1=False \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/test.parquet" \
  data.train_batch_size=16 \
  data.max_prompt_length=512 \
  data.max_response_length=256 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.use_remove_padding=True \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=8 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.actor.use_kl_loss=True \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.kl_loss_type=low_var_kl \
  actor_rollout_ref.actor.policy_loss.loss_mode=tracer_vanilla \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.calculate_log_probs=True \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
  trainer.logger=console \
  trainer.n_gpus_per_node=1 \
  trainer.nnodes=1 \
  trainer.val_before_train=False \
  trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  trainer.total_training_steps="$STEPS" \
  2>&1 | tee "$OUT.log"

"$PYTHON" -m tracer.integrations.verl_join "$OUT"
"$PYTHON" -m tracer info "$OUT/joined"
# exit status 1 means an error finding: read it before concluding that tracing is wrong
"$PYTHON" -m tracer check "$OUT/joined" || echo "tracer check: error findings above (exit $?)"
"$PYTHON" -m tracer check "$OUT/rollout" || echo "tracer check (rollout): error findings above (exit $?)"
# what to report back: file counts per side, and verl's own probs_diff metric next to tracer's
ls "$OUT/rollout/steps" | wc -l
ls "$OUT/workers/steps" | wc -l
grep -o "training/rollout_probs_diff_mean:[^ ]*" "$OUT.log" | head -n "$STEPS" || true
"$PYTHON" -m tracer check "$OUT/rollout" --select sampler.probs_diff || true
