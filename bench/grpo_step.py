"""One GRPO step of our trainer (`rlhf.step.train_step`, `algorithm.adv_estimator=grpo`) against TRL's
GRPOTrainer and against the floor (the same model passes done bare), on identical work; with our step's
old-log-prob pass and without it, with the KL panel, and our GAE step (with its critic) beside it.

    python -m venv /tmp/venv-trl116 && /tmp/venv-trl116/bin/pip install torch==2.13.0 -e ".[bench-trl1]"
    /tmp/venv-trl116/bin/python bench/grpo_step.py      # against TRL 1.16; the last line is key=value
    python bench/grpo_step.py --iters 5 --warmup 1 --skip-memory   # as well with the bench extra's TRL
    python bench/grpo_step.py --gpu                      # Qwen2.5-0.5B-shaped model, bf16 autocast, CUDA

The workload, our side, `PhaseTimer`, the counters, the memory probe and the interleaved rounds are
bench/common.py's; the floor is bench/floor.py's `GroupFloorSide`. The work, identical for every side: the
first 8 of the workload's prompts x n=4 = 32 sequences of 64 sampled tokens at temperature 1, never
stopping at EOS; the model as policy and frozen reference; float32 (--gpu: bf16 autocast); one optimizer
step per step over one forward/backward of all 32, so the update is exactly on-policy.
- ours (`group_config`): `rlhf.setup.load_models` (no critic) + `build_setup`, then `rlhf.step.train_step`;
  group-std advantages, k3+ KL in the loss (coef 0.05, none in the reward), token-mean loss, clip 0.2,
  grad clip 1.0, fused AdamW at lr 3e-6 constant, rollout.ignore_eos=true, trainer.log_kl_panel=false.
  Rows: "ours" (actor.recompute_old_logprobs=auto: the update's own detached log-probs are the old ones,
  no old-log-prob pass), "ours, old-log-prob pass" (=always) and "ours, KL panel on" (the trainer's
  default; the panel needs the actor's logits, so the pass runs).
- TRL (`TRLGRPOSide`): `trl.GRPOTrainer` with our GSM8K rule as reward function, the same batch shape,
  beta=0.05 with use_bias_correction_kl=True (1.16's default; TRL's KL is k3 in the loss, times the
  importance ratio in the graph: on-policy its gradient is k3+'s, so ours uses k3+), epsilon 0.2,
  loss_type "dapo" (the same token mean over the one mini-batch), scale_rewards "group", the same
  optimizer settings; bf16 and activation checkpointing off unless --gpu (its configs default them on).
  With one optimizer step per generation it also skips the old-log-prob forward.
- floor: the sampling loop (`torch.multinomial`), the reference forward, one forward+backward, AdamW.
- ours gae: bench/ppo_step.py's PPO settings (critic, GAE, k3 in the reward) on the same 32 sequences.
Differences left (said in the output): TRL masks EOS while sampling (min_new_tokens), ours samples it and
ignores it; group std + 1e-4 (TRL) vs + 1e-6 (ours); ours keeps the sampler's log-probs on float32
(rollout.logprobs_from_sampler's default) and logs their mismatch; TRL shuffles the batch and runs its
Trainer loop (callbacks, logging).

Timing: by default each row in a fresh process of its own, stepped from this one a side at a time
(`--shared-process`: all in this one process), interleaved round by round (the order rotates) after warm-up,
medians over `--iters` rounds; the OpenMP settings are the environment's, printed with the mode. TRL: `trainer.train()` runs in a helper thread that a callback parks at every
`on_step_end`; one timed step is one iteration of its training loop, from the thread's release to the next
`on_step_end`, with its phases from wrappers around `policy.generate`, `_get_per_token_logps_and_entropies`
(reference / old-policy forwards) and `_prepare_inputs` (the whole rollout: generation, reward, reference,
advantages). Ours: `rlhf.step.train_step`'s own timer. Before timing, one step per side is checked: 64 decoding
steps, one optimizer step per optimizer, 32 sequences in every policy forward, the KL where it belongs, the
old-log-prob pass only where configured. Peak memory of a step, per side in a fresh subprocess, as
bench/common.py says (not the models or optimizer state; the resident size before the steps shows GAE's critic).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import warnings

# bench/common.py first: it sets the environment before torch loads.
from common import (GROUP_PROMPTS, KL_COEF, LR, N, NUM_RESPONSES, PHASES, PROMPT_WIDTH, RESPONSE_LENGTH, OursSide,
                    OursVariant, PhaseTimer, build_workload, count_optimizer_steps, forward_batch_sizes,
                    interleaved_rounds, load_group_workload, load_line, measure_memory, median_phase, median_untimed,
                    our_config, paired, print_versions_and_load, serve_side, side_processes, start, step_memory)

from floor import GroupFloorSide
from trl_grpo import TRLGRPOSide

# ----------------------------------------------------------------------------- ours


def group_config(workdir: str, estimator: str, log_kl_panel: bool, gpu: bool, recompute: str = "auto"):
    """bench/common.py's config of our side (model, lengths, temperature, lr, clips, ignore_eos, seed,
    precision) with this workload's batch shape; for grpo the KL moves from the reward into the loss (k3+)."""
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
                      "actor.use_kl_loss=true", "actor.kl_loss_type=k3+", f"actor.kl_loss_coef={KL_COEF}"]
    cfg = our_config(workdir, log_kl_panel, gpu, recompute)
    for item in overrides:
        key, _, value = item.partition("=")
        set_value(cfg, key, yaml.safe_load(value), text=value)
    validate(cfg)
    return cfg


