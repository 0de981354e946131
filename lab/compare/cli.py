"""Compare KL estimators x placements over seeds: run a grid of train.py runs, then report from their metrics.jsonl.

The command line of `python -m lab.compare` (examples in the package docstring; the paragraph above is
`--help`'s description): check every run's config before the first one starts, run the grid, write the
report.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lab.compare.grid import (DEFAULT_GRID, GRIDS, GRPO_GRID, REGIMES, Arm, grid_jobs, run_dir, run_grid, run_key,
                               run_overrides, seed_list, shared_overrides)
from lab.compare.landing import LANDING_GRID, VARIANTS, landing_report, run_all, variant_dir
from lab.compare.report import write_report
from rlhf.config import ConfigError, load_config


DEFAULT_JOBS = min(2, os.cpu_count() or 1)
LANDING_TASKS = ("bandit", "tree")  # --grid bandit | tree: the synthetic tasks, lab/compare/landing.py


def _regimes_text() -> str:
    """`separating (coefficient 0.1, 20 steps, actor.lr=2e-4), small (...)` for --help."""
    parts = []
    for name, regime in REGIMES.items():
        coef = "the config's coefficient" if regime.kl_coef is None else f"coefficient {regime.kl_coef}"
        runs = [f"runs {' '.join(regime.runs)}"] if regime.runs else []
        parts.append(f"{name} ({', '.join([coef, f'{regime.steps} steps', *regime.overrides, *runs])})")
    return "; ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    """The options of `python -m lab.compare`."""
    parser = argparse.ArgumentParser(
        prog="python -m lab.compare", description=__doc__.split("\n\n")[0],
        epilog=f"grid ppo, the default ({len(DEFAULT_GRID)} runs, configs/tiny.yaml): {' '.join(DEFAULT_GRID)}\n"
               f"grid grpo ({len(GRPO_GRID)} runs, configs/tiny_grpo.yaml): {' '.join(GRPO_GRID)}\n"
               "estimators: any of train.py's (k1/kl, k2/mse, k3/low_var_kl, abs, X+, full).\n"
               f"regimes: {_regimes_text()}\n"
               "every run: rollout.paired_noise=true (same seed -> same sampling noise: paired runs).\n"
               "report: the claims first (each a paired difference over seeds with its 95% interval, and the\n"
               "verdict), then per run the mean over seeds with its 95% interval (Student t) of the exact and\n"
               "forward KL, the final val/accuracy, the mean reward and each estimator's bias; differences to\n"
               "no-kl are paired (per seed, then over seeds) and resolved when that interval excludes 0\n"
               "(see kl_estimators.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    grid = parser.add_argument_group("the grid")
    grid.add_argument("--grid", choices=(*GRIDS, *LANDING_TASKS), default="ppo",
                      help="which default runs, config and output dir: ppo (GAE with a critic, configs/tiny.yaml) "
                           "or grpo (configs/tiny_grpo.yaml); see below; bandit or tree: every estimator x "
                           "placement under rloo, grpo and gae on configs/<task>.yaml, against where the "
                           "analysis says each lands (lab/compare/landing.py) (default: %(default)s)")
    grid.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                      help="--grid bandit/tree: the advantage estimators to run (default: all)")
    grid.add_argument("--runs", nargs="+", metavar="RUN", default=None,
                      help="runs to make, each reward:<estimator>, loss:<estimator>, loss-corrected:<estimator> "
                           "or no-kl (default: the grid's, below)")
    grid.add_argument("--config", default=None, help="base config (default: the grid's)")
    grid.add_argument("--regime", choices=REGIMES, default=None,
                      help="how far the runs move from pi_ref: the coefficient, steps and overrides below "
                           "(default: the grid's, separating for ppo, small for grpo)")
    grid.add_argument("--steps", type=int, default=None,
                      help="PPO steps per run, trainer.total_steps (default: the regime's)")
    grid.add_argument("--kl-coef", type=float, default=None,
                      help="the one KL coefficient, used for algorithm.kl_ctrl.kl_coef and actor.kl_loss_coef "
                           "(default: the regime's, else the config's algorithm.kl_ctrl.kl_coef)")
    grid.add_argument("--seed", type=int, default=None,
                      help="trainer.seed of every run, the first one with --seeds (default: the config's)")
    grid.add_argument("--seeds", type=int, default=1, metavar="N",
                      help="run each grid point with N seeds: S, S+1, ..., S+N-1, S being --seed (or the "
                           "config's trainer.seed); N > 1 puts seed s of a run in <output-dir>/<run>/seed<s>/ "
                           "and takes N times as long (default: %(default)s, the layout <output-dir>/<run>/)")
    grid.add_argument("overrides", nargs="*", metavar="key=value",
                      help="extra train.py overrides applied to every run, e.g. data.train_batch_size=32")
    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", default=None,
                     help="runs go to <dir>/<run>/ (<dir>/<run>/seed<s>/ with --seeds N > 1), the report to "
                          "<dir>/kl_estimators.{png,md} (default: the grid's, outputs/kl_estimators[_grpo])")
    out.add_argument("--cache-dir", default=None,
                     help="trainer.cache_dir shared by all runs (default: the config's, else <output-dir>/cache)")
    out.add_argument("--group", default=None, help="wandb group of the runs (default: kl-estimators-<date-time>)")
    out.add_argument("--offline", action="store_true", help="wandb offline even with credentials (WANDB_MODE=offline)")
    out.add_argument("--no-wandb", action="store_true", help="no wandb at all (trainer.logger=none)")
    out.add_argument("--jobs", type=int, default=DEFAULT_JOBS, metavar="J",
                     help="runs at a time, each with 1/J of the CPU threads (OMP_NUM_THREADS, unless set); "
                          "the tiny model's small matrices keep two threads from halving a step, so two runs "
                          "of one thread finish sooner (default: %(default)s, min(2, CPUs))")
    out.add_argument("--skip-done", action="store_true",
                     help="keep runs (each seed's) in <output-dir> that already finished")
    out.add_argument("--report-only", metavar="DIR",
                     help="run nothing; redraw the report from the runs under DIR (one seed or several)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m lab.compare` with `argv` (None: sys.argv[1:]). Returns the exit code: 0, 1 if a run
    failed (the others and the report still made), 2 for a bad run name, seed count or config."""
    args = build_parser().parse_args(argv)
    if args.grid in LANDING_TASKS:
        return landing_main(args)
    grid = GRIDS[args.grid]
    regime = REGIMES[args.regime or grid.regime]
    args.runs = list(regime.runs or grid.runs) if args.runs is None else args.runs
    args.config = args.config or grid.config
    args.output_dir = args.output_dir or regime.output_dir or grid.output_dir
    args.steps = regime.steps if args.steps is None else args.steps
    if args.report_only:
        png, md = write_report(args.report_only)
        print(f"report: {png}\n        {md}")
        return 0

    # `--runs a b key=value` would swallow the overrides; run names never hold "=", so take them back.
    args.overrides += [text for text in args.runs if "=" in text]
    try:
        arms = [Arm.parse(text) for text in args.runs if "=" not in text]
        base = load_config(args.config, args.overrides)
        seeds = seed_list(base.trainer.seed if args.seed is None else args.seed, args.seeds)
        if args.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {args.jobs}.")
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kl_coef = args.kl_coef if args.kl_coef is not None else (
        regime.kl_coef if regime.kl_coef is not None else base.algorithm.kl_ctrl.kl_coef)
    group = args.group or f"kl-estimators-{time.strftime('%Y%m%d-%H%M%S')}"
    output_dir = os.path.abspath(args.output_dir)
    cache_dir = os.path.abspath(args.cache_dir or base.trainer.cache_dir or os.path.join(output_dir, "cache"))
    config = os.path.abspath(args.config)
    shared = shared_overrides(args.steps, kl_coef, args.seed, group, regime.overrides)
    extra = list(args.overrides) + (["trainer.logger=none"] if args.no_wandb else [])
    try:  # every run's config is checked before the first one starts
        for arm, seed in grid_jobs(arms, seeds):
            load_config(config, run_overrides(arm, output_dir, cache_dir, shared, extra, seed))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = dict(os.environ, **({"WANDB_MODE": "offline"} if args.offline else {}))
    layout = "<run>/" if len(seeds) == 1 else "<run>/seed<s>/"
    print(f"{len(arms)} runs x {args.steps} steps x {len(seeds)} seed(s) ({', '.join(map(str, seeds))}), "
          f"regime {args.regime or grid.regime} (KL coefficient {kl_coef}{''.join(' ' + o for o in regime.overrides)}), "
          f"wandb group {group}\n"
          f"runs in {output_dir}/{layout}, {args.jobs} at a time, embedded cache in {cache_dir}", flush=True)
    start = time.perf_counter()
    os.makedirs(output_dir, exist_ok=True)
    status = run_grid(arms, config, output_dir, cache_dir, shared, extra, args.skip_done, env, seeds, args.jobs)
    print(f"grid finished in {(time.perf_counter() - start) / 60:.1f} min")
    png, md = write_report(output_dir, status)
    print(f"report: {png}\n        {md}")
    failed = [name for name, s in status.items() if s.startswith("failed")]
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0



