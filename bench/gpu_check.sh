#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (no network there): at most 12 minutes,
# the sum of its three timeouts below (240 + 180 + 300 s; none has run on a GPU yet, so how long each takes
# is not measured). With a machine's start (1-2 minutes) that fits a 15-minute lease once, with no rerun.
# Writes everything to $OUT (default outputs/gpu_check): the GPU's name, each check's log, and
#   ppo_step.txt         python bench/ppo_step.py --gpu: ours against TRL 0.29.1's PPOTrainer at Qwen2.5-0.5B's
#                        shape, bf16 (seconds per step, tokens per second, peak GPU memory)
#   grpo_step.txt        $GRPO_PYTHON bench/grpo_step.py --gpu: ours against TRL's GRPOTrainer, the same shape
#                        (by phase, with and without the old-log-prob pass, the floor, peak GPU memory)
#   rehearsal.json       python bench/rehearse_gpu_recipe.py --gpu: 3 steps of the GPU recipe with the
#                        recipe's own batch sizes (256 prompts, micro-batches 4), random weights, then resume
# Needs torch with CUDA and the repository's requirements; `python` with the bench extra (TRL 0.29.1),
# and GRPO_PYTHON (default: python) an interpreter with the bench-trl1 extra (TRL 1.16), e.g.
#   GRPO_PYTHON=/tmp/venv-trl116/bin/python bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'accelerate', accelerate.__version__)"; } > "$OUT/gpu.txt" 2>&1

# 9 timed rounds (after 2 warm-up ones) of the five sides, interleaved: TRL, ours, ours with the KL panel
# off (the old-log-prob pass forced, then skipped), the floor; then one memory process each for ours and TRL.
timeout 240 python bench/ppo_step.py --gpu --iters 9 > "$OUT/ppo_step.txt" 2>&1
echo "ppo_step exit $?" >> "$OUT/gpu.txt"

# 7 timed rounds (after 1 warm-up one) of the six sides, interleaved: TRL, ours, ours with the old-log-prob
# pass, ours with the KL panel, ours gae, the floor; then one memory process each for ours, TRL and gae.
timeout 180 "${GRPO_PYTHON:-python}" bench/grpo_step.py --gpu --iters 7 --warmup 1 > "$OUT/grpo_step.txt" 2>&1
echo "grpo_step exit $?" >> "$OUT/gpu.txt"

# 3 recipe steps of 256 prompts x 512 tokens, an evaluation of 128, a checkpoint each step, then run B.
timeout 300 python bench/rehearse_gpu_recipe.py --gpu --layers 24 --steps 3 --val-samples 128 \
    --output "$OUT/rehearsal" > "$OUT/rehearsal.log" 2>&1
echo "rehearsal exit $?" >> "$OUT/gpu.txt"
cp "$OUT/rehearsal/results.json" "$OUT/rehearsal.json" 2>/dev/null
rm -rf "$OUT/rehearsal/model" "$OUT/rehearsal/run/checkpoints"  # GBs; only the numbers come back
cat "$OUT/gpu.txt"