class OursGroupSide(OursSide):
    """bench/common.py's `OursSide` on this workload, grpo (no critic) or gae (critic, as ppo_step's PPO step);
    `step()` runs with the KL panel off and actor.recompute_old_logprobs=auto, `variant(name)` otherwise."""

    def __init__(self, workdir: str, estimator: str, gpu: bool):
        _, tokenizer, prompts = load_group_workload(workdir)
        self.estimator = estimator
        super().__init__(f"ours {estimator}", group_config(workdir, estimator, True, gpu),
                         group_config(workdir, estimator, False, gpu), tokenizer, prompts)
        self.cfg_always = group_config(workdir, estimator, False, gpu, recompute="always")

    def step(self, log_kl_panel: bool = False, timer: PhaseTimer | None = None, cfg=None) -> dict[str, float]:
        return super().step(log_kl_panel, timer, cfg)

    def variant(self, name: str, cfg) -> OursVariant:
        return OursVariant(self, name, cfg)

    def describe(self) -> str:
        opts = self.torch_optimizers
        return (f"{type(opts[0]).__name__}(fused={opts[0].defaults.get('fused')}) x{len(opts)} "
                f"({'actor, critic' if len(opts) == 2 else 'actor; no critic built'})")

    def check(self, cfg=None, pass_expected: bool = False) -> dict:
        """One step with `cfg`: RESPONSE_LENGTH decoding steps, one optimizer step per model, NUM_RESPONSES
        sequences in every actor forward, the KL where it belongs, a critic only for gae, and the old-log-prob
        pass only where `pass_expected`."""
        optimizer_steps, sizes = [], []
        timer = PhaseTimer(self.actor)
        opts = self.torch_optimizers
        with count_optimizer_steps(opts, optimizer_steps), forward_batch_sizes(self.actor, sizes):
            self.step(timer=timer, cfg=cfg)
        who = f"{self.name} ({(cfg or self.cfg_minimal).actor.recompute_old_logprobs})"
        assert timer.decode_steps == [RESPONSE_LENGTH], f"{who} ran {timer.decode_steps} decoding steps"
        assert optimizer_steps == [1] * len(opts), f"{who} took {optimizer_steps} optimizer steps"
        assert set(sizes) == {NUM_RESPONSES}, f"{who}: actor forwards of batch sizes {sorted(set(sizes))}"
        assert (self.models[1] is None) == (self.estimator == "grpo"), f"{who}: critic {self.models[1]!r}"
        assert ("old_log_prob" in timer.seconds) == pass_expected, f"{who}: phases {sorted(timer.seconds)}"
        if self.estimator == "grpo":
            assert "actor/kl_loss" in self.last_metrics and "actor/reward_kl_penalty" not in self.last_metrics
        else:
            assert "actor/reward_kl_penalty" in self.last_metrics and "critic/vf_loss" in self.last_metrics
        return {"policy_forwards": len(sizes), "optimizer_steps": optimizer_steps}


# ----------------------------------------------------------------------------- measuring


SIDES = ("trl", "ours", "gae")  # what a memory subprocess can measure (--memory-child)
ROWS = {"trl": "TRL GRPOTrainer", "ours": "ours grpo", "always": "ours grpo, old-log-prob pass",
        "panel": "ours grpo, KL panel on", "gae": "ours gae (critic)", "floor": "floor (bare passes)"}


