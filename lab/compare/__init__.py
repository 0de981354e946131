"""Compare KL estimators x placements over seeds: run a grid of train.py runs, then report from their metrics.jsonl.

    python -m lab.compare                                     # the default grid on configs/tiny.yaml, one seed
    python -m lab.compare --seeds 3                           # each run with seeds S, S+1, S+2 (S: --seed)
    python -m lab.compare --seeds 3 --regime small            # coefficient 0.01 at the config's learning rate
    python -m lab.compare --runs no-kl reward:k1 loss:k3+ --steps 3
    python -m lab.compare --report-only outputs/kl_estimators # redraw the report from runs on disk
    wandb sweep configs/sweeps/kl_estimators.yaml              # the grid (one seed) through W&B, then `wandb agent`

A run is named like the trainer's wandb tag: `reward:<estimator>` (KL in the reward), `loss:<estimator>`
(KL in the actor loss), `loss-corrected:<estimator>` (the KL loss with the off-policy correction) or `no-kl`.

The modules, in the order a comparison uses them:
    labels   a run's label <-> the trainer overrides of its KL (also train.py's wandb tags)
    grid     the grids and regimes, each run's overrides and directory (one seed or several), the runner
    runs     the runs read back from their metrics.jsonl and config.yaml, grouped by label over seeds
    stats    a mean over seeds and its 95% Student t interval; paired differences, when they resolve
    claims   what training can show of docs/kl.md's claims, each judged on a paired difference
    figure   the report's figure, <output-dir>/kl_estimators.png
    report   the claims table and the per-run table, <output-dir>/kl_estimators.md, and the figure
    cli      the command line (`python -m lab.compare --help`)
The names below are theirs, re-exported: `from lab import compare; compare.main([...])`.
"""

from lab.compare.claims import LAST_STEPS, Claim, claims, claims_table
from lab.compare.cli import build_parser, main
from lab.compare.figure import mean_curve, paired_curve, plot_report
from lab.compare.grid import (DEFAULT_CONFIG, DEFAULT_GRID, GRIDS, GRPO_GRID, PAIRED_NOISE, REGIMES, Arm, Grid,
                               Regime, grid_jobs, job_env, last_step, run_dir, run_grid, run_key, run_overrides,
                               seed_list, shared_overrides, warm_start_cached)
from rlhf.labels import PLACEMENTS, kl_overrides, kl_tags, legend_name, parse_kl_tag, run_label
from lab.compare.report import OUTCOMES, REPORT_NAME, difference_cell, interval_cell, report_table, write_report
from lab.compare.runs import Group, Run, duplicate_seeds, group_runs, load_runs
from rlhf.stats import (MAX_SEEDS_ESTIMATE, T95, Estimate, excludes_zero, paired_differences, seeds_needed,
                                t95)

__all__ = [
    "LAST_STEPS", "Claim", "claims", "claims_table",
    "build_parser", "main",
    "mean_curve", "paired_curve", "plot_report",
    "DEFAULT_CONFIG", "DEFAULT_GRID", "GRIDS", "GRPO_GRID", "PAIRED_NOISE", "REGIMES", "Arm", "Grid", "Regime",
    "grid_jobs", "last_step", "run_dir", "run_grid", "run_key", "run_overrides", "seed_list", "shared_overrides",
    "PLACEMENTS", "kl_overrides", "kl_tags", "legend_name", "parse_kl_tag", "run_label",
    "OUTCOMES", "REPORT_NAME", "difference_cell", "interval_cell", "report_table", "write_report",
    "Group", "Run", "duplicate_seeds", "group_runs", "load_runs",
    "MAX_SEEDS_ESTIMATE", "T95", "Estimate", "excludes_zero", "paired_differences", "seeds_needed", "t95",
]
