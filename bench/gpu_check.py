"""The first minutes on a GPU: one process, no network, within --budget (520 s by default: 80 s to spare under a
600 s call), answering what a user of the recipes needs to know. Its first line and the JSON come before anything
is installed or imported; then it prints one line per part as it starts (its estimated duration, ESTIMATED_S) and
one as it ends, with its numbers (so the output's tail alone answers), and writes one JSON (rewritten after every
part, so a run cut short still leaves its data) and its log into --out (default outputs/gpu_check/). A part
whose estimate does not fit what is left of the budget is skipped, saying so; one short of a package it needs
(PART_NEEDS), of pip to install the carried wheels or of a C compiler for torch.compile fails with the reason,
and the next part runs.

    python bench/prepare_gpu_check.py          # first, where there is network: fills .gpu_check/ (docs/gpu.md)
    python bench/gpu_check.py --out /tmp/check # on the GPU machine, from the repository's root
    python bench/gpu_check.py --parts recipes memory_sweep    # some parts only
    python bench/gpu_check.py --toy --device cpu   # every part at toy size on a CPU (tests/test_gpu_check.py)
    python bench/gpu_check.py --real           # a networked GPU machine: the real weights and GSM8K (below)

Parts, in the order of answers per second, each timed with the device synchronised (`parts.<name>` in the JSON),
each with its memory (`memory`: the baseline once the previous part is freed, the allocator's allocated and
reserved peaks, and the device-level peak, polled: what the CUDA context and the allocator's slack add):
- recipes: configs/gsm8k_qwen2.5_0.5b.yaml and its GRPO sibling exactly as shipped (batch, lengths, micro-batches,
  bf16, checkpointing) on Qwen2.5-0.5B's architecture with random weights from its config, Qwen's tokenizer and
  GSM8K prompts (.gpu_check/gsm8k_test.jsonl; without it GSM8K-shaped generated problems): two
  rlhf.step.train_step's each; per phase (sampling, log-probs, update) seconds and peak memory, next to
  bench/recipe_memory.py's computation for the same prompt length. A random model never samples EOS, so every
  response runs to 512 tokens: the worst case;
- lora_recipes: the LoRA recipes (configs/*_lora.yaml) the same way (peft from the carried wheels);
- settings_80gb: each recipe with its 80 GB column's sizes (bench/recipe_memory.fitting_overrides: larger
  micro-batches, no checkpointing) on one mini-batch of prompts, two steps: per phase peak against the model;
- evaluation: the greedy evaluation at each recipe's evaluation batch and response length, the actor alone:
  seconds, tokens/s and the peak above the weights against the model's;
- lora_evaluation: each LoRA recipe's step 0, the trainer's evaluation of the bf16 base with its adapters at the
  recipe's evaluation batch (1,319 prompts) and prefill sub-batch, as wide as the longest GSM8K test prompt: the
  peak against the model's evaluation, seconds;
- decoding: the eager static-cache loop under bf16 autocast at batch sizes 1-256, 128 tokens: the prefill's time
  apart from the per-token time, the device's copy bandwidth measured, and the floor it sets (the bf16 weights
  and the KV cache read once a token); the reference loop at one size;
- memory_sweep: the PPO recipe's update on 32 of its responses at each actor.ppo_micro_batch_size of 1-32, with
  gradient checkpointing on and off: peak memory against the model (an out-of-memory is recorded, not fatal);
- compiled_decoding: the compiled one-token step (`decode.decode(..., step_type=decode.CompiledTokenStep)`, a CUDA
  graph) at batch 256: its compile time, its per-token time beside the eager loop's, its greedy tokens against
  the eager ones;
- checkpoint: the PPO recipe's checkpoint (float32 actor and critic, AdamW moments) written once: seconds, GiB;
- cuda_tests: the tests marked `cuda` (tests/test_cuda.py), run in this process by pytest;
- embedded_default: configs/tiny.yaml trained on the device for its 40 steps (the warm start from .gpu_check/,
  else built first, ~2 min on one CPU thread): held-out accuracy at step 0 and at the end, seconds a step.
With --real (network needed): the base model's greedy accuracy on all 1,319 test problems (strict and
flexible) and the PPO recipe's first --steps steps against verl's reference curve (docs/gpu.md).

Without a CUDA device, or short of a package or of .gpu_check/'s files, it says which (also as the JSON's
`error`) and exits at once (2).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import glob
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

START = time.perf_counter()  # the budget counts from here, the script's start
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREPARED = os.path.join(REPO, ".gpu_check")
PARTS = ("recipes", "lora_recipes", "settings_80gb", "evaluation", "lora_evaluation", "decoding", "memory_sweep",
         "compiled_decoding", "checkpoint", "cuda_tests", "embedded_default")
# Seconds each part is expected to take on one H100 or H200, estimated from the code (nothing has run on a GPU):
# eager decoding host-bound at ~20 ms a token whatever the batch (every recipe's responses run to 512 tokens on
# random weights), the update ~0.1 s a micro-batch. A part starts only where its estimate fits what is left of
# --budget; the JSON's `seconds` are the measured times to replace these with.
ESTIMATED_S = {"recipes": 150, "lora_recipes": 100, "settings_80gb": 60, "evaluation": 30, "lora_evaluation": 60,
               "decoding": 25, "memory_sweep": 80, "compiled_decoding": 150, "checkpoint": 10, "cuda_tests": 30,
               "embedded_default": 90}
# --toy --device cpu: measured on the project's 2-core CPU (2026-12-06: 0.1-2.0 s a part), rounded up
TOY_ESTIMATED_S = {"recipes": 3, "lora_recipes": 4, "settings_80gb": 2, "evaluation": 1, "lora_evaluation": 2,
                   "decoding": 1, "memory_sweep": 3, "compiled_decoding": 1, "checkpoint": 1, "cuda_tests": 1,
                   "embedded_default": 3}
LORA_RECIPES = {"ppo": "gsm8k_qwen2.5_0.5b_lora.yaml", "grpo": "gsm8k_qwen2.5_0.5b_grpo_lora.yaml"}
NEEDED = ("torch", "transformers", "accelerate", "tokenizers", "yaml", "tqdm")
# What one part needs beyond NEEDED: without it the part fails, saying what to bring
PART_NEEDS = {"lora_recipes": ("peft",), "lora_evaluation": ("peft",), "cuda_tests": ("pytest",),
              "embedded_default": ("datasets",)}
GIB = 2**30
DEFAULT_BUDGET_S = 520  # seconds: 80 s to spare under a call of 600 s (the lent GPU's limit on one command)
# verl's Qwen2.5-0.5B-Instruct PPO log on GSM8K (docs/gpu.md): held-out accuracy by step
VERL_CURVE = {0: 0.0008, 9: 0.013, 19: 0.176, 29: 0.458}


class Report:
    """The JSON and the log: `part(name)` times a part, records its results or its error, and rewrites the JSON."""

    def __init__(self, out_dir: str, args):
        os.makedirs(out_dir, exist_ok=True)
        self.path, self.log_path = os.path.join(out_dir, "gpu_check.json"), os.path.join(out_dir, "gpu_check.log")
        self.data = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "args": vars(args), "machine": {"python": platform.python_version()}, "parts": {},
                     "finished": False}
        self.log_file = open(self.log_path, "w")
        self.budget = args.budget
        self.log(f"gpu_check: budget {self.budget:.0f} s, parts {' '.join(args.parts)}; writing {self.path}")
        self.write()

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
        return self.budget - (time.perf_counter() - START)

    def skip(self, name: str, status: str, said: str) -> None:
        """A part not run: `status` skipped (`said` is its note) or failed (its error)."""
        self.data["parts"][name] = {"status": status, "note" if status == "skipped" else "error": said}
        self.log(f"{name}: {status} | {said}")
        self.write()

    @contextlib.contextmanager
    def part(self, name: str, device, estimated_s: float):
        """Times the part, measures its memory (PartMemory), records its results or its error, rewrites the JSON,
        and prints one line as it starts (its estimate) and one as it ends: status, seconds, the part's `summary`
        and its memory."""
        result = {"status": "running", "estimated_s": estimated_s}
        self.data["parts"][name] = result
        self.log(f"{name}: start, estimated {estimated_s:.0f} s ({self.seconds_left():.0f} s of the budget left)")
        start = time.perf_counter()
        memory = PartMemory(device)
        try:
            with memory:
                yield result, memory
            result["status"] = "ok"
        except Skipped as e:
            result["status"], result["note"] = "skipped", str(e)
        except Exception as e:  # a part's failure is a result; the next part runs
            result["status"], result["error"] = "failed", f"{type(e).__name__}: {e}"
            self.log(traceback.format_exc())
        finally:
            result["seconds"] = round(time.perf_counter() - start, 2)
            result["memory"] = memory.result()
            said = result.get("summary") or result.get("note") or result.get("error", "")
            self.log(f"{name}: {result['status']} in {result['seconds']:.1f} s" + (f" | {said}" if said else "")
                     + (f" | memory GiB: {memory.line()}" if memory.measured else ""))
            self.write()


class Skipped(Exception):
    """A part that cannot run here (its reason is recorded as the part's note)."""


class PartMemory:
    """A part's memory on a CUDA device, in GiB: `baseline` once the previous part is freed (a garbage collection
    and the allocator's cache emptied first), the allocator's `allocated` and `reserved` peaks (`fold` keeps them
    across the phase probes' resets), and the `device` peak (total less free memory, polled every 10 ms by a
    thread: what the CUDA context and the allocator's slack add to the allocator's count)."""

    def __init__(self, device):
        self.device, self.measured = device, device.type == "cuda"
        self.baseline, self.peaks, self._stop = {}, {"allocated": 0.0, "reserved": 0.0, "device": 0.0}, None

    def _device_used(self) -> float:
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return (total - free) / GIB

    def __enter__(self):
        if not self.measured:
            return self
        import torch

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.baseline = {"allocated": torch.cuda.memory_allocated() / GIB,
                         "reserved": torch.cuda.memory_reserved() / GIB, "device": self._device_used()}
        self._stop = threading.Event()

        def poll():
            while not self._stop.wait(0.01):
                self.peaks["device"] = max(self.peaks["device"], self._device_used())

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def fold(self) -> None:
        """Keep the allocator's peaks so far (before a phase probe resets them)."""
        if self.measured:
            import torch

            self.peaks["allocated"] = max(self.peaks["allocated"], torch.cuda.max_memory_allocated() / GIB)
            self.peaks["reserved"] = max(self.peaks["reserved"], torch.cuda.max_memory_reserved() / GIB)

    def __exit__(self, *exc):
        if self.measured:
            self.fold()
            self._stop.set()
            self._thread.join()
            self.peaks["device"] = max(self.peaks["device"], self._device_used())
        return False

    def result(self) -> dict | None:
        if not self.measured:
            return None
        return {"baseline": {k: round(v, 3) for k, v in self.baseline.items()},
                **{f"{k}_peak": round(v, 3) for k, v in self.peaks.items()}}

    def line(self) -> str:
        b, p = self.baseline, self.peaks
        return (f"baseline {b.get('allocated', 0):.2f} allocated ({b.get('device', 0):.2f} device), peaks: allocated "
                f"{p['allocated']:.2f}, reserved {p['reserved']:.2f}, device {p['device']:.2f}")


# ----------------------------------------------------------------------------- before anything runs


def missing_packages(needed: tuple[str, ...] | None = None) -> list[str]:
    """Which of `needed` (default NEEDED) this Python cannot import."""
    return [name for name in (NEEDED if needed is None else needed) if importlib.util.find_spec(name) is None]


def install_wheels(wheel_dir: str, report_log) -> None:
    """pip install --no-index --no-deps the carried wheels of the packages this Python lacks; RuntimeError with
    pip's own last line where it fails (no pip in the image: "No module named pip")."""
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    lacking = [w for w in wheels if importlib.util.find_spec(os.path.basename(w).split("-")[0].lower()) is None]
    if lacking:
        report_log(f"installing {len(lacking)} carried wheel(s): {', '.join(os.path.basename(w) for w in lacking)}")
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", *lacking],
                              capture_output=True, text=True)
        if done.returncode:
            said = (done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"]
            raise RuntimeError(f"pip install of the carried wheels failed: {said[-1]}")
        importlib.invalidate_caches()


def preflight(args) -> str | None:
    """What is missing to run, as a message naming what to bring; None when everything is there."""
    missing = missing_packages()
    if missing:
        return (f"missing package(s): {', '.join(missing)}. On a machine with network: python bench/prepare_gpu_check.py "
                f"--packages {' '.join(missing)}, and bring the repository with its .gpu_check/ folder.")
    import torch

    if not args.toy and args.device == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU build)"
        return (f"no CUDA device: torch {torch.__version__} (CUDA {built}) sees none. Run this on a machine with an "
                "NVIDIA GPU and torch's CUDA build; at toy size on a CPU: --toy --device cpu.")
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
    """The trainer's timer with each phase's device-synchronised seconds and peak memory, allocated and reserved
    (CUDA only; the part's PartMemory keeps its own peaks across the resets)."""

    GROUPS = {"sampling": ("gen",), "log-probs": ("old_log_prob", "ref", "values"),
              "update": ("update_actor", "update_critic", "update_step")}

    def __init__(self, device, memory: "PartMemory | None" = None):
        from rlhf.tracking import Timer

        self.device, self.memory, self.timer, self.peaks, self.reserved = device, memory, Timer(), {}, {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        import torch

        sync(self.device)
        if self.device.type == "cuda":
            if self.memory is not None:
                self.memory.fold()
            torch.cuda.reset_peak_memory_stats()
        with self.timer(name):
            yield
            sync(self.device)
        if self.device.type == "cuda":
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated() / GIB)
            self.reserved[name] = max(self.reserved.get(name, 0), torch.cuda.max_memory_reserved() / GIB)

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
                              "peak_gib": max((round(self.peaks[n], 3) for n in present if n in self.peaks), default=None),
                              "reserved_gib": max((round(self.reserved[n], 3) for n in present if n in self.reserved),
                                                  default=None)}
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


