"""LoRA against full fine-tuning on the embedded default: PPO step time and peak memory, in one run.

    python bench/lora_step.py                                  # configs/tiny.yaml against configs/tiny_lora.yaml
    python bench/lora_step.py --steps 6 trainer.cache_dir=/work/cache

Each side runs in a fresh process of its own (the peak resident set size, `ru_maxrss`, only ever grows within a
process): the trainer's own set-up (`rlhf.setup.setup`, the embedded default from trainer.cache_dir), one
untimed step, then `--steps` steps of `rlhf.step.train_step`, timed. It prints, per side, the parameters that
train, the optimizer's state (AdamW's two float32 moments per trained parameter), the median step time and
the process's peak RSS. The sides alternate (full, LoRA, full, LoRA, ...) `--rounds` times so that a change in
the machine's load hits both; the medians are over all rounds' steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SIDES = {"full": "configs/tiny.yaml", "lora": "configs/tiny_lora.yaml"}


def child(config: str, steps: int, overrides: list[str]) -> dict:
    """One side in this process: set up, one untimed step, `steps` timed steps."""
    import torch
    from accelerate import Accelerator

    from rlhf.config import load_config
    from rlhf.setup import setup
    from rlhf.step import plan_step, train_step
    from rlhf.tracking import Timer

    cfg = load_config(config, ["trainer.logger=none", "trainer.output_dir=/tmp/lora_step_bench", *overrides])
    accelerator = Accelerator(cpu=True)
    run = setup(cfg, accelerator)
    plan = plan_step(cfg, accelerator.mixed_precision)
    times = []
    for step in range(1, steps + 2):
        start = time.perf_counter()
        train_step(cfg, plan, accelerator, run, step, Timer())
        if step > 1:
            times.append(time.perf_counter() - start)
    actor, critic, _ = run.models
    trained = sum(p.numel() for m in (actor, critic) if m is not None for p in m.parameters() if p.requires_grad)
    moments = sum(t.numel() * t.element_size() for opt in run.optimizers if opt is not None
                  for state in opt.state.values() for t in state.values() if torch.is_tensor(t) and t.dim())
    return {"times": times, "trained": trained, "optimizer_mib": moments / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two sides")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides for both sides")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.steps, args.overrides)), flush=True)
        return
    results = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side, config in SIDES.items():
            out = subprocess.run([sys.executable, __file__, "--child", config, "--steps", str(args.steps),
                                  *args.overrides], capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
            line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
            results[side].append(json.loads(line.removeprefix("RESULT ")))
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.rounds} rounds x {args.steps} steps")
    print("| side | config | trained parameters | optimizer state (MiB) | median step (s) | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|")
    for side, rounds in results.items():
        times = [t for r in rounds for t in r["times"]]
        print(f"| {side} | {SIDES[side]} | {rounds[0]['trained']:,} | {rounds[0]['optimizer_mib']:.2f} | "
              f"{statistics.median(times):.2f} | {max(r['peak_rss_mib'] for r in rounds):.0f} |")


if __name__ == "__main__":
    main()
