"""What bench/ppo_step.py and bench/grpo_step.py share: the workload, our side of the comparison, the clocks
and counters, the memory probe, the interleaved rounds and the lines that say what a timing was taken under.

Importing this module sets the environment both benchmarks run in (before torch loads), so it is the first
import of each benchmark; the trainer (`rlhf`, `train`) comes from the installed project (pip install -e .).

The workload, built in a temporary directory with no network (`build_workload`):
- a byte-level BPE tokenizer of 400 tokens trained with `tokenizers` on generated GSM8K-style problems;
- a tiny Qwen2 (MODEL_SIZE: hidden 128, MLP 384, 4 layers, 4 heads, 2 KV heads, tied embeddings, random
  init), from which every side loads its policy, its reference and (PPO) its critic;
- 32 prompts with their GSM8K ground truth: the chat-templated question alone (so they fit), one of the
  full 48 tokens and the rest shorter, left-padded to 48. A PPO step takes all 32; a GRPO step the first 8
  (`load_group_workload`) x 4 responses.
With --gpu the model has Qwen2.5-0.5B's shape instead (QWEN_0_5B_SIZE; the tokenizer stays the 400-token
one: the other embedding rows are never prompted, though they can be sampled), every side runs under bf16
autocast over float32 weights on CUDA, and memory is the GPU's (torch.cuda.max_memory_allocated).

Peak memory of a step is measured per side in a fresh subprocess (`measure_memory`, `step_memory`): one
warm-up step, then the peak resident set size over 2 more steps (Linux VmHWM, reset through
/proc/self/clear_refs just before them) minus the resident size at that moment. So it counts what a step
allocates (activations, logits, caches) and not the interpreter, the imports, the models, the optimizer
state or one-time lazy set-up, which differ between the sides in ways unrelated to a step. The subprocesses
run with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors leave the resident set at once rather than
staying in glibc's heap.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time

# The OpenMP settings are the user's, as they run either trainer, and printed with every timing (the
# side processes inherit them). On a loaded machine set OMP_WAIT_POLICY=PASSIVE: spinning threads wait for
# descheduled ones at every op (at load 8 on 2 cores, 64-token generation took 31 s spinning and 1.3 s passive).
OPENMP_SEEN = {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from recipe_memory import QWEN2_5_0_5B  # noqa: E402  (bench/, beside this file: the model's shape)
from rlhf.tracking import Timer  # noqa: E402  (the trainer's timer, which PhaseTimer extends)

NUM_PROMPTS = 32  # prompts in the workload: a PPO step takes all of them
GROUP_PROMPTS = 8  # a GRPO step: the first 8 prompts ...
N = 4  # ... x 4 responses each
NUM_RESPONSES = GROUP_PROMPTS * N  # 32 sequences per step, as a PPO step has
PROMPT_WIDTH = 48
RESPONSE_LENGTH = 64
MINI_BATCH = 16
VOCAB_SIZE = 400
LR = 3e-6
KL_COEF = 0.05
SEED = 1234
MODEL_SIZE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512)
QWEN_0_5B_SIZE = {**QWEN2_5_0_5B, "max_position_embeddings": 512}  # --gpu
# Our trainer's timer names (and the floor's) grouped into the phases reported.
PHASES = (("generate", ("gen",)), ("old_logprob", ("old_log_prob",)), ("reference", ("ref",)),
          ("values", ("values",)), ("update", ("update_actor", "update_critic", "update")))


def sync() -> None:
    """Wait for queued GPU work, so that wall-clock times mean something (no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn) -> float:
    """Wall seconds of one call of `fn()`."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def start(threads: int | None, gpu: bool):
    """What every benchmark here does first: threads (None: torch's, from OMP_NUM_THREADS or the cores), a
    CUDA device for --gpu, TRL present, transformers quiet. Returns the (trl, transformers) modules."""
    if threads:
        torch.set_num_threads(threads)
    if gpu and not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA device; torch sees none")
    try:
        import trl
    except ImportError:
        sys.exit("TRL is the reference and is not installed: pip install -e \".[bench]\"")
    import transformers

    transformers.logging.set_verbosity_error()  # load reports of the freshly initialised value heads
    transformers.logging.disable_progress_bar()
    return trl, transformers


# ----------------------------------------------------------------------------- the workload


def build_workload(workdir: str, gpu: bool) -> None:
    """Write workdir/model (tokenizer + random-init Qwen2: MODEL_SIZE, or QWEN_0_5B_SIZE for --gpu) and
    workdir/prompts.json."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.data import INSTRUCTION
    from rlhf.embedded import generate_problems, train_tokenizer
    from rlhf.models import load_tokenizer
    from rlhf.rewards.gsm8k import extract_ground_truth

    problems = generate_problems(600, seed=0)
    texts = ["user", "assistant"] + [f"{p['question']} {INSTRUCTION}\n{p['answer']}" for p in problems]
    tokenizer = train_tokenizer(texts, VOCAB_SIZE)
    torch.manual_seed(SEED)
    size = {"vocab_size": len(tokenizer), **(QWEN_0_5B_SIZE if gpu else MODEL_SIZE)}
    config = Qwen2Config(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None, **size)
    model_dir = os.path.join(workdir, "model")
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)  # as every side loads it

    # The question alone in the chat template: with the instruction appended, prompts are >= 56 tokens.
    chats = [[{"role": "user", "content": p["question"]}] for p in problems]
    ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
    chosen = [i for i, x in enumerate(ids) if len(x) == PROMPT_WIDTH][:1]  # one full-width prompt ...
    chosen += [i for i, x in enumerate(ids) if len(x) < PROMPT_WIDTH][:NUM_PROMPTS - 1]  # ... and shorter
    assert len(chosen) == NUM_PROMPTS, "not enough short prompts; generate more problems"
    with open(os.path.join(workdir, "prompts.json"), "w") as f:
        json.dump({"input_ids": [ids[i] for i in chosen],
                   "ground_truth": [extract_ground_truth(problems[i]["answer"]) for i in chosen]}, f)


