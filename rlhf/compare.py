"""Compare KL estimators x placements: run a grid of train.py runs, then report from their metrics.jsonl.

    python -m rlhf.compare                                     # the default grid on configs/tiny.yaml
    python -m rlhf.compare --runs no-kl reward:k1 loss:k3+ --steps 3
    python -m rlhf.compare --report-only outputs/kl_estimators # redraw the report from runs on disk
    wandb sweep configs/sweeps/kl_estimators.yaml              # the same grid through W&B, then `wandb agent`

A run is named like the trainer's wandb tag: `reward:<estimator>` (KL in the reward), `loss:<estimator>`
(KL in the actor loss) or `no-kl`. Every run gets the same seed, the same number of steps and the same KL
coefficient (`algorithm.kl_ctrl.kl_coef` and `actor.kl_loss_coef`, with a fixed controller), and writes to
`<output-dir>/<run>/` (train.py's output_dir). The runs go one after another, each a fresh `train.py`
process (a failing run is reported, not fatal), all in one wandb group; wandb runs offline without
credentials. They share `trainer.cache_dir`, so the embedded warm start is built once.

The report reads only `metrics.jsonl` and `config.yaml` of each run (no wandb server needed) and writes
`<output-dir>/kl_estimators.png` and `<output-dir>/kl_estimators.md`. Bias here is, per step, an
estimator's batch mean minus the exact KL (`kl/full`) on the same sampled tokens: both are per-token means
in nats, and the panel logs every estimator in every run whatever the run optimises.
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
# Chosen so the default grid, warm start included, finishes in under 30 minutes on 2 CPU cores. Estimated
# for configs/tiny.yaml as of this writing (timed on a shared 2-core machine, scaled by its load): ~19 s per
# PPO step, ~15 s per evaluation of the 256 held-out problems (step 0 and the last), ~15 s to start a run:
# 9 x (15 + 2 x 15 + 5 x 19) s = 21 min, plus 2-4 min for the warm start. Re-time it when tiny.yaml changes.
DEFAULT_STEPS = 5
DEFAULT_OUTPUT_DIR = "outputs/kl_estimators"
REPORT_NAME = "kl_estimators"  # -> kl_estimators.png, kl_estimators.md
PLACEMENTS = ("reward", "loss")


@dataclass(frozen=True)
class Arm:
    """One run of the grid: where the KL goes and which estimator (None for no KL)."""

    placement: str  # "reward" | "loss" | "none"
    estimator: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Arm":
        """`reward:k1`, `loss:k3+` or `no-kl` -> Arm. Raises ValueError naming the valid forms."""
        if text == "no-kl":
            return cls("none")
        placement, sep, estimator = text.partition(":")
        if not sep or placement not in PLACEMENTS:
            raise ValueError(f"run {text!r} is not one of reward:<estimator>, loss:<estimator>, no-kl "
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
        reward, loss = self.placement == "reward", self.placement == "loss"
        out = [f"algorithm.use_kl_in_reward={str(reward).lower()}", f"actor.use_kl_loss={str(loss).lower()}"]
        if reward:
            out.append(f"algorithm.kl_penalty={self.estimator}")
        if loss:
            out.append(f"actor.kl_loss_type={self.estimator}")
        return out


def shared_overrides(steps: int | None, kl_coef: float, seed: int | None, group: str) -> list[str]:
    """What every run of a comparison has in common: the coefficient in both places (fixed), steps, seed."""
    out = ["algorithm.kl_ctrl.type=fixed", f"algorithm.kl_ctrl.kl_coef={kl_coef}",
           f"actor.kl_loss_coef={kl_coef}", f"trainer.group={group}"]
    if steps is not None:
        out.append(f"trainer.total_steps={steps}")
    if seed is not None:
        out.append(f"trainer.seed={seed}")
    return out


def run_overrides(arm: Arm, output_dir: str, cache_dir: str, shared: list[str], extra: list[str]) -> list[str]:
    """All overrides of one run, in the order train.py applies them (later wins: `extra` comes last)."""
    return [*shared, *arm.overrides(), f"trainer.experiment_name={arm.name}",
            f"trainer.output_dir={os.path.join(output_dir, arm.dirname)}", f"trainer.cache_dir={cache_dir}", *extra]


# ----------------------------------------------------------------------------- running the grid


def run_grid(arms: list[Arm], config: str, output_dir: str, cache_dir: str, shared: list[str],
             extra: list[str], skip_done: bool = False, env: dict | None = None) -> dict[str, str]:
    """Run each arm as `python train.py --config ... overrides`, one after another.

    Returns {run name: "ok" | "skipped" | "failed (exit N)"}. Each run's stdout and stderr go to
    `<output_dir>/<run>/train.log`; a run directory left by an earlier comparison is replaced (its old
    checkpoints would otherwise mix with the new run's), unless `skip_done` and it already reached its last step.
    """
    status = {}
    for i, arm in enumerate(arms, 1):
        overrides = run_overrides(arm, output_dir, cache_dir, shared, extra)
        total = load_config(config, overrides).trainer.total_steps
        run_dir = os.path.join(output_dir, arm.dirname)
        if skip_done and last_step(run_dir) == total:
            print(f"[{i}/{len(arms)}] {arm.name}: already has {total} steps in {run_dir}, skipped")
            status[arm.name] = "skipped"
            continue
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(run_dir)
        log_path = os.path.join(run_dir, "train.log")
        command = [sys.executable, TRAIN_PY, "--config", config, *overrides]
        print(f"[{i}/{len(arms)}] {arm.name}: {' '.join(arm.overrides())}  (log: {log_path})", flush=True)
        start = time.perf_counter()
        with open(log_path, "w") as log:
            log.write(" ".join(command) + "\n\n")
            log.flush()
            code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        seconds = time.perf_counter() - start
        if code == 0:
            status[arm.name] = "ok"
            final = read_metrics(os.path.join(run_dir, "metrics.jsonl"))[-1]
            print(f"    done in {seconds:.0f}s: kl/full={final.get('kl/full', float('nan')):.4f} "
                  f"val/accuracy={final.get('val/accuracy', float('nan')):.3f}", flush=True)
        else:
            status[arm.name] = f"failed (exit {code})"
            print(f"    FAILED (exit {code}) after {seconds:.0f}s; last lines of {log_path}:\n"
                  + _tail(log_path), flush=True)
    return status


def last_step(run_dir: str) -> int | None:
    """The last step a run directory's metrics.jsonl reached; None if it has none."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = read_metrics(path) if os.path.exists(path) else []
    return rows[-1]["step"] if rows else None


def _tail(path: str, num_lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join("      " + line for line in f.readlines()[-num_lines:])


# ----------------------------------------------------------------------------- the report


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

    def bias(self, estimator: str) -> list[float]:
        """Per step: kl/<estimator> - kl/full (both per-token means over the same sampled tokens)."""
        return [r[f"kl/{estimator}"] - r["kl/full"] for r in self.rows
                if r.get(f"kl/{estimator}") is not None and r.get("kl/full") is not None]

    @property
    def total_steps(self) -> int:
        return self.config["trainer"]["total_steps"]

    @property
    def last_step(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0


def _order(label: str) -> tuple:
    """Report order: no KL, then the reward runs, then the loss runs, each in DEFAULT_GRID order."""
    known = list(DEFAULT_GRID)
    return (known.index(label) if label in known else len(known), label)


def load_runs(directory: str) -> list[Run]:
    """Every train.py run under `directory` (a folder holding metrics.jsonl and config.yaml)."""
    runs = []
    for path in sorted(glob.glob(os.path.join(directory, "**", "metrics.jsonl"), recursive=True)):
        run_dir = os.path.dirname(path)
        config_path = os.path.join(run_dir, "config.yaml")
        if not os.path.exists(config_path):
            continue
        with open(config_path) as f:
            config = yaml.safe_load(f)
        runs.append(Run(run_label(from_dict(config)), run_dir, config, read_metrics(path)))
    return sorted(runs, key=lambda r: _order(r.label))


def legend_name(label: str) -> str:
    """`reward:k1` -> `KL in reward: k1`; `no-kl` -> `no KL`."""
    if label == "no-kl":
        return "no KL"
    return " + ".join(f"KL in {part.replace(':', ': ', 1)}" for part in label.split(" + "))


# Colour = estimator (the same in both placements), line style = placement.
_COLOURS = {"k1": "tab:blue", "k2": "tab:orange", "k3": "tab:green", "k3+": "tab:red", "full": "tab:purple",
            "abs": "tab:brown", "k1+": "tab:pink", "abs+": "tab:olive", "k2+": "tab:cyan"}
_STYLES = {"reward": "-", "loss": "--"}


def _style(label: str) -> dict:
    if label == "no-kl":
        return dict(color="black", linestyle=":", marker="o")
    placement, _, estimator = label.split(" + ")[0].partition(":")
    return dict(color=_COLOURS.get(canonical(estimator), "tab:gray"), linestyle=_STYLES[placement],
                marker="o" if placement == "reward" else "s")


def plot_report(runs: list[Run], path: str, title: str) -> None:
    """The figure: exact KL, score and accuracy against steps; each estimator's bias against kl/full."""
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
        for run in runs:
            steps, values = run.series(key)
            style = _style(run.label)
            ax.plot(steps, values, label=legend_name(run.label), linewidth=1.6, markersize=3.5, **style)
        ax.set(title=heading, xlabel="PPO step", ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax, estimator in zip(bottom, PANEL_ESTIMATORS):
        for run in runs:
            rows = [r for r in run.rows if r.get(f"kl/{estimator}") is not None and r.get("kl/full") is not None]
            style = _style(run.label)
            ax.plot([r["kl/full"] for r in rows], [r[f"kl/{estimator}"] - r["kl/full"] for r in rows],
                    linestyle="none", marker=style["marker"], color=style["color"], markersize=4, alpha=0.8)
        ax.axhline(0.0, color="gray", linewidth=0.8)
        ax.set(title=f"Bias of {estimator}: kl/{estimator} − kl/full",
               xlabel="exact KL, kl/full (nats per token)", ylabel=f"kl/{estimator} − kl/full (nats per token)")
        ax.ticklabel_format(axis="both", style="sci", scilimits=(-2, 3))
        ax.grid(alpha=0.3)
    handles, labels = top[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 5), fontsize=10,
               title="placement: estimator (colour = estimator; solid/circle = in the reward, "
                     "dashed/square = in the loss)")
    fig.suptitle(title, fontsize=13)
    fig.savefig(path, dpi=110)


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def _mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):+.1e} ± {std:.1e}"


def report_table(runs: list[Run]) -> str:
    """Markdown: one row per run (final exact KL, accuracy, mean reward, each estimator's bias)."""
    head = ["run", "steps", "final exact KL", "val/accuracy (step 0 → final)", "mean reward"]
    head += [f"{e} bias (mean ± sd)" for e in PANEL_ESTIMATORS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        _, kl_full = run.series("kl/full")
        _, accuracy = run.series("val/accuracy")
        _, score = run.series("critic/score/mean")
        steps = f"{run.last_step}" if run.last_step == run.total_steps else f"{run.last_step}/{run.total_steps} ⚠"
        cells = [legend_name(run.label), steps, _fmt(kl_full[-1] if kl_full else None),
                 f"{_fmt(accuracy[0] if accuracy else None, '.3f')} → {_fmt(accuracy[-1] if accuracy else None, '.3f')}",
                 _fmt(statistics.fmean(score) if score else None, ".3f")]
        cells += [_mean_std(run.bias(e)) for e in PANEL_ESTIMATORS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _common(runs: list[Run], getter) -> str:
    values = sorted({str(getter(r.config)) for r in runs})
    return values[0] if len(values) == 1 else "differs: " + ", ".join(values)


def write_report(directory: str, status: dict[str, str] | None = None) -> tuple[str, str]:
    """Read every run under `directory`, write <directory>/kl_estimators.{png,md}; return their paths."""
    runs = [r for r in load_runs(directory) if r.rows]
    if not runs:
        raise FileNotFoundError(f"no train.py runs (metrics.jsonl + config.yaml) under {directory!r}")
    steps = _common(runs, lambda c: c["trainer"]["total_steps"])
    seed = _common(runs, lambda c: c["trainer"]["seed"])
    coef = _common(runs, lambda c: (c["algorithm"]["kl_ctrl"]["kl_coef"], c["actor"]["kl_loss_coef"]))
    model = _common(runs, lambda c: c["model"]["path"])
    title = f"KL estimators × placement: {len(runs)} runs, model {model}, {steps} PPO steps, seed {seed}"
    png = os.path.join(directory, f"{REPORT_NAME}.png")
    md = os.path.join(directory, f"{REPORT_NAME}.md")
    plot_report(runs, png, title)
    lines = [
        f"# {title}",
        "",
        f"KL coefficient (reward, loss): {coef}. All KL numbers are per-token means in nats. "
        "Exact KL = `kl/full`, the full-vocabulary KL(π‖π_ref) averaged over the sampled response tokens. "
        "Bias of an estimator = its logged batch mean (`kl/<estimator>`) minus `kl/full` on the same tokens, "
        "mean ± standard deviation over the steps. Mean reward = `critic/score/mean` (task score of the "
        "sampled responses) averaged over the steps.",
        "",
        report_table(runs),
        "",
        f"![KL estimators]({REPORT_NAME}.png)",
    ]
    failed = {name: s for name, s in (status or {}).items() if s.startswith("failed")}
    incomplete = [r.label for r in runs if r.last_step < r.total_steps]
    if failed or incomplete:
        lines += ["", "Not complete: " + ", ".join(
            [f"{n} {s}" for n, s in failed.items()] + [f"{n} (stopped early)" for n in incomplete if n not in failed])
            + ". See each run's train.log."]
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    return png, md


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf.compare", description=__doc__.split("\n\n")[0],
        epilog=f"default grid ({len(DEFAULT_GRID)} runs): {' '.join(DEFAULT_GRID)}\n"
               "estimators: any of train.py's (k1/kl, k2/mse, k3/low_var_kl, abs, X+, full).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    grid = parser.add_argument_group("the grid")
    grid.add_argument("--runs", nargs="+", metavar="RUN", default=list(DEFAULT_GRID),
                      help=f"runs to make, each reward:<estimator>, loss:<estimator> or no-kl "
                           f"(default: the {len(DEFAULT_GRID)}-run grid below)")
    grid.add_argument("--config", default=DEFAULT_CONFIG, help="base config (default: configs/tiny.yaml)")
    grid.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                      help="PPO steps per run, trainer.total_steps (default: %(default)s)")
    grid.add_argument("--kl-coef", type=float, default=None,
                      help="the one KL coefficient, used for algorithm.kl_ctrl.kl_coef and actor.kl_loss_coef "
                           "(default: the config's algorithm.kl_ctrl.kl_coef)")
    grid.add_argument("--seed", type=int, default=None, help="trainer.seed of every run (default: the config's)")
    grid.add_argument("overrides", nargs="*", metavar="key=value",
                      help="extra train.py overrides applied to every run, e.g. data.train_batch_size=32")
    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                     help="runs go to <dir>/<run>/, the report to <dir>/kl_estimators.{png,md} (default: %(default)s)")
    out.add_argument("--cache-dir", default=None,
                     help="trainer.cache_dir shared by all runs (default: the config's, else <output-dir>/cache)")
    out.add_argument("--group", default=None, help="wandb group of the runs (default: kl-estimators-<date-time>)")
    out.add_argument("--offline", action="store_true", help="wandb offline even with credentials (WANDB_MODE=offline)")
    out.add_argument("--no-wandb", action="store_true", help="no wandb at all (trainer.logger=none)")
    out.add_argument("--skip-done", action="store_true", help="keep runs in <output-dir> that already finished")
    out.add_argument("--report-only", metavar="DIR", help="run nothing; redraw the report from the runs under DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report_only:
        png, md = write_report(args.report_only)
        print(f"report: {png}\n        {md}")
        return 0

    # `--runs a b key=value` would swallow the overrides; run names never hold "=", so take them back.
    args.overrides += [text for text in args.runs if "=" in text]
    try:
        arms = [Arm.parse(text) for text in args.runs if "=" not in text]
        base = load_config(args.config, args.overrides)
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
        for arm in arms:
            load_config(config, run_overrides(arm, output_dir, cache_dir, shared, extra))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = dict(os.environ, **({"WANDB_MODE": "offline"} if args.offline else {}))
    print(f"{len(arms)} runs x {args.steps} steps, KL coefficient {kl_coef}, seed "
          f"{base.trainer.seed if args.seed is None else args.seed}, wandb group {group}\n"
          f"runs in {output_dir}/<run>/, embedded cache in {cache_dir}", flush=True)
    start = time.perf_counter()
    os.makedirs(output_dir, exist_ok=True)
    status = run_grid(arms, config, output_dir, cache_dir, shared, extra, args.skip_done, env)
    print(f"grid finished in {(time.perf_counter() - start) / 60:.1f} min")
    png, md = write_report(output_dir, status)
    print(f"report: {png}\n        {md}")
    failed = [name for name, s in status.items() if s.startswith("failed")]
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
