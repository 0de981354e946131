"""The first minutes on a GPU: one process, no network, about 8 minutes on one H200, answering what a user of the
recipes needs to know. Writes one JSON (rewritten after every part, so a run cut short still leaves its data) and
one log, into --out (default outputs/gpu_check/).

    python bench/prepare_gpu_check.py          # first, where there is network: fills .gpu_check/ (docs/gpu.md)
    python bench/gpu_check.py                  # on the GPU machine, from the repository's root
    python bench/gpu_check.py --parts recipes memory_sweep    # some parts only
    python bench/gpu_check.py --toy --device cpu   # every part at toy size on a CPU (tests/test_gpu_check.py)
    python bench/gpu_check.py --real           # a networked GPU machine: the real weights and GSM8K (below)

Parts, in order, each timed with the device synchronised (`parts.<name>` in the JSON):
- cuda_tests: the tests marked `cuda` (tests/test_cuda.py: bf16 autocast, full_kl against its CPU result, the
  two decoding loops on the GPU), run in this process by pytest;
- embedded_default: configs/tiny.yaml trained on the device for its 40 steps (the warm start from .gpu_check/,
  else built first, ~2 min on one CPU thread):
  held-out accuracy at step 0 and at the end, seconds a step;
- decode_sweep: Qwen2.5-0.5B's architecture (random weights) under bf16 autocast, the static-cache loop at
  batch sizes up to the whole GSM8K test set (1,319), the reference loop at two of them, the compiled step at
  one (its compile time too): ms a token and tokens/s;
- recipes: configs/gsm8k_qwen2.5_0.5b.yaml and its GRPO sibling exactly as shipped (batch, lengths,
  micro-batches, bf16, checkpointing) on Qwen2.5-0.5B's architecture with random weights from its config, Qwen's
  tokenizer and GSM8K prompts (.gpu_check/gsm8k_test.jsonl; without it GSM8K-shaped generated problems):
  two rlhf.step.train_step's each; per phase (sampling, log-probs, update) seconds and peak memory, next to
  bench/recipe_memory.py's computation for the same prompt length. A random model never samples EOS, so every
  response runs to 512 tokens: the worst case;
- memory_sweep: the PPO recipe's update on 32 of its responses at each actor.ppo_micro_batch_size of 1-32:
  peak memory against the memory model (an out-of-memory is recorded, not fatal);
- checkpoint: the PPO recipe's checkpoint (float32 actor and critic, AdamW moments) written once: seconds, GiB.
With --real (network needed): the base model's greedy accuracy on all 1,319 test problems (strict and
flexible) and the PPO recipe's first --steps steps against verl's reference curve (docs/gpu.md).

Without a CUDA device, or short of a package or of .gpu_check/'s files, it says which and exits at once (2).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREPARED = os.path.join(REPO, ".gpu_check")
PARTS = ("cuda_tests", "embedded_default", "decode_sweep", "recipes", "memory_sweep", "checkpoint")
NEEDED = ("torch", "transformers", "accelerate", "tokenizers", "yaml", "tqdm", "datasets")  # datasets: embedded_default
GIB = 2**30
# verl's Qwen2.5-0.5B-Instruct PPO log on GSM8K (docs/gpu.md): held-out accuracy by step
VERL_CURVE = {0: 0.0008, 9: 0.013, 19: 0.176, 29: 0.458}


class Report:
    """The JSON and the log: `part(name)` times a part, records its results or its error, and rewrites the JSON."""

    def __init__(self, out_dir: str, args):
        os.makedirs(out_dir, exist_ok=True)
        self.path, self.log_path = os.path.join(out_dir, "gpu_check.json"), os.path.join(out_dir, "gpu_check.log")
        self.data = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "args": vars(args), "machine": {}, "parts": {}, "finished": False}
        self.log_file = open(self.log_path, "w")
        self.start, self.budget = time.perf_counter(), args.budget

    def log(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def write(self) -> None:
        with open(self.path + ".part", "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(self.path + ".part", self.path)

    def seconds_left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    @contextlib.contextmanager
    def part(self, name: str):
        result = {"status": "running"}
        self.data["parts"][name] = result
        self.log(f"{name}: start")
        start = time.perf_counter()
        try:
            yield result
            result["status"] = "ok"
        except Exception as e:  # a part's failure is a result; the next part runs
            result["status"], result["error"] = "failed", f"{type(e).__name__}: {e}"
            self.log(traceback.format_exc())
        finally:
            result["seconds"] = round(time.perf_counter() - start, 2)
            self.log(f"{name}: {result['status']} in {result['seconds']:.1f} s")
            self.write()


# ----------------------------------------------------------------------------- before anything runs


def missing_packages() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def install_wheels(wheel_dir: str, report_log) -> None:
    """pip install --no-index --no-deps the carried wheels of the packages this Python lacks."""
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    lacking = [w for w in wheels if importlib.util.find_spec(os.path.basename(w).split("-")[0].lower()) is None]
    if lacking:
        report_log(f"installing {len(lacking)} carried wheel(s): {', '.join(os.path.basename(w) for w in lacking)}")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", *lacking],
                       check=True)
        importlib.invalidate_caches()


def preflight(args) -> str | None:
    """What is missing to run, as a message naming what to bring; None when everything is there."""
    import torch

    if not args.toy and args.device == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU build)"
        return (f"no CUDA device: torch {torch.__version__} (CUDA {built}) sees none. Run this on a machine with an "
                "NVIDIA GPU and torch's CUDA build; at toy size on a CPU: --toy --device cpu.")
    missing = missing_packages()
    if missing:
        return (f"missing package(s): {', '.join(missing)}. On a machine with network: python bench/prepare_gpu_check.py "
                f"--packages {' '.join(missing)}, and bring the repository with its .gpu_check/ folder.")
    if importlib.util.find_spec("rlhf") is None:
        return ("the project is not installed: pip install --no-deps --no-build-isolation -e . (no network needed "
                "where setuptools is installed).")
    if not args.toy and not args.real and not os.path.isfile(os.path.join(args.prepared, "qwen2.5-0.5b-config.json")):
        return (f"{args.prepared} has no qwen2.5-0.5b-config.json or tokenizer: run python bench/prepare_gpu_check.py "
                "on a machine with network first.")
    return None


# ----------------------------------------------------------------------------- helpers


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


class Rows:
    """Prompt rows as the trainer indexes them (rows[list of indices] -> {column: list}), without `datasets`."""

    def __init__(self, columns: dict[str, list]):
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index):
        return {key: [values[i] for i in index] for key, values in self.columns.items()}


class PhaseProbe:
    """The trainer's timer with each phase's device-synchronised seconds and peak memory (CUDA only)."""

    GROUPS = {"sampling": ("gen",), "log-probs": ("old_log_prob", "ref", "values"),
              "update": ("update_actor", "update_critic", "update_step")}

    def __init__(self, device):
        from rlhf.tracking import Timer

        self.device, self.timer, self.peaks = device, Timer(), {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        import torch

        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with self.timer(name):
            yield
            sync(self.device)
        if self.device.type == "cuda":
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated() / GIB)

    @property
    def seconds(self):
        return self.timer.seconds

    def metrics(self):
        return self.timer.metrics()

    def phases(self) -> dict[str, dict]:
        out = {}
        for phase, names in self.GROUPS.items():
            present = [n for n in names if n in self.timer.seconds]
            if present:
                out[phase] = {"seconds": round(sum(self.timer.seconds[n] for n in present), 3),
                              "peak_gib": max((self.peaks[n] for n in present if n in self.peaks), default=None)}
        return out


def qwen_parts(args, tmp: str):
    """(model directory of random Qwen2.5-0.5B-architecture weights, tokenizer): the recipes' model. --toy: a
    2-layer, 64-wide Qwen2 with the embedded tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rlhf.models import load_tokenizer

    model_dir = os.path.join(tmp, "model")
    if args.toy:
        from rlhf.embedded import generate_problems, train_tokenizer

        problems = generate_problems(64, seed=0)
        tokenizer = train_tokenizer([p["question"] + " " + p["answer"] for p in problems], vocab_size=500)
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    else:
        with open(os.path.join(args.prepared, "qwen2.5-0.5b-config.json")) as f:
            config = Qwen2Config(**{k: v for k, v in json.load(f).items() if k != "transformers_version"})
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.prepared, "qwen2.5-tokenizer"))
    torch.manual_seed(0)
    with torch.device(args.device):
        Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)  # bf16, as the hub's
    tokenizer.save_pretrained(model_dir)
    return model_dir, load_tokenizer(model_dir)


