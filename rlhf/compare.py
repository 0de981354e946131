"""Compare KL estimators x placements over seeds: run a grid of train.py runs, then report from their metrics.jsonl.

    python -m rlhf.compare                                     # the default grid on configs/tiny.yaml, one seed
    python -m rlhf.compare --seeds 3                           # each run with seeds S, S+1, S+2 (S: --seed)
    python -m rlhf.compare --runs no-kl reward:k1 loss:k3+ --steps 3
    python -m rlhf.compare --report-only outputs/kl_estimators # redraw the report from runs on disk
    wandb sweep configs/sweeps/kl_estimators.yaml              # the grid (one seed) through W&B, then `wandb agent`

A run is named like the trainer's wandb tag: `reward:<estimator>` (KL in the reward), `loss:<estimator>`
(KL in the actor loss), `loss-corrected:<estimator>` (the KL loss with the off-policy correction) or `no-kl`.
Every run gets the same seeds, the same number of steps and the same KL coefficient
(`algorithm.kl_ctrl.kl_coef` and `actor.kl_loss_coef`, with a fixed controller). `--seeds N` gives each run
the seeds S, S+1, ..., S+N-1 (S: `--seed`, else the config's `trainer.seed`). With one seed (the default) a
run writes to `<output-dir>/<run>/` (train.py's output_dir); with N > 1, seed s of a run writes to
`<output-dir>/<run>/seed<s>/`, and the grid goes seed by seed (every run with the first seed, then every run
with the next). A run directory left by an earlier comparison is replaced (kept with `--skip-done` if it
finished), also one in the other layout. The runs go one after another, each a fresh `train.py` process (a
failing run is reported, not fatal), all in one wandb group; wandb runs offline without credentials. They
share `trainer.cache_dir`, so the embedded warm start is built once.

The report reads only `metrics.jsonl` and `config.yaml` of each run (no wandb server needed; either
layout), groups the runs by label (rlhf.config.run_label) over their seeds (those that finished, if any
did), and writes `<output-dir>/kl_estimators.png` and `<output-dir>/kl_estimators.md`. Per label: seeds; the
mean over seeds and its 95% Student t interval (none with one seed) of the final exact KL (`kl/full` at the
last step), the final `val/accuracy`, the mean reward and each estimator's bias; for the first three, the
difference to `no-kl`, marked resolved when the two 95% intervals do not overlap, else with a rough number of
seeds that would resolve it. Bias here is, per step, an estimator's batch mean minus the exact KL (`kl/full`)
on the same sampled tokens (both per-token means in nats), averaged over the steps; the trainer logs every
estimator in every run whatever the run optimises. The figure shows each curve's mean over seeds with its 95%
interval shaded, and every seed's per-step bias.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import yaml

from rlhf.config import ConfigError, from_dict, load_config, run_label
from rlhf.kl import PANEL_ESTIMATORS, canonical, check_estimator
from rlhf.tracking import read_metrics

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_PY = os.path.join(REPO_ROOT, "train.py")
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "tiny.yaml")
# docs/kl.md's comparison: the principled (k1), the GRPO-style (k3) and the exact (full) estimator in the
# reward; every loss form, including the two that should not regularise (k1) or regularise the wrong
# direction (k3); and no KL. configs/sweeps/kl_estimators.yaml holds the same list (a test checks).
DEFAULT_GRID = ("no-kl", "reward:k1", "reward:k3", "reward:full",
                "loss:k1", "loss:k2", "loss:k3", "loss:k3+", "loss:full")
# `--grid grpo`: the same estimators under GRPO (configs/tiny_grpo.yaml), where the KL goes in the loss.
GRPO_GRID = ("no-kl", "loss:k1", "loss:k3", "loss:k3+", "loss:k2", "loss:full")
GRIDS = {"ppo": (DEFAULT_GRID, DEFAULT_CONFIG, "outputs/kl_estimators"),
         "grpo": (GRPO_GRID, os.path.join(REPO_ROOT, "configs", "tiny_grpo.yaml"), "outputs/kl_estimators_grpo")}
# Chosen so the default grid (one seed), warm start included, finishes well within 30 minutes on 2 CPU cores.
# Measured on 2026-11-30 on this project's 2-core CPU machine, nothing else running (README.md, "A real run"
# and the first command's timing): `python -m rlhf.compare --steps 20 --offline`, the 9 runs with the warm
# start already cached, took 10.7 min, i.e. ~71 s per run, of which 20 PPO steps of configs/tiny.yaml at
# ~2.5 s each are ~50 s and starting the process plus the two evaluations ~21 s; building the warm start adds
# ~1.5 min. So ~12 min for the default grid from an empty cache: room for a machine twice as slow or busy.
# `--seeds N` multiplies the grid's part by N. Re-time it when tiny.yaml changes; configs/sweeps/
# kl_estimators.yaml uses the same number (a test checks).
DEFAULT_STEPS = 20
REPORT_NAME = "kl_estimators"  # -> kl_estimators.png, kl_estimators.md
PLACEMENTS = ("reward", "loss", "loss-corrected")


@dataclass(frozen=True)
class Arm:
    """One run of the grid: where the KL goes and which estimator (None for no KL)."""

    placement: str  # "reward" | "loss" | "loss-corrected" (the KL loss with the off-policy correction) | "none"
    estimator: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Arm":
        """`reward:k1`, `loss:k3+`, `loss-corrected:k3` or `no-kl` -> Arm. Raises ValueError naming the valid
        forms."""
        if text == "no-kl":
            return cls("none")
        placement, sep, estimator = text.partition(":")
        if not sep or placement not in PLACEMENTS:
            raise ValueError(f"run {text!r} is not one of reward:<estimator>, loss:<estimator>, "
                             f"loss-corrected:<estimator>, no-kl "
                             f"(e.g. {', '.join(DEFAULT_GRID[:3])}).")
        check_estimator(estimator, allow_full=True)  # raises with the list of valid names
        return cls(placement, estimator)

    @property
    def name(self) -> str:
        """The run's label (rlhf.config.run_label, also its wandb tag): `reward:k1`, `loss:k3+`, `no-kl`."""
        return run_label(load_config(None, self.overrides()))

    @property
    def dirname(self) -> str:
        return self.name.replace(":", "-")

    def overrides(self) -> list[str]:
        """The trainer overrides that put this run's KL where it belongs (and nowhere else)."""
        reward, loss = self.placement == "reward", self.placement in ("loss", "loss-corrected")
        corrected = self.placement == "loss-corrected"
        out = [f"algorithm.use_kl_in_reward={str(reward).lower()}", f"actor.use_kl_loss={str(loss).lower()}",
               f"actor.kl_loss_off_policy_correction={str(corrected).lower()}"]
        if reward:
            out.append(f"algorithm.kl_penalty={self.estimator}")
        if loss:
            out.append(f"actor.kl_loss_type={self.estimator}")
        return out


