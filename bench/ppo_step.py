"""One PPO step of our trainer (`rlhf.step.train_step`) against TRL's PPOTrainer on identical work, and
against the floor (the same model passes done bare).

    pip install -e ".[bench]"                   # TRL 0.29.1 (PPOTrainer is gone from TRL 1.13 on)
    python bench/ppo_step.py                    # a few minutes on 2 cores; the last line is key=value
    python bench/ppo_step.py --iters 9 --profile ours   # plus a torch.profiler table of our step, alone
    python bench/ppo_step.py --shared-process   # every side in this one process (a loaded machine)
    python bench/ppo_step.py --gpu              # Qwen2.5-0.5B-shaped models, bf16 autocast, CUDA

Workload, identical for every side: bench/common.py's (a 400-token tokenizer, a random-init tiny Qwen2 as
the policy, a copy as the reference, a critic of the same size with its value head zeroed as `rlhf.models`
does; with --gpu, Qwen2.5-0.5B's shape under bf16 autocast), all 32 prompts left-padded to 48 tokens,
64 sampled tokens per response at temperature 1, never stopping at EOS; 1 PPO epoch over 2 mini-batches
of 16; k3 KL in the reward; float32; torch threads as the environment sets them (`--threads` to choose).
TRL cannot score by rule, so it also gets a reward model of the same size and runs one more forward per
step; our side scores GSM8K by rule and skips that pass. The output says so.
The policy is left at its random init: it rarely samples EOS, so no side could stop generating early
even if it tried. One step of TRL and of ours is checked before timing: exactly 64 decoding steps
(forward passes inside the generation call: TRL's `generate`, our timer's "gen" phase) and 2 optimizer
steps per optimizer.

How the sides are run: by default each in a fresh process of its own (built and checked there alone), stepped
from this one a side at a time, interleaved round by round (the order rotates every round, so drift hits every
side alike) after warm-up, medians over `--iters` rounds; each user runs one trainer at a time, and TRL's
gc.collect() then walks only its own objects. `--shared-process` runs them all in this one process instead,
the variants of ours on one set of models (less process switching on a loaded machine). The OpenMP settings
(OMP_NUM_THREADS, OMP_WAIT_POLICY) are the environment's, printed with the mode. What each side's time is:
- TRL: `trainer.train()` runs one PPO step per call (`args.num_total_batches = 1`); a callback takes
  the time from `on_train_begin` to `on_train_end`, i.e. exactly one iteration of TRL's training loop
  (data loading, rollout, reward model, GAE, PPO update, its logging and its gc.collect()).
  The per-call set-up before `on_train_begin` (a few small tensors) is not counted, in TRL's favour.
- ours: the wall time of `rlhf.step.train_step(...)` on the trainer's own set-up (`rlhf.setup.load_models` and
  `rlhf.setup.build_setup` on the workload's prompts), and its per-phase timer: a `PhaseTimer` (a subclass of
  `rlhf.tracking.Timer`, passed into `rlhf.step.train_step`) that synchronises with the GPU before each phase's time
  is taken, opens a profiler range per phase and counts the actor's forwards while generating.
- "ours, panel off": the same with `trainer.log_kl_panel=false` and the old-log-prob forward forced
  (`actor.recompute_old_logprobs=always`): the step without the KL panel's work, for the panel's cost.
- "ours, panel off, no pass": `trainer.log_kl_panel=false` alone: without the panel, the float32 sampler's
  log-probs serve as the old ones (`rollout.logprobs_from_sampler`), so the old-log-prob forward is skipped;
  against "ours, panel off", what skipping that pass saves.
- floor (bench/floor.py): sampling with a bare KV-cache loop (one forward per token, `torch.multinomial`);
  reference, old-policy and critic forwards without grad; two mini-batches of actor and critic
  forward+backward with the simplest losses; the optimizer steps (fused AdamW). No accelerate, no metrics.
Peak memory of a step is measured for ours and TRL, each in a fresh subprocess, as bench/common.py says:
what a step allocates, not the models or the optimizer state.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# bench/common.py first: it sets the environment before torch loads.
from common import (KL_COEF, LR, MINI_BATCH, NUM_PROMPTS, PHASES, PROMPT_WIDTH, RESPONSE_LENGTH, SEED, STEP_KEYS,
                    GenerationClock, OursSide, OursVariant, PhaseTimer, build_workload, child_flags,
                    count_decode_steps, count_optimizer_steps, interleaved_rounds, load_line, load_workload,
                    measure_memory, median_phase, median_untimed, our_config, paired, print_versions_and_load,
                    serve_side, side_processes, start, step_memory, sync, timed)

import torch

from floor import FloorSide


# ----------------------------------------------------------------------------- TRL


class TRLSide:
    """TRL's PPOTrainer, set up for exactly the workload (`gpu`: bf16); `step()` runs one PPO step."""

    name = "TRL PPOTrainer"

    def __init__(self, workdir: str, gpu: bool):
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
            bf16=gpu, fp16=False, gradient_checkpointing=False,  # PPOConfig defaults bf16 and GC on
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