def build_side(name: str, workdir: str, gpu: bool):
    """One of SIDES: TRL's GRPOTrainer, our grpo step or our gae step."""
    if name == "trl":
        return TRLGRPOSide(workdir, gpu)
    return OursGroupSide(workdir, "grpo" if name == "ours" else "gae", gpu)


@dataclasses.dataclass
class Result:
    """What the timed rounds and the memory subprocesses measured."""

    times: dict[str, list[dict[str, float]]]  # ROWS key -> per round: "step", each phase's s, "gen_synced"
    memory: dict[str, dict[str, float]]  # SIDES -> common.step_memory's fields; empty: --skip-memory
    on_gpu: bool
    shared_process: bool  # all sides in one process (--shared-process), else one process per side
    load: tuple[str, str]  # /proc/loadavg's three averages as the rounds began and as they ended


def ours_about(side: OursGroupSide, check: dict) -> dict:
    """What the report prints about one of our sides: its optimizers, model and check."""
    return {"name": side.name, "optimizer": side.describe(), "vocab": side.models[0].config.vocab_size,
            "num_params": sum(p.numel() for p in side.models[0].parameters()), "device": str(side.accelerator.device),
            "check": check}


def open_row(key: str, workdir: str, gpu: bool):
    """One of ROWS built and checked alone (in a side's own process): (side, what the report prints about it).
    TRL's side holds a training thread: close() it when done."""
    if key == "trl":
        side = TRLGRPOSide(workdir, gpu)
        return side, {"name": side.name, "optimizer": side.describe(), "check": side.check()}
    if key == "floor":
        side = GroupFloorSide(workdir, gpu)
        return side, {"name": side.name}
    ours = OursGroupSide(workdir, "gae" if key == "gae" else "grpo", gpu)
    if key == "gae":  # float32: the sampler's log-probs serve, no pass
        return ours, ours_about(ours, ours.check(pass_expected=ours.accelerator.mixed_precision != "no"))
    cfg = {"ours": None, "always": ours.cfg_always, "panel": ours.cfg_panel}[key]
    check = ours.check(cfg, pass_expected=key != "ours")
    return (ours if key == "ours" else ours.variant(ROWS[key], cfg)), ours_about(ours, check)


def print_setup(trl, transformers, about: dict, prompts: dict, gpu: bool, shared_process: bool) -> None:
    """What the timing is taken under: mode, versions, machine, workload, optimizers, what was checked."""
    ours = about["ours"]
    print_versions_and_load(trl, transformers, gpu, shared_process)
    print(f"workload: Qwen2 {ours['num_params'] / 1e6:.2f}M parameters (vocab {ours['vocab']}), "
          f"{GROUP_PROMPTS} prompts x n={N} = {NUM_RESPONSES} sequences, prompts left-padded to "
          f"{PROMPT_WIDTH} tokens (lengths {sorted(map(len, prompts['input_ids']))}), {RESPONSE_LENGTH} "
          f"sampled tokens at temperature 1, one optimizer step per step, KL in the loss (coef {KL_COEF}: "
          f"ours k3+, TRL k3 x ratio), lr {LR}, {'bf16 autocast over float32 weights' if gpu else 'float32'}, "
          f"on {ours['device']}")
    trl_check, ours_check, gae_check = (about[k]["check"] for k in ("trl", "ours", "gae"))
    print(f"optimizers: TRL {about['trl']['optimizer']}; ours grpo {ours['optimizer']}; ours gae "
          f"{about['gae']['optimizer']}")
    print(f"checked, one step each: {RESPONSE_LENGTH} decoding steps, {NUM_RESPONSES} sequences per policy "
          f"forward, no old-log-prob forward (TRL, ours grpo), one with recompute_old_logprobs=always or the "
          f"KL panel; policy forwards per step: TRL {trl_check['policy_forwards']}, ours grpo "
          f"{ours_check['policy_forwards']}, ours gae {gae_check['policy_forwards']}; optimizer steps: TRL "
          f"{trl_check['optimizer_steps']}, ours grpo {ours_check['optimizer_steps']}, ours gae "
          f"{gae_check['optimizer_steps']} (actor, critic)")
    print("differences left: TRL masks EOS while sampling (min_new_tokens), ours samples it and ignores it; "
          "group std + 1e-4 (TRL) vs + 1e-6 (ours); ours keeps the sampler's log-probs (float32) and logs "
          "their mismatch with the update's.")