def shared_overrides(steps: int | None, kl_coef: float, seed: int | None, group: str) -> list[str]:
    """What every run of a comparison has in common: the coefficient in both places (fixed), steps and, with
    one seed, the seed (None: the config's)."""
    out = ["algorithm.kl_ctrl.type=fixed", f"algorithm.kl_ctrl.kl_coef={kl_coef}",
           f"actor.kl_loss_coef={kl_coef}", f"trainer.group={group}"]
    if steps is not None:
        out.append(f"trainer.total_steps={steps}")
    if seed is not None:
        out.append(f"trainer.seed={seed}")
    return out


def seed_list(first: int, count: int) -> list[int]:
    """The seeds of `--seeds count`: first, first + 1, ..., first + count - 1."""
    if count < 1:
        raise ValueError(f"--seeds must be at least 1, got {count}.")
    return [first + i for i in range(count)]


def run_dir(output_dir: str, arm: Arm, seed: int | None = None) -> str:
    """Where a run writes: `<output_dir>/<run>/` with one seed (seed None), `<output_dir>/<run>/seed<seed>/`
    for one seed of several."""
    return os.path.join(output_dir, arm.dirname, *([] if seed is None else [f"seed{seed}"]))


def run_key(label: str, seed: int | None = None) -> str:
    """How the runner's status and the report name a run: `loss:k3`, or `loss:k3 (seed 43)` for one seed of
    several."""
    return label if seed is None else f"{label} (seed {seed})"


def run_overrides(arm: Arm, output_dir: str, cache_dir: str, shared: list[str], extra: list[str],
                  seed: int | None = None) -> list[str]:
    """All overrides of one run, in the order train.py applies them (later wins: `extra` comes last). With
    several seeds, `seed` is this run's: it comes after `extra`, so that a `trainer.seed=` there cannot make
    the seeds equal, and the run goes to its seed's directory (see run_dir)."""
    name = arm.name if seed is None else f"{arm.name}/seed{seed}"  # the wandb run name
    out = [*shared, *arm.overrides(), f"trainer.experiment_name={name}",
           f"trainer.output_dir={run_dir(output_dir, arm, seed)}", f"trainer.cache_dir={cache_dir}", *extra]
    return out + ([] if seed is None else [f"trainer.seed={seed}"])


