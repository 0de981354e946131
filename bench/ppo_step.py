"""One PPO step of our trainer (`train.train_step`) against TRL's PPOTrainer on identical work, and
against the floor (the same model passes done bare).

    pip install -r requirements-bench.txt       # TRL 0.29.1, the last release with its PPOTrainer
    python bench/ppo_step.py                    # a few minutes on 2 cores; the last line is key=value
    python bench/ppo_step.py --iters 9 --profile ours   # plus a torch.profiler table of our step
    python bench/ppo_step.py --gpu              # Qwen2.5-0.5B-shaped models, bf16 autocast, CUDA

Workload, identical for every side (built here, in a temporary directory, with no network):
- a byte-level BPE tokenizer of 400 tokens trained with `tokenizers` on generated GSM8K-style problems;
- a tiny Qwen2 (hidden 128, MLP 384, 4 layers, 4 heads, 2 KV heads, tied embeddings, random init) as the
  policy, a copy as the reference, a critic of the same size (value head zeroed, as `rlhf.models` does);
- 32 prompts (the chat-templated question alone, so they fit) left-padded to 48 tokens;
- 64 sampled tokens per response at temperature 1, never stopping at EOS; 1 PPO epoch over 2
  mini-batches of 16; k3 KL in the reward; float32; torch threads set to 2.
  With --gpu: the models have Qwen2.5-0.5B's shape instead (QWEN_0_5B_SIZE), every side runs under bf16
  autocast on CUDA, and memory is the GPU's (torch.cuda.max_memory_allocated).
TRL cannot score by rule, so it also gets a reward model of the same size and runs one more forward per
step; our side scores GSM8K by rule and skips that pass. The output says so.
The policy is left at its random init: it rarely samples EOS, so no side could stop generating early
even if it tried. One step of TRL and of ours is checked before timing: exactly 64 decoding steps
(forward passes inside the generation call: TRL's `generate`, our timer's "gen" phase) and 2 optimizer
steps per optimizer.

How each side is timed, all in this one process, interleaved round by round (the order rotates every
round) after warm-up, medians over `--iters` rounds:
- TRL: `trainer.train()` runs one PPO step per call (`args.num_total_batches = 1`); a callback takes
  the time from `on_train_begin` to `on_train_end`, i.e. exactly one iteration of TRL's training loop
  (data loading, rollout, reward model, GAE, PPO update, its logging and its gc.collect()).
  The per-call set-up before `on_train_begin` (a few small tensors) is not counted, in TRL's favour.
- ours: the wall time of `train.train_step(...)` on the trainer's own set-up (`rlhf.setup.load_models` and
  `rlhf.setup.build_setup` on the workload's prompts), and its per-phase timer: a `PhaseTimer` (a subclass of
  `rlhf.tracking.Timer`, passed into `train_step`) that synchronises with the GPU before each phase's time
  is taken, opens a profiler range per phase and counts the actor's forwards while generating.
- "ours, estimator only": the same with `trainer.log_kl_panel=false`, for the KL panel's cost.
- floor: sampling with a bare KV-cache loop (one forward per token, `torch.multinomial`); reference,
  old-policy and critic forwards without grad; two mini-batches of actor and critic forward+backward with
  the simplest losses; the optimizer steps (fused AdamW). No accelerate, no metrics.
Peak memory is measured per side in a fresh subprocess: one warm-up step, then the peak resident set
size over 2 more steps (Linux VmHWM, reset through /proc/self/clear_refs just before them) minus the
resident size at that moment. So it counts what a step allocates (activations, logits, caches) and not
the interpreter, the imports, the models, the optimizer state or one-time lazy set-up, which differ
between the sides in ways unrelated to a step. The subprocesses run with MALLOC_MMAP_THRESHOLD_=65536
so that freed tensors leave the resident set at once rather than staying in glibc's heap.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

# Before torch starts OpenMP: idle OpenMP threads sleep instead of spinning. On a machine shared with other
# jobs (more runnable threads than cores) spinning threads wait for descheduled ones at every op: at load 8
# on 2 cores, 64-token generation took 31 s spinning and 1.3 s passive (median of 5, same process kind).
# It applies to every side alike; OMP_WAIT_POLICY=ACTIVE in the environment measures the other way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import torch  # noqa: E402

from recipe_memory import QWEN2_5_0_5B  # noqa: E402  (bench/, beside this file: the model's shape)
from rlhf.tracking import Timer  # noqa: E402  (the trainer's timer, which PhaseTimer extends)

NUM_PROMPTS = 32
PROMPT_WIDTH = 48
RESPONSE_LENGTH = 64
MINI_BATCH = 16
VOCAB_SIZE = 400
LR = 3e-6
KL_COEF = 0.05
SEED = 1234
MODEL_SIZE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512)
# --gpu: randomly initialised models of Qwen2.5-0.5B's shape (the tokenizer stays the 400-token one; the
# other embedding rows are simply never prompted, though they can be sampled), bf16 autocast, on CUDA.
QWEN_0_5B_SIZE = {**QWEN2_5_0_5B, "max_position_embeddings": 512}
SETUP = argparse.Namespace(model_size=MODEL_SIZE, bf16=False)  # set once by main() from the flags


def sync() -> None:
    """Wait for queued GPU work, so that wall-clock times mean something (no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- the workload


def build_workload(workdir: str) -> None:
    """Write workdir/model (tokenizer + random-init tiny Qwen2) and workdir/prompts.json."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.data import INSTRUCTION
    from rlhf.embedded import generate_problems, train_tokenizer
    from rlhf.models import load_tokenizer
    from rlhf.rewards.gsm8k import extract_ground_truth

    problems = generate_problems(600, seed=0)
    texts = ["user", "assistant"] + [f"{p['question']} {INSTRUCTION}\n{p['answer']}" for p in problems]
    tokenizer = train_tokenizer(texts, VOCAB_SIZE)
    torch.manual_seed(SEED)
    size = {"vocab_size": len(tokenizer), **SETUP.model_size}
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

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                sync()
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)


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


# ----------------------------------------------------------------------------- TRL


class TRLSide:
    """TRL's PPOTrainer, set up for exactly the workload; `step()` runs one PPO step."""

    name = "TRL PPOTrainer"

    def __init__(self, workdir: str):
        from datasets import Dataset
        from transformers import AutoModelForSequenceClassification, TrainerCallback
        from transformers.trainer_callback import PrinterCallback, ProgressCallback
        from trl.experimental.ppo import PPOConfig, PPOTrainer

        from rlhf.models import load_causal_lm, load_critic

        model_dir, tokenizer, prompts = load_workload(workdir)
        torch.manual_seed(SEED)
        self.policy = load_causal_lm(model_dir)
        reward_model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
        args = PPOConfig(
            output_dir=os.path.join(workdir, "trl"), report_to="none", seed=SEED,
            # local batch = per_device_train_batch_size * gradient_accumulation_steps = 32 prompts, cut into
            # num_mini_batches=2 mini-batches of 16; each is one micro-batch (range(0, 16, 32)) and one
            # optimizer step. (16 x 2 accumulation steps would step the optimizer once per epoch instead.)
            per_device_train_batch_size=NUM_PROMPTS, gradient_accumulation_steps=1,
            num_mini_batches=NUM_PROMPTS // MINI_BATCH, num_ppo_epochs=1,
            local_rollout_forward_batch_size=NUM_PROMPTS,  # generate and score all 32 at once, as ours does
            response_length=RESPONSE_LENGTH, temperature=1.0,
            stop_token=None, stop_token_id=None,  # TRL then sets eos_token_id=None: no stop, no truncation
            missing_eos_penalty=None,
            kl_estimator="k3", kl_coef=KL_COEF, learning_rate=LR, cliprange=0.2, cliprange_value=0.2,
            gamma=1.0, lam=0.95, whiten_rewards=False,
            bf16=SETUP.bf16, fp16=False, gradient_checkpointing=False,  # PPOConfig defaults bf16 and GC on
            # The lr schedule is built for this many steps; each train() call below runs one of them.
            total_episodes=NUM_PROMPTS * 100_000, num_sample_generations=0,
            save_strategy="no", eval_strategy="no", logging_steps=1, disable_tqdm=True,
            dataloader_num_workers=0,
        )
        self.trainer = PPOTrainer(
            args=args, processing_class=tokenizer, model=self.policy, ref_model=load_causal_lm(model_dir),
            reward_model=reward_model, value_model=load_critic(model_dir),
            train_dataset=Dataset.from_dict({"input_ids": prompts["input_ids"]}),
        )
        for callback in (PrinterCallback, ProgressCallback):  # printing is not part of the work
            self.trainer.remove_callback(callback)
        self.trainer.args.num_total_batches = 1  # train() = one PPO step
        self.bounds: dict[str, float] = {}
        bounds = self.bounds

        class StepClock(TrainerCallback):
            def on_train_begin(self, *args, **kwargs):
                bounds["begin"] = time.perf_counter()

            def on_train_end(self, *args, **kwargs):
                bounds["end"] = time.perf_counter()

        self.trainer.add_callback(StepClock())
        self.gen_clock = GenerationClock(self.policy, "generate")

    def describe(self) -> str:
        opt = self.trainer.optimizer.optimizer
        return (f"{type(opt).__name__}(fused={opt.defaults.get('fused')}, foreach={opt.defaults.get('foreach')}) "
                f"over policy+value")

    def step(self) -> dict[str, float]:
        self.gen_clock.seconds = 0.0
        with contextlib.redirect_stdout(io.StringIO()):  # its "===training policy===" banner, every call
            self.trainer.train()
        return {"step": self.bounds["end"] - self.bounds["begin"], "gen_synced": self.gen_clock.seconds}

    def check(self) -> None:
        """One step that must sample exactly RESPONSE_LENGTH tokens and take 2 optimizer steps."""
        decode_steps, optimizer_steps = [], []
        with count_decode_steps(self.policy, "generate", self.policy, decode_steps), \
                count_optimizer_steps([self.trainer.optimizer.optimizer], optimizer_steps):
            self.step()
        assert decode_steps == [RESPONSE_LENGTH], f"TRL ran {decode_steps} decoding steps, not [{RESPONSE_LENGTH}]"
        assert optimizer_steps == [NUM_PROMPTS // MINI_BATCH], f"TRL took {optimizer_steps} optimizer steps"


# ----------------------------------------------------------------------------- ours


def our_config(workdir: str, log_kl_panel: bool):
    """Our Config for the workload (no EOS stop: `rollout.ignore_eos=true`)."""
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
        f"trainer.mixed_precision={'bf16' if SETUP.bf16 else 'no'}",
    ]
    return load_config(None, overrides)


class PhaseTimer(Timer):
    """The trainer's timer (`with timer(name): ...`, `seconds`), passed into `train.train_step`, with what the
    benchmark needs around each phase: a profiler range `phase/<name>`, a GPU synchronisation before the
    phase's time is taken (so "gen" is the synchronised generation time), and, during "gen", a count of the
    forward passes of `model` (the unwrapped actor) appended to `decode_steps`."""

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
            handle = self.model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            with record_function(f"phase/{name}"), super().__call__(name):
                yield
                sync()
        finally:
            if handle is not None:
                handle.remove()
                self.decode_steps.append(calls[0])


class OursSide:
    """Our trainer's step on the trainer's own set-up (`rlhf.setup.load_models`, `rlhf.setup.build_setup`: seed, AdamW
    optimizers, accelerate, prompt sampler, KL controller); `step()` runs `train.train_step` once."""

    name = "ours train_step"

    def __init__(self, workdir: str):
        from accelerate import Accelerator
        from datasets import Dataset

        from rlhf.setup import build_setup, load_models

        self.cfg_panel, self.cfg_minimal = our_config(workdir, True), our_config(workdir, False)
        cfg = self.cfg_panel
        model_dir, tokenizer, prompts = load_workload(workdir)
        self.accelerator = Accelerator(mixed_precision=cfg.trainer.mixed_precision)
        train_set = Dataset.from_dict(prompts)  # input_ids (already tokenized) and ground_truth
        self.run = build_setup(cfg, self.accelerator, tokenizer, train_set, None, *load_models(cfg, model_dir))
        self.models, self.optimizers = self.run.models, self.run.optimizers
        self.actor = self.accelerator.unwrap_model(self.models[0])  # what the decoding loop calls
        self.num_steps = 0

    def describe(self) -> str:
        opt = self.optimizers[0].optimizer
        return (f"{type(opt).__name__}(fused={opt.defaults.get('fused')}, foreach={opt.defaults.get('foreach')}) "
                "x2 (actor, critic); rollout.ignore_eos=true")

    def step(self, log_kl_panel: bool = True, timer: PhaseTimer | None = None) -> dict[str, float]:
        from train import train_step

        timer = timer or PhaseTimer(self.actor)
        self.num_steps += 1
        start = time.perf_counter()
        metrics, _, _ = train_step(self.cfg_panel if log_kl_panel else self.cfg_minimal, self.accelerator,
                                   self.run, self.num_steps, timer)
        sync()
        seconds = time.perf_counter() - start
        self.last_metrics = metrics
        return {"step": seconds, **timer.seconds, "gen_synced": timer.seconds["gen"]}

    def check(self) -> None:
        """One step that must sample exactly RESPONSE_LENGTH tokens, take 2 optimizer steps per model and
        log the whole KL panel."""
        optimizer_steps = []
        timer = PhaseTimer(self.actor)
        with count_optimizer_steps([opt.optimizer for opt in self.optimizers], optimizer_steps):
            self.step(timer=timer)
        assert timer.decode_steps == [RESPONSE_LENGTH], \
            f"ours ran {timer.decode_steps} decoding steps, not [{RESPONSE_LENGTH}]"
        assert optimizer_steps == [NUM_PROMPTS // MINI_BATCH] * 2, f"ours took {optimizer_steps} optimizer steps"
        missing = [f"kl/{n}" for n in ("k1", "k2", "k3", "abs", "full") if f"kl/{n}" not in self.last_metrics]
        assert not missing, f"the KL panel lacks {missing}"


class OursMinimal:
    """`OursSide` with `trainer.log_kl_panel=false`: only the estimator in use (k3) is computed."""

    name = "ours, estimator only"

    def __init__(self, ours: OursSide):
        self.ours = ours

    def step(self) -> dict[str, float]:
        return self.ours.step(log_kl_panel=False)


# ----------------------------------------------------------------------------- the floor


class FloorSide:
    """The model passes of one PPO step, done bare: plain torch + transformers, no metrics, no accelerate."""

    name = "floor (bare passes)"

    def __init__(self, workdir: str):
        from rlhf.models import load_causal_lm, load_critic
        from rlhf.rollout import kv_cache_name, left_pad

        model_dir, tokenizer, prompts = load_workload(workdir)
        torch.manual_seed(SEED)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # where accelerate puts the other sides
        self.actor = load_causal_lm(model_dir).eval().to(self.device)
        self.critic = load_critic(model_dir).eval().to(self.device)
        self.ref = load_causal_lm(model_dir).eval().requires_grad_(False).to(self.device)
        self.cache_name = kv_cache_name(self.actor)  # `past_key_values` or, from transformers 5.24, `cache`
        # The fastest AdamW on this device, as the trainer and TRL's side use.
        self.actor_opt = torch.optim.AdamW(self.actor.parameters(), lr=LR, weight_decay=0.0, fused=True)
        self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=LR, weight_decay=0.0, fused=True)
        self.prompt_ids, self.prompt_mask = (t.to(self.device) for t in left_pad(prompts["input_ids"],
                                                                                tokenizer.pad_token_id))

    def _sample(self):
        """(B, P+R): RESPONSE_LENGTH tokens sampled through the KV cache, one forward per token."""
        from rlhf.rollout import position_ids_from_mask

        ids, mask = self.prompt_ids, self.prompt_mask
        positions = position_ids_from_mask(mask)
        out = self.actor(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        tokens = []
        for t in range(RESPONSE_LENGTH):
            tokens.append(torch.multinomial(torch.softmax(out.logits[:, -1].float(), dim=-1), 1))  # (B, 1)
            if t + 1 < RESPONSE_LENGTH:
                mask = torch.cat([mask, torch.ones_like(tokens[-1])], dim=1)
                out = self.actor(input_ids=tokens[-1], attention_mask=mask, position_ids=positions[:, -1:] + t + 1,
                                 use_cache=True, **{self.cache_name: getattr(out, self.cache_name)})
        return torch.cat([ids, *tokens], dim=1)

    def _logprobs(self, model, inputs, response_ids):
        logits = model(**inputs, logits_to_keep=RESPONSE_LENGTH + 1, use_cache=False).logits[:, :-1]  # (B, R, V)
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)

    def step(self) -> dict[str, float]:
        clock = [time.perf_counter()]
        seconds = {}

        def lap(name):  # phase times, for comparison with our trainer's
            sync()
            clock.append(time.perf_counter())
            seconds[name] = clock[-1] - clock[-2]

        # bf16 autocast over float32 weights when SETUP.bf16, as accelerate's mixed precision does.
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=SETUP.bf16):
            self._passes(lap)
        return {"step": clock[-1] - clock[0], **seconds}

    def _passes(self, lap) -> None:
        from rlhf.rollout import position_ids_from_mask

        with torch.no_grad():
            sequences = self._sample()  # (B, P+R)
            lap("gen")
            response_ids = sequences[:, self.prompt_ids.shape[1]:]  # (B, R)
            attention_mask = torch.cat([self.prompt_mask, torch.ones_like(response_ids)], dim=1)
            inputs = dict(input_ids=sequences, attention_mask=attention_mask,
                          position_ids=position_ids_from_mask(attention_mask))
            self._logprobs(self.actor, inputs, response_ids)
            lap("old_log_prob")
            self._logprobs(self.ref, inputs, response_ids)
            lap("ref")
            self.critic(**inputs, use_cache=False)
            lap("values")
        for index in torch.arange(len(sequences), device=self.device).split(MINI_BATCH):
            mini = {k: v[index] for k, v in inputs.items()}
            (-self._logprobs(self.actor, mini, response_ids[index]).mean()).backward()
            values = self.critic(**mini, use_cache=False).logits[:, -RESPONSE_LENGTH - 1:-1, 0]  # (b, R)
            values.square().mean().backward()
            for opt in (self.actor_opt, self.critic_opt):
                opt.step()
                opt.zero_grad(set_to_none=True)
        lap("update")


