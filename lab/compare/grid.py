"""The grid of a comparison: its runs (Arm), the overrides and directory of each, and the runner.

Every run gets the same seeds, the same number of steps, the same KL coefficient (`algorithm.kl_ctrl.kl_coef`
and `actor.kl_loss_coef`, with a fixed controller), the same regime (Regime: how far the runs move from
pi_ref) and paired sampling noise (`rollout.paired_noise`). `--seeds N` gives each run
the seeds S, S+1, ..., S+N-1 (S: `--seed`, else the config's `trainer.seed`). With one seed (the default) a
run writes to `<output-dir>/<run>/` (train.py's output_dir); with N > 1, seed s of a run writes to
`<output-dir>/<run>/seed<s>/`, and the grid goes seed by seed (every run with the first seed, then every run
with the next). A run directory left by an earlier comparison is replaced (kept with `--skip-done` if it
finished), also one in the other layout. Each run is a fresh `train.py` process (a failing run is reported,
not fatal), `jobs` of them at a time, each with its share of the CPU threads; all in one wandb group; wandb
runs offline without credentials. They share `trainer.cache_dir`, so the embedded warm start is built once
(by the first run alone, when it is not cached yet).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

from rlhf.labels import kl_overrides, parse_kl_tag, run_label
from rlhf.config import load_config
from rlhf.embedded import cache_entry, embedded_options
from rlhf.tracking import read_metrics

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_COMMAND = (sys.executable, "-m", "train")  # the installed trainer (pip install -e .), a fresh process per run
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "tiny.yaml")
# docs/kl.md's comparison: the principled (k1), the GRPO-style (k3) and the exact (full) estimator in the
# reward; every loss form, including the two that should not regularise (k1) or regularise the wrong
# direction (k3); and no KL. configs/sweeps/kl_estimators.yaml holds the same list (a test checks).
DEFAULT_GRID = ("no-kl", "reward:k1", "reward:k3", "reward:full",
                "loss:k1", "loss:k2", "loss:k3", "loss:k3+", "loss:full")
# `--grid grpo`: the same estimators under GRPO (configs/tiny_grpo.yaml), where the KL goes in the loss.
GRPO_GRID = ("no-kl", "loss:k1", "loss:k3", "loss:k3+", "loss:k2", "loss:full")


@dataclass(frozen=True)
class Regime:
    """How far a comparison's runs move from pi_ref: the one KL coefficient (None: the config's
    algorithm.kl_ctrl.kl_coef), the PPO steps per run and the trainer overrides every run gets; a regime may
    name its own runs and output directory (None: the grid's)."""

    kl_coef: float | None
    steps: int
    overrides: tuple[str, ...] = ()
    runs: tuple[str, ...] | None = None
    output_dir: str | None = None


# `separating`, the ppo grid's default: a learning rate 4x configs/tiny.yaml's, so that without a KL the
# policy moves far from pi_ref within the run, and a coefficient 10x its, so that a KL gradient holds it
# back by a margin three paired seeds resolve. The steps and the epochs stay at 20 and configs/tiny.yaml's
# 2 x 2 mini-batches, so that a run costs what a `small` one does (docs/results.md, "The separating regime,
# three seeds", has what `--seeds 3` resolves and how long it takes).
# `small`: the configs' own learning rate and coefficient (0.01 in configs/tiny.yaml), 20 steps: the
# policy stays so close to pi_ref that no placement's effect resolves; the grpo grid's default.
# `binding`: set up for a KL loss to decide where training stops, so that k3 (the forward KL) and k3+ (the
# reverse KL) part on the planted habit (docs/kl.md, "The habit a forward KL keeps"); measured, its runs are
# noise-dominated and end far from those limits (docs/results.md, "The KL binds"). RLOO, because its advantages
# leave the coefficient as set (GAE's whitening and GRPO's std take both KL losses towards the corner);
# coefficient 0.3, where verl's clamp leaves k3's floor alone and the two limits lie 0.137 apart in habit
# rate on the runs' warm start; configs/tiny_grpo.yaml's batch (16 prompts x 4 responses), learning rate
# 3e-4, 80 steps; sampled evaluation (4 responses per problem) every 20 steps for val/habit_rate and val/pass@1.
BINDING = Regime(0.3, 80, ("algorithm.adv_estimator=rloo", "rollout.n=4", "data.train_batch_size=16",
                           "actor.ppo_mini_batch_size=8", "actor.lr=3e-4", "trainer.val_samples=4",
                           "trainer.test_freq=20"),
                 runs=("no-kl", "reward:k1", "loss:k2", "loss:k3", "loss:k3+", "loss:full"),
                 output_dir="outputs/kl_binding")
REGIMES = {"separating": Regime(0.1, 20, ("actor.lr=2e-4",)), "small": Regime(None, 20), "binding": BINDING}
# Every run samples with common random numbers: same seed, same step -> same sampling noise, so runs with
# the same seed differ only where their policies do, and differences between them are paired.
PAIRED_NOISE = "rollout.paired_noise=true"


class Grid(NamedTuple):
    """A named grid of `--grid`: its runs, base config, default output directory and default regime."""

    runs: tuple[str, ...]
    config: str
    output_dir: str
    regime: str


GRIDS = {"ppo": Grid(DEFAULT_GRID, DEFAULT_CONFIG, "outputs/kl_estimators", "separating"),
         "grpo": Grid(GRPO_GRID, os.path.join(REPO_ROOT, "configs", "tiny_grpo.yaml"), "outputs/kl_estimators_grpo",
                      "small")}


@dataclass(frozen=True)
class Arm:
    """One run of the grid: where the KL goes and which estimator (None for no KL)."""

    placement: str  # "reward" | "loss" | "loss-corrected" (the KL loss with the off-policy correction) | "none"
    estimator: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Arm":
        """`reward:k1`, `loss:k3+`, `loss-corrected:k3` or `no-kl` -> Arm (labels.parse_kl_tag). Raises
        ValueError naming the valid forms."""
        return cls(*parse_kl_tag(text))

    @property
    def name(self) -> str:
        """The run's label (labels.run_label, also its wandb tag): `reward:k1`, `loss:k3+`, `no-kl`."""
        return run_label(load_config(None, self.overrides()))

    @property
    def dirname(self) -> str:
        return self.name.replace(":", "-")

    def overrides(self) -> list[str]:
        """The trainer overrides that put this run's KL where it belongs (and nowhere else)."""
        return kl_overrides(self.placement, self.estimator)


def shared_overrides(steps: int | None, kl_coef: float, seed: int | None, group: str,
                     regime: tuple[str, ...] = ()) -> list[str]:
    """What every run of a comparison has in common: the coefficient in both places (fixed), paired sampling
    noise, the regime's overrides, steps and, with one seed, the seed (None: the config's)."""
    out = ["algorithm.kl_ctrl.type=fixed", f"algorithm.kl_ctrl.kl_coef={kl_coef}",
           f"actor.kl_loss_coef={kl_coef}", f"trainer.group={group}", PAIRED_NOISE, *regime]
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


class _Job(NamedTuple):
    """One run of run_grid still to make: its status key, its `[i/n] name` title, its arm, config and
    overrides, and its directory."""

    key: str
    title: str
    arm: Arm
    cfg: object  # rlhf.config.Config
    overrides: list[str]
    directory: str


def run_grid(arms: list[Arm], config: str, output_dir: str, cache_dir: str, shared: list[str],
             extra: list[str], skip_done: bool = False, env: dict | None = None,
             seeds: list[int] | None = None, jobs: int = 1) -> dict[str, str]:
    """Run each arm (with each of `seeds`, if several) as `python train.py --config ... overrides`, `jobs` at
    a time.

    Returns {run_key(run name, seed): "ok" | "skipped" | "failed (exit N)"}, in grid order. Each run's stdout
    and stderr go to `train.log` in its directory (run_dir); a run directory left by an earlier comparison is
    replaced (its old checkpoints would otherwise mix with the new run's), unless `skip_done` and it already
    reached its last step. A one-seed run left in `<output_dir>/<run>/` is removed before that run's seeds
    start. With `jobs` > 1 every run gets the same share of the CPU threads (job_env), so that runs that
    are compared with each other ran with the same arithmetic, and a warm start that is not cached yet is
    built by the first run alone.
    """
    status, todo = {}, []
    planned = grid_jobs(arms, seeds)
    for i, (arm, seed) in enumerate(planned, 1):
        overrides = run_overrides(arm, output_dir, cache_dir, shared, extra, seed)
        cfg = load_config(config, overrides)
        total = cfg.trainer.total_steps
        directory, key = run_dir(output_dir, arm, seed), run_key(arm.name, seed)
        if seed is not None:
            _remove_one_seed_run(run_dir(output_dir, arm))
        if skip_done and last_step(directory) == total:
            print(f"[{i}/{len(planned)}] {key}: already has {total} steps in {directory}, skipped")
            status[key] = "skipped"
            continue
        status[key] = "not run"  # its place in the grid's order; the run's outcome replaces it
        todo.append(_Job(key, f"[{i}/{len(planned)}] {key}", arm, cfg, overrides, directory))
    run_env = job_env(env, jobs)

    def start(job: _Job) -> tuple[str, str]:
        shutil.rmtree(job.directory, ignore_errors=True)
        os.makedirs(job.directory)
        say(f"{job.title}: {' '.join(job.arm.overrides())}  (log: {job.directory}/train.log)")
        return job.key, _train(config, job.overrides, job.directory, run_env, job.title)

    if jobs > 1 and todo and not warm_start_cached(todo[0].cfg):
        key, result = start(todo.pop(0))
        status[key] = result
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for key, result in pool.map(start, todo):
            status[key] = result
    return status


def job_env(env: dict | None, jobs: int) -> dict | None:
    """The environment of each run when `jobs` run at once: OMP_NUM_THREADS = the CPUs / jobs (at least 1;
    one the caller set is kept) and threads that wait without spinning, which would steal the other runs'
    cores (OMP_WAIT_POLICY=PASSIVE). With one job, `env` unchanged."""
    if jobs <= 1:
        return env
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    base.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return base


def warm_start_cached(cfg) -> bool:
    """Whether a run of `cfg` (a Config) finds what it loads already built: its model is not the embedded
    default, or the embedded default's warm start is in its `trainer.cache_dir`."""
    return cfg.model.path != "embedded" or os.path.isdir(cache_entry(cfg.trainer.cache_dir, embedded_options(cfg)))


def _train(config: str, overrides: list[str], directory: str, env: dict | None, title: str = "") -> str:
    """One train.py process, logging to <directory>/train.log; returns "ok" or "failed (exit N)". `title`
    (the run's `[i/n] name`) starts the line that says how it ended."""
    log_path = os.path.join(directory, "train.log")
    command = [*TRAIN_COMMAND, "--config", config, *overrides]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n\n")
        log.flush()
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    seconds = time.perf_counter() - start
    if code != 0:
        say(f"    {title} FAILED (exit {code}) after {seconds:.0f}s; last lines of {log_path}:\n" + _tail(log_path))
        return f"failed (exit {code})"
    final = read_metrics(os.path.join(directory, "metrics.jsonl"))[-1]
    say(f"    {title} done in {seconds:.0f}s: kl/full={final.get('kl/full', float('nan')):.4f} "
        f"val/accuracy={final.get('val/accuracy', float('nan')):.3f}")
    return "ok"


def say(text: str) -> None:
    """Print `text` and its newline in one write, so that lines of runs going at once never interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


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
