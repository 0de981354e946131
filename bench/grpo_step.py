"""One GRPO step of our trainer (`train.train_step`, `algorithm.adv_estimator=grpo`) against TRL's
GRPOTrainer on identical work, and our GAE step (with its critic) against our GRPO step.

    pip install -r requirements-bench.txt       # TRL 0.29.1 (its GRPOTrainer needs nothing more)
    python bench/grpo_step.py                   # a few minutes on 2 cores; the last line is key=value
    python bench/grpo_step.py --iters 5 --warmup 1 --skip-memory
    python bench/grpo_step.py --gpu             # Qwen2.5-0.5B-shaped model, bf16 autocast, CUDA (prepared)

The workload (tokenizer, random-init tiny Qwen2, chat-templated GSM8K-style prompts), our side, `PhaseTimer`,
the decode/optimizer-step counters, the per-process memory measurement and the interleaved rounds are
bench/common.py's, shared with bench/ppo_step.py; what is GRPO-specific is here.

Workload, identical for every side: the first 8 of the workload's 32 prompts (one of the full 48 tokens,
the rest shorter, left-padded to 48) x n=4 responses = 32 sequences of 64 sampled tokens at temperature 1,
never stopping at EOS; the workload's model as policy and as frozen reference; float32; torch threads 2;
one optimizer step per step, over all 32 responses in one forward/backward.
- ours (GRPO, `group_config`): `rlhf.setup.load_models` (no critic is built) + `rlhf.setup.build_setup`,
  then `train.train_step`; 8 prompts x rollout.n=4 in one mini-batch and one micro-batch, 1 epoch,
  algorithm.adv_estimator=grpo (divided by the group's std), k3 in the loss (coef 0.05, none in the
  reward), token-mean loss, clip 0.2, grad clip 1.0, fused AdamW at lr 3e-6 with no schedule,
  rollout.ignore_eos=true, the KL panel on (the trainer's default; also timed off: "estimator only").
- TRL (`TRLGRPOSide`): `trl.GRPOTrainer` with a Python reward function (`gsm8k_reward`: our GSM8K rule,
  "strict" as ours), the same batch shape (one train step = one generation of 8 prompts x 4 + one
  optimizer step), beta=0.05 (TRL's KL is k3 in the loss) without its bias correction, epsilon 0.2, the
  same token mean and group-std scaling, lr 3e-6 constant, grad clip 1.0, fused AdamW, no reference sync,
  no dropout, bf16 and activation checkpointing off (its configs default them on), logging every step (as
  ours computes its metrics every step). Each setting and why is at its `GRPOConfig` below.
Differences that could not be removed (the first four are said in the output):
- TRL skips the old-policy log-prob forward when num_iterations=1 and the generation batch is one optimizer
  step (it uses the update forward's detached log-probs); our trainer always runs that pass (32 x 112
  tokens, no grad). TRL's favour.
- Ours computes the KL panel (every estimator and the exact KL from both models' logits) by default; the
  "estimator only" row turns it off.
- TRL masks EOS while sampling (min_new_tokens), ours samples it and goes on (ignore_eos): the sampling
  distributions differ by one token of 400; the work is the same.
- Group std: TRL divides by std + 1e-4, ours by std + 1e-6. Our k3 clamps as verl's and our policy loss has
  verl's dual clip; on the one on-policy update (ratio 1) neither is active.
- TRL shuffles the generation batch (cheap) and runs its Trainer loop (callbacks, logging, epoch
  bookkeeping: with 8 prompts every step is an epoch, as our prompt sampler's is).

Our GAE step for comparison: `bench/ppo_step.py`'s PPO configuration (critic, GAE with gamma 1, lam 0.95,
whitened advantages, k3 KL in the reward, value clip 0.2) on the same 8 prompts x n=4 = 32 responses of 64
tokens, one mini-batch of 32 and one optimizer step per model. The difference to our GRPO step is the critic
(a forward in the rollout, a forward/backward and an AdamW step in the update, and its weights, gradients and
optimizer state) and where the KL goes (reward vs loss: elementwise, no extra pass).

How each side is timed, in this one process, interleaved round by round (the order rotates every round) after
warm-up, medians over `--iters` rounds:
- TRL: from the release of `trainer.train()`'s thread, parked by a callback (`TRLGRPOSide`), to its next
  `on_step_end` (after a GPU sync): exactly one iteration of TRL's training loop (the previous step's
  logging, the data loader, generation, reward, reference forward, advantages, loss forward/backward,
  clipping, optimizer and scheduler steps). The main thread only waits meanwhile.
- ours: the wall time of `train.train_step(...)` with bench/common.py's `PhaseTimer` (phases synchronised).
Before timing, one step of each side is checked: exactly 64 decoding steps in the generation call, one
optimizer step per optimizer, 32 sequences in every policy forward, 64-token completions on TRL's side, the
right losses (KL in TRL's loss / ours: actor/kl_loss; GAE: the reward KL and a critic).
Peak memory of a step per side, each in a fresh subprocess, as bench/common.py says: what a step allocates,
not the models or the optimizer state. The line after it gives the resident memory before the steps, where
GAE's critic (weights, grads, AdamW state) shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
import warnings

# bench/common.py first: it sets the environment before torch loads and puts the repository root on sys.path.
from common import (GROUP_PROMPTS, KL_COEF, LR, N, NUM_RESPONSES, PHASES, PROMPT_WIDTH, RESPONSE_LENGTH, SEED,
                    GenerationClock, OursMinimal, OursSide, PhaseTimer, build_workload, count_decode_steps,
                    count_optimizer_steps, forward_batch_sizes, interleaved_rounds, load_group_workload,
                    measure_memory, median_phase, median_untimed, our_config, paired, print_versions_and_load,
                    start, step_memory, sync)

import torch

# ----------------------------------------------------------------------------- ours


def group_config(workdir: str, estimator: str, log_kl_panel: bool, gpu: bool):
    """bench/common.py's config of our side (model, lengths, temperature, lr, clips, ignore_eos, seed,
    precision) with this workload's batch shape; for grpo the KL moves from the reward into the loss (k3)."""
    import yaml

    from rlhf.config import set_value, validate

    overrides = [
        f"data.train_batch_size={GROUP_PROMPTS}", f"rollout.n={N}",
        f"rollout.log_prob_micro_batch_size={NUM_RESPONSES}", "actor.ppo_epochs=1",
        f"actor.ppo_mini_batch_size={GROUP_PROMPTS}", f"actor.ppo_micro_batch_size={NUM_RESPONSES}",
        "actor.loss_agg_mode=token-mean", f"algorithm.adv_estimator={estimator}",
    ]
    if estimator == "grpo":
        overrides += ["algorithm.norm_adv_by_std_in_grpo=true", "algorithm.use_kl_in_reward=false",
                      "actor.use_kl_loss=true", "actor.kl_loss_type=k3", f"actor.kl_loss_coef={KL_COEF}"]
    cfg = our_config(workdir, log_kl_panel, gpu)
    for item in overrides:
        key, _, value = item.partition("=")
        set_value(cfg, key, yaml.safe_load(value), text=value)
    validate(cfg)
    return cfg