def recipe_config(args, name: str, model_dir: str, out_dir: str, extra=(), lora: bool = False):
    """The recipe as shipped (`lora`: its LoRA sibling), with only where the model is and where the run writes;
    --toy shrinks it, and `extra` comes last."""
    from rlhf.config import load_config

    file = (LORA_RECIPES[name] if lora else
            "gsm8k_qwen2.5_0.5b.yaml" if name == "ppo" else "gsm8k_qwen2.5_0.5b_grpo.yaml")
    toy = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2",
           "rollout.log_prob_micro_batch_size=2", "data.max_response_length=16", "data.val_batch_size=4"] if args.toy else []
    return load_config(os.path.join(REPO, "configs", file), [f"model.path={model_dir}", f"trainer.output_dir={out_dir}",
                                                             "trainer.logger=none", *toy, *extra])


def fresh_accelerator(cfg, device):
    """An Accelerator for `cfg`'s mixed precision: accelerate keeps one state per process and refuses another
    precision once set, and the parts differ (the embedded default trains without autocast, the recipes in bf16)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(mixed_precision=cfg.trainer.mixed_precision, cpu=device.type == "cpu")


def build_run(cfg, rows: Rows, accelerator, val_rows: Rows | None = None):
    from rlhf.setup import build_setup, load_models

    return build_setup(cfg, accelerator, load_tokenizer_of(cfg), rows, val_rows, *load_models(cfg, cfg.model.path))


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
        raise Skipped("the tests marked cuda need a CUDA device")
    outcomes = {}

    class Collect:
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                outcomes[report.nodeid] = report.outcome

    code = pytest.main(["-q", "-m", "cuda", "-p", "no:cacheprovider", os.path.join(REPO, "tests", "test_cuda.py")],
                       plugins=[Collect()])
    result.update(exit_code=int(code), tests=outcomes, passed=sum(o == "passed" for o in outcomes.values()),
                  failed=sum(o != "passed" for o in outcomes.values()))
    result["summary"] = f"{result['passed']} passed, {result['failed']} failed"
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
    result["summary"] = (f"{len(steps)} steps, median {result['median_step_s']:.2f} s a step; held-out accuracy "
                         + ", ".join(f"step {k}: {v:.3f}" for k, v in accuracy.items()))


def model_shape(args, model) -> dict:
    """The memory model's shape of `model` (Qwen2.5-0.5B's, or the toy's)."""
    c = model.config
    return dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                vocab_size=c.vocab_size, tie_word_embeddings=True)


