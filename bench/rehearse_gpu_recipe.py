"""Rehearse a GPU recipe on a CPU at Qwen2.5-0.5B's real shape, before a user's first GPU run does.

    python bench/rehearse_gpu_recipe.py                  # the PPO recipe: real width and vocabulary, 12 of 24 layers
    python bench/rehearse_gpu_recipe.py --layers 24      # full depth: ~18 min, 22.2 GiB peak here (docs/gpu.md)
    python bench/rehearse_gpu_recipe.py --recipe grpo    # the GRPO recipe, the same way
    python bench/rehearse_gpu_recipe.py --gpu --layers 24   # on a GPU machine: the recipe's own batch sizes

--recipe names a recipe (ppo: configs/gsm8k_qwen2.5_0.5b.yaml, the default; grpo:
configs/gsm8k_qwen2.5_0.5b_grpo.yaml) or a config file. What runs is the recipe's command,
    accelerate launch --config_file configs/accelerate/one_gpu.yaml --mixed_precision bf16 \
        train.py --config <recipe>
with `train.py` wrapped by a small harness (below) and overrides that only say where the model and data
are, shrink the batch (--prompts per step: 4 for PPO, 1 for GRPO, whose one prompt brings its group of
rollout.n = 5 responses) and the step count, and put a KL in the reward as well as the loss (`full` in the
loss: the exact KL over all 151,936 logits, with gradient). Everything else is the recipe's: float32 master
weights under bf16 autocast, a bfloat16 reference, gradient checkpointing, 512 + 512-token lengths, one
PPO epoch, the micro-batch sizes, the critic (PPO) or the groups (GRPO), greedy evaluation.

The model and data are made here, with no network:
- a Qwen2ForCausalLM with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864,
  vocabulary 151,936, tied embeddings; --layers sets the depth, 12 by default: half the time, room to
  spare), randomly initialised and saved in bfloat16 as the hub's is;
- a tokenizer of the embedded default's kind (`rlhf.embedded.train_tokenizer`: a byte-level BPE of at most
  500 tokens with a ChatML template), not Qwen's: the embedding has the real 151,936 rows, and the few ids
  the tokenizer knows are all it can decode (a random model samples almost only ids above them, which
  decode to nothing and score 0);
- GSM8K-schema rows (question, "... #### N" answer) whose chat-templated prompts are 100 to 300 tokens:
  GSM8K's questions are short word problems, and next to the 512-token responses the prompts' share of the
  memory is small (GSM8K itself cannot be tokenized here, offline, to match it exactly).
A random model almost never samples EOS, so every response runs to the full 512 tokens: the worst case.

Run A trains `--steps` steps with a checkpoint after each; the last checkpoint is then deleted and run B
resumes from the one before (`trainer.resume_from=auto`) and repeats the last step. Checks:
- every step finite (no skipped update, every logged number finite), the KL panel finite, kl/full >= 0;
- the resumed step equals the uninterrupted one (every logged number but timings);
- no float32 tensor of shape (..., 151936) with more rows than rlhf.core_algos.LOGITS_CHUNK_ROWS is ever
  created: the claim of logprobs_from_logits, entropy_from_logits and kl.full_kl, which convert bf16 logits
  to float32 a chunk of rows at a time. A TorchDispatchMode in the harness sees every op's outputs, forward
  and backward; the micro-batch (4 x 512 = 2048 rows of logits) is larger than a chunk (1024 rows), so a
  whole float32 copy would be caught (the GRPO recipe's micro-batch is its group of 5: 2,565 rows);
- peak memory: the training process's peak resident set size (CPU; ru_maxrss), or the device's
  max_memory_allocated (GPU), as logged in perf/max_memory_allocated_gb; beside it, what
  bench/recipe_memory.py computes for the same config and depth;
- speed: each step's tokens per second (perf/throughput: prompt and response tokens over the step's time, which
  includes an evaluation where there is one) and the same without the evaluation's time.
Results go to <output>/results.json and are printed, one per line; the last line says PASSED or FAILED.

The recipe runs under bf16 autocast, so on a CPU every matmul is bf16. torch multiplies bf16 matrices fast
only where the CPU has AVX-512 (oneDNN); elsewhere (AVX2 only) it falls back to a plain single-threaded loop,
measured at 0.4 GFLOP/s against 66.5 in float32 on a 2-core AMD EPYC without AVX-512, which would make a
real-width step take hours. The script measures both rates first (cpu_matmul_gflops in results.json) and
stops where bf16 is more than 10 times slower than float32, unless --allow-slow-bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import recipe_memory  # noqa: E402  (bench/, beside this file)

from rlhf.checkpoint import list_checkpoints  # noqa: E402
from rlhf.config import load_config  # noqa: E402
from rlhf.core_algos import LOGITS_CHUNK_ROWS  # noqa: E402
from rlhf.data import build_prompt, write_jsonl  # noqa: E402
from rlhf.embedded import generate_problems, train_tokenizer  # noqa: E402
from rlhf.tracking import read_metrics  # noqa: E402

ONE_GPU = os.path.join(REPO, "configs", "accelerate", "one_gpu.yaml")  # 1 process; no GPU needed
# Qwen/Qwen2.5-0.5B-Instruct's config.json: the shape, and the two fields beside it that the rehearsal keeps
QWEN2_5_0_5B = {**recipe_memory.QWEN2_5_0_5B, "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6}
PROMPT_TOKENS = (100, 300)  # chat-templated prompt lengths drawn uniformly in this range
NOT_COMPARED = ("timing_s/", "perf/")  # wall-clock numbers differ between two runs of the same step

# train.py's command line under rlhf.tracking.Float32LogitsWatch; writes what it saw to $REHEARSAL_REPORT.
HARNESS = '''
import json, os, resource, sys
import train
from rlhf.tracking import Float32LogitsWatch

with Float32LogitsWatch(int(os.environ["REHEARSAL_VOCAB"])) as watch:
    code = train.cli(sys.argv[1:])
with open(os.environ["REHEARSAL_REPORT"], "w") as f:
    json.dump({"exit_code": code, "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
               "float32_logits_rows": watch.rows, "float32_logits_shape": watch.shape,
               "float32_logits_op": watch.op}, f)
sys.exit(code)
'''


def make_model(model_dir: str, num_layers: int) -> int:
    """The random Qwen2.5-0.5B-shaped model and the embedded tokenizer, saved to model_dir; its parameters."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    problems = generate_problems(256, seed=0)
    tokenizer = train_tokenizer([p["question"] + " " + p["answer"] for p in problems], vocab_size=500)
    config = Qwen2Config(**{**QWEN2_5_0_5B, "num_hidden_layers": num_layers}, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def make_data(path: str, tokenizer, num_rows: int, seed: int) -> list[int]:
    """GSM8K-schema rows whose prompts are PROMPT_TOKENS long (several generated problems' text joined into
    one question); returns the prompt lengths."""
    rng = random.Random(seed)
    problems = generate_problems(20 * num_rows, seed=seed)
    rows, lengths = [], []
    for i in range(num_rows):
        target = rng.randint(*PROMPT_TOKENS)
        sentences = iter(problems[20 * i:20 * (i + 1)])
        question, answer = "", None
        while True:
            problem = next(sentences)
            longer = (question + " " + problem["question"]).strip()
            if answer is not None and len(tokenizer(build_prompt(tokenizer, longer))["input_ids"]) > target:
                break
            question, answer = longer, problem["answer"]  # the last problem's answer is the row's
        rows.append({"question": question, "answer": answer})
        lengths.append(len(tokenizer(build_prompt(tokenizer, question))["input_ids"]))
    write_jsonl(rows, path)
    return lengths


def recipe_path(name: str) -> str:
    """The config file --recipe names: a recipe of bench/recipe_memory.RECIPES, or a path."""
    if name in recipe_memory.RECIPES:
        return recipe_memory.RECIPES[name]
    if not os.path.isfile(name):
        sys.exit(f"--recipe {name!r} is neither a recipe ({', '.join(sorted(recipe_memory.RECIPES))}) nor a config file")
    return os.path.abspath(name)


def overrides(model_dir: str, data_dir: str, out_dir: str, args) -> list[str]:
    """Where things are, the batch and step count, the KL placement; nothing else of the recipe changes."""
    batch = [] if args.gpu else [  # --gpu: the recipe's own batch sizes
        f"data.train_batch_size={args.prompts}", "data.val_batch_size=4", f"actor.ppo_mini_batch_size={args.prompts}"]
    return [f"model.path={model_dir}", f"data.train_files={data_dir}/train.jsonl",
            f"data.val_files={data_dir}/val.jsonl", *batch, f"data.max_val_samples={args.val_samples}",
            f"trainer.total_steps={args.steps}", "trainer.save_freq=1", f"trainer.output_dir={out_dir}",
            "trainer.logger=none", "algorithm.use_kl_in_reward=true", "actor.kl_loss_type=full"]


def launch(recipe: str, harness: str, report: str, args: list[str], log_path: str) -> tuple[dict, float]:
    """`accelerate launch --mixed_precision bf16 <harness> --config <recipe> <args>`: (report, wall seconds)."""
    # accelerate launch gives a CPU process 1 thread unless OMP_NUM_THREADS says otherwise. Transparent huge
    # pages for torch's large CPU tensors: each new 0.6 GB logits tensor otherwise faults in 150k small pages,
    # which made the steps several times slower in this project's virtual machine.
    env = {"OMP_NUM_THREADS": str(os.cpu_count()), "THP_MEM_ALLOC_ENABLE": "1", **os.environ, "REPO": REPO,
           "REHEARSAL_REPORT": report, "REHEARSAL_VOCAB": str(QWEN2_5_0_5B["vocab_size"]), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", ONE_GPU, "--mixed_precision",
               "bf16", harness, "--config", recipe, *args]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if code != 0 or not os.path.exists(report):
        with open(log_path) as f:
            sys.exit(f"the run failed (exit {code}); the end of {log_path}:\n{f.read()[-4000:]}")
    with open(report) as f:
        return json.load(f), wall


def finite_rows(rows: list[dict]) -> bool:
    return all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, (int, float)))