def gsm8k_questions(args) -> tuple[list[str], list[str], str]:
    """(questions, ground truths, where they came from): the carried GSM8K test set, or generated problems, two
    to four joined into one question (GSM8K's questions are several sentences long)."""
    from rlhf.embedded import generate_problems
    from rlhf.rewards.gsm8k import extract_ground_truth

    path = os.path.join(args.prepared, "gsm8k_test.jsonl")
    if os.path.isfile(path) and not args.toy:
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        return ([r["question"] for r in rows], [extract_ground_truth(r["answer"]) for r in rows],
                "GSM8K test set (.gpu_check/gsm8k_test.jsonl)")
    problems = generate_problems(4 * 1319, seed=1)
    questions, truths = [], []
    for i in range(1319):
        group = problems[4 * i:4 * i + 2 + i % 3]
        questions.append(" ".join(p["question"] for p in group))
        truths.append(extract_ground_truth(group[-1]["answer"]))
    return questions, truths, "generated GSM8K-shaped problems (rlhf.embedded.generate_problems, 2-4 joined)"


def prompt_rows(tokenizer, questions, truths, max_prompt_length: int) -> Rows:
    from rlhf.data import INSTRUCTION, build_prompt

    ids = tokenizer([build_prompt(tokenizer, q, INSTRUCTION) for q in questions], add_special_tokens=False)["input_ids"]
    keep = [i for i, x in enumerate(ids) if len(x) <= max_prompt_length]
    return Rows({"input_ids": [ids[i] for i in keep], "ground_truth": [truths[i] for i in keep]})