def grid_jobs(arms: list[Arm], seeds: list[int] | None) -> list[tuple[Arm, int | None]]:
    """The runs to make, as (arm, seed): seed by seed, each with every arm in turn. `seeds` None or one seed:
    [(arm, None), ...], the one-seed layout with the seed in the shared overrides."""
    if seeds is None or len(seeds) == 1:
        return [(arm, None) for arm in arms]
    return [(arm, seed) for seed in seeds for arm in arms]


# ----------------------------------------------------------------------------- running the grid


def run_grid(arms: list[Arm], config: str, output_dir: str, cache_dir: str, shared: list[str],
             extra: list[str], skip_done: bool = False, env: dict | None = None,
             seeds: list[int] | None = None) -> dict[str, str]:
    """Run each arm (with each of `seeds`, if several) as `python train.py --config ... overrides`, in turn.

    Returns {run_key(run name, seed): "ok" | "skipped" | "failed (exit N)"}. Each run's stdout and stderr go
    to `train.log` in its directory (run_dir); a run directory left by an earlier comparison is replaced (its
    old checkpoints would otherwise mix with the new run's), unless `skip_done` and it already reached its
    last step. A one-seed run left in `<output_dir>/<run>/` is removed before that run's seeds start.
    """
    status = {}
    jobs = grid_jobs(arms, seeds)
    for i, (arm, seed) in enumerate(jobs, 1):
        overrides = run_overrides(arm, output_dir, cache_dir, shared, extra, seed)
        total = load_config(config, overrides).trainer.total_steps
        directory, key = run_dir(output_dir, arm, seed), run_key(arm.name, seed)
        if seed is not None:
            _remove_one_seed_run(run_dir(output_dir, arm))
        if skip_done and last_step(directory) == total:
            print(f"[{i}/{len(jobs)}] {key}: already has {total} steps in {directory}, skipped")
            status[key] = "skipped"
            continue
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        print(f"[{i}/{len(jobs)}] {key}: {' '.join(arm.overrides())}  (log: {directory}/train.log)", flush=True)
        status[key] = _train(config, overrides, directory, env)
    return status


def _train(config: str, overrides: list[str], directory: str, env: dict | None) -> str:
    """One train.py process, logging to <directory>/train.log; returns "ok" or "failed (exit N)"."""
    log_path = os.path.join(directory, "train.log")
    command = [sys.executable, TRAIN_PY, "--config", config, *overrides]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n\n")
        log.flush()
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    seconds = time.perf_counter() - start
    if code != 0:
        print(f"    FAILED (exit {code}) after {seconds:.0f}s; last lines of {log_path}:\n" + _tail(log_path),
              flush=True)
        return f"failed (exit {code})"
    final = read_metrics(os.path.join(directory, "metrics.jsonl"))[-1]
    print(f"    done in {seconds:.0f}s: kl/full={final.get('kl/full', float('nan')):.4f} "
          f"val/accuracy={final.get('val/accuracy', float('nan')):.3f}", flush=True)
    return "ok"


def _remove_one_seed_run(directory: str) -> None:
    """Remove a one-seed run's files from <output_dir>/<run>/ (all but its seed<k>/ folders), so that the
    report does not count it as one more seed next to the seed folders."""
    if not os.path.exists(os.path.join(directory, "metrics.jsonl")):
        return
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not (name.startswith("seed") and os.path.isdir(path)):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def last_step(run_dir: str) -> int | None:
    """The last step a run directory's metrics.jsonl reached; None if it has none."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = read_metrics(path) if os.path.exists(path) else []
    return rows[-1]["step"] if rows else None


def _tail(path: str, num_lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join("      " + line for line in f.readlines()[-num_lines:])


# ----------------------------------------------------------------------------- statistics over seeds

# Two-sided 95% critical values of Student's t (its 0.975 quantile) by degrees of freedom: the standard table,
# e.g. NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2, rounded to 3 decimals.
# tests/test_compare.py recomputes each one by integrating the t density.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
       29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
MAX_SEEDS_ESTIMATE = 1000  # seeds_to_resolve looks no further


def t95(df: int) -> float:
    """The two-sided 95% critical value of Student's t with `df` >= 1 degrees of freedom. Between tabulated
    values (30 < df) that of the next smaller tabulated df: slightly too large, so intervals err wide (at most
    ~1%; the limit for df -> infinity is 1.960, df > 120 gets 1.980)."""
    if df < 1:
        raise ValueError(f"Student's t needs at least 1 degree of freedom, got {df}.")
    return T95[max(d for d in T95 if d <= df)]


@dataclass(frozen=True)
class Estimate:
    """One number per seed (a final KL, an accuracy, a mean bias, ...): their mean over seeds and its 95%
    interval, mean ± t95(n - 1) * sd / sqrt(n), with sd the sample standard deviation over the n seeds
    (n - 1 in its denominator). With one seed there is no interval (sd and half_width are None)."""

    values: tuple[float, ...]  # one per seed

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        """The mean over seeds; NaN without values."""
        return statistics.fmean(self.values) if self.values else math.nan

    @property
    def sd(self) -> float | None:
        """The sample standard deviation over seeds (n - 1 in the denominator); None with fewer than 2."""
        return statistics.stdev(self.values) if self.n >= 2 else None

    @property
    def half_width(self) -> float | None:
        """Half the width of the 95% interval of the mean, in the values' unit; None with fewer than 2 seeds."""
        return None if self.sd is None else t95(self.n - 1) * self.sd / math.sqrt(self.n)