@contextlib.contextmanager
def shared_sides(workdir: str, gpu: bool):
    """--shared-process: every row in this process, the grpo variants on one set of models; yields
    (sides, about) and stops TRL's training thread on exit."""
    trl_side = TRLGRPOSide(workdir, gpu)
    try:
        ours, gae = OursGroupSide(workdir, "grpo", gpu), OursGroupSide(workdir, "gae", gpu)
        sides = [("trl", trl_side), ("ours", ours), ("always", ours.variant(ROWS["always"], ours.cfg_always)),
                 ("panel", ours.variant(ROWS["panel"], ours.cfg_panel)), ("gae", gae),
                 ("floor", GroupFloorSide(workdir, gpu))]
        about = {"trl": {"name": trl_side.name, "optimizer": trl_side.describe(), "check": trl_side.check()},
                 "ours": ours_about(ours, ours.check())}
        ours.check(ours.cfg_always, pass_expected=True)
        ours.check(ours.cfg_panel, pass_expected=True)
        about["gae"] = ours_about(gae, gae.check(pass_expected=gae.accelerator.mixed_precision != "no"))
        yield sides, about
    finally:
        trl_side.close()


def measure(args, trl, transformers) -> Result | None:
    """Build the workload and the sides (each in its own process, or all in this one with --shared-process),
    check one step of each, run the interleaved rounds, then measure memory (one subprocess per side). None for
    --iters 0."""
    script = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as workdir:
        build_workload(workdir, args.gpu)
        _, tokenizer, prompts = load_group_workload(workdir)
        with (shared_sides(workdir, args.gpu) if args.shared_process
              else side_processes(script, ROWS, workdir, args.threads, args.gpu)) as opened:
            sides, about = opened if args.shared_process else (opened, {k: side.about for k, side in opened})
            print_setup(trl, transformers, about, prompts, args.gpu, args.shared_process)
            load_start = load_line()
            times = interleaved_rounds(sides, args.warmup, args.iters)
            load_end = load_line()
        memory = {} if args.skip_memory else {k: measure_memory(script, k, workdir, args.threads, args.gpu)
                                              for k in SIDES}
    if not args.iters:
        return None
    return Result(times, memory, about["ours"]["device"].startswith("cuda"), args.shared_process,
                  (load_start, load_end))


# ----------------------------------------------------------------------------- printing


def print_memory(memory: dict[str, dict[str, float]], on_gpu: bool) -> None:
    """Each side's peak memory of a step, from its subprocess, and the ratios: ours/TRL, GAE/GRPO."""
    def mb(key: str, field: str = "step_peak_mb") -> float:
        return memory[key][field]

    what = ("torch.cuda.max_memory_allocated over 2 steps after a warm-up one, minus what was allocated "
            "before them" if on_gpu else "peak RSS over 2 steps after a warm-up one, minus RSS before them")
    print(f"\npeak memory of a step ({what}; one fresh process per side):")
    for key in SIDES:
        print(f"  {ROWS[key]:<18} {mb(key):7.1f} MB   (peak {mb(key, 'peak_rss_mb'):.0f} MB, "
              f"before the steps {mb(key, 'rss_before_mb'):.0f} MB)")
    critic_mb = mb("gae", "rss_before_mb") - mb("ours", "rss_before_mb")
    print(f"memory ours/TRL {mb('ours') / mb('trl'):.2f} (target <= 1); GAE/GRPO: a step's peak "
          f"{mb('gae') / mb('ours'):.2f}x, resident before the steps {critic_mb:+.0f} MB "
          "(the critic's weights, gradients and AdamW state)")