class OursGroupSide(OursSide):
    """bench/common.py's `OursSide` (its `step()`: `train.train_step` timed with `PhaseTimer`) on this
    workload, with `algorithm.adv_estimator` grpo (no critic) or gae (critic, as ppo_step's PPO step)."""

    def __init__(self, workdir: str, estimator: str, gpu: bool):
        _, tokenizer, prompts = load_group_workload(workdir)
        self.estimator = estimator
        super().__init__(f"ours {estimator} train_step", group_config(workdir, estimator, True, gpu),
                         group_config(workdir, estimator, False, gpu), tokenizer, prompts)

    def describe(self) -> str:
        opts = self.torch_optimizers
        return (f"{type(opts[0]).__name__}(fused={opts[0].defaults.get('fused')}) x{len(opts)} "
                f"({'actor, critic' if len(opts) == 2 else 'actor; no critic built'})")

    def check(self) -> dict:
        """One step: exactly RESPONSE_LENGTH decoding steps, one optimizer step per model, NUM_RESPONSES
        sequences in every actor forward, the KL where it belongs and a critic only for gae."""
        optimizer_steps, sizes = [], []
        timer = PhaseTimer(self.actor)
        opts = self.torch_optimizers
        with count_optimizer_steps(opts, optimizer_steps), forward_batch_sizes(self.actor, sizes):
            self.step(timer=timer)
        who = f"ours ({self.estimator})"
        assert timer.decode_steps == [RESPONSE_LENGTH], f"{who} ran {timer.decode_steps} decoding steps"
        assert optimizer_steps == [1] * len(opts), f"{who} took {optimizer_steps} optimizer steps"
        assert set(sizes) == {NUM_RESPONSES}, f"{who}: actor forwards of batch sizes {sorted(set(sizes))}"
        assert (self.models[1] is None) == (self.estimator == "grpo"), f"{who}: critic {self.models[1]!r}"
        if self.estimator == "grpo":
            assert "actor/kl_loss" in self.last_metrics and "actor/reward_kl_penalty" not in self.last_metrics
        else:
            assert "actor/reward_kl_penalty" in self.last_metrics and "critic/vf_loss" in self.last_metrics
        return {"policy_forwards": len(sizes), "optimizer_steps": optimizer_steps}