def train_steps(args, cfg, rows: Rows, memory: PartMemory, report: Report, record: dict, num_steps: int = 2) -> None:
    """`num_steps` rlhf.step.train_step's of `cfg` (the second is the one with AdamW's moments in place): into
    `record`, per step its seconds and each phase's seconds and peaks; then the model's computation per phase
    for the longest prompt, and the measured peak."""
    import torch

    from rlhf.step import plan_step, train_step

    device = torch.device(args.device)
    rm = memory_model()
    widths = sorted(len(x) for x in rows.columns["input_ids"])
    accelerator = fresh_accelerator(cfg, device)
    run = build_run(cfg, rows, accelerator)
    plan = plan_step(cfg, accelerator.mixed_precision)
    steps = record["steps"] = []
    for step in range(1, num_steps + 1):
        probe = PhaseProbe(device, memory)
        sync(device)
        start = time.perf_counter()
        metrics = train_step(cfg, plan, accelerator, run, step, probe).metrics
        sync(device)
        steps.append({"seconds": round(time.perf_counter() - start, 2), "phases": probe.phases(),
                      "response_length": metrics["response_length/mean"], "kl_full": metrics.get("kl/full")})
        report.write()
    computed = rm.memory(cfg, shape=model_shape(args, run.models[0]), prompt_tokens=min(widths[-1], cfg.data.max_prompt_length))
    peaks = [phase["peak_gib"] for phase in steps[-1]["phases"].values() if phase["peak_gib"]]
    record.update(
        prompts=cfg.data.train_batch_size, responses=cfg.data.train_batch_size * cfg.rollout.n,
        mixed_precision=cfg.trainer.mixed_precision, gradient_checkpointing=cfg.model.gradient_checkpointing,
        micro_batches={"actor.ppo_micro_batch_size": cfg.actor.ppo_micro_batch_size,
                       "rollout.log_prob_micro_batch_size": cfg.rollout.log_prob_micro_batch_size},
        computed_peak_gib={p: round(computed[p], 2) for p in rm.PHASES if p != "evaluation"},
        peak_gib=max(peaks) if peaks else None)
    del run, accelerator