def resolved(a: Estimate, b: Estimate) -> bool:
    """Whether the difference of the means of a and b is resolved: both have a 95% interval and the two
    intervals do not overlap, |mean_a - mean_b| > half_width_a + half_width_b."""
    if a.half_width is None or b.half_width is None:
        return False
    return abs(a.mean - b.mean) > a.half_width + b.half_width


def seeds_to_resolve(a: Estimate, b: Estimate) -> int | None:
    """Roughly how many seeds per run would resolve the difference of a and b if its size and the two runs'
    sample sds stayed as observed: the smallest n >= 2 with t95(n - 1) * (sd_a + sd_b) / sqrt(n) < |mean_a -
    mean_b| (the rule of `resolved` with n seeds on both sides; = 2 t sd / sqrt(n) with sd their mean).
    None when it cannot be told: a run with fewer than 2 seeds (no spread) or equal means;
    MAX_SEEDS_ESTIMATE + 1 when more than MAX_SEEDS_ESTIMATE seeds would be needed."""
    if a.sd is None or b.sd is None or a.mean == b.mean:
        return None
    difference, spread = abs(a.mean - b.mean), a.sd + b.sd
    for n in range(2, MAX_SEEDS_ESTIMATE + 1):
        if t95(n - 1) * spread / math.sqrt(n) < difference:
            return n
    return MAX_SEEDS_ESTIMATE + 1


# ----------------------------------------------------------------------------- reading runs back