def recipe_config(args, name: str, model_dir: str, out_dir: str, extra=()):
    """The recipe as shipped, with only where the model is and where the run writes; --toy shrinks it."""
    from rlhf.config import load_config

    path = os.path.join(REPO, "configs", "gsm8k_qwen2.5_0.5b.yaml" if name == "ppo" else "gsm8k_qwen2.5_0.5b_grpo.yaml")
    toy = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2",
           "rollout.log_prob_micro_batch_size=2", "data.max_response_length=16"] if args.toy else []
    return load_config(path, [f"model.path={model_dir}", f"trainer.output_dir={out_dir}", "trainer.logger=none",
                              *toy, *extra])


def fresh_accelerator(cfg, device):
    """An Accelerator for `cfg`'s mixed precision: accelerate keeps one state per process and refuses another
    precision once set, and the parts differ (the embedded default trains without autocast, the recipes in bf16)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(mixed_precision=cfg.trainer.mixed_precision, cpu=device.type == "cpu")


def build_run(cfg, rows: Rows, accelerator):
    from rlhf.setup import build_setup, load_models

    return build_setup(cfg, accelerator, load_tokenizer_of(cfg), rows, None, *load_models(cfg, cfg.model.path))


def load_tokenizer_of(cfg):
    from rlhf.models import load_tokenizer

    return load_tokenizer(cfg.model.path)


def memory_model():
    """bench/recipe_memory.py, beside this file."""
    import recipe_memory

    return recipe_memory


# ----------------------------------------------------------------------------- the parts


def cuda_tests(result, args) -> None:
    import pytest

    if args.device != "cuda":
        result["note"] = "not run: the tests marked cuda need a CUDA device"
        return
    outcomes = {}

    class Collect:
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                outcomes[report.nodeid] = report.outcome

    code = pytest.main(["-q", "-m", "cuda", "-p", "no:cacheprovider", os.path.join(REPO, "tests", "test_cuda.py")],
                       plugins=[Collect()])
    result.update(exit_code=int(code), tests=outcomes, passed=sum(o == "passed" for o in outcomes.values()),
                  failed=sum(o != "passed" for o in outcomes.values()))
    if code != 0:
        raise RuntimeError(f"pytest exit code {int(code)}: {result['failed']} failed")


def embedded_default(result, args, tmp: str) -> None:
    import train
    from rlhf.config import load_config
    from rlhf.tracking import read_metrics

    cache = os.path.join(args.prepared, "embedded-cache")  # the warm start prepare_gpu_check.py built, if any
    overrides = [f"trainer.output_dir={tmp}/tiny", "trainer.logger=none",
                 f"trainer.cache_dir={cache if os.path.isdir(cache) and not args.toy else os.path.join(tmp, 'cache')}"]
    if args.toy:
        overrides += ["trainer.total_steps=2", "task.options.num_train=64", "task.options.num_val=16",
                      "task.options.sft_steps=5", "task.options.hidden_size=32", "task.options.num_layers=1",
                      "task.options.num_heads=2", "task.options.num_kv_heads=1", "data.train_batch_size=8",
                      "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=4"]
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # train.main makes its own Accelerator
    start = time.perf_counter()
    train.main(load_config(os.path.join(REPO, "configs", "tiny.yaml"), overrides))
    rows = read_metrics(os.path.join(tmp, "tiny", "metrics.jsonl"))
    steps = [r for r in rows if "timing_s/step" in r]
    accuracy = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    result.update(wall_s=round(time.perf_counter() - start, 1), steps=len(steps), accuracy_by_step=accuracy,
                  median_step_s=sorted(r["timing_s/step"] for r in steps)[len(steps) // 2],
                  cpu_reference="docs/results.md, 'The embedded default': accuracy rises over the 40 steps on CPU")


def decode_sweep(result, args, model_dir: str, tokenizer, rows: Rows, report: Report) -> None:
    import torch

    from rlhf import decode
    from rlhf.models import load_causal_lm
    from rlhf.rollout import SamplingParams, _decode, left_pad, next_token

    device = torch.device(args.device)
    model = load_causal_lm(model_dir, "float32").to(device).eval()
    tokens = 16 if args.toy else 128
    sizes = [1, 4, 16] if args.toy else [1, 8, 32, 128, 256, 512, 1319]
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    autocast = device.type == "cuda"
    runs = []

    def timed(batch_size: int, loop: str) -> dict:
        ids, mask = left_pad(rows[list(range(batch_size))]["input_ids"], tokenizer.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        generator = torch.Generator(device=device).manual_seed(0)
        sync(device)
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            if loop == "compiled":
                decode.decode(model, ids, mask, tokens, lambda logits: next_token(logits, params, generator), 1.0,
                              None, tokenizer.pad_token_id, generator, compiled=True)
            else:
                _decode(model, ids, mask, params, None, tokenizer.pad_token_id, torch.all, generator,
                        reference=loop == "reference")
        sync(device)
        seconds = time.perf_counter() - start
        return {"loop": loop, "batch": batch_size, "prompt_width": ids.shape[1], "seconds": round(seconds, 3),
                "ms_per_token": round(seconds / tokens * 1e3, 3), "tokens_per_s": round(batch_size * tokens / seconds)}

    timed(sizes[0], "static")  # warm-ups
    timed(sizes[0], "reference")
    result.update(tokens=tokens, autocast_bf16=autocast, runs=runs)
    for loop, batch_size in [*(("static", b) for b in sizes), ("reference", sizes[1]), ("reference", sizes[-3])]:
        runs.append(timed(batch_size, loop))
        report.write()  # a run cut short keeps the sizes done
    if args.toy:  # compiling takes ~30 s on a CPU: tests/test_decode.py's slow test covers the compiled step there
        return
    if report.seconds_left() < 120:
        result["compiled_note"] = "not run: less than 120 s of --budget left"
        return
    start = time.perf_counter()
    try:
        timed(sizes[-3], "compiled")
        result["compile_s"] = round(time.perf_counter() - start, 1)
        runs.append(timed(sizes[-3], "compiled"))
    except Exception as e:  # the compiled step is optional: the trainer runs the eager one
        result["compiled_error"] = f"{type(e).__name__}: {str(e)[:300]}"


def recipes(result, args, model_dir: str, rows: Rows, tmp: str, report: Report) -> None:
    import torch

    from rlhf.step import plan_step, train_step

    device = torch.device(args.device)
    rm = memory_model()
    widths = sorted(len(x) for x in rows.columns["input_ids"])
    for name in ("ppo", "grpo"):
        cfg = recipe_config(args, name, model_dir, os.path.join(tmp, name))
        accelerator = fresh_accelerator(cfg, device)
        run = build_run(cfg, rows, accelerator)
        plan = plan_step(cfg, accelerator.mixed_precision)
        steps = []
        for step in (1, 2):
            probe = PhaseProbe(device)
            sync(device)
            start = time.perf_counter()
            metrics = train_step(cfg, plan, accelerator, run, step, probe).metrics
            sync(device)
            steps.append({"seconds": round(time.perf_counter() - start, 2), "phases": probe.phases(),
                          "response_length": metrics["response_length/mean"], "kl_full": metrics.get("kl/full")})
            result[name] = {"steps": steps}
            report.write()
        computed = rm.memory(cfg, shape=rm.QWEN2_5_0_5B, prompt_tokens=widths[-1]) if not args.toy else None
        peaks = [phase["peak_gib"] for step in steps for phase in step["phases"].values() if phase["peak_gib"]]
        result[name].update(
            prompts=cfg.data.train_batch_size, responses=cfg.data.train_batch_size * cfg.rollout.n,
            mixed_precision=cfg.trainer.mixed_precision, micro_batches={
                "actor.ppo_micro_batch_size": cfg.actor.ppo_micro_batch_size,
                "rollout.log_prob_micro_batch_size": cfg.rollout.log_prob_micro_batch_size},
            computed_peak_gib=None if computed is None else {p: round(computed[p], 2) for p in rm.PHASES},
            peak_gib=max(peaks) if peaks else None)
        del run
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    result["prompt_tokens"] = {"min": widths[0], "median": widths[len(widths) // 2], "max": widths[-1]}


def memory_sweep(result, args, model_dir: str, rows: Rows, tmp: str) -> None:
    """The update alone (rlhf.step's advantages and PPO epochs) on one rollout batch of 32 responses, per
    micro-batch size."""
    import torch

    from rlhf.processes import sum_over_processes
    from rlhf.step import plan_step, ppo_update, rewards_to_advantages, rollout

    device = torch.device(args.device)
    rm = memory_model()
    responses = 4 if args.toy else 32
    sizes = [1, 2, 4] if args.toy else [1, 2, 4, 8, 16, 32]
    base = ["data.train_batch_size=" + str(responses), f"actor.ppo_mini_batch_size={responses}",
            f"rollout.log_prob_micro_batch_size={min(responses, 8)}"]
    cfg = recipe_config(args, "ppo", model_dir, os.path.join(tmp, "sweep"), base)
    accelerator = fresh_accelerator(cfg, device)
    run = build_run(cfg, rows, accelerator)
    prompts = rows[list(range(responses))]
    plan = plan_step(cfg, accelerator.mixed_precision)
    batch = rollout(cfg, plan, accelerator, run.models, run.tokenizer, prompts,
                    torch.arange(responses, device=accelerator.device), None, PhaseProbe(device))
    scores = torch.zeros(responses, device=accelerator.device)
    _, batch.token_rewards, batch.advantages, batch.returns = rewards_to_advantages(
        cfg, plan, batch, scores, run.kl_ctrl.value, sum_over_processes(accelerator))
    sweep = []
    for micro in sizes:
        cfg_micro = recipe_config(args, "ppo", model_dir, os.path.join(tmp, "sweep"),
                                  [*base, f"actor.ppo_micro_batch_size={micro}"])
        entry = {"micro_batch": micro}
        computed = rm.memory(cfg_micro, shape=rm.QWEN2_5_0_5B if not args.toy else _toy_shape(run),
                             prompt_tokens=batch.seq.prompt_ids.shape[1])
        entry["computed_update_gib"] = round(computed["update"], 3)
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            ppo_update(cfg_micro, plan, accelerator, run.models, run.optimizers, batch, 1, PhaseProbe(device))
            sync(device)
            entry["seconds"] = round(time.perf_counter() - start, 2)
            if device.type == "cuda":
                entry["measured_update_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
                entry["error"] = round(entry["computed_update_gib"] / entry["measured_update_gib"] - 1, 3)
        except torch.OutOfMemoryError:
            entry["measured_update_gib"] = "out of memory"
        sweep.append(entry)
        result["sweep"] = sweep
    result["prompt_width"] = batch.seq.prompt_ids.shape[1]


def _toy_shape(run) -> dict:
    c = run.models[0].config
    return dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                vocab_size=c.vocab_size, tie_word_embeddings=True)


def checkpoint(result, args, model_dir: str, rows: Rows, tmp: str) -> None:
    import torch

    from rlhf.checkpoint import save_checkpoint

    device = torch.device(args.device)
    cfg = recipe_config(args, "ppo", model_dir, os.path.join(tmp, "checkpoint"))
    accelerator = fresh_accelerator(cfg, device)
    run = build_run(cfg, rows, accelerator)
    for optimizer in (opt for opt in run.optimizers if opt is not None):  # AdamW's moments, as after a step
        for group in optimizer.optimizer.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        optimizer.optimizer.step()  # zero gradients: the moments are made, the weights do not move
        optimizer.optimizer.zero_grad(set_to_none=True)
    sync(device)
    start = time.perf_counter()
    path = save_checkpoint(accelerator, cfg.trainer.output_dir, 1, 1, info={"adv_estimator": "gae"})
    os.sync()
    result["seconds_to_write"] = round(time.perf_counter() - start, 2)
    result["gib"] = round(sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs) / GIB, 3)
    shutil.rmtree(cfg.trainer.output_dir, ignore_errors=True)


def real_mode(report, args, tmp: str) -> None:
    """A networked machine: the base model's greedy accuracy on GSM8K's test set, then the PPO recipe's first steps."""
    import train
    from rlhf.config import load_config
    from rlhf.tracking import read_metrics

    recipe = os.path.join(REPO, "configs", "gsm8k_qwen2.5_0.5b.yaml")
    out = os.path.join(args.out, "real_run")
    with report.part("real_base_accuracy") as result:
        from rlhf.evaluate import evaluate_models

        evaluated = evaluate_models(load_config(recipe, []), {"model": "Qwen/Qwen2.5-0.5B-Instruct"}, recipe)
        result.update(num_problems=evaluated["num_problems"], metrics=evaluated["metrics"]["model"])
    with report.part("real_first_steps") as result:
        train.main(load_config(recipe, [f"trainer.output_dir={out}", f"trainer.total_steps={args.steps}",
                                        "trainer.logger=none", "trainer.save_freq=0"]))
        rows = read_metrics(os.path.join(out, "metrics.jsonl"))
        step_seconds = sorted(r["timing_s/step"] for r in rows if "timing_s/step" in r)
        result.update(val_accuracy_by_step={r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r},
                      verl_reference=VERL_CURVE, median_step_s=step_seconds[len(step_seconds) // 2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "gpu_check"))
    parser.add_argument("--parts", nargs="*", default=list(PARTS), help=f"any of {', '.join(PARTS)}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--toy", action="store_true", help="every part at toy size (the test suite: --device cpu)")
    parser.add_argument("--real", action="store_true", help="networked machine: real weights and GSM8K from the hub")
    parser.add_argument("--steps", type=int, default=20, help="--real: PPO steps to compare with verl's curve")
    parser.add_argument("--prepared", default=PREPARED, help="what bench/prepare_gpu_check.py wrote")
    parser.add_argument("--budget", type=float, default=480, help="seconds: a part not started by then is skipped, "
                                                                  "and the compiled decoding step needs 120 s left")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    if os.path.isdir(os.path.join(args.prepared, "wheels")):
        install_wheels(os.path.join(args.prepared, "wheels"), print)
    problem = preflight(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "0" if args.real else "1")
    import accelerate
    import torch
    import transformers

    report = Report(args.out, args)
    device = torch.device(args.device)
    report.data["machine"] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "device_memory_gib": (torch.cuda.get_device_properties(0).total_memory / GIB if device.type == "cuda" else None),
        "torch": torch.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__,
        "python": platform.python_version()}
    report.write()
    report.log(f"{report.data['machine']}; parts: {' '.join(args.parts)}")
    def wanted(name: str) -> bool:
        if name not in args.parts:
            return False
        if report.seconds_left() <= 0:
            report.data["parts"][name] = {"status": "skipped", "note": f"over the --budget of {args.budget:.0f} s"}
            report.write()
            return False
        return True

    with tempfile.TemporaryDirectory() as tmp:
        if args.real:
            real_mode(report, args, tmp)
        else:
            if wanted("cuda_tests"):
                with report.part("cuda_tests") as result:
                    cuda_tests(result, args)
            if wanted("embedded_default"):
                with report.part("embedded_default") as result:
                    embedded_default(result, args, tmp)
            if set(args.parts) & {"decode_sweep", "recipes", "memory_sweep", "checkpoint"}:
                model_dir, tokenizer = qwen_parts(args, tmp)
                questions, truths, source = gsm8k_questions(args)
                rows = prompt_rows(tokenizer, questions, truths, 512)
                widths = sorted(len(ids) for ids in rows.columns["input_ids"])
                report.data["prompts"] = {"source": source, "rows": len(rows), "tokens_min": widths[0],
                                          "tokens_median": widths[len(widths) // 2], "tokens_max": widths[-1]}
            for name, fn in (("decode_sweep", lambda r: decode_sweep(r, args, model_dir, tokenizer, rows, report)),
                             ("recipes", lambda r: recipes(r, args, model_dir, rows, tmp, report)),
                             ("memory_sweep", lambda r: memory_sweep(r, args, model_dir, rows, tmp)),
                             ("checkpoint", lambda r: checkpoint(r, args, model_dir, rows, tmp))):
                if wanted(name):
                    with report.part(name) as result:
                        fn(result)
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
    report.data["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report.write()
    status = {name: part["status"] for name, part in report.data["parts"].items()}
    failed, skipped = ([n for n, st in status.items() if st == kind] for kind in ("failed", "skipped"))
    report.log(f"done: {sum(st == 'ok' for st in status.values())} part(s) ok"
               + (f", failed: {', '.join(failed)}" if failed else "")
               + (f", skipped (over the budget): {', '.join(skipped)}" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
