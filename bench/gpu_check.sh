#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (no network there). None has run on a GPU
# yet, so how long each takes is not measured; each has a timeout:
#   ppo_step         240 s   python bench/ppo_step.py --gpu: ours against TRL 0.29.1's PPOTrainer at
#                            Qwen2.5-0.5B's shape, bf16 (seconds per step, tokens per second, peak GPU memory)
#   grpo_step        180 s   $GRPO_PYTHON bench/grpo_step.py --gpu: ours against TRL's GRPOTrainer, the same
#                            shape (by phase, with and without the old-log-prob pass, the floor, peak memory)
#   rehearsal        300 s   python bench/rehearse_gpu_recipe.py --gpu: 3 steps of the PPO recipe with its own
#                            batch sizes (256 prompts, micro-batches 4), random weights, then a resume
#   rehearsal_grpo   300 s   the same for the GRPO recipe (--recipe grpo: 64 prompts x 5 responses)
# then recipes.txt: each recipe's steps side by side (seconds, tokens per second with and without the
# evaluation, peak GPU memory).
#   bash bench/gpu_check.sh                           # all four: at most 17 minutes
#   bash bench/gpu_check.sh rehearsal rehearsal_grpo  # the two recipes alone: at most 10 minutes
# All four do not fit a 15-minute lease with a machine's start (1-2 minutes): name the checks to run.
# Writes everything to $OUT (default outputs/gpu_check): the GPU's name, each check's log and results.
# Needs torch with CUDA and the repository's requirements; `python` with the bench extra (TRL 0.29.1),
# and GRPO_PYTHON (default: python) an interpreter with the bench-trl1 extra (TRL 1.16), e.g.
#   GRPO_PYTHON=/tmp/venv-trl116/bin/python bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu_check}
CHECKS=" ${*:-ppo_step grpo_step rehearsal rehearsal_grpo} "
for check in $CHECKS; do
  case $check in ppo_step|grpo_step|rehearsal|rehearsal_grpo) ;;
    *) echo "unknown check '$check': choose from ppo_step grpo_step rehearsal rehearsal_grpo" >&2; exit 2 ;; esac
done
mkdir -p "$OUT"
{ date -u +%Y-%m-%dT%H:%M:%SZ; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'accelerate', accelerate.__version__)"; echo "checks:$CHECKS"; } > "$OUT/gpu.txt" 2>&1

if [[ $CHECKS == *" ppo_step "* ]]; then
  # 9 timed rounds (after 2 warm-up ones) of the five sides, interleaved: TRL, ours, ours with the KL panel
  # off (the old-log-prob pass forced, then skipped), the floor; then one memory process each for ours and TRL.
  timeout 240 python bench/ppo_step.py --gpu --iters 9 > "$OUT/ppo_step.txt" 2>&1
  echo "ppo_step exit $?" >> "$OUT/gpu.txt"
fi

if [[ $CHECKS == *" grpo_step "* ]]; then
  # 7 timed rounds (after 1 warm-up one) of the six sides, interleaved: TRL, ours, ours with the old-log-prob
  # pass, ours with the KL panel, ours gae, the floor; then one memory process each for ours, TRL and gae.
  timeout 180 "${GRPO_PYTHON:-python}" bench/grpo_step.py --gpu --iters 7 --warmup 1 > "$OUT/grpo_step.txt" 2>&1
  echo "grpo_step exit $?" >> "$OUT/gpu.txt"
fi

# 3 recipe steps (the recipe's own batch, 512-token responses), an evaluation of 128 problems, a checkpoint
# each step, then run B resumes and repeats the last step.
for recipe in ppo grpo; do
  name=rehearsal; [[ $recipe == grpo ]] && name=rehearsal_grpo
  [[ $CHECKS == *" $name "* ]] || continue
  timeout 300 python bench/rehearse_gpu_recipe.py --gpu --recipe $recipe --layers 24 --steps 3 --val-samples 128 \
      --output "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name exit $?" >> "$OUT/gpu.txt"
  cp "$OUT/$name/results.json" "$OUT/$name.json" 2>/dev/null
  rm -rf "$OUT/$name/model" "$OUT/$name/run/checkpoints"  # GBs; only the numbers come back
done

# The two recipes side by side, from whichever rehearsals finished.
python - "$OUT" > "$OUT/recipes.txt" 2>&1 <<'PY'
import json, os, sys
out = sys.argv[1]
print("| recipe | steps (s) | tokens/s | tokens/s without the evaluation | peak GPU memory (GiB) | checks |")
print("|---|---|---|---|---|---|")
for name in ("rehearsal", "rehearsal_grpo"):
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path):
        print(f"| {name} | (no results) | | | | |")
        continue
    with open(path) as f:
        r = json.load(f)
    ok = (r["all_steps_finite"] and r["kl_full_nonnegative"] and r["resume_repeats_last_step"]
          and r["float32_logits_within_chunk"])
    fmt = lambda xs: ", ".join(f"{x:.0f}" for x in xs)
    print(f"| {r['recipe']} | {fmt(r['step_s'])} | {fmt(r['tokens_per_s'])} | "
          f"{fmt(r['tokens_per_s_without_evaluation'])} | {r['max_memory_allocated_gb'] or 0:.1f} | "
          f"{'passed' if ok else 'FAILED'} |")
PY
cat "$OUT/gpu.txt" "$OUT/recipes.txt"