# ----------------------------------------------------------------------------- TRL


def gsm8k_reward(completions, ground_truth, **kwargs) -> list[float]:
    """TRL reward function: our GSM8K rule on the decoded completions (as `train.score_responses`)."""
    from rlhf.config import DataConfig
    from rlhf.rewards.gsm8k import compute_score

    method = DataConfig().reward_method  # "strict", what our side uses
    return [compute_score(text, truth, method=method) for text, truth in zip(completions, ground_truth)]


class TRLGRPOSide:
    """TRL's GRPOTrainer, set up for exactly the workload (`gpu`: bf16); `step()` runs one iteration of its
    training loop.

    `trainer.train()` runs in a helper thread with a huge max_steps; a callback parks it at every
    `on_step_end` (and at `on_train_begin`) until `step()` releases it. Only one thread runs at a time."""

    name = "TRL GRPOTrainer"

    def __init__(self, workdir: str, gpu: bool):
        from datasets import Dataset
        from transformers import TrainerCallback
        from transformers.trainer_callback import PrinterCallback, ProgressCallback
        from trl import GRPOConfig, GRPOTrainer

        from rlhf.models import load_causal_lm

        model_dir, tokenizer, prompts = load_group_workload(workdir)
        # TRL takes text prompts and tokenizes them itself (`processing_class(text=prompts)`): give it the
        # chat-templated text of our prompts, checked to tokenize back to exactly our token ids.
        texts = [tokenizer.decode(ids) for ids in prompts["input_ids"]]
        assert tokenizer(text=texts)["input_ids"] == prompts["input_ids"], "TRL would see other prompt tokens"
        torch.manual_seed(SEED)
        self.policy = load_causal_lm(model_dir)
        args = GRPOConfig(
            output_dir=os.path.join(workdir, "trl-grpo"), report_to="none", seed=SEED,
            # 32 completions = 8 prompts x 4 per generation and per optimizer step, one forward/backward.
            per_device_train_batch_size=NUM_RESPONSES, gradient_accumulation_steps=1, steps_per_generation=1,
            num_generations=N, num_iterations=1,
            # EOS is masked out while sampling, so every completion is exactly 64 tokens and none is cut at an
            # EOS (eos_token_id=None does not work: transformers refills it from the generation config).
            max_completion_length=RESPONSE_LENGTH, generation_kwargs={"min_new_tokens": RESPONSE_LENGTH},
            temperature=1.0, top_p=1.0, top_k=0,
            # "dapo": the sum over the generation batch's tokens / their number, here the same token mean over
            # the one mini-batch as ours; "group": advantages divided by the group's std, as ours.
            beta=KL_COEF, use_bias_correction_kl=False, epsilon=0.2, loss_type="dapo", scale_rewards="group",
            mask_truncated_completions=False, sync_ref_model=False, disable_dropout=True,
            learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
            optim="adamw_torch_fused",
            # TRL's configs default to bf16 and activation checkpointing on. (`gradient_checkpointing`, the old
            # name, is a deprecated alias in transformers 5: the new name set to False turns both off.)
            bf16=gpu, fp16=False, activation_checkpointing=False,
            max_steps=10**9, save_strategy="no", eval_strategy="no", logging_steps=1, disable_tqdm=True,
            log_completions=False, dataloader_num_workers=0,
        )
        self.trainer = GRPOTrainer(
            model=self.policy, reward_funcs=gsm8k_reward, args=args, processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": texts, "ground_truth": prompts["ground_truth"]}),
        )
        for callback in (PrinterCallback, ProgressCallback):  # printing is not part of the work
            self.trainer.remove_callback(callback)
        self.gen_clock = GenerationClock(self.policy, "generate")

        self._go, self._done, self._ready = threading.Semaphore(0), threading.Semaphore(0), threading.Event()
        self._stopping, self._error = False, None
        self.begin = self.end = 0.0
        self.last_metrics: dict[str, float] = {}
        side = self

        class Parking(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                side._ready.set()  # set-up done (optimizer built): the constructor may return
                side._park()

            def on_step_end(self, args, state, control, **kwargs):
                sync()
                side.end = time.perf_counter()
                side.last_metrics = {k: v[-1] for k, v in side.trainer._metrics["train"].items() if v}
                side._done.release()
                side._park()
                if side._stopping:
                    control.should_training_stop = True
                return control

        self.trainer.add_callback(Parking())
        self._thread = threading.Thread(target=self._train, name="trl-grpo-train", daemon=True)
        self._thread.start()
        while not self._ready.wait(timeout=5.0):  # so that nothing else runs alongside TRL's set-up
            if not self._thread.is_alive():
                raise RuntimeError("TRL's training thread stopped during set-up") from self._error

    def _park(self) -> None:
        """In the training thread: wait for `step()` (or `close()`), then start the clock."""
        self._go.acquire()
        self.begin = time.perf_counter()

    def _train(self) -> None:
        try:
            self.trainer.train()
        except BaseException as e:  # re-raised in the main thread by step()
            self._error = e
        finally:
            self._done.release()

    def describe(self) -> str:
        opt = self.trainer.optimizer.optimizer  # built before on_train_begin, which the constructor waits for
        return f"{type(opt).__name__}(fused={opt.defaults.get('fused')}) over the policy"

    def step(self) -> dict[str, float]:
        self.gen_clock.seconds = 0.0
        self._go.release()
        while not self._done.acquire(timeout=5.0):
            if not self._thread.is_alive():
                break
        if self._error is not None or not self._thread.is_alive():
            raise RuntimeError("TRL's training thread stopped") from self._error
        return {"step": self.end - self.begin, "gen_synced": self.gen_clock.seconds}

    def close(self) -> None:
        if self._thread.is_alive():
            self._stopping = True
            self._go.release()
            self._thread.join(timeout=120)

    def check(self) -> dict:
        """One step: exactly RESPONSE_LENGTH decoding steps, one optimizer step, NUM_RESPONSES sequences in
        every policy forward, every completion RESPONSE_LENGTH tokens, a KL term in the loss."""
        decode_steps, optimizer_steps, sizes = [], [], []
        with count_decode_steps(self.policy, "generate", self.policy, decode_steps), \
                count_optimizer_steps([self.trainer.optimizer.optimizer], optimizer_steps), \
                forward_batch_sizes(self.policy, sizes):
            self.step()
        assert decode_steps == [RESPONSE_LENGTH], f"TRL ran {decode_steps} decoding steps, not [{RESPONSE_LENGTH}]"
        assert optimizer_steps == [1], f"TRL took {optimizer_steps} optimizer steps"
        assert set(sizes) == {NUM_RESPONSES}, f"TRL: policy forwards of batch sizes {sorted(set(sizes))}"
        m = self.last_metrics
        lengths = (m.get("completions/min_length"), m.get("completions/max_length"))
        assert lengths == (RESPONSE_LENGTH, RESPONSE_LENGTH), f"TRL's completions have lengths {lengths}"
        assert "kl" in m, "TRL computed no KL (beta 0?)"
        assert self.trainer.ref_model is not None and not self.trainer.args.use_bias_correction_kl
        assert not (self.trainer.args.gradient_checkpointing or self.trainer.args.activation_checkpointing)
        return {"policy_forwards": len(sizes), "optimizer_steps": optimizer_steps}


# ----------------------------------------------------------------------------- measuring


SIDES = ("trl", "ours", "gae")  # what a memory subprocess can measure (--memory-child)


def build_side(name: str, workdir: str, gpu: bool):
    """One of SIDES: TRL's GRPOTrainer, our grpo step or our gae step."""
    if name == "trl":
        return TRLGRPOSide(workdir, gpu)
    return OursGroupSide(workdir, "grpo" if name == "ours" else "gae", gpu)


@dataclasses.dataclass
class Result:
    """What the timed rounds and the memory subprocesses measured."""

    names: dict[str, str]  # side key ("trl", "ours", "minimal", "gae") -> its name, in the order of a round
    times: dict[str, list[dict[str, float]]]  # side key -> per round: "step", each phase's s, "gen_synced"
    memory: dict[str, dict[str, float]]  # "ours", "trl", "gae" -> common.step_memory's fields; empty: --skip-memory
    on_gpu: bool


def print_setup(trl, transformers, ours: OursGroupSide, prompts: dict, gpu: bool) -> None:
    """What the timing is taken under: versions, machine, workload."""
    device = ours.accelerator.device
    num_params = sum(p.numel() for p in ours.models[0].parameters())
    print_versions_and_load(trl, transformers, device)
    print(f"workload: Qwen2 {num_params / 1e6:.2f}M parameters (vocab {ours.models[0].config.vocab_size}), "
          f"{GROUP_PROMPTS} prompts x n={N} = {NUM_RESPONSES} sequences, prompts left-padded to "
          f"{PROMPT_WIDTH} tokens (lengths {sorted(map(len, prompts['input_ids']))}), {RESPONSE_LENGTH} "
          f"sampled tokens at temperature 1, one optimizer step per step, k3 KL in the loss (coef "
          f"{KL_COEF}), lr {LR}, {'bf16 autocast over float32 weights' if gpu else 'float32'}, "
          f"on {device}")


def print_checks(trl_side: TRLGRPOSide, ours: OursGroupSide, gae: OursGroupSide) -> None:
    """Check one step of each side (their `check()`) and say what was checked and what still differs."""
    trl_check, ours_check, gae_check = trl_side.check(), ours.check(), gae.check()
    print(f"optimizers: TRL {trl_side.describe()}; ours grpo {ours.describe()}; ours gae {gae.describe()}")
    print(f"checked, one step each: {RESPONSE_LENGTH} decoding steps, {NUM_RESPONSES} sequences per policy "
          f"forward; policy forwards per step: TRL {trl_check['policy_forwards']}, ours grpo "
          f"{ours_check['policy_forwards']}, ours gae {gae_check['policy_forwards']}; optimizer steps: TRL "
          f"{trl_check['optimizer_steps']}, ours grpo {ours_check['optimizer_steps']}, ours gae "
          f"{gae_check['optimizer_steps']} (actor, critic)")
    print("differences left: TRL skips the old-policy log-prob forward (num_iterations=1, one optimizer step "
          "per generation: it reuses the update's detached log-probs), ours always runs it; ours computes "
          "the KL panel (the 'estimator only' row does not); TRL masks EOS while sampling (min_new_tokens), "
          "ours samples it and ignores it; group std + 1e-4 (TRL) vs + 1e-6 (ours).")


def measure(args, trl, transformers) -> Result | None:
    """Build the workload and the four sides, check one step of each, run the interleaved rounds, then
    measure memory (one subprocess per side). None for --iters 0."""
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as workdir:
        build_workload(workdir, args.gpu)
        _, tokenizer, prompts = load_group_workload(workdir)
        trl_side = TRLGRPOSide(workdir, args.gpu)
        try:
            ours, gae = OursGroupSide(workdir, "grpo", args.gpu), OursGroupSide(workdir, "gae", args.gpu)
            minimal = OursMinimal(ours, "ours grpo, estimator only")
            sides = [("trl", trl_side), ("ours", ours), ("minimal", minimal), ("gae", gae)]
            print_setup(trl, transformers, ours, prompts, args.gpu)
            print_checks(trl_side, ours, gae)
            times = interleaved_rounds(sides, args.warmup, args.iters)
        finally:
            trl_side.close()
        memory = {} if args.skip_memory else {k: measure_memory(os.path.abspath(__file__), k, workdir, args.threads,
                                                                args.gpu) for k in ("ours", "trl", "gae")}
    if not args.iters:
        return None
    return Result({key: side.name for key, side in sides}, times, memory, ours.accelerator.device.type == "cuda")


# ----------------------------------------------------------------------------- printing


def print_memory(memory: dict[str, dict[str, float]], on_gpu: bool) -> None:
    """Each side's peak memory of a step, from its subprocess, and the ratios: ours/TRL, GAE/GRPO."""
    def mb(key: str, field: str = "step_peak_mb") -> float:
        return memory[key][field]

    what = ("torch.cuda.max_memory_allocated over 2 steps after a warm-up one, minus what was allocated "
            "before them" if on_gpu else "peak RSS over 2 steps after a warm-up one, minus RSS before them")
    print(f"\npeak memory of a step ({what}; one fresh process per side):")
    for key, label in (("ours", "ours grpo"), ("trl", "TRL"), ("gae", "ours gae")):
        print(f"  {label:<10} {mb(key):7.1f} MB   (peak {mb(key, 'peak_rss_mb'):.0f} MB, "
              f"before the steps {mb(key, 'rss_before_mb'):.0f} MB)")
    critic_mb = mb("gae", "rss_before_mb") - mb("ours", "rss_before_mb")
    print(f"memory ours/TRL {mb('ours') / mb('trl'):.2f} (target <= 1); GAE/GRPO: a step's peak "
          f"{mb('gae') / mb('ours'):.2f}x, resident before the steps {critic_mb:+.0f} MB "
          "(the critic's weights, gradients and AdamW state)")


def print_report(r: Result) -> None:
    """The medians, the ratios against their targets, generation and phases, memory, and a key=value line."""
    times = r.times
    med = {k: statistics.median(t["step"] for t in v) for k, v in times.items()}
    ratio, gae_over_grpo = paired(times, "ours", "trl"), paired(times, "gae", "ours")
    print(f"\nstep time, median of {len(times['ours'])} (min)")
    for key, name in r.names.items():
        print(f"  {name:<28} {med[key]:7.3f} s  ({min(t['step'] for t in times[key]):.3f})")
    print(f"ratio ours/TRL            {ratio:.3f}   (target <= 0.65; median of per-round ratios; ratio of medians "
          f"{med['ours'] / med['trl']:.3f})")
    print(f"ratio ours/TRL, panel off {paired(times, 'minimal', 'trl'):.3f}   (ours with trainer.log_kl_panel=false)")
    print(f"GAE / GRPO (ours)         {gae_over_grpo:.3f}   (median of per-round ratios; the GRPO step "
          f"takes {1 - 1 / gae_over_grpo:.0%} less time)")

    gen_s = {k: statistics.median(t["gen_synced"] for t in times[k]) for k in ("ours", "trl", "gae")}
    print(f"\ngeneration ({NUM_RESPONSES} x {RESPONSE_LENGTH} tokens), median s: ours {gen_s['ours']:.3f}, "
          f"TRL {gen_s['trl']:.3f}; the rest of the step: ours {med['ours'] - gen_s['ours']:.3f}, "
          f"TRL {med['trl'] - gen_s['trl']:.3f}")
    print("our steps by phase, median s:  grpo     gae")
    for label, keys in PHASES:
        print(f"  {label:<12} {median_phase(times['ours'], keys):16.3f} {median_phase(times['gae'], keys):7.3f}")
    print(f"  {'other':<12} {median_untimed(times['ours']):16.3f} {median_untimed(times['gae']):7.3f}   "
          "(batch building, scoring, advantages, metrics)")
    if r.memory:
        print_memory(r.memory, r.on_gpu)

    def mb(key: str) -> float:
        return r.memory.get(key, {}).get("step_peak_mb", float("nan"))

    print(f"ours_s_per_step={med['ours']:.4f} trl_s_per_step={med['trl']:.4f} ratio={ratio:.3f} "
          f"ours_peak_mb={mb('ours'):.1f} trl_peak_mb={mb('trl'):.1f} gae_s_per_step={med['gae']:.4f} "
          f"gae_over_grpo={gae_over_grpo:.3f} gae_peak_mb={mb('gae'):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=11, help="timed rounds (each times every side once)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--skip-memory", action="store_true", help="skip the three memory subprocesses")
    parser.add_argument("--gpu", action="store_true", help="a model of Qwen2.5-0.5B's shape (random init), bf16 "
                        "autocast, on CUDA (needs a GPU; prepared, not yet run on one)")
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    trl, transformers = start(args.threads, args.gpu)
    # Noise from the libraries, nothing about the work: transformers 5's renames (TRL calls
    # `is_gradient_checkpointing`), and pin_memory on a machine without an accelerator.
    warnings.filterwarnings("ignore", message=".*is deprecated and will be removed in v6.*")
    warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true.*")
    if args.memory_child:
        # One side, then the process exits (TRL's training thread is a daemon).
        print(json.dumps(step_memory(build_side(args.memory_child, args.workdir, args.gpu))))
        return
    result = measure(args, trl, transformers)
    if result is not None:
        print_report(result)


if __name__ == "__main__":
    main()