def steps_line(name: str, record: dict) -> str:
    """One recipe's numbers for the part's line: the last step's seconds per phase and its peak against the model."""
    last = record["steps"][-1]
    phases = ", ".join(f"{p} {v['seconds']:.1f}" for p, v in last["phases"].items())
    peak = "" if record["peak_gib"] is None else f"; peak {record['peak_gib']:.2f} GiB"
    computed = max(record["computed_peak_gib"].values())
    return f"{name}: step {last['seconds']:.1f} s ({phases}){peak}, computed {computed:.2f}"


def recipes(result, args, model_dir: str, rows: Rows, tmp: str, report: Report, memory: PartMemory,
            lora: bool = False) -> None:
    lines = []
    for name in ("ppo", "grpo"):
        cfg = recipe_config(args, name, model_dir, os.path.join(tmp, name), lora=lora)
        result[name] = {}
        train_steps(args, cfg, rows, memory, report, result[name])
        lines.append(steps_line(name, result[name]))
    widths = sorted(len(x) for x in rows.columns["input_ids"])
    result["prompt_tokens"] = {"min": widths[0], "median": widths[len(widths) // 2], "max": widths[-1]}
    result["summary"] = "; ".join(lines)


def settings_80gb(result, args, model_dir: str, rows: Rows, tmp: str, report: Report, memory: PartMemory) -> None:
    """Each recipe with the sizes of the memory model's 80 GB column, on one mini-batch of prompts: the update's
    peak is a micro-batch's, whatever the batch."""
    rm = memory_model()
    lines = []
    for name in ("ppo", "grpo"):
        overrides = rm.fitting_overrides(name, 80, "none", 1)
        base = recipe_config(args, name, model_dir, os.path.join(tmp, name))
        one_mini_batch = [f"data.train_batch_size={base.actor.ppo_mini_batch_size}"]
        cfg = recipe_config(args, name, model_dir, os.path.join(tmp, name), [*overrides, *one_mini_batch])
        result[name] = {"overrides": overrides + one_mini_batch}
        train_steps(args, cfg, rows, memory, report, result[name])
        lines.append(steps_line(name, result[name]))
    result["summary"] = "; ".join(lines)


def evaluation(result, args, model_dir: str, tokenizer, rows: Rows, tmp: str, report: Report, memory: PartMemory) -> None:
    """One greedy evaluation batch of each recipe (data.val_batch_size prompts, data.max_response_length tokens,
    bf16 autocast), the actor alone: the peak above its weights against the model's evaluation less static."""
    import torch

    from rlhf.models import load_causal_lm
    from rlhf.rollout import SamplingParams, generate, left_pad

    device = torch.device(args.device)
    rm = memory_model()
    model = load_causal_lm(model_dir, "float32").to(device).eval()
    lines = []
    for name in ("ppo", "grpo"):
        cfg = recipe_config(args, name, model_dir, os.path.join(tmp, name))
        size = min(cfg.data.val_batch_size, len(rows))
        ids, mask = left_pad(rows[list(range(size))]["input_ids"], tokenizer.pad_token_id)
        computed = rm.memory(cfg, shape=model_shape(args, model), prompt_tokens=ids.shape[1],
                             val_prompt_tokens=ids.shape[1])
        memory.fold()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated() / GIB if device.type == "cuda" else None
        sync(device)
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            seq = generate(model, tokenizer, ids.to(device), mask.to(device),
                           SamplingParams(cfg.data.max_response_length, greedy=True,
                                          prefill_batch_size=cfg.data.val_prefill_batch_size))
        sync(device)
        seconds = time.perf_counter() - start
        tokens = int(seq.response_mask.sum())
        record = result[name] = {
            "batch": size, "prompt_width": ids.shape[1], "response_tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds), "computed_above_static_gib": round(computed["evaluation"] - computed["static"], 3)}
        line = f"{name}: batch {size}, {seconds:.1f} s, {tokens / seconds:,.0f} tokens/s"
        if device.type == "cuda":
            record["peak_above_weights_gib"] = round(torch.cuda.max_memory_allocated() / GIB - weights, 3)
            line += (f", {record['peak_above_weights_gib']:.2f} GiB above the weights "
                     f"(computed {record['computed_above_static_gib']:.2f})")
        lines.append(line)
        del seq
        report.write()
    result["summary"] = "; ".join(lines)


def widened(rows: Rows, size: int, width: int) -> Rows:
    """The first `size` rows, the longest of them lengthened to `width` tokens (its own tokens repeated in front)
    where it is shorter: a batch pads to its longest prompt, so the batch is `width` wide."""
    picked = rows[list(range(min(size, len(rows))))]
    ids = picked["input_ids"]
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    while len(ids[longest]) < width:
        ids[longest] = (ids[longest] + ids[longest])[-width:]
    return Rows(picked)


def lora_evaluation(result, args, model_dir: str, rows: Rows, tmp: str, memory: PartMemory) -> None:
    """Step 0 of each LoRA recipe: the trainer's greedy evaluation (rlhf.held_out.evaluate) of the bf16 base with
    its adapters, set up as for training (critic, optimizers), at the recipe's data.val_batch_size and
    data.val_prefill_batch_size, the batch as wide as the longest GSM8K test prompt, data.max_response_length
    tokens under bf16 autocast: seconds, and the peak against the memory model's evaluation (which counts AdamW's
    moments, made only at the first step)."""
    import torch

    from rlhf.held_out import evaluate

    device = torch.device(args.device)
    rm = memory_model()
    lines = []
    for name in ("ppo", "grpo"):
        toy = ["data.val_prefill_batch_size=3"] if args.toy else []  # toy: 4 prompts, a sub-batch not dividing them
        cfg = recipe_config(args, name, model_dir, os.path.join(tmp, f"{name}-lora-eval"), toy, lora=True)
        val_rows = widened(rows, cfg.data.val_batch_size, rm.GSM8K_TEST_PROMPT_TOKENS)
        width = max(len(ids) for ids in val_rows.columns["input_ids"])
        accelerator = fresh_accelerator(cfg, device)
        run = build_run(cfg, rows, accelerator, val_rows)
        computed = rm.memory(cfg, shape=model_shape(args, run.models[0]), prompt_tokens=width, val_prompt_tokens=width)
        memory.fold()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync(device)
        start = time.perf_counter()
        metrics = evaluate(cfg, accelerator, run)
        sync(device)
        seconds = time.perf_counter() - start
        record = result[name] = {
            "batch": len(val_rows), "prefill_batch": cfg.data.val_prefill_batch_size, "prompt_width": width,
            "response_tokens": cfg.data.max_response_length, "seconds": round(seconds, 2),
            "answers_per_s": round(len(val_rows) / seconds, 1), "clip_ratio": metrics["val/greedy_clip_ratio"],
            "computed_gib": round(computed["evaluation"], 3)}
        line = (f"{name}-lora: batch {len(val_rows)} x {width} tokens, prefill {cfg.data.val_prefill_batch_size or 'whole'}"
                f", {seconds:.1f} s")
        if device.type == "cuda":
            record["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
            line += f", peak {record['peak_gib']:.2f} GiB (computed {record['computed_gib']:.2f})"
        lines.append(line)
        del run, accelerator
        gc.collect()
    result["summary"] = "; ".join(lines)


def copy_bandwidth(device) -> float:
    """The device's copy bandwidth, bytes read + written per second, over ten copies of 1 GiB (toy: 64 MiB)."""
    import torch

    x = torch.empty((2**28 if device.type == "cuda" else 2**24,), device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * 10 * x.numel() * x.element_size() / (time.perf_counter() - start)


def decode_floor_s(model, batch: int, context: int, bandwidth: float) -> float:
    """Seconds a token cannot beat at `batch`: the bf16 weights (autocast's copies) and each sequence's KV cache
    of `context` tokens (float32 keys; bf16 values on transformers 5.2x, float32 on 5.17) read once, at the copy
    bandwidth."""
    c = model.config
    kv_width = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    weights = 2 * sum(p.numel() for p in model.parameters())
    value_bytes = 2 if memory_model().cache_keeps_value_dtype() else 4
    cache = batch * context * c.num_hidden_layers * kv_width * (4 + value_bytes)
    return (weights + cache) / bandwidth


def decoding(result, args, model_dir: str, tokenizer, rows: Rows, report: Report) -> None:
    """The eager static-cache loop (and the reference loop at one size): the prefill timed apart from the tokens
    after it, against the floor the measured copy bandwidth sets."""
    import torch

    from rlhf.models import load_causal_lm
    from rlhf import decode
    from rlhf.rollout import SamplingParams, left_pad, next_token

    device = torch.device(args.device)
    model = load_causal_lm(model_dir, "float32").to(device).eval()
    tokens = 16 if args.toy else 128
    sizes = [1, 4, 16] if args.toy else [1, 8, 32, 128, 256]
    autocast = device.type == "cuda"
    bandwidth = copy_bandwidth(device)
    result.update(tokens=tokens, autocast_bf16=autocast, copy_bandwidth_gb_s=round(bandwidth / 1e9, 1), runs=[])

    def timed(batch_size: int, loop: str, new_tokens: int) -> float:
        ids, mask = (t.to(device) for t in left_pad(rows[list(range(batch_size))]["input_ids"], tokenizer.pad_token_id))
        generator = torch.Generator(device=device).manual_seed(0)
        sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        sync(device)
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            run = decode.reference_decode if loop == "reference" else decode.decode
            run(model, ids, mask, decode.Decoding(new_tokens, lambda logits: next_token(logits, sampling, generator),
                                                  1.0, None, tokenizer.pad_token_id))
        sync(device)
        return time.perf_counter() - start

    timed(sizes[0], "static", tokens)  # warm-ups
    timed(sizes[0], "reference", tokens)
    lines = []
    for loop, batch_size in [*(("static", b) for b in sizes), ("reference", sizes[1])]:
        prefill = timed(batch_size, loop, 1)  # the prompts' forward pass and one token drawn
        total = timed(batch_size, loop, tokens)
        per_token = (total - prefill) / (tokens - 1)
        width = max(len(ids) for ids in rows[list(range(batch_size))]["input_ids"])
        floor = decode_floor_s(model, batch_size, width + tokens // 2, bandwidth)
        result["runs"].append({"loop": loop, "batch": batch_size, "prompt_width": width, "prefill_s": round(prefill, 4),
                               "ms_per_token": round(per_token * 1e3, 3), "floor_ms_per_token": round(floor * 1e3, 4),
                               "times_floor": round(per_token / floor, 1),
                               "tokens_per_s": round(batch_size / per_token)})
        if loop == "static" and batch_size in (sizes[0], sizes[-1]) or loop == "reference":
            lines.append(f"{loop} b{batch_size}: prefill {prefill * 1e3:.0f} ms, {per_token * 1e3:.2f} ms/token "
                         f"(floor {floor * 1e3:.3f}, x{per_token / floor:.0f})")
        report.write()  # a run cut short keeps the sizes done
    result["summary"] = f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s; " + "; ".join(lines)


def compiled_decoding(result, args, model_dir: str, tokenizer, rows: Rows, report: Report) -> None:
    """The compiled one-token step at one batch size: compile time, per-token time beside the eager loop's, and
    its greedy tokens against the eager ones (equal up to float rounding: the attention reads the whole cache)."""
    import torch

    from rlhf import decode
    from rlhf.models import load_causal_lm
    from rlhf.rollout import SamplingParams, left_pad, next_token

    if args.toy:  # compiling takes ~30 s on a CPU: tests/test_decode.py covers the compiled step there
        raise Skipped("not at toy size: tests/test_decode.py compiles the step on the CPU")
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH: torch.compile builds its kernels' launchers "
                           "with one; install one (apt-get install gcc) or leave this part out")
    device = torch.device(args.device)
    model = load_causal_lm(model_dir, "float32").to(device).eval()
    tokens, batch_size = 128, 256
    params = SamplingParams(max_new_tokens=tokens, greedy=True)
    ids, mask = left_pad(rows[list(range(batch_size))]["input_ids"], tokenizer.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)

    def run(compiled: bool, new_tokens: int = tokens):
        sync(device)
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            how = decode.Decoding(new_tokens, lambda logits: next_token(logits, params), 1.0, None,
                                  tokenizer.pad_token_id)
            token_step = decode.CompiledTokenStep if compiled else decode.TokenStep
            out = decode.decode(model, ids, mask, how, step_type=token_step)[0]
        sync(device)
        return out, time.perf_counter() - start

    eager, eager_s = run(False)
    _, compile_s = run(True)  # the first call compiles (and records the CUDA graph)
    compiled, compiled_s = run(True)
    _, prefill_s = run(False, 1)
    per_token = {"eager": (eager_s - prefill_s) / (tokens - 1), "compiled": (compiled_s - prefill_s) / (tokens - 1)}
    same = (eager == compiled).float().mean().item()
    result.update(batch=batch_size, tokens=tokens, compile_s=round(compile_s, 1), greedy_tokens_equal=round(same, 4),
                  ms_per_token={k: round(v * 1e3, 3) for k, v in per_token.items()})
    result["summary"] = (f"b{batch_size}: compile {compile_s:.0f} s; {per_token['compiled'] * 1e3:.2f} ms/token against "
                         f"eager {per_token['eager'] * 1e3:.2f}; greedy tokens equal {same:.1%}")


def memory_sweep(result, args, model_dir: str, rows: Rows, tmp: str, memory: PartMemory) -> None:
    """The update alone (rlhf.step's advantages and PPO epochs) on one rollout batch of 32 responses, per
    micro-batch size, with gradient checkpointing on and off."""
    import torch

    from rlhf.rollout import generate, left_pad
    from rlhf.step import Batch, forward_passes, plan_step, ppo_update

    device = torch.device(args.device)
    rm = memory_model()
    responses = 4 if args.toy else 32
    sizes = [1, 2, 4] if args.toy else [1, 2, 4, 8, 16, 32]
    base = ["data.train_batch_size=" + str(responses), f"actor.ppo_mini_batch_size={responses}",
            f"rollout.log_prob_micro_batch_size={min(responses, 8)}"]
    lines = []
    for checkpointing in (True, False):
        flag = f"model.gradient_checkpointing={str(checkpointing).lower()}"
        cfg = recipe_config(args, "ppo", model_dir, os.path.join(tmp, "sweep"), [*base, flag])
        accelerator = fresh_accelerator(cfg, device)
        run = build_run(cfg, rows, accelerator)
        plan = plan_step(cfg, accelerator.mixed_precision)
        prompts = left_pad(rows[list(range(responses))]["input_ids"], run.tokenizer.pad_token_id)
        with accelerator.autocast():
            seq = generate(run.models[0], run.tokenizer, *(t.to(device) for t in prompts), plan.sampling)
        passes = forward_passes(cfg, plan, accelerator, run.models, seq, PhaseProbe(device))
        # the update's memory does not depend on the advantages' values: 0 (GAE's of zero scores would be close)
        zeros = torch.zeros(seq.response_mask.shape, device=accelerator.device)
        batch = Batch(seq=seq, group_ids=torch.arange(responses, device=accelerator.device),
                      old_logprobs=passes.old_logprobs, sampler_logprobs=seq.logprobs, ref_logprobs=passes.ref_logprobs,
                      exact_kl=passes.exact_kl, exact_forward_kl=passes.exact_forward_kl, old_values=passes.old_values,
                      token_rewards=zeros, advantages=zeros, returns=zeros)
        # AdamW's moments are made at the first optimizer step: one update first, so every size counts them
        ppo_update(cfg, plan, accelerator, run, batch, 1, PhaseProbe(device))
        sweep = result["checkpointing" if checkpointing else "no_checkpointing"] = []
        for micro in sizes:
            cfg_micro = recipe_config(args, "ppo", model_dir, os.path.join(tmp, "sweep"),
                                      [*base, flag, f"actor.ppo_micro_batch_size={micro}"])
            computed = rm.memory(cfg_micro, shape=model_shape(args, run.models[0]),
                                 prompt_tokens=batch.seq.prompt_ids.shape[1])
            entry = {"micro_batch": micro, "computed_update_gib": round(computed["update"], 6)}
            try:
                memory.fold()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                ppo_update(cfg_micro, plan, accelerator, run, batch, 1, PhaseProbe(device))
                sync(device)
                entry["seconds"] = round(time.perf_counter() - start, 2)
                if device.type == "cuda":
                    entry["measured_update_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
                    entry["reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
                    entry["error"] = round(entry["computed_update_gib"] / entry["measured_update_gib"] - 1, 3)
            except torch.OutOfMemoryError:
                entry["measured_update_gib"] = "out of memory"
            sweep.append(entry)
        result["prompt_width"] = batch.seq.prompt_ids.shape[1]
        errors = [e["error"] for e in sweep if "error" in e]
        lines.append(f"checkpointing {'on' if checkpointing else 'off'}: micro {sizes[0]}-{sizes[-1]}"
                     + (f", model error {min(errors):+.0%} to {max(errors):+.0%}" if errors else "")
                     + "".join(f", micro {e['micro_batch']} out of memory" for e in sweep
                               if e.get("measured_update_gib") == "out of memory"))
        del run, accelerator, batch
        gc.collect()
    result["summary"] = "; ".join(lines)


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
    result["summary"] = f"{result['gib']:.2f} GiB written in {result['seconds_to_write']:.1f} s"
    del run, accelerator
    shutil.rmtree(cfg.trainer.output_dir, ignore_errors=True)


def real_mode(report, args, tmp: str) -> None:
    """A networked machine: the base model's greedy accuracy on GSM8K's test set, then the PPO recipe's first steps."""
    import torch

    import train
    from rlhf.config import load_config
    from rlhf.tracking import read_metrics

    recipe = os.path.join(REPO, "configs", "gsm8k_qwen2.5_0.5b.yaml")
    out = os.path.join(args.out, "real_run")
    device = torch.device(args.device)
    with report.part("real_base_accuracy", device, 300) as (result, _):
        from rlhf.evaluate import evaluate_models

        evaluated = evaluate_models(load_config(recipe, []), {"model": "Qwen/Qwen2.5-0.5B-Instruct"}, recipe)
        result.update(num_problems=evaluated["num_problems"], metrics=evaluated["metrics"]["model"])
    with report.part("real_first_steps", device, 60 * args.steps) as (result, _):
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
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds from the start: a part whose estimate does not fit what is left is skipped")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    report = Report(args.out, args)  # the first line and the JSON, before anything is installed or imported
    if os.path.isdir(os.path.join(args.prepared, "wheels")):
        try:
            install_wheels(os.path.join(args.prepared, "wheels"), report.log)
        except Exception as e:  # no pip in the image, say: recorded; a part short of a package says so as it starts
            report.data["install"] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            report.log(f"install: failed | {type(e).__name__}: {e}")
            report.write()
    problem = preflight(args)
    if problem:
        report.data["error"] = problem
        report.write()
        print(f"error: {problem}", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "0" if args.real else "1")
    import accelerate
    import torch
    import transformers

    device = torch.device(args.device)
    report.data["machine"] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "device_memory_gib": (torch.cuda.get_device_properties(0).total_memory / GIB if device.type == "cuda" else None),
        "torch": torch.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__,
        "python": platform.python_version()}
    report.write()
    report.log(f"{report.data['machine']}")
    estimates = TOY_ESTIMATED_S if args.toy else ESTIMATED_S

    def wanted(name: str) -> bool:
        if name not in args.parts:
            return False
        left, missing = report.seconds_left(), missing_packages(PART_NEEDS.get(name, ()))
        if estimates[name] > left:
            report.skip(name, "skipped", f"estimated {estimates[name]:.0f} s, {max(left, 0):.0f} s of the --budget "
                                         f"of {args.budget:.0f} s left")
            return False
        if missing:
            report.skip(name, "failed", f"missing package(s) {', '.join(missing)}: python bench/prepare_gpu_check.py "
                                        f"--packages {' '.join(missing)} carries their wheels")
            return False
        return True

    with tempfile.TemporaryDirectory() as tmp:
        if args.real:
            real_mode(report, args, tmp)
        else:
            if set(args.parts) - {"cuda_tests", "embedded_default"}:
                model_dir, tokenizer = qwen_parts(args, tmp)
                questions, truths, source = gsm8k_questions(args)
                rows = prompt_rows(tokenizer, questions, truths, 512)
                widths = sorted(len(ids) for ids in rows.columns["input_ids"])
                report.data["prompts"] = {"source": source, "rows": len(rows), "tokens_min": widths[0],
                                          "tokens_median": widths[len(widths) // 2], "tokens_max": widths[-1]}
            parts = {
                "recipes": lambda r, m: recipes(r, args, model_dir, rows, tmp, report, m),
                "lora_recipes": lambda r, m: recipes(r, args, model_dir, rows, tmp, report, m, lora=True),
                "settings_80gb": lambda r, m: settings_80gb(r, args, model_dir, rows, tmp, report, m),
                "evaluation": lambda r, m: evaluation(r, args, model_dir, tokenizer, rows, tmp, report, m),
                "lora_evaluation": lambda r, m: lora_evaluation(r, args, model_dir, rows, tmp, m),
                "decoding": lambda r, m: decoding(r, args, model_dir, tokenizer, rows, report),
                "memory_sweep": lambda r, m: memory_sweep(r, args, model_dir, rows, tmp, m),
                "compiled_decoding": lambda r, m: compiled_decoding(r, args, model_dir, tokenizer, rows, report),
                "checkpoint": lambda r, m: checkpoint(r, args, model_dir, rows, tmp),
                "cuda_tests": lambda r, m: cuda_tests(r, args),
                "embedded_default": lambda r, m: embedded_default(r, args, tmp),
            }
            for name in PARTS:
                if wanted(name):
                    with report.part(name, device, estimates[name]) as (result, memory):  # its memory: after the previous part's is freed
                        parts[name](result, memory)
    report.data["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report.write()
    status = {name: part["status"] for name, part in report.data["parts"].items()}
    failed = [n for n, st in status.items() if st == "failed"]
    skipped = [f"{n} ({report.data['parts'][n]['note']})" for n, st in status.items() if st == "skipped"]
    report.log(f"done: {sum(st == 'ok' for st in status.values())} part(s) ok"
               + (f", failed: {', '.join(failed)}" if failed else "")
               + (f", skipped: {', '.join(skipped)}" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
