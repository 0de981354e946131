"""Where the trainer lands on the synthetic tasks: `python -m lab.compare --grid bandit` (or `--grid tree`).

Every estimator (k1, k2, k3, abs, k1+, k3+, abs+, full) x placement (reward, loss), under each advantage
estimator of VARIANTS (RLOO, the configs' default, whose fixed points are the textbook ones; GRPO with groups of
8 and its std; GAE with a critic, gamma = lam = 1), with paired seeds, each run a plain train.py run of
configs/bandit.yaml or configs/tree.yaml (lab.compare.grid.run_grid). Each run's theory.json holds its final
distances to its own fixed point (where the analysis of lab.theory.fixed_points says that estimator x placement
x advantage estimator lands) and to every textbook candidate; `landing_report` tabulates them over seeds:

- landed: the final TV to its own fixed point, at most LANDED (0.03);
- apart from each other candidate: the paired difference (TV to the candidate - TV to its own fixed point)
  over seeds, resolved when its 95% interval excludes 0 (candidates within LANDED of the fixed point are the
  same point, and not asked to be told apart);
- the crossover (k3 in the loss at the forward-KL optimum, k3+ at the reverse one, under RLOO): each one's
  margin, TV to the other optimum minus TV to its own, against 10x its spread over seeds;
- for a cell that did not land, why: on the bandit, where the solver goes from each seed's end (another stable
  point, or a run that had not got there: from_the_end_rows); on the tree, where plain gradient ascent ends
  (plain_flow_rows).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from lab.compare.grid import Arm, run_dir
from rlhf.stats import Estimate, excludes_zero
from lab.theory.fixed_points import ESTIMATORS, PLACEMENTS

LANDED = 0.03  # a run has landed on a point when its final total variation to it is at most this
CROSSOVER_RATIO = 10.0  # the crossover's margin must exceed this many standard deviations over seeds
# The advantage estimators each cell runs under: name -> train.py overrides.
VARIANTS = {
    "rloo": ("algorithm.adv_estimator=rloo", "rollout.n=8"),
    "grpo": ("algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=true", "rollout.n=8"),
    "gae": ("algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=1.0", "rollout.n=8"),
}
LANDING_GRID = tuple(f"{placement}:{estimator}" for estimator in ESTIMATORS for placement in PLACEMENTS)


def run_in_process(config: str, overrides: list[str], directory: str) -> str:
    """One run, train.main in this process, its output in <directory>/train.log; "ok" or "failed (<error>)".
    The landing grid's runs take seconds, a fresh train.py process mostly spends them importing, so each worker
    of `run_all` imports the trainer once and runs many (every run's config and seeds are its own)."""
    import contextlib
    import shutil
    import traceback

    import torch

    import train
    from rlhf.config import load_config

    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    torch.set_num_threads(1)
    with open(os.path.join(directory, "train.log"), "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        try:
            train.main(load_config(config, overrides))
        except Exception as e:  # reported, not fatal: the other runs and the report still go on
            traceback.print_exc()
            return f"failed ({type(e).__name__}: {e})"
    return "ok"


def run_all(jobs: list[tuple[str, str, list[str], str]], workers: int) -> dict[str, str]:
    """Run each (key, config, overrides, directory) by run_in_process, `workers` processes at a time, each on
    one thread (OMP_WAIT_POLICY=PASSIVE, so that waiting threads do not spin on the other's core). Returns
    {key: status} in the given order, printing a line as each run ends."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from lab.compare.grid import say

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    status = {key: "not run" for key, *_ in jobs}
    start = time.perf_counter()
    if workers <= 1:  # here, one after another (no worker process to start)
        for i, (key, config, overrides, directory) in enumerate(jobs, 1):
            status[key] = run_in_process(config, overrides, directory)
            say(f"[{i}/{len(jobs)}] {key} {status[key]}{_landed_at(directory)} ({time.perf_counter() - start:.0f}s in)")
        return status
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(run_in_process, config, overrides, directory): (i, key, directory)
                   for i, (key, config, overrides, directory) in enumerate(jobs, 1)}
        for future in as_completed(futures):
            i, key, directory = futures[future]
            status[key] = future.result()
            say(f"[{i}/{len(jobs)}] {key} {status[key]}{_landed_at(directory)} ({time.perf_counter() - start:.0f}s in)")
    return status


def _landed_at(directory: str) -> str:
    """': TV to its fixed point 0.012' from a finished run's theory.json, '' without one."""
    path = os.path.join(directory, "theory.json")
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f": TV to its fixed point {json.load(f)['metrics']['theory/tv_to_fixed_point']:.3f}"


def variant_dir(output_dir: str, variant: str) -> str:
    """Where one advantage estimator's runs go: <output_dir>/<variant>/<run>/seed<s>/."""
    return os.path.join(output_dir, variant)


@dataclass(frozen=True)
class Cell:
    """One estimator x placement x advantage estimator over seeds: each seed's theory.json."""

    variant: str
    arm: str  # "loss:k3", ...
    records: dict[int, dict]  # seed -> theory.json

    def distances(self, candidate: str) -> dict[int, float]:
        """seed -> the final TV to `candidate` ("fixed_point", "reverse_optimum", ...)."""
        return {seed: r["metrics"][f"theory/tv_to_{candidate}"] for seed, r in self.records.items()}

    def estimate(self, candidate: str) -> Estimate:
        return Estimate(tuple(self.distances(candidate)[s] for s in sorted(self.records)))

    @property
    def candidates(self) -> list[str]:
        """The candidates other than the fixed point, as the runs name them."""
        first = next(iter(self.records.values()))
        return [name for name in first["candidates"] if name != "fixed_point"]

    def same_point(self, candidate: str) -> bool:
        """Whether `candidate` is within LANDED of the fixed point (in TV), so that landing on one is landing on
        both."""
        from lab.theory.optima import tv
        import torch

        first = next(iter(self.records.values()))
        point, other = (torch.tensor(first["candidates"][k], dtype=torch.float64) for k in ("fixed_point", candidate))
        return tv(point, other) <= LANDED

    def apart(self, candidate: str) -> Estimate:
        """The paired difference, per seed, of the TV to `candidate` minus the TV to the fixed point."""
        own, other = self.distances("fixed_point"), self.distances(candidate)
        return Estimate(tuple(other[s] - own[s] for s in sorted(own)))


def _run_path(output_dir: str, variant: str, arm: str, seed: int, seeds: list[int], name: str) -> str:
    """A file of one run: run_dir's layout (a seed folder only with several seeds) under the variant's folder."""
    layout_seed = seed if len(seeds) > 1 else None
    return os.path.join(run_dir(variant_dir(output_dir, variant), Arm.parse(arm), layout_seed), name)


def read_cells(output_dir: str, seeds: list[int], runs=LANDING_GRID) -> list[Cell]:
    """Every cell of `runs` with a theory.json under output_dir (variant_dir / run_dir layout), in grid order."""
    cells = []
    for variant in VARIANTS:
        for text in runs:
            records = {}
            for seed in seeds:
                path = _run_path(output_dir, variant, text, seed, seeds, "theory.json")
                if os.path.exists(path):
                    with open(path, encoding="utf-8") as f:
                        records[seed] = json.load(f)
            if records:
                cells.append(Cell(variant, text, records))
    return cells


def _fmt(e: Estimate, digits: int = 3) -> str:
    return f"{e.mean:.{digits}f}" + ("" if e.half_width is None else f" ± {e.half_width:.{digits}f}")


def cell_rows(cells: list[Cell]) -> list[str]:
    """The report's table: one row per cell with its fixed point, the final TV to it (mean ± 95% over seeds,
    and the largest), whether it landed, and per other candidate the TV to it and whether it is resolved apart."""
    rows = ["| advantage | run | fixed point | seeds | TV to it | max | landed | other candidates: TV to each (apart?) |",
            "|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        own = cell.estimate("fixed_point")
        label = next(iter(cell.records.values()))["fixed_point"]
        others = []
        for name in cell.candidates:
            tv = _fmt(cell.estimate(name))
            if cell.same_point(name):
                others.append(f"{name} {tv} (= fixed point)")
            else:
                apart = cell.apart(name)
                verdict = "resolved" if excludes_zero(apart) and apart.mean > 0 else "NOT resolved"
                others.append(f"{name} {tv} ({verdict})")
        landed = "yes" if max(own.values) <= LANDED else "**no**"
        rows.append(f"| {cell.variant} | {cell.arm} | {label} | {own.n} | {_fmt(own)} | {max(own.values):.3f} | "
                    f"{landed} | {'; '.join(others)} |")
    return rows


def summary_rows(cells: list[Cell]) -> list[str]:
    """One row per estimator x placement, one column per advantage estimator: the final TV to that cell's own
    fixed point (mean ± 95% over seeds), `landed` or `NOT landed`, and `apart` when it is resolved apart from
    every candidate that is not the same point (else the candidates it is not told apart from)."""
    variants = [v for v in VARIANTS if any(c.variant == v for c in cells)]
    rows = ["| run | " + " | ".join(variants) + " |", "|---" * (1 + len(variants)) + "|"]
    for arm in dict.fromkeys(c.arm for c in cells):
        entries = []
        for variant in variants:
            cell = next((c for c in cells if c.variant == variant and c.arm == arm), None)
            if cell is None:
                entries.append("not run")
                continue
            own = cell.estimate("fixed_point")
            close = [name for name in cell.candidates if not cell.same_point(name)
                     and not (excludes_zero(cell.apart(name)) and cell.apart(name).mean > 0)]
            landed = "landed" if max(own.values) <= LANDED else "**NOT landed**"
            entries.append(f"{_fmt(own)} {landed}" + (f", not told from {', '.join(close)}" if close else ""))
        rows.append(f"| {arm} | " + " | ".join(entries) + " |")
    return rows


def crossover(cells: list[Cell], variant: str = "rloo") -> list[str]:
    """The crossover's lines: k3 in the loss against the forward-KL optimum, k3+ against the reverse one, each
    margin (TV to the other optimum - TV to its own) with its spread over seeds and their ratio."""
    lines = []
    for arm, own, other in (("loss:k3", "forward_optimum", "reverse_optimum"),
                            ("loss:k3+", "reverse_optimum", "forward_optimum")):
        cell = next((c for c in cells if c.variant == variant and c.arm == arm), None)
        if cell is None:
            lines.append(f"- {arm} under {variant}: not run")
            continue
        margins = Estimate(tuple(cell.distances(other)[s] - cell.distances(own)[s] for s in sorted(cell.records)))
        ratio = margins.mean / margins.sd if margins.sd else float("inf")
        verdict = "met" if ratio >= CROSSOVER_RATIO else "missed"
        lines.append(f"- {arm} under {variant}: TV to {own} {_fmt(cell.estimate(own))}, to {other} "
                     f"{_fmt(cell.estimate(other))}; margin {margins.mean:.3f}, sd over seeds "
                     f"{margins.sd if margins.sd is not None else float('nan'):.4f}: {ratio:.0f}x its spread "
                     f"({verdict}, target {CROSSOVER_RATIO:.0f}x)")
    return lines


# The advantage model tree_plain_flow follows for each variant's runs. Not grpo: each of its steps sums over every
# group of 8 of the tree's responses, ~2 minutes a cell on a CPU (docs/results.md has the command for one).
PLAIN_FLOW_MODELS = {"rloo": "exact", "gae": "gae"}


def plain_flow_rows(cells: list[Cell]) -> list[str]:
    """For each tree cell that did not land: where lab.theory.fixed_points.tree_plain_flow (plain gradient ascent on
    tabular logits, from the same pi_ref) ends, and each seed's final TV to that point (mean ± 95%, max). A
    cell is at that point when every seed is within LANDED of it."""
    import torch

    from lab.theory.fixed_points import tree_plain_flow
    from lab.theory.optima import tv

    rows = ["| advantage | run | TV to its fixed point | TV to the plain path's end | max | at the plain path's end |",
            "|---|---|---|---|---|---|"]
    for cell in cells:
        own = cell.estimate("fixed_point")
        if max(own.values) <= LANDED:
            continue
        if cell.variant not in PLAIN_FLOW_MODELS:
            rows.append(f"| {cell.variant} | {cell.arm} | {_fmt(own)} | not computed | | |")
            continue
        arm = Arm.parse(cell.arm)
        # the corrected loss has the on-policy gradient of k2 in the loss (lab.landing.run_kl)
        estimator, placement = ("k2", "loss") if arm.placement == "loss-corrected" else (arm.estimator, arm.placement)
        first_record = next(iter(cell.records.values()))
        ref, rewards = (torch.tensor(first_record[k], dtype=torch.float64) for k in ("ref", "rewards"))
        first = ref.sum(-1)  # pi_ref is the reference model's: the same for every seed of a cell
        f, s = tree_plain_flow(first, ref / first[:, None], rewards, first_record["beta"], estimator, placement,
                               advantage=PLAIN_FLOW_MODELS[cell.variant])
        end = f[:, None] * s
        tvs = Estimate(tuple(tv(torch.tensor(cell.records[seed]["policy"], dtype=torch.float64), end)
                             for seed in sorted(cell.records)))
        at = "yes" if max(tvs.values) <= LANDED else "**no**"
        rows.append(f"| {cell.variant} | {cell.arm} | {_fmt(own)} | {_fmt(tvs)} | {max(tvs.values):.3f} | {at} |")
    return rows


def from_the_end_rows(cells: list[Cell]) -> list[str]:
    """For each cell that did not land: where the analysis's own dynamics (lab.landing.fixed_point_from: the
    solver, the run's advantage model, clamps and kinks included) go from each seed's final policy. A seed that
    did not land *stays* when the solver moves it by at most LANDED (in TV): the run ended on another stable
    point of the dynamics the fixed point is computed from; it goes *to its fixed point* when the solver from
    there ends within LANDED of it: the run had not got there; else *elsewhere*.

    For the bandit: one state, where the solver's natural gradient and a plain gradient on the logits give every
    token a step of the same sign (pi_x (A_x - E A) against A_x - E A), so a point one leaves the other leaves
    too, only more slowly near a corner. On the tree they weight a prefix's conditional differently (by how often
    it is visited) and can reach different stable points: plain_flow_rows speaks for the tree."""
    import torch

    from lab.landing import fixed_point_from
    from lab.theory.optima import tv

    rows = ["| advantage | run | TV to its fixed point | TV the solver moves it | TV from there to its fixed point "
            "| seeds: landed / stays / to its fixed point / elsewhere |", "|---|---|---|---|---|---|"]
    for cell in cells:
        own = cell.estimate("fixed_point")
        if max(own.values) <= LANDED:
            continue
        moved, left, verdicts = [], [], {"landed": 0, "stays": 0, "to its fixed point": 0, "elsewhere": 0}
        for seed in sorted(cell.records):
            record = cell.records[seed]
            end = torch.tensor(record["policy"], dtype=torch.float64)
            after = fixed_point_from(record, end)
            moved.append(tv(end, after))
            left.append(tv(after, torch.tensor(record["candidates"]["fixed_point"], dtype=torch.float64)))
            if record["metrics"]["theory/tv_to_fixed_point"] <= LANDED:
                verdict = "landed"
            elif moved[-1] <= LANDED:
                verdict = "stays"
            else:
                verdict = "to its fixed point" if left[-1] <= LANDED else "elsewhere"
            verdicts[verdict] += 1
        rows.append(f"| {cell.variant} | {cell.arm} | {_fmt(own)} | {_fmt(Estimate(tuple(moved)))} | "
                    f"{_fmt(Estimate(tuple(left)))} | {' / '.join(str(v) for v in verdicts.values())} |")
    return rows


def landing_report(output_dir: str, seeds: list[int], task: str, runs=LANDING_GRID) -> str:
    """Write <output_dir>/landing.md (the table, the crossover, the cells that did not land) and, with
    matplotlib, <output_dir>/landing.png (TV to the fixed point against steps); returns the markdown."""
    cells = read_cells(output_dir, seeds, runs)
    missed = [f"{c.variant} {c.arm}" for c in cells if max(c.estimate("fixed_point").values) > LANDED]
    lines = [f"# Where the trainer lands: the {task}", "",
             f"Final total variation to each point, mean ± 95% interval over seeds {seeds} (Student t); landed = "
             f"every seed within {LANDED}; apart = the paired difference (TV to the candidate - TV to the fixed "
             "point) resolved above 0.", "", *summary_rows(cells), "", "Every cell and candidate:", "",
             *cell_rows(cells), ""]
    if task == "bandit":
        lines += ["The crossover:", "", *crossover(cells), ""]
    lines += [f"Cells that did not land: {', '.join(missed) if missed else 'none'}."]
    if task == "bandit" and missed:
        lines += ["", "The cells that did not land, with the solver started from each seed's final policy instead of "
                  "pi_ref (the same advantage model, clamps and kinks): a seed that stays is on another stable point "
                  "of those dynamics; one the solver carries to its fixed point had not got there. The solver moves "
                  "every state by its natural gradient, a dying token at full speed, so 'to its fixed point' from "
                  "near a corner says that corner is not stable, not that training would leave it soon:", "",
                  *from_the_end_rows(cells)]
    if task == "tree" and missed:
        lines += ["", "Where there are several stable points, the path decides. The cells that did not land, against "
                  "where plain gradient ascent on tabular logits ends from the same pi_ref (lab.theory.fixed_points."
                  "tree_plain_flow; the solver's natural gradient moves every prefix at full speed, the plain "
                  "gradient each prefix by how often it is visited):", "", *plain_flow_rows(cells)]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(output_dir, "landing.md"), "w", encoding="utf-8") as f:
        f.write(text)
    _figure(output_dir, cells, seeds, task)
    return text


def _figure(output_dir: str, cells: list[Cell], seeds: list[int], task: str) -> str:
    """landing.png: per advantage estimator, the TV to the fixed point against steps (mean over seeds), one
    line per cell (colour: the estimator; solid: in the reward, dashed: in the loss), on a log scale."""
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global state (safe in notebooks)

    from rlhf.tracking import read_metrics

    variants = [v for v in VARIANTS if any(c.variant == v for c in cells)]
    fig = Figure(figsize=(5 * len(variants), 4), layout="constrained")
    axes = fig.subplots(1, len(variants), sharey=True, squeeze=False)
    for ax, variant in zip(axes[0], variants):
        for cell in (c for c in cells if c.variant == variant):
            curves = []
            for seed in cell.records:
                path = _run_path(output_dir, variant, cell.arm, seed, seeds, "metrics.jsonl")
                curves.append([(r["step"], r["theory/tv_to_fixed_point"]) for r in read_metrics(path)
                               if "theory/tv_to_fixed_point" in r])
            steps = [s for s, _ in curves[0]]
            mean = [sum(c[i][1] for c in curves) / len(curves) for i in range(len(steps))]
            placement, estimator = cell.arm.split(":")
            ax.plot(steps, mean, lw=1, label=cell.arm, color=f"C{ESTIMATORS.index(estimator)}",
                    linestyle="-" if placement == "reward" else "--")  # colour: estimator; dashes: a KL loss
        ax.axhline(LANDED, color="k", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(f"{task}, {variant}")
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("TV to its fixed point")
    axes[0][-1].legend(fontsize=6, ncol=2)
    path = os.path.join(output_dir, "landing.png")
    fig.savefig(path, dpi=120)
    return path