def load_workload(workdir: str):
    """(model_dir, tokenizer, prompts {"input_ids": list[list[int]], "ground_truth": list[str]})."""
    from rlhf.models import load_tokenizer

    model_dir = os.path.join(workdir, "model")
    with open(os.path.join(workdir, "prompts.json")) as f:
        prompts = json.load(f)
    return model_dir, load_tokenizer(model_dir), prompts


def load_group_workload(workdir: str):
    """The workload cut to the first GROUP_PROMPTS prompts (the first is the full-width one)."""
    model_dir, tokenizer, prompts = load_workload(workdir)
    prompts = {key: values[:GROUP_PROMPTS] for key, values in prompts.items()}
    assert max(map(len, prompts["input_ids"])) == PROMPT_WIDTH, "the full-width prompt must be among them"
    return model_dir, tokenizer, prompts


# ----------------------------------------------------------------------------- clocks and counters


@contextlib.contextmanager
def count_decode_steps(owner, name: str, model, counts: list[int]):
    """Inside the block, every call of the generation function `owner.<name>` (TRL's `policy.generate`)
    appends how many forward passes of `model` it ran. (Ours: `PhaseTimer` counts them.)"""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls = [0]
        handle = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            return original(*args, **kwargs)
        finally:
            handle.remove()
            counts.append(calls[0])

    setattr(owner, name, counted)
    try:
        yield
    finally:
        setattr(owner, name, original)


class GenerationClock:
    """Wraps the generation function `owner.<name>` (TRL's `policy.generate`) so that `seconds` accumulates
    its wall time, synchronised with the GPU: generated tokens per second. (Ours: `PhaseTimer`'s "gen".)"""

    def __init__(self, owner, name: str):
        self.seconds = 0.0
        original = getattr(owner, name)

        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                sync()
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed_call)