# ----------------------------------------------------------------------------- memory (one side per process)


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def measure_memory_child(side_name: str, workdir: str, num_steps: int = 2) -> dict[str, float]:
    side = TRLSide(workdir) if side_name == "trl" else OursSide(workdir)
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


def measure_memory(side_name: str, workdir: str, threads: int) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", side_name, "--workdir", workdir,
           "--threads", str(threads), *(["--gpu"] if SETUP.model_size is QWEN_0_5B_SIZE else [])]
    # With a fixed mmap threshold glibc maps every block above 64 KiB on its own and unmaps it on free,
    # so the resident size follows the live tensors instead of what the allocator keeps around.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"memory measurement of {side_name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- profiling


@contextlib.contextmanager
def phase_ranges(side):
    """Profiler ranges named `phase/<name>` around the phases of a side's step, so that the profile can
    be read per phase. Ours: nothing to do, `PhaseTimer` opens one per phase of the trainer's timer. TRL:
    its module-level helpers (generation, forwards, reward/value model passes), which its training loop
    looks up at call time."""
    from torch.profiler import record_function

    if isinstance(side, TRLSide):
        from trl.experimental.ppo import ppo_trainer

        def ranged(fn, label):
            def wrapper(*args, **kwargs):
                name = label(*args) if callable(label) else label
                with record_function(f"phase/{name}"):
                    return fn(*args, **kwargs)
            return wrapper

        originals = {name: getattr(ppo_trainer, name) for name in ("batch_generation", "forward", "get_reward")}
        ppo_trainer.batch_generation = ranged(originals["batch_generation"], "gen")
        ppo_trainer.forward = ranged(originals["forward"],
                                     lambda model, *_: "update_forward" if torch.is_grad_enabled() else "ref")
        ppo_trainer.get_reward = ranged(originals["get_reward"],
                                        lambda model, *_: "reward" if model is side.trainer.reward_model else "values")
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(ppo_trainer, name, fn)
    else:  # ours: PhaseTimer's ranges; the floor: no named phases inside, the profile is of the whole step
        yield