def landing_main(args) -> int:
    """`--grid bandit` / `--grid tree`: every run of LANDING_GRID (or --runs) under each of --variants, with
    --seeds seeds, then the landing report. Exit codes as main's."""
    config = os.path.join(os.path.dirname(GRIDS["ppo"].config), f"{args.grid}.yaml")
    output_dir = os.path.abspath(args.output_dir or f"outputs/landing_{args.grid}")
    runs = list(LANDING_GRID) if args.runs is None else args.runs
    args.overrides += [text for text in runs if "=" in text]
    try:
        arms = [Arm.parse(text) for text in runs if "=" not in text]
        base = load_config(config, args.overrides)
        seeds = seed_list(base.trainer.seed if args.seed is None else args.seed, args.seeds)
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    variants = args.variants or list(VARIANTS)
    kl_coef = args.kl_coef if args.kl_coef is not None else base.algorithm.kl_ctrl.kl_coef
    cache_dir = os.path.abspath(args.cache_dir or os.path.join(output_dir, "cache"))
    one_seed = seeds[0] if len(seeds) == 1 else None  # one seed: in the shared overrides (grid_jobs' layout)
    shared = shared_overrides(args.steps, kl_coef, one_seed, args.group or f"landing-{args.grid}")
    extra = ["trainer.logger=none", *args.overrides] if args.no_wandb else list(args.overrides)
    try:  # every run's config is checked before the first one starts
        for variant in variants:
            for arm, seed in grid_jobs(arms, seeds):
                load_config(config, run_overrides(arm, variant_dir(output_dir, variant), cache_dir, shared,
                                                  [*VARIANTS[variant], *extra], seed))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(arms)} runs x {len(variants)} advantage estimators ({', '.join(variants)}) x {len(seeds)} "
          f"seed(s), KL coefficient {kl_coef}, in {output_dir}, {args.jobs} at a time", flush=True)
    jobs = []
    for variant in variants:
        for arm, seed in grid_jobs(arms, seeds):
            directory = run_dir(variant_dir(output_dir, variant), arm, seed)
            overrides = run_overrides(arm, variant_dir(output_dir, variant), cache_dir, shared,
                                      [*VARIANTS[variant], *extra], seed)
            jobs.append((f"{variant} {run_key(arm.name, seed)}", config, overrides, directory))
    start = time.perf_counter()
    status = run_all(jobs, args.jobs)
    print(f"grid finished in {(time.perf_counter() - start) / 60:.1f} min")
    print(landing_report(output_dir, seeds, args.grid, [arm.name for arm in arms]))
    failed = [name for name, s in status.items() if s.startswith("failed")]
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