@contextlib.contextmanager
def count_optimizer_steps(optimizers, counts: list[int]):
    """Inside the block, counts[i] counts the steps taken by optimizers[i] (torch optimizers)."""
    counts[:] = [0] * len(optimizers)

    def hook_for(i):
        return lambda *_: counts.__setitem__(i, counts[i] + 1)

    handles = [opt.register_step_post_hook(hook_for(i)) for i, opt in enumerate(optimizers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def forward_batch_sizes(model, sizes: list[int]):
    """Inside the block, every forward of `model` appends its batch size to `sizes`."""
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        sizes.append(int(ids.shape[0]))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class PhaseTimer(Timer):
    """The trainer's timer (`with timer(name): ...`, `seconds`), passed into `rlhf.step.train_step`, with what the
    benchmark needs around each phase: a profiler range `phase/<name>`, a GPU synchronisation before the
    phase's time is taken (so "gen" is the synchronised generation time), and, during "gen", a count of the
    decoding steps of `model` (the unwrapped actor) appended to `decode_steps`: the calls of its output layer,
    one per token, whether the reference loop runs the whole model for it or rlhf.decode's step its layers."""

    def __init__(self, model=None):
        super().__init__()
        self.model = model
        self.decode_steps: list[int] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        from torch.profiler import record_function

        calls = [0]
        handle = None
        if name == "gen" and self.model is not None:
            handle = self.model.get_output_embeddings().register_forward_pre_hook(
                lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            with record_function(f"phase/{name}"), super().__call__(name):
                yield
                sync()
        finally:
            if handle is not None:
                handle.remove()
                self.decode_steps.append(calls[0])


# ----------------------------------------------------------------------------- our side


def our_config(workdir: str, log_kl_panel: bool, gpu: bool, recompute: str = "auto"):
    """Our Config for the PPO step on the workload (no EOS stop: `rollout.ignore_eos=true`), the old-log-prob
    pass as `actor.recompute_old_logprobs=recompute`; grpo_step changes the batch shape and where the KL goes."""
    from rlhf.config import load_config

    overrides = [
        f"model.path={os.path.join(workdir, 'model')}", "model.dtype=float32",
        f"data.max_prompt_length={PROMPT_WIDTH}", f"data.max_response_length={RESPONSE_LENGTH}",
        f"data.train_batch_size={NUM_PROMPTS}", "rollout.temperature=1.0",
        f"rollout.log_prob_micro_batch_size={NUM_PROMPTS}",
        "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k3", f"algorithm.kl_ctrl.kl_coef={KL_COEF}",
        "algorithm.gamma=1.0", "algorithm.lam=0.95",
        "actor.ppo_epochs=1", f"actor.ppo_mini_batch_size={MINI_BATCH}", f"actor.ppo_micro_batch_size={MINI_BATCH}",
        f"actor.lr={LR}", f"critic.lr={LR}", "actor.clip_ratio=0.2", "critic.cliprange_value=0.2",
        f"trainer.log_kl_panel={str(log_kl_panel).lower()}", "trainer.logger=none", f"trainer.seed={SEED}",
        f"trainer.output_dir={os.path.join(workdir, 'ours')}", "rollout.ignore_eos=true",
        f"trainer.mixed_precision={'bf16' if gpu else 'no'}", f"actor.recompute_old_logprobs={recompute}",
    ]
    return load_config(None, overrides)


class OursSide:
    """Our trainer's step on the trainer's own set-up (`rlhf.setup.load_models`, `rlhf.setup.build_setup`:
    seed, AdamW optimizers, accelerate, prompt order, KL controller); `step()` runs `rlhf.step.train_step`
    once with `cfg_panel`, or with `cfg_minimal` (the same with `trainer.log_kl_panel=false`)."""

    def __init__(self, name: str, cfg_panel, cfg_minimal, tokenizer, prompts: dict):
        from accelerate import Accelerator
        from datasets import Dataset

        from rlhf.setup import build_setup, load_models

        self.name, self.cfg_panel, self.cfg_minimal = name, cfg_panel, cfg_minimal
        self.accelerator = Accelerator(mixed_precision=cfg_panel.trainer.mixed_precision)
        train_set = Dataset.from_dict(prompts)  # input_ids (already tokenized) and ground_truth
        self.run = build_setup(cfg_panel, self.accelerator, tokenizer, train_set, None,
                               *load_models(cfg_panel, cfg_panel.model.path))
        self.models, self.optimizers = self.run.models, self.run.optimizers
        self.torch_optimizers = [opt.optimizer for opt in self.optimizers if opt is not None]
        self.actor = self.accelerator.unwrap_model(self.models[0])  # what the decoding loop calls
        self.num_steps = 0
        self.last_metrics: dict[str, float] = {}

    def step(self, log_kl_panel: bool = True, timer: PhaseTimer | None = None, cfg=None) -> dict[str, float]:
        """One `rlhf.step.train_step` with `cfg` (a variant of `cfg_panel` on the same models), else `cfg_panel`
        or `cfg_minimal`: {"step": wall s, each timer phase's s, "gen_synced": the "gen" phase}."""
        from rlhf.step import plan_step, train_step

        timer = timer or PhaseTimer(self.actor)
        cfg = cfg or (self.cfg_panel if log_kl_panel else self.cfg_minimal)
        plan = plan_step(cfg, self.accelerator.mixed_precision)  # as train.py's main does, once per config
        self.num_steps += 1
        start = time.perf_counter()
        result = train_step(cfg, plan, self.accelerator, self.run, self.num_steps, timer)
        sync()
        seconds = time.perf_counter() - start
        self.last_metrics = result.metrics
        return {"step": seconds, **timer.seconds, "gen_synced": timer.seconds["gen"]}


class OursVariant:
    """An `OursSide` stepped with another config of the same models (the KL panel off, the old-log-prob pass
    forced): another row of the same trainer, sharing its models and optimizers."""

    def __init__(self, ours: OursSide, name: str, cfg):
        self.ours, self.name, self.cfg = ours, name, cfg

    def step(self) -> dict[str, float]:
        return self.ours.step(cfg=self.cfg)


# ----------------------------------------------------------------------------- memory (one side per process)


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def step_memory(side, num_steps: int = 2) -> dict[str, float]:
    """In this (fresh) process: what `num_steps` steps of `side` allocate at their peak, after a warm-up step
    (see the module docstring). MB: {"step_peak_mb", "peak_rss_mb", "rss_before_mb"}; on a GPU the last two
    are the allocated memory at the peak and before the steps."""
    side.step()  # warm-up: lazy imports, one-time caches and the optimizer state are not a step's memory
    if torch.cuda.is_available():  # on a GPU, what counts is the GPU memory the tensors of a step take
        sync()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(num_steps):
            side.step()
        peak = torch.cuda.max_memory_allocated()
        return {"step_peak_mb": (peak - before) / 2**20, "peak_rss_mb": peak / 2**20, "rss_before_mb": before / 2**20}
    before = _rss_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
    for _ in range(num_steps):
        side.step()
    peak = _rss_kb("VmHWM")
    return {"step_peak_mb": (peak - before) / 1024, "peak_rss_mb": peak / 1024, "rss_before_mb": before / 1024}


def child_flags(threads: int | None, gpu: bool) -> list[str]:
    """The command-line flags a side's process gets from the benchmark's."""
    return [*(["--threads", str(threads)] if threads else []), *(["--gpu"] if gpu else [])]


def measure_memory(script: str, side_name: str, workdir: str, threads: int, gpu: bool) -> dict[str, float]:
    """`step_memory` of one side in a fresh process: `script --memory-child side_name`, whose last line of
    output is the JSON of `step_memory`."""
    cmd = [sys.executable, script, "--memory-child", side_name, "--workdir", workdir, *child_flags(threads, gpu)]
    # With a fixed mmap threshold glibc maps every block above 64 KiB on its own and unmaps it on free,
    # so the resident size follows the live tensors instead of what the allocator keeps around.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"memory measurement of {side_name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- one side per process

# A side's process answers on its own copy of stdout; everything else it prints goes to stderr.
ANSWER = "@side "


def serve_side(side, about: dict) -> None:
    """The loop of a side's process (`script --side-child KEY`): say `about` (the side's name and what the
    report prints about it), then one step per "step" line read, each answered with the step's results and
    its CPU time, until stdin closes."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the libraries' prints (and the C level's) go to stderr, not into the answers

    def answer(payload: dict) -> None:
        answers.write(ANSWER + json.dumps(payload) + "\n")
        answers.flush()

    answer(about)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        cpu = time.process_time()
        result = side.step()
        answer({**result, "cpu_s": time.process_time() - cpu})


class SideProcess:
    """One side in a fresh process of its own (`script --side-child key`, `serve_side`), stepped from this
    one: `step()` has the same results as the side's own, with its CPU time; `about` is what the side said
    when it was ready. Its stderr is kept in a file and shown when it fails."""

    def __init__(self, script: str, key: str, workdir: str, threads: int | None, gpu: bool):
        import tempfile

        self.key = key
        self.log = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, script, "--side-child", key, "--workdir", workdir, *child_flags(threads, gpu)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.about = self._answer()  # built and checked: only then is the next side started
        self.name = self.about["name"]

    def _answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):])
        self.log.seek(0)
        raise RuntimeError(f"the process of side {self.key} stopped:\n{self.log.read()[-3000:]}")

    def step(self) -> dict[str, float]:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


@contextlib.contextmanager
def side_processes(script: str, keys, workdir: str, threads: int | None, gpu: bool):
    """A `SideProcess` for each key, started one after another (each builds and checks its side alone), as
    a list of (key, SideProcess); all closed on exit."""
    sides: list[tuple[str, SideProcess]] = []
    try:
        for key in keys:
            sides.append((key, SideProcess(script, key, workdir, threads, gpu)))
        yield sides
    finally:
        for _, side in sides:
            side.close()


# ----------------------------------------------------------------------------- rounds and their medians


# What a step's result holds besides its timer phases: the wall time, the synchronised generation time and
# the process's CPU time over the step (all its threads: TRL's training thread too).
STEP_KEYS = ("step", "gen_synced", "cpu_s")


def interleaved_rounds(sides: list[tuple[str, object]], warmup: int, iters: int) -> dict[str, list[dict]]:
    """`warmup` untimed steps of every side, then `iters` rounds of one step each, the order rotating so no side
    always goes first and drift hits every side alike; each side's step results in order, with the step's CPU
    time ("cpu_s"), a line printed per round. A side in a process of its own (`SideProcess`) is stepped the
    same way and takes the step's CPU time in that process.

    On a CPU shared with other jobs the wall time of a step grows with the load, unevenly; the process's CPU
    time counts the work done and the time spent waiting at the sides' own synchronisation points only."""
    for _ in range(warmup):
        for _, side in sides:
            side.step()
    times: dict[str, list[dict[str, float]]] = {key: [] for key, _ in sides}
    for r in range(iters):
        for key, side in sides[r % len(sides):] + sides[:r % len(sides)]:
            cpu = time.process_time()
            times[key].append(side.step())
            times[key][-1].setdefault("cpu_s", time.process_time() - cpu)  # a SideProcess brings its own
        last = {k: times[k][-1] for k, _ in sides}
        print(f"round {r + 1}/{iters}: " + ", ".join(f"{k} {t['step']:.3f}s (cpu {t['cpu_s']:.3f})"
                                                     for k, t in last.items()), flush=True)
    return times


def paired(times: dict[str, list[dict]], a: str, b: str, key: str = "step") -> float:
    """Median over rounds of side a's step time (or `key`: "cpu_s") / side b's in the same round."""
    return statistics.median(x[key] / y[key] for x, y in zip(times[a], times[b]))


def median_phase(steps: list[dict], keys) -> float:
    """Median over steps of the time spent in these timer phases."""
    return statistics.median(sum(t.get(k, 0.0) for k in keys) for t in steps)


def median_untimed(steps: list[dict]) -> float:
    """Median over steps of the time outside every timed phase."""
    return statistics.median(t["step"] - sum(v for k, v in t.items() if k not in STEP_KEYS) for t in steps)


def describe_mode(shared_process: bool) -> str:
    """The line that says how the sides were run, printed above the numbers."""
    if shared_process:
        return ("mode: shared process (--shared-process): every side in this one process, interleaved round by "
                "round, the order rotating; each side runs beside the others' objects (TRL's gc.collect() "
                "walks them too)")
    return ("mode: one fresh process per side (the default): each side built and checked alone in its own "
            "process, then stepped round by round from this one, one side at a time, the order rotating")


def load_line() -> str:
    """The load average as /proc/loadavg has it (1, 5, 15 minutes), for the start and end of a measurement."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def print_versions_and_load(trl, transformers, gpu: bool, shared_process: bool) -> None:
    """The mode, versions, threads, OpenMP settings, load and device a timing was taken under, with a warning
    when the machine is busy."""
    openmp = ", ".join(f"{k}={v if v is not None else 'unset'}" for k, v in OPENMP_SEEN.items())
    print(describe_mode(shared_process))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"torch threads {torch.get_num_threads()}, {openmp} (the environment's, as seen), "
          f"load average {load_line()} on {os.cpu_count()} CPUs")
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        print("warning: the machine is busy (load above the CPU count): timings are inflated and noisy; "
              "compare the sides within this run, not runs with each other.")
    if gpu:
        print(f"device: {torch.cuda.get_device_name()}")