def matmul_gflops(dtype: torch.dtype, rows: int = 256, cols: int = 1024, repeats: int = 2) -> float:
    """GFLOP/s of a (rows x hidden) @ (hidden x cols) matmul in `dtype` on this CPU (hidden: Qwen2.5-0.5B's)."""
    hidden = QWEN2_5_0_5B["hidden_size"]
    a, b = torch.randn(rows, hidden).to(dtype), torch.randn(hidden, cols).to(dtype)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * rows * hidden * cols * repeats / (time.perf_counter() - start) / 1e9


def speed(steps: list[dict]) -> dict[str, list[float]]:
    """Each step's tokens per second: perf/throughput (over the whole step, an evaluation included where the
    step has one) and over the step's time less its evaluation's (timing_s/testing)."""
    tokens = [row["perf/throughput"] * row["timing_s/step"] for row in steps]
    return {"tokens_per_s": [row["perf/throughput"] for row in steps],
            "tokens_per_s_without_evaluation": [n / (row["timing_s/step"] - row.get("timing_s/testing", 0.0))
                                                for n, row in zip(tokens, steps)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # 12: the full 24 layers ran here in 17.8 min with a 22.2 GiB peak, 1.3 GiB short of this machine's
    # memory; 12 take 9.8 min with room to spare. The width and vocabulary, where the logits' memory is,
    # stay real at any depth.
    parser.add_argument("--layers", type=int, default=12,
                        help="decoder layers (Qwen2.5-0.5B has 24; fewer keep the real width and vocabulary)")
    parser.add_argument("--recipe", default="ppo",
                        help="ppo (configs/gsm8k_qwen2.5_0.5b.yaml), grpo (configs/gsm8k_qwen2.5_0.5b_grpo.yaml) "
                             "or a config file")
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts per step on the CPU (default: 4, or 1 where rollout.n > 1: one group)")
    parser.add_argument("--steps", type=int, default=2, help="PPO steps of run A (run B repeats the last)")
    parser.add_argument("--val-samples", type=int, default=4, help="held-out problems per evaluation")
    parser.add_argument("--gpu", action="store_true", help="keep the recipe's batch sizes (on a GPU machine)")
    parser.add_argument("--output", default=os.path.join(REPO, "outputs", "rehearsal"))
    parser.add_argument("--allow-slow-bf16", action="store_true",
                        help="run on a CPU whose bf16 matmuls are more than 10x slower than float32 (hours)")
    args = parser.parse_args()
    if args.gpu and not torch.accelerator.is_available():
        sys.exit("--gpu needs a GPU (or another accelerator); torch sees none")
    if args.steps < 2:
        sys.exit("--steps must be at least 2: run B resumes from the checkpoint before the last step")
    recipe = recipe_path(args.recipe)
    recipe_cfg = load_config(recipe)
    if args.prompts is None:
        args.prompts = 4 if recipe_cfg.rollout.n == 1 else 1

    cpu_gflops = None
    if not args.gpu:
        cpu_gflops = {"float32": matmul_gflops(torch.float32), "bfloat16": matmul_gflops(torch.bfloat16)}
        print(f"this CPU's matmuls: {cpu_gflops['float32']:.1f} GFLOP/s in float32, "
              f"{cpu_gflops['bfloat16']:.1f} in bfloat16", flush=True)
        if cpu_gflops["bfloat16"] * 10 < cpu_gflops["float32"] and not args.allow_slow_bf16:
            sys.exit("bf16 matmuls are more than 10x slower than float32 on this CPU (no AVX-512: torch's reference "
                     "GEMM), and the recipe runs under bf16 autocast: a real-width step would take hours. Run the "
                     "rehearsal on a CPU with AVX-512 or on a GPU (--gpu), or pass --allow-slow-bf16.")
    out = os.path.abspath(args.output)
    model_dir, data_dir, run_dir = (os.path.join(out, name) for name in ("model", "data", "run"))
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(data_dir)
    start = time.perf_counter()
    num_params = make_model(model_dir, args.layers)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    num_train = (recipe_cfg.data.train_batch_size if args.gpu else args.prompts) * args.steps
    prompt_lengths = make_data(os.path.join(data_dir, "train.jsonl"), tokenizer, num_train, seed=1)
    make_data(os.path.join(data_dir, "val.jsonl"), tokenizer, args.val_samples, seed=2)
    setup_s = time.perf_counter() - start
    print(f"model: {num_params / 1e6:.1f}M parameters, {args.layers} layers; prompts {min(prompt_lengths)}-"
          f"{max(prompt_lengths)} tokens; set up in {setup_s:.0f} s", flush=True)

    harness = os.path.join(out, "harness.py")
    with open(harness, "w") as f:
        f.write(HARNESS)
    run_args = overrides(model_dir, data_dir, run_dir, args)
    report_a, wall_a = launch(recipe, harness, os.path.join(out, "report_a.json"), run_args, os.path.join(out, "run_a.log"))
    uninterrupted = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    checkpoints = list_checkpoints(run_dir)
    checkpoint_gb = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(checkpoints[-1])
                        for f in files) / 2**30
    shutil.rmtree(checkpoints[-1])  # as if killed during the last step
    print(f"run A: {args.steps} steps in {wall_a:.0f} s; resuming from {checkpoints[-2]}", flush=True)
    report_b, wall_b = launch(recipe, harness, os.path.join(out, "report_b.json"), [*run_args, "trainer.resume_from=auto"],
                              os.path.join(out, "run_b.log"))
    resumed = read_metrics(os.path.join(run_dir, "metrics.jsonl"))

    last_a, last_b = uninterrupted[-1], resumed[-1]
    differing = sorted(k for k, v in last_a.items() if not k.startswith(NOT_COMPARED) and last_b.get(k) != v)
    steps = [row for row in uninterrupted if "actor/pg_loss" in row]
    panel = {key: last_a[key] for key in ("kl/k1", "kl/k2", "kl/k3", "kl/abs", "kl/full")}
    results = {
        "date": time.strftime("%Y-%m-%d"), "recipe": os.path.relpath(recipe, REPO), "layers": args.layers, "parameters_m": num_params / 1e6,
        "gpu": torch.cuda.get_device_name() if args.gpu else None, "cpu_matmul_gflops": cpu_gflops,
        "run_args": run_args,
        "prompt_tokens": [min(prompt_lengths), max(prompt_lengths)],
        "wall_s": {"setup": setup_s, "run_a": wall_a, "run_b": wall_b},
        "step_s": [row["timing_s/step"] for row in steps], **speed(steps),
        "peak_rss_gb": max(report_a["max_rss_gb"], report_b["max_rss_gb"]),
        "max_memory_allocated_gb": max((row.get("perf/max_memory_allocated_gb", 0) for row in resumed + uninterrupted),
                                       default=0) or None,
        "checkpoint_gb": checkpoint_gb,
        "all_steps_finite": finite_rows(uninterrupted) and all(row["actor/skipped_updates"] == 0 for row in steps),
        "kl_panel_last_step": panel,
        "kl_full_nonnegative": all(row["kl/full"] >= 0 for row in steps),
        "resume_repeats_last_step": not differing and last_b["step"] == last_a["step"], "resume_differs": differing,
        "float32_logits_max_rows": max(report_a["float32_logits_rows"], report_b["float32_logits_rows"]),
        "float32_logits_largest": report_a["float32_logits_shape"], "logits_chunk_rows": LOGITS_CHUNK_ROWS,
    }
    results["float32_logits_within_chunk"] = results["float32_logits_max_rows"] <= LOGITS_CHUNK_ROWS
    # bench/recipe_memory.py's computation for this run's config and depth, beside the measured peak
    computed = recipe_memory.memory(load_config(recipe, run_args),
                                    shape={**QWEN2_5_0_5B, "num_hidden_layers": args.layers})
    results["computed_static_gb"], results["computed_peak_gb"] = computed["static"], computed["peak"]
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    for key, value in results.items():
        if key != "run_args":
            print(f"{key}: {value}")
    ok = (results["all_steps_finite"] and results["kl_full_nonnegative"] and results["resume_repeats_last_step"]
          and results["float32_logits_within_chunk"])
    print("REHEARSAL PASSED" if ok else "REHEARSAL FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