def print_report(r: Result) -> None:
    """Every round, the medians, the ratios against their targets, the phases, memory, a key=value line."""
    times = r.times
    med = {k: statistics.median(t["step"] for t in v) for k, v in times.items()}
    ratio, overhead = paired(times, "ours", "trl"), paired(times, "ours", "floor")
    saving, gae_over_grpo = 1 - 1 / paired(times, "always", "ours"), paired(times, "gae", "ours")
    print(f"\nstep time, median of {len(times['ours'])} (min); "
          f"{'all sides in one process' if r.shared_process else 'each side in its own process'}; load average "
          f"{r.load[0]} at the start of the rounds, {r.load[1]} at the end")
    for key, name in ROWS.items():
        print(f"  {name:<30} {med[key]:7.3f} s  ({min(t['step'] for t in times[key]):.3f})")
    print(f"ratio ours/TRL            {ratio:.3f}   (target <= 0.80; median of per-round ratios; ratio of medians "
          f"{med['ours'] / med['trl']:.3f}); with the old-log-prob pass {paired(times, 'always', 'trl'):.3f}")
    print(f"overhead ours/floor       {overhead:.3f}   (target <= 1.05; ratio of medians "
          f"{med['ours'] / med['floor']:.3f})")
    low = {k: min(t["step"] for t in v) for k, v in times.items()}  # the load only adds time
    print(f"ratios of the fastest steps: ours/TRL {low['ours'] / low['trl']:.3f}, ours/floor "
          f"{low['ours'] / low['floor']:.3f}, with the old-log-prob pass/TRL {low['always'] / low['trl']:.3f}")
    print(f"old-log-prob pass skipped {saving:.1%} of the step with it (per-round); KL panel on / off "
          f"{paired(times, 'panel', 'ours'):.3f}; GAE / GRPO {gae_over_grpo:.3f}")
    cpu = {k: statistics.median(t["cpu_s"] for t in v) for k, v in times.items()}
    cpu_ratio, cpu_overhead = paired(times, "ours", "trl", "cpu_s"), paired(times, "ours", "floor", "cpu_s")
    if not r.on_gpu:  # on a GPU the CPU time is not the work
        print("CPU time of a step (the process's, all threads), median s: "
              + ", ".join(f"{k} {cpu[k]:.3f}" for k in ROWS))
        print(f"  per-round ratios: ours/TRL {cpu_ratio:.3f}, ours/floor {cpu_overhead:.3f}, with the old-log-prob "
              f"pass/TRL {paired(times, 'always', 'trl', 'cpu_s'):.3f}, pass skipped "
              f"{1 - 1 / paired(times, 'always', 'ours', 'cpu_s'):.1%}")

    print("\nby phase, median s (TRL's update: the step after its rollout, with its Trainer loop; other: "
          "batch building, scoring, advantages, metrics):\n" + " " * 24 + "".join(f"{k:>8}" for k in ROWS))
    for label, keys in [*PHASES, ("other", None)]:
        print(f"  {label:<21} " + "".join(f"{median_phase(times[k], keys) if keys else median_untimed(times[k]):8.3f}"
                                          for k in ROWS))
    if r.memory:
        print_memory(r.memory, r.on_gpu)

    def mb(key: str) -> float:
        return r.memory.get(key, {}).get("step_peak_mb", float("nan"))

    print(f"ours_s_per_step={med['ours']:.4f} trl_s_per_step={med['trl']:.4f} ratio={ratio:.3f} "
          f"overhead={overhead:.3f} always_s_per_step={med['always']:.4f} pass_saving={saving:.3f} "
          f"ours_peak_mb={mb('ours'):.1f} trl_peak_mb={mb('trl'):.1f} gae_s_per_step={med['gae']:.4f} "
          f"gae_over_grpo={gae_over_grpo:.3f} gae_peak_mb={mb('gae'):.1f} cpu_ratio={cpu_ratio:.3f} "
          f"cpu_overhead={cpu_overhead:.3f} mode={'shared-process' if r.shared_process else 'process-per-side'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=11, help="timed rounds (each times every side once)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads in every process (default: "
                        "torch's own, from OMP_NUM_THREADS or the cores)")
    parser.add_argument("--shared-process", action="store_true", help="every side in this one process (for a "
                        "loaded machine, where process switches add noise); default: one fresh process per side")
    parser.add_argument("--skip-memory", action="store_true", help="skip the three memory subprocesses")
    parser.add_argument("--gpu", action="store_true", help="a model of Qwen2.5-0.5B's shape (random init), bf16 "
                        "autocast, on CUDA (needs a GPU; prepared, not yet run on one)")
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--memory-child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--side-child", choices=tuple(ROWS), help=argparse.SUPPRESS)
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
    if args.side_child:
        side, about = open_row(args.side_child, args.workdir, args.gpu)
        try:
            serve_side(side, about)
        finally:
            if hasattr(side, "close"):  # TRL's training thread
                side.close()
        return
    result = measure(args, trl, transformers)
    if result is not None:
        print_report(result)


if __name__ == "__main__":
    main()