@dataclass
class Run:
    """One finished (or stopped) train.py run, as read back from its output directory."""

    label: str  # "reward:k1", "loss:k3+", "no-kl" (or "reward:k1 + loss:k2" when both are on)
    path: str
    config: dict
    rows: list[dict]  # metrics.jsonl

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows that logged `key` with a finite value."""
        pairs = [(r["step"], r[key]) for r in self.rows if r.get(key) is not None and math.isfinite(r[key])]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def final(self, key: str) -> float | None:
        """The last finite value of `key` (at the run's last step that logged it); None if it never did."""
        _, values = self.series(key)
        return values[-1] if values else None

    def average(self, key: str) -> float | None:
        """The mean of `key` over the steps that logged it; None if none did."""
        _, values = self.series(key)
        return statistics.fmean(values) if values else None

    def bias(self, estimator: str) -> list[float]:
        """Per step: kl/<estimator> - kl/full (both per-token means over the same sampled tokens, nats)."""
        return [r[f"kl/{estimator}"] - r["kl/full"] for r in self.rows
                if r.get(f"kl/{estimator}") is not None and r.get("kl/full") is not None]

    def mean_bias(self, estimator: str) -> float | None:
        """The bias of `estimator` averaged over the steps (nats per token); None if never logged."""
        values = self.bias(estimator)
        return statistics.fmean(values) if values else None

    @property
    def seed(self) -> int:
        return self.config["trainer"]["seed"]

    @property
    def key(self) -> str:
        """run_key of this run: its label, plus its seed when it sits in a seed<k>/ folder (several seeds)."""
        return run_key(self.label, self.seed if os.path.basename(self.path) == f"seed{self.seed}" else None)

    @property
    def total_steps(self) -> int:
        return self.config["trainer"]["total_steps"]

    @property
    def last_step(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0

    @property
    def complete(self) -> bool:
        return self.last_step >= self.total_steps


def _order(label: str) -> tuple:
    """Report order: no KL, then the reward runs, then the loss runs, each in DEFAULT_GRID order."""
    known = list(DEFAULT_GRID)
    return (known.index(label) if label in known else len(known), label)


def load_runs(directory: str) -> list[Run]:
    """Every train.py run under `directory` (a folder holding metrics.jsonl and config.yaml), at any depth:
    `<run>/` (one seed) and `<run>/seed<k>/` (several) alike. Sorted by label (report order), then seed."""
    runs = []
    for path in sorted(glob.glob(os.path.join(directory, "**", "metrics.jsonl"), recursive=True)):
        run_dir = os.path.dirname(path)
        config_path = os.path.join(run_dir, "config.yaml")
        if not os.path.exists(config_path):
            continue
        with open(config_path) as f:
            config = yaml.safe_load(f)
        runs.append(Run(run_label(from_dict(config)), run_dir, config, read_metrics(path)))
    return sorted(runs, key=lambda r: (_order(r.label), r.seed))


@dataclass
class Group:
    """The runs of one label (one grid point) over its seeds."""

    label: str
    runs: list[Run]  # the seeds the numbers are made from: those that reached their last step (all, if none did)
    stopped: list[Run]  # seeds left out: they stopped early while other seeds of the label finished

    def estimate(self, number: Callable[[Run], float | None]) -> Estimate:
        """`number(run) -> float | None` of each seed (Nones skipped) -> its mean over seeds with interval."""
        return Estimate(tuple(v for v in map(number, self.runs) if v is not None))

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]


def group_runs(runs: list[Run]) -> list[Group]:
    """Runs -> one Group per label, in the order of `runs` (load_runs: report order)."""
    labels = list(dict.fromkeys(r.label for r in runs))
    groups = []
    for label in labels:
        seeds = [r for r in runs if r.label == label]
        complete = [r for r in seeds if r.complete]
        groups.append(Group(label, complete or seeds, [r for r in seeds if not r.complete] if complete else []))
    return groups


def duplicate_seeds(groups: list[Group]) -> list[str]:
    """`label: seed s in dir1, dir2` for each seed that a label has more than once (each copy counts as a seed)."""
    out = []
    for group in groups:
        for seed in sorted({s for s in group.seeds if group.seeds.count(s) > 1}):
            paths = ", ".join(r.path for r in group.runs if r.seed == seed)
            out.append(f"{group.label}: seed {seed} in {paths}")
    return out


# ----------------------------------------------------------------------------- the report


def legend_name(label: str) -> str:
    """`reward:k1` -> `KL in reward: k1`; `no-kl` -> `no KL`."""
    if label == "no-kl":
        return "no KL"
    return " + ".join(f"KL in {part.replace(':', ': ', 1)}" for part in label.split(" + "))


# Colour = estimator (the same in both placements), line style = placement.
_COLOURS = {"k1": "tab:blue", "k2": "tab:orange", "k3": "tab:green", "k3+": "tab:red", "full": "tab:purple",
            "abs": "tab:brown", "k1+": "tab:pink", "abs+": "tab:olive", "k2+": "tab:cyan"}
_STYLES = {"reward": "-", "loss": "--", "loss-corrected": "-."}


def _style(label: str) -> dict:
    if label == "no-kl":
        return dict(color="black", linestyle=":", marker="o")
    placement, _, estimator = label.split(" + ")[0].partition(":")
    return dict(color=_COLOURS.get(canonical(estimator), "tab:gray"), linestyle=_STYLES[placement],
                marker="o" if placement == "reward" else "s")


def mean_curve(runs: list[Run], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """`key` against steps over seeds: (steps, mean, low, high), one entry per step that some seed logged;
    low and high bound the 95% interval of the mean (Estimate), NaN where fewer than 2 seeds logged the step."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for step, value in zip(*run.series(key)):
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    estimates = [Estimate(tuple(by_step[s])) for s in steps]
    half = [math.nan if e.half_width is None else e.half_width for e in estimates]
    return (steps, [e.mean for e in estimates], [e.mean - h for e, h in zip(estimates, half)],
            [e.mean + h for e, h in zip(estimates, half)])


def plot_report(groups: list[Group], path: str, title: str) -> None:
    """The figure: exact KL, score and accuracy against steps (mean over seeds, 95% interval shaded); each
    estimator's bias against kl/full (every step of every seed)."""
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global state (safe in notebooks)
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(17, 10), layout="constrained")
    grid = fig.add_gridspec(2, 12)
    top = [fig.add_subplot(grid[0, 4 * i:4 * (i + 1)]) for i in range(3)]
    bottom = [fig.add_subplot(grid[1, 3 * i:3 * (i + 1)]) for i in range(len(PANEL_ESTIMATORS))]
    curves = [
        ("kl/full", "Exact KL(π‖π_ref) on the sampled responses", "kl/full (nats per token)"),
        ("critic/score/mean", "Task reward on the sampled responses", "critic/score/mean (fraction correct)"),
        ("val/accuracy", "Held-out accuracy, greedy decoding", "val/accuracy (fraction correct)"),
    ]
    for ax, (key, heading, ylabel) in zip(top, curves):
        for group in groups:
            steps, mean, low, high = mean_curve(group.runs, key)
            style = _style(group.label)
            seeds = f" ({len(group.runs)} seeds)" if len(group.runs) > 1 else ""
            ax.plot(steps, mean, label=legend_name(group.label) + seeds, linewidth=1.6, markersize=3.5, **style)
            ax.fill_between(steps, low, high, color=style["color"], alpha=0.15, linewidth=0)
        ax.set(title=heading, xlabel="PPO step", ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax, estimator in zip(bottom, PANEL_ESTIMATORS):
        for group in groups:
            rows = [r for run in group.runs for r in run.rows
                    if r.get(f"kl/{estimator}") is not None and r.get("kl/full") is not None]
            style = _style(group.label)
            ax.plot([r["kl/full"] for r in rows], [r[f"kl/{estimator}"] - r["kl/full"] for r in rows],
                    linestyle="none", marker=style["marker"], color=style["color"], markersize=4, alpha=0.8)
        ax.axhline(0.0, color="gray", linewidth=0.8)
        ax.set(title=f"Bias of {estimator}: kl/{estimator} − kl/full\n(every step of every seed)",
               xlabel="exact KL, kl/full (nats per token)", ylabel=f"kl/{estimator} − kl/full (nats per token)")
        ax.ticklabel_format(axis="both", style="sci", scilimits=(-2, 3))
        ax.grid(alpha=0.3)
    handles, labels = top[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 5), fontsize=10,
               title="placement: estimator (colour = estimator; solid/circle = in the reward, dashed/square = "
                     "in the loss, dash-dot/square = in the loss with the off-policy correction)\n"
                     "lines: mean over seeds; shaded: its 95% interval (Student t; none with one seed)")
    fig.suptitle(title, fontsize=13)
    fig.savefig(path, dpi=110)


# The outcome columns, each followed by its difference to no KL: (header, number per seed, format).
OUTCOMES = (
    ("final exact KL", lambda run: run.final("kl/full"), ".4f"),
    ("final val/accuracy", lambda run: run.final("val/accuracy"), ".3f"),
    ("mean reward", lambda run: run.average("critic/score/mean"), ".3f"),
)
REFERENCE = "no-kl"  # the run the differences are taken to


def interval_cell(estimate: Estimate, spec: str) -> str:
    """`mean ± half-width` of the 95% interval; `mean (n=1)` with one seed (no interval); `n/a` with none."""
    if estimate.n == 0:
        return "n/a"
    if estimate.half_width is None:
        return f"{format(estimate.mean, spec)} (n=1)"
    return f"{format(estimate.mean, spec)} ± {format(estimate.half_width, spec.lstrip('+'))}"


def difference_cell(estimate: Estimate, reference: Estimate, spec: str) -> str:
    """The difference run - no KL, then `resolved` or `unresolved` with why or ~how many seeds would resolve it."""
    if estimate.n == 0 or reference.n == 0:
        return "n/a"
    difference = format(estimate.mean - reference.mean, "+" + spec.lstrip("+"))
    if resolved(estimate, reference):
        return f"{difference} resolved"
    if min(estimate.n, reference.n) < 2:
        return f"{difference} unresolved (n=1)"
    needed = seeds_to_resolve(estimate, reference)
    if needed is None:
        return f"{difference} unresolved (equal means)"
    count = f"~{needed}" if needed <= MAX_SEEDS_ESTIMATE else f">{MAX_SEEDS_ESTIMATE}"
    return f"{difference} unresolved ({count} seeds)"


def _steps_cell(group: Group) -> str:
    last, total = min(r.last_step for r in group.runs), max(r.total_steps for r in group.runs)
    return f"{last}" if last >= total else f"{last}/{total} ⚠"


def _seeds_cell(group: Group) -> str:
    return f"{len(group.runs)}" + (f" (+{len(group.stopped)} stopped early, left out)" if group.stopped else "")


def report_table(groups: list[Group]) -> str:
    """Markdown: one row per run label: seeds, steps, each outcome (mean ± 95% half-width over seeds) with its
    difference to no KL when there is a no-kl run, each estimator's bias (mean over steps, then over seeds)."""
    reference = next((g for g in groups if g.label == REFERENCE), None)
    head = ["run", "seeds", "steps"]
    for name, _, _ in OUTCOMES:
        head += [f"{name} (mean ± 95% CI)"] + ([f"Δ {name} vs no KL"] if reference else [])
    head += [f"{e} bias (mean ± 95% CI)" for e in PANEL_ESTIMATORS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in groups:
        cells = [legend_name(group.label), _seeds_cell(group), _steps_cell(group)]
        for _, number, spec in OUTCOMES:
            cells.append(interval_cell(group.estimate(number), spec))
            if reference is group:
                cells.append("reference")
            elif reference:
                cells.append(difference_cell(group.estimate(number), reference.estimate(number), spec))
        cells += [interval_cell(group.estimate(lambda run, e=e: run.mean_bias(e)), "+.1e") for e in PANEL_ESTIMATORS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _common(runs: list[Run], getter) -> str:
    values = sorted({str(getter(r.config)) for r in runs})
    return values[0] if len(values) == 1 else "differs: " + ", ".join(values)


def _seeds_text(groups: list[Group]) -> str:
    """`seed 42` or `seeds 42, 43, 44` (all the seeds any run used)."""
    seeds = sorted({s for g in groups for s in g.seeds})
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def _explanation(groups: list[Group], coef: str) -> list[str]:
    """The report's paragraphs that say what the table's numbers are and how differences are judged."""
    start = [r.series("val/accuracy")[1][0] for g in groups for r in g.runs if r.series("val/accuracy")[1]]
    start_text = ("n/a" if not start else f"{start[0]:.3f} in every run" if min(start) == max(start)
                  else f"{min(start):.3f} to {max(start):.3f} over the runs")
    differences = (
        "**Differences to no KL** (Δ = the run's mean − no KL's mean) are marked *resolved* when the two 95% "
        "intervals do not overlap (|Δ| > the sum of the two half-widths). This is conservative: with similar "
        "spreads it asks for about √2 times the difference that Welch's t-test at 5% needs. An unresolved "
        "difference shows ~N seeds, a rough estimate of the seeds per run that would resolve it if Δ and both "
        "runs' sds stayed as observed (the smallest N with 2·t(N−1)·sd/√N < |Δ|, sd the mean of the two sds); "
        "the sds of a few seeds are themselves noisy. `(n=1)`: a run with one seed has no interval, so none "
        "of its differences can be resolved or sized: run more seeds (`--seeds N`)."
        if any(g.label == REFERENCE for g in groups) else
        f"No `{REFERENCE}` run, so no differences to it are marked.")
    return [
        f"KL coefficient (reward, loss): {coef}. All KL numbers are per-token means in nats. Exact KL = "
        "`kl/full`, the full-vocabulary KL(π‖π_ref) averaged over the sampled response tokens.",
        "",
        "**Per seed, then over seeds.** Each number is first taken per run of one seed: the final exact KL "
        "(`kl/full` at its last step), the final `val/accuracy` (its last evaluation), the mean reward "
        "(`critic/score/mean`, the task score of the sampled responses, averaged over the steps) and each "
        "estimator's bias (its logged batch mean `kl/<estimator>` minus `kl/full` on the same tokens, averaged "
        "over the steps). A cell is the mean of these over the run's n seeds ± the half-width of its 95% "
        "interval, t·sd/√n, with sd the sample standard deviation over the seeds and t Student's two-sided 95% "
        "value for n−1 degrees of freedom (a table in rlhf/compare.py). `(n=1)`: one seed, no interval. "
        f"`val/accuracy` before PPO (step 0): {start_text}.",
        "",
        differences,
    ]


def _notes(groups: list[Group], status: dict[str, str] | None) -> list[str]:
    """Lines about failed, stopped and duplicated runs ([] if none)."""
    failed = {name: s for name, s in (status or {}).items() if s.startswith("failed")}
    stopped = [r.key for g in groups for r in g.runs + g.stopped if not r.complete]
    lines = []
    if failed or stopped:
        lines += ["", "Not complete: " + ", ".join(
            [f"{n} {s}" for n, s in failed.items()] + [f"{n} (stopped early)" for n in stopped if n not in failed])
            + ". See each run's train.log. A label with finished seeds leaves out those that stopped early."]
    duplicates = duplicate_seeds(groups)
    if duplicates:
        lines += ["", "Seeds found twice (each copy counted as a seed): " + "; ".join(duplicates) + "."]
    return lines


def write_report(directory: str, status: dict[str, str] | None = None) -> tuple[str, str]:
    """Read every run under `directory`, write <directory>/kl_estimators.{png,md}; return their paths."""
    runs = [r for r in load_runs(directory) if r.rows]
    if not runs:
        raise FileNotFoundError(f"no train.py runs (metrics.jsonl + config.yaml) under {directory!r}")
    groups = group_runs(runs)
    steps = _common(runs, lambda c: c["trainer"]["total_steps"])
    coef = _common(runs, lambda c: (c["algorithm"]["kl_ctrl"]["kl_coef"], c["actor"]["kl_loss_coef"]))
    model = _common(runs, lambda c: c["model"]["path"])
    title = (f"KL estimators × placement: {len(groups)} runs, model {model}, {steps} PPO steps, "
             f"{_seeds_text(groups)}")
    png = os.path.join(directory, f"{REPORT_NAME}.png")
    md = os.path.join(directory, f"{REPORT_NAME}.md")
    plot_report(groups, png, title)
    lines = [f"# {title}", "", *_explanation(groups, coef), "", report_table(groups), "",
             f"![KL estimators]({REPORT_NAME}.png)", *_notes(groups, status)]
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    return png, md


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf.compare", description=__doc__.split("\n\n")[0],
        epilog=f"grid ppo, the default ({len(DEFAULT_GRID)} runs, configs/tiny.yaml): {' '.join(DEFAULT_GRID)}\n"
               f"grid grpo ({len(GRPO_GRID)} runs, configs/tiny_grpo.yaml): {' '.join(GRPO_GRID)}\n"
               "estimators: any of train.py's (k1/kl, k2/mse, k3/low_var_kl, abs, X+, full).\n"
               "report: per run, the mean over seeds with its 95% interval (Student t) of the final exact KL,\n"
               "the final val/accuracy, the mean reward and each estimator's bias; differences to no-kl are\n"
               "marked resolved when the 95% intervals do not overlap (see kl_estimators.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    grid = parser.add_argument_group("the grid")
    grid.add_argument("--grid", choices=GRIDS, default="ppo",
                      help="which default runs, config and output dir: ppo (GAE with a critic, configs/tiny.yaml) "
                           "or grpo (configs/tiny_grpo.yaml); see below (default: %(default)s)")
    grid.add_argument("--runs", nargs="+", metavar="RUN", default=None,
                      help="runs to make, each reward:<estimator>, loss:<estimator>, loss-corrected:<estimator> "
                           "or no-kl (default: the grid's, below)")
    grid.add_argument("--config", default=None, help="base config (default: the grid's)")
    grid.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                      help="PPO steps per run, trainer.total_steps (default: %(default)s)")
    grid.add_argument("--kl-coef", type=float, default=None,
                      help="the one KL coefficient, used for algorithm.kl_ctrl.kl_coef and actor.kl_loss_coef "
                           "(default: the config's algorithm.kl_ctrl.kl_coef)")
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
    out.add_argument("--skip-done", action="store_true",
                     help="keep runs (each seed's) in <output-dir> that already finished")
    out.add_argument("--report-only", metavar="DIR",
                     help="run nothing; redraw the report from the runs under DIR (one seed or several)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    grid_runs, grid_config, grid_output_dir = GRIDS[args.grid]
    args.runs = list(grid_runs) if args.runs is None else args.runs
    args.config = args.config or grid_config
    args.output_dir = args.output_dir or grid_output_dir
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
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kl_coef = base.algorithm.kl_ctrl.kl_coef if args.kl_coef is None else args.kl_coef
    group = args.group or f"kl-estimators-{time.strftime('%Y%m%d-%H%M%S')}"
    output_dir = os.path.abspath(args.output_dir)
    cache_dir = os.path.abspath(args.cache_dir or base.trainer.cache_dir or os.path.join(output_dir, "cache"))
    config = os.path.abspath(args.config)
    shared = shared_overrides(args.steps, kl_coef, args.seed, group)
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
          f"KL coefficient {kl_coef}, wandb group {group}\n"
          f"runs in {output_dir}/{layout}, embedded cache in {cache_dir}", flush=True)
    start = time.perf_counter()
    os.makedirs(output_dir, exist_ok=True)
    status = run_grid(arms, config, output_dir, cache_dir, shared, extra, args.skip_done, env, seeds)
    print(f"grid finished in {(time.perf_counter() - start) / 60:.1f} min")
    png, md = write_report(output_dir, status)
    print(f"report: {png}\n        {md}")
    failed = [name for name, s in status.items() if s.startswith("failed")]
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
