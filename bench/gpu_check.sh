#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (no network there): at most 9 minutes,
# the two timeouts below (it has not run on a GPU yet, so how long each check takes is not measured).
# Writes everything to $OUT (default outputs/gpu_check): the GPU's name, each check's log, and
#   ppo_step.txt         python bench/ppo_step.py --gpu: ours against TRL's PPOTrainer at Qwen2.5-0.5B's
#                        shape, bf16 (seconds per step, tokens per second, peak GPU memory)
#   rehearsal.json       python bench/rehearse_gpu_recipe.py --gpu: 3 steps of the GPU recipe with the
#                        recipe's own batch sizes (256 prompts, micro-batches 4), random weights, then resume
# Needs torch with CUDA, the repository's requirements and requirements-bench.txt (TRL) installed.
#   bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'accelerate', accelerate.__version__)"; } > "$OUT/gpu.txt" 2>&1

# 11 timed rounds (after 2 warm-up ones) of the four sides, interleaved: TRL, ours, ours with the KL panel
# off, the floor; then one memory process each for ours and TRL.
timeout 240 python bench/ppo_step.py --gpu --iters 11 > "$OUT/ppo_step.txt" 2>&1
echo "ppo_step exit $?" >> "$OUT/gpu.txt"

# 3 recipe steps of 256 prompts x 512 tokens, an evaluation of 128, a checkpoint each step, then run B.
timeout 300 python bench/rehearse_gpu_recipe.py --gpu --layers 24 --steps 3 --val-samples 128 \
    --output "$OUT/rehearsal" > "$OUT/rehearsal.log" 2>&1
echo "rehearsal exit $?" >> "$OUT/gpu.txt"
cp "$OUT/rehearsal/results.json" "$OUT/rehearsal.json" 2>/dev/null
rm -rf "$OUT/rehearsal/model" "$OUT/rehearsal/run/checkpoints"  # GBs; only the numbers come back
cat "$OUT/gpu.txt"