def profile(side, name: str, num_steps: int = 2) -> None:
    """torch.profiler over `num_steps` steps of one side: time per phase, then the top ops."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with phase_ranges(side), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            side.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / num_steps
    print(f"\n--- torch.profiler, {name}: {total:.0f} ms of CPU time per step (profiler on) ---")
    for e in sorted((e for e in events if e.key.startswith("phase/")), key=lambda e: -e.cpu_time_total):
        print(f"  {e.key:<28} {e.cpu_time_total / 1e3 / num_steps:8.1f} ms/step  ({e.count // num_steps} calls/step)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


# ----------------------------------------------------------------------------- main


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# Our trainer's timer names (and the floor's) grouped into the phases reported.
PHASES = (("generate", ("gen",)), ("old_logprob", ("old_log_prob",)), ("reference", ("ref",)),
          ("values", ("values",)), ("update", ("update_actor", "update_critic", "update")))


def interleaved_rounds(sides: list[tuple[str, object]], warmup: int, iters: int) -> dict[str, list[dict]]:
    """`warmup` untimed steps of every side, then `iters` rounds of one step each, the order rotating so no side
    always goes first; each side's step results in order, a line printed per round."""
    for _ in range(warmup):
        for _, side in sides:
            side.step()
    times: dict[str, list[dict[str, float]]] = {key: [] for key, _ in sides}
    for r in range(iters):
        for key, side in sides[r % len(sides):] + sides[:r % len(sides)]:
            times[key].append(side.step())
        print(f"round {r + 1}/{iters}: " + ", ".join(f"{k} {times[k][-1]['step']:.3f}s" for k, _ in sides),
              flush=True)
    return times


