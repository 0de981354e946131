"""Reading a comparison's runs back from disk, and grouping them by label over their seeds.

Only each run's `metrics.jsonl` and `config.yaml` are read (no wandb server needed), in either layout
(`<run>/` or `<run>/seed<k>/`). A run's label is labels.run_label of its saved config; a label's numbers come
from its seeds that finished, if any did.
"""

from __future__ import annotations

import glob
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import yaml

from lab.compare.grid import DEFAULT_GRID, run_key
from rlhf.labels import run_label
from rlhf.stats import Estimate
from rlhf.config import from_dict
from rlhf.tracking import read_metrics


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

    def late(self, key: str, count: int) -> float | None:
        """The mean of `key` over the last `count` steps that logged it (all of them if fewer); None if none did."""
        _, values = self.series(key)
        return statistics.fmean(values[-count:]) if values else None

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

    def per_seed(self, number: Callable[[Run], float | None]) -> dict[int, float]:
        """{seed: number(run)} over the seeds (Nones skipped): what stats.paired_differences pairs by seed."""
        values = {run.seed: number(run) for run in self.runs}
        return {seed: value for seed, value in values.items() if value is not None}

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