class OursPPOSide(OursSide):
    """bench/common.py's `OursSide` with the PPO step's config (`our_config`): all 32 prompts, the critic."""

    def __init__(self, workdir: str, gpu: bool):
        _, tokenizer, prompts = load_workload(workdir)
        super().__init__("ours train_step", our_config(workdir, True, gpu), our_config(workdir, False, gpu),
                         tokenizer, prompts)
        self.cfg_forced = our_config(workdir, False, gpu, recompute="always")  # panel off, the pass kept

    def describe(self) -> str:
        opt = self.torch_optimizers[0]
        return (f"{type(opt).__name__}(fused={opt.defaults.get('fused')}, foreach={opt.defaults.get('foreach')}) "
                "x2 (actor, critic); rollout.ignore_eos=true")

    def check(self, cfgs=None) -> None:
        """One step of each config (default: all three): exactly RESPONSE_LENGTH sampled tokens and 2 optimizer
        steps per model; the panel's step logs the whole KL panel; the old-log-prob forward runs in the two
        configs that need or force it and not in "panel off, no pass"."""
        for cfg in cfgs or (self.cfg_panel, self.cfg_forced, self.cfg_minimal):
            pass_expected = cfg is not self.cfg_minimal
            optimizer_steps = []
            timer = PhaseTimer(self.actor)
            with count_optimizer_steps(self.torch_optimizers, optimizer_steps):
                self.step(timer=timer, cfg=cfg)
            who = f"ours (log_kl_panel={cfg.trainer.log_kl_panel}, {cfg.actor.recompute_old_logprobs})"
            assert timer.decode_steps == [RESPONSE_LENGTH], \
                f"{who} ran {timer.decode_steps} decoding steps, not [{RESPONSE_LENGTH}]"
            assert optimizer_steps == [NUM_PROMPTS // MINI_BATCH] * 2, f"{who} took {optimizer_steps} optimizer steps"
            assert ("old_log_prob" in timer.seconds) == pass_expected, f"{who}: phases {sorted(timer.seconds)}"
            if cfg.trainer.log_kl_panel:
                missing = [f"kl/{n}" for n in ("k1", "k2", "k3", "abs", "full") if f"kl/{n}" not in self.last_metrics]
                assert not missing, f"the KL panel lacks {missing}"


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



# ----------------------------------------------------------------------------- measuring


@dataclasses.dataclass
class Result:
    """What the timed rounds and the checks after them measured."""

    names: dict[str, str]  # side key ("trl", "ours", "minimal", "no_pass", "floor") -> its name, in a round's order
    times: dict[str, list[dict[str, float]]]  # side key -> per round: "step", each phase's s, "gen_synced"
    vocab_size: int
    full_kl_ms: float  # kl.full_kl on one batch's (NUM_PROMPTS, RESPONSE_LENGTH, vocab_size) logits
    memory: dict[str, dict[str, float]]  # "ours", "trl" -> common.step_memory's fields; empty: --skip-memory
    shared_process: bool  # all sides in one process (--shared-process), else one process per side
    load: tuple[str, str]  # /proc/loadavg's three averages as the rounds began and as they ended


ROWS = ("trl", "ours", "minimal", "no_pass", "floor")  # the sides timed, in a round's first order
VARIANT_NAMES = {"minimal": "ours, panel off", "no_pass": "ours, panel off, no pass"}


def build_side(name: str, workdir: str, gpu: bool):
    """The side a memory subprocess measures: "trl" or "ours"."""
    return TRLSide(workdir, gpu) if name == "trl" else OursPPOSide(workdir, gpu)


def gc_about(num_objects_before_ours: int | None = None) -> dict:
    """What one gc.collect() (TRL calls two a step) costs in this process, and how many objects it walks."""
    gc_ms = 1e3 * statistics.median(timed(gc.collect) for _ in range(3))
    return {"gc_ms": gc_ms, "objects": len(gc.get_objects()), "objects_before_ours": num_objects_before_ours}


def ours_about(ours: OursPPOSide) -> dict:
    """What the report prints about our side: its optimizers and model."""
    return {"name": ours.name, "optimizer": ours.describe(), "vocab": ours.models[0].config.vocab_size,
            "num_params": sum(p.numel() for p in ours.models[0].parameters()), "device": str(ours.accelerator.device)}


def open_row(key: str, workdir: str, gpu: bool):
    """One of ROWS built and checked alone (in a side's own process): (side, what the report prints about it)."""
    if key == "trl":
        side = TRLSide(workdir, gpu)
        side.check()  # exactly RESPONSE_LENGTH decoding steps, 2 optimizer steps
        return side, {"name": side.name, "optimizer": side.describe(), **gc_about()}
    if key == "floor":
        side = FloorSide(workdir, gpu)
        return side, {"name": side.name}
    ours = OursPPOSide(workdir, gpu)
    cfg = {"ours": ours.cfg_panel, "minimal": ours.cfg_forced, "no_pass": ours.cfg_minimal}[key]
    ours.check([cfg])
    side = ours if key == "ours" else OursVariant(ours, VARIANT_NAMES[key], cfg)
    return side, {**ours_about(ours), "name": side.name}


def shared_sides(workdir: str, gpu: bool):
    """--shared-process: every row in this process, the variants on our side's models: (sides, about)."""
    trl_side = TRLSide(workdir, gpu)
    num_objects_trl = len(gc.get_objects())
    ours, floor = OursPPOSide(workdir, gpu), FloorSide(workdir, gpu)
    sides = [("trl", trl_side), ("ours", ours), ("minimal", OursVariant(ours, VARIANT_NAMES["minimal"], ours.cfg_forced)),
             ("no_pass", OursVariant(ours, VARIANT_NAMES["no_pass"], ours.cfg_minimal)), ("floor", floor)]
    about = {"trl": {"name": trl_side.name, "optimizer": trl_side.describe(), **gc_about(num_objects_trl)},
             "ours": ours_about(ours)}
    trl_side.check()  # exactly RESPONSE_LENGTH decoding steps, 2 optimizer steps
    ours.check()
    return sides, about


def print_setup(trl, transformers, about: dict, tokenizer, prompts: dict, gpu: bool, shared_process: bool) -> None:
    """What the timing is taken under: mode, versions, machine, workload, optimizers, TRL's extra work."""
    ours, trl_about = about["ours"], about["trl"]
    print_versions_and_load(trl, transformers, gpu, shared_process)
    print(f"workload: Qwen2 {ours['num_params'] / 1e6:.2f}M parameters (vocab {ours['vocab']}, tokenizer "
          f"{len(tokenizer)}), {NUM_PROMPTS} prompts x {PROMPT_WIDTH} tokens (left-padded, shortest "
          f"{min(map(len, prompts['input_ids']))}), {RESPONSE_LENGTH} sampled tokens, 1 epoch x "
          f"{NUM_PROMPTS // MINI_BATCH} mini-batches of {MINI_BATCH}, k3 KL in the reward, "
          f"{'bf16 autocast over float32 weights' if gpu else 'float32'}, on {ours['device']}")
    print(f"optimizers: TRL {trl_about['optimizer']}; ours {ours['optimizer']}")
    print("TRL also runs a reward-model forward every step (it cannot score by rule); ours skips that pass: "
          "GSM8K is scored by rule.")
    before = trl_about["objects_before_ours"]
    whose = (f"{1 - before / trl_about['objects']:.1%} of them added by our side and the floor" if before
             else "TRL's own process")
    print(f"TRL calls gc.collect() twice per step; one call takes {trl_about['gc_ms']:.0f} ms in its process "
          f"({trl_about['objects']} objects tracked: {whose}).")


def measure(args, trl, transformers) -> Result | None:
    """Build the workload and the sides (each in its own process, or all in this one with --shared-process),
    check one step of TRL and of ours, run the interleaved rounds, profile the sides named by --profile, then
    time kl.full_kl and measure memory. None for --iters 0."""
    script = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory(prefix="ppo-bench-") as workdir, contextlib.ExitStack() as stack:
        build_workload(workdir, args.gpu)
        _, tokenizer, prompts = load_workload(workdir)
        if args.shared_process:
            sides, about = shared_sides(workdir, args.gpu)
        else:
            sides = stack.enter_context(side_processes(script, ROWS, workdir, args.threads, args.gpu))
            about = {key: side.about for key, side in sides}
        print_setup(trl, transformers, about, tokenizer, prompts, args.gpu, args.shared_process)
        load_start = load_line()
        times = interleaved_rounds(sides, args.warmup, args.iters)
        load_end = load_line()
        stack.close()  # the side processes end before anything else is timed
        for key in args.profile:  # with --shared-process beside the others in this process, else alone in a fresh one
            if args.shared_process:
                profile(dict(sides)[key], key)
            else:
                sys.stdout.flush()
                subprocess.run([sys.executable, script, "--profile-child", key, "--workdir", workdir,
                                *child_flags(args.threads, args.gpu)], check=True)
        if not args.iters:  # profiling only
            return None

        from accelerate import PartialState

        from rlhf import kl

        vocab_size, device = about["ours"]["vocab"], PartialState().device
        logits, ref_logits = torch.randn(2, NUM_PROMPTS, RESPONSE_LENGTH, vocab_size, device=device)
        full_kl_ms = 1e3 * statistics.median(timed(lambda: (kl.full_kl(logits, ref_logits, 1.0), sync()))
                                             for _ in range(11))
        memory = {} if args.skip_memory else {
            k: measure_memory(os.path.abspath(__file__), k, workdir, args.threads, args.gpu) for k in ("ours", "trl")}
    return Result({key: side.name for key, side in sides}, times, vocab_size, full_kl_ms, memory,
                  args.shared_process, (load_start, load_end))


# ----------------------------------------------------------------------------- printing


def print_phases(times: dict[str, list[dict]], ours_s: float) -> None:
    """Our step's phases (medians and shares of `ours_s`, our median step), with the panel off (the pass
    forced, then skipped) and the floor's."""
    print("\nour step by phase, median s (share of our step); the same with the panel off (old-log-prob pass "
          "forced, skipped) and for the floor:")
    print(f"  {'phase':<12} {'ours':>7}           {'no panel':>8} {'no pass':>8} {'floor':>7}")
    accounted = set(STEP_KEYS)
    sides = ("ours", "minimal", "no_pass", "floor")
    for label, keys in PHASES:
        accounted.update(keys)
        full, lean, skipped, bare = (median_phase(times[side], keys) for side in sides)
        print(f"  {label:<12} {full:7.3f}  ({full / ours_s:5.1%})   {lean:8.3f} {skipped:8.3f} {bare:7.3f}")
    for key in sorted({k for t in times["ours"] for k in t} - accounted):  # phases not named in PHASES
        value = statistics.median(t[key] for t in times["ours"])
        print(f"  {key:<12} {value:7.3f}  ({value / ours_s:5.1%})")
    full, lean, skipped, bare = (median_untimed(times[side]) for side in sides)
    print(f"  {'other':<12} {full:7.3f}  ({full / ours_s:5.1%})   {lean:8.3f} {skipped:8.3f} {bare:7.3f}   "
          "(outside the timed phases: batch building, scoring, GAE, metrics)")


def print_throughput(times: dict[str, list[dict]]) -> None:
    """Sampled tokens over the (GPU-synchronised) generation call; prompt + response tokens of the batch over
    the rest of the step (the scoring forwards and the PPO update). Ours against TRL."""
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


def print_memory(memory: dict[str, dict[str, float]]) -> None:
    """Each side's peak memory of a step, from its subprocess."""
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


def print_report(r: Result) -> None:
    """The medians, the ratios against their targets, the phases, throughput, memory, and a key=value line."""
    times = r.times
    med = {k: statistics.median(t["step"] for t in v) for k, v in times.items()}
    ratio, overhead = med["ours"] / med["trl"], med["ours"] / med["floor"]
    panel_cost = paired(times, "ours", "minimal") - 1
    pass_saving = 1 - paired(times, "no_pass", "minimal")
    lean_ratio = med["no_pass"] / med["trl"]
    print(f"\nstep time, median of {len(times['ours'])} (min); "
          f"{'all sides in one process' if r.shared_process else 'each side in its own process'}; load average "
          f"{r.load[0]} at the start of the rounds, {r.load[1]} at the end")
    for key, name in r.names.items():
        print(f"  {name:<24} {med[key]:7.3f} s  ({min(t['step'] for t in times[key]):.3f})")
    print(f"ratio ours/TRL        {ratio:.3f}   (target <= 0.70; median of per-round ratios "
          f"{paired(times, 'ours', 'trl'):.3f}); panel off, no pass: {lean_ratio:.3f} "
          f"(per-round {paired(times, 'no_pass', 'trl'):.3f})")
    print(f"overhead ours/floor   {overhead:.3f}   (target <= 1.05; per-round {paired(times, 'ours', 'floor'):.3f})")
    print(f"KL panel cost         {panel_cost:+.1%}  (target <= 3%; median of per-round ours/panel-off - 1, the "
          f"old-log-prob pass in both; ratio of medians {med['ours'] / med['minimal'] - 1:+.1%})")
    print(f"                      cross-check: kl.full_kl on ({NUM_PROMPTS}, {RESPONSE_LENGTH}, {r.vocab_size}) "
          f"logits takes {r.full_kl_ms:.1f} ms = {r.full_kl_ms / 1e3 / med['ours']:.1%} of our step "
          "(the panel's main extra work)")
    print(f"no old-log-prob pass  {pass_saving:+.1%} of the step saved (median of per-round 1 - no-pass/panel-off, "
          f"both with the panel off; ratio of medians {1 - med['no_pass'] / med['minimal']:+.1%})")
    print_phases(times, med["ours"])
    print_throughput(times)
    if r.memory:
        print_memory(r.memory)
    ours_mb = r.memory.get("ours", {}).get("step_peak_mb", float("nan"))
    trl_mb = r.memory.get("trl", {}).get("step_peak_mb", float("nan"))
    print(f"ours_s_per_step={med['ours']:.4f} trl_s_per_step={med['trl']:.4f} ratio={ratio:.3f} "
          f"overhead={overhead:.3f} kl_panel_cost={panel_cost:.4f} pass_saving={pass_saving:.4f} "
          f"lean_ratio={lean_ratio:.3f} ours_peak_mb={ours_mb:.1f} trl_peak_mb={trl_mb:.1f} "
          f"mode={'shared-process' if r.shared_process else 'process-per-side'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=21, help="timed rounds (each times every side once); "
                        "0 = no timing report (with --profile: profile only)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads in every process (default: "
                        "torch's own, from OMP_NUM_THREADS or the cores)")
    parser.add_argument("--shared-process", action="store_true", help="every side in this one process (for a "
                        "loaded machine, where process switches add noise); default: one fresh process per side")
    parser.add_argument("--skip-memory", action="store_true", help="skip the two memory subprocesses")
    parser.add_argument("--gpu", action="store_true", help="models of Qwen2.5-0.5B's shape (random init), bf16 "
                        "autocast, on CUDA (needs a GPU; prepared, not yet run on one)")
    parser.add_argument("--profile", nargs="*", choices=("ours", "trl", "floor", "minimal", "no_pass"), default=[],
                        help="after timing, print a torch.profiler table for these sides")
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--side-child", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--profile-child", choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    trl, transformers = start(args.threads, args.gpu)
    if args.memory_child:
        print(json.dumps(step_memory(build_side(args.memory_child, args.workdir, args.gpu))))
        return
    if args.side_child:
        serve_side(*open_row(args.side_child, args.workdir, args.gpu))
        return
    if args.profile_child:
        profile(open_row(args.profile_child, args.workdir, args.gpu)[0], args.profile_child)
        return
    result = measure(args, trl, transformers)
    if result is not None:
        print_report(result)


if __name__ == "__main__":
    main()