def print_versions_and_load(trl, transformers) -> None:
    """The versions, threads and load a timing was taken under, with a warning when the machine is busy."""
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        print("warning: the machine is busy (load above the CPU count): timings are inflated and noisy; "
              "compare the sides within this run, not runs with each other.")


def start(threads: int, gpu: bool):
    """What every benchmark here does first: threads, the model size (--gpu: Qwen2.5-0.5B's shape, bf16),
    TRL present, transformers quiet. Returns the (trl, transformers) modules, for their versions."""
    torch.set_num_threads(threads)
    if gpu and not torch.cuda.is_available():
        sys.exit("--gpu needs a CUDA device; torch sees none")
    SETUP.model_size = QWEN_0_5B_SIZE if gpu else MODEL_SIZE
    SETUP.bf16 = gpu
    try:
        import trl
    except ImportError:
        sys.exit("TRL is the reference and is not installed: pip install -r requirements-bench.txt")
    import transformers

    transformers.logging.set_verbosity_error()  # load reports of the freshly initialised value heads
    transformers.logging.disable_progress_bar()
    return trl, transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=21, help="timed rounds (each times every side once); "
                        "0 = no timing report (with --profile: profile only)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--skip-memory", action="store_true", help="skip the two memory subprocesses")
    parser.add_argument("--gpu", action="store_true", help="models of Qwen2.5-0.5B's shape (random init), bf16 "
                        "autocast, on CUDA (needs a GPU; prepared, not yet run on one)")
    parser.add_argument("--profile", nargs="*", choices=("ours", "trl", "floor", "minimal"), default=[],
                        help="after timing, print a torch.profiler table for these sides")
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", choices=("ours", "trl"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    trl, transformers = start(args.threads, args.gpu)
    if args.memory_child:
        print(json.dumps(measure_memory_child(args.memory_child, args.workdir)))
        return

    with tempfile.TemporaryDirectory(prefix="ppo-bench-") as workdir:
        build_workload(workdir)
        _, tokenizer, prompts = load_workload(workdir)
        trl_side = TRLSide(workdir)
        num_objects_trl = len(gc.get_objects())
        ours, floor = OursSide(workdir), FloorSide(workdir)
        minimal = OursMinimal(ours)
        num_objects = len(gc.get_objects())
        gc_ms = 1e3 * statistics.median(timed(gc.collect) for _ in range(3))
        num_params = sum(p.numel() for p in ours.models[0].parameters())
        print_versions_and_load(trl, transformers)
        vocab_size = ours.models[0].config.vocab_size
        device = ours.accelerator.device
        if device.type == "cuda":
            print(f"device: {torch.cuda.get_device_name()}")
        print(f"workload: Qwen2 {num_params / 1e6:.2f}M parameters (vocab {vocab_size}, tokenizer "
              f"{len(tokenizer)}), {NUM_PROMPTS} prompts x {PROMPT_WIDTH} tokens (left-padded, shortest "
              f"{min(map(len, prompts['input_ids']))}), {RESPONSE_LENGTH} sampled tokens, 1 epoch x "
              f"{NUM_PROMPTS // MINI_BATCH} mini-batches of {MINI_BATCH}, k3 KL in the reward, "
              f"{'bf16 autocast over float32 weights' if SETUP.bf16 else 'float32'}, on {device}")
        print(f"optimizers: TRL {trl_side.describe()}; ours {ours.describe()}")
        print("TRL also runs a reward-model forward every step (it cannot score by rule); ours skips that pass: "
              "GSM8K is scored by rule.")
        print(f"TRL calls gc.collect() twice per step; one call takes {gc_ms:.0f} ms in this process "
              f"({num_objects} objects tracked, {1 - num_objects_trl / num_objects:.1%} of them added by our side "
              "and the floor; the rest come mostly from the imports, which TRL's own process has too).")

        sides = [("trl", trl_side), ("ours", ours), ("minimal", minimal), ("floor", floor)]
        trl_side.check()  # exactly RESPONSE_LENGTH decoding steps, 2 optimizer steps
        ours.check()
        times = interleaved_rounds(sides, args.warmup, args.iters)

        for key in args.profile:
            profile(dict(sides)[key], key)
        if not args.iters:  # profiling only
            return
        from rlhf import kl

        logits, ref_logits = torch.randn(2, NUM_PROMPTS, RESPONSE_LENGTH, vocab_size, device=device)
        full_kl_ms = 1e3 * statistics.median(timed(lambda: (kl.full_kl(logits, ref_logits, 1.0), sync()))
                                             for _ in range(11))
        memory = {} if args.skip_memory else {k: measure_memory(k, workdir, args.threads) for k in ("ours", "trl")}

    med = {k: statistics.median(t["step"] for t in v) for k, v in times.items()}

    def paired(a: str, b: str) -> float:  # median over rounds of a's step / b's step in the same round
        return statistics.median(x["step"] / y["step"] for x, y in zip(times[a], times[b]))

    ratio, overhead = med["ours"] / med["trl"], med["ours"] / med["floor"]
    panel_cost = paired("ours", "minimal") - 1
    print(f"\nstep time, median of {args.iters} (min)")
    for key, side in sides:
        print(f"  {side.name:<24} {med[key]:7.3f} s  ({min(t['step'] for t in times[key]):.3f})")
    print(f"ratio ours/TRL        {ratio:.3f}   (target <= 0.65; median of per-round ratios "
          f"{paired('ours', 'trl'):.3f})")
    print(f"overhead ours/floor   {overhead:.3f}   (target <= 1.15; per-round {paired('ours', 'floor'):.3f})")
    print(f"KL panel cost         {panel_cost:+.1%}  (target <= 3%; median of per-round ours/estimator-only - 1; "
          f"ratio of medians {med['ours'] / med['minimal'] - 1:+.1%})")
    print(f"                      cross-check: kl.full_kl on ({NUM_PROMPTS}, {RESPONSE_LENGTH}, {vocab_size}) "
          f"logits takes {full_kl_ms:.1f} ms = {full_kl_ms / 1e3 / med['ours']:.1%} of our step "
          "(the panel's main extra work)")

    print("\nour step by phase, median s (share of our step); the same for the panel off and for the floor:")
    print(f"  {'phase':<12} {'ours':>7}           {'no panel':>8} {'floor':>7}")
    accounted = {"step", "gen_synced"}
    for label, keys in PHASES:
        accounted.update(keys)
        full, lean, bare = (statistics.median(sum(t.get(k, 0.0) for k in keys) for t in times[side])
                            for side in ("ours", "minimal", "floor"))
        print(f"  {label:<12} {full:7.3f}  ({full / med['ours']:5.1%})   {lean:8.3f} {bare:7.3f}")
    for key in sorted({k for t in times["ours"] for k in t} - accounted):  # phases not named in PHASES
        value = statistics.median(t[key] for t in times["ours"])
        print(f"  {key:<12} {value:7.3f}  ({value / med['ours']:5.1%})")
    full, lean, bare = (statistics.median(t["step"] - sum(v for k, v in t.items() if k not in ("step", "gen_synced"))
                                          for t in times[side])
                        for side in ("ours", "minimal", "floor"))
    print(f"  {'other':<12} {full:7.3f}  ({full / med['ours']:5.1%})   {lean:8.3f} {bare:7.3f}   "
          "(outside the timed phases: batch building, scoring, GAE, metrics)")

    # Throughput: sampled tokens over the (GPU-synchronised) generation call; prompt + response tokens of
    # the batch over the rest of the step (the scoring forwards and the PPO update).
    gen_s = {k: statistics.median(t["gen_synced"] for t in times[k]) for k in ("ours", "trl")}
    rest_s = {k: statistics.median(t["step"] - t["gen_synced"] for t in times[k]) for k in ("ours", "trl")}
    width = PROMPT_WIDTH + RESPONSE_LENGTH
    print("\nthroughput, ours vs TRL (medians):")
    print(f"  generated tokens/s   {NUM_PROMPTS * RESPONSE_LENGTH / gen_s['ours']:9.0f} vs "
          f"{NUM_PROMPTS * RESPONSE_LENGTH / gen_s['trl']:9.0f}   ({NUM_PROMPTS} x {RESPONSE_LENGTH} sampled tokens "
          f"/ generation: {gen_s['ours']:.3f} vs {gen_s['trl']:.3f} s)")
    print(f"  training tokens/s    {NUM_PROMPTS * width / rest_s['ours']:9.0f} vs "
          f"{NUM_PROMPTS * width / rest_s['trl']:9.0f}   ({NUM_PROMPTS} x {width} tokens / the rest of the step: "
          f"{rest_s['ours']:.3f} vs {rest_s['trl']:.3f} s; TRL's includes its reward model and gc)")

    ours_mb = memory.get("ours", {}).get("step_peak_mb", float("nan"))
    trl_mb = memory.get("trl", {}).get("step_peak_mb", float("nan"))
    if memory:
        if torch.cuda.is_available():
            print("\npeak GPU memory of a step (torch.cuda.max_memory_allocated over 2 steps after a warm-up one, "
                  "minus what was allocated before them; one fresh process per side):")
        else:
            print("\npeak memory of a step (peak RSS over 2 steps after a warm-up one, minus RSS before them; "
                  "one fresh process per side):")
        for key in ("ours", "trl"):
            m = memory[key]
            print(f"  {key:<5} {m['step_peak_mb']:7.1f} MB   (peak {m['peak_rss_mb']:.0f} MB, "
                  f"before the steps {m['rss_before_mb']:.0f} MB)")
    print(f"ours_s_per_step={med['ours']:.4f} trl_s_per_step={med['trl']:.4f} ratio={ratio:.3f} "
          f"overhead={overhead:.3f} kl_panel_cost={panel_cost:.4f} ours_peak_mb={ours_mb:.1f} trl_peak_mb={trl_mb:.1f}")


if __name__ == "__main__":
    main()
