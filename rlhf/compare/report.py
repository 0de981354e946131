"""The report of a comparison: `<output-dir>/kl_estimators.png` and `<output-dir>/kl_estimators.md`.

Per label: seeds; the mean over seeds and its 95% Student t interval (none with one seed) of the final exact
KL (`kl/full` at the last step), the final `val/accuracy`, the mean reward and each estimator's bias; for the
first three, the difference to `no-kl`, marked resolved when the two 95% intervals do not overlap, else with
a rough number of seeds that would resolve it. Bias here is, per step, an estimator's batch mean minus the
exact KL (`kl/full`) on the same sampled tokens (both per-token means in nats), averaged over the steps; the
trainer logs every estimator in every run whatever the run optimises. The figure shows each curve's mean
over seeds with its 95% interval shaded, and every seed's per-step bias.
"""

from __future__ import annotations

import math
import os

from rlhf.compare.runs import Group, Run, duplicate_seeds, group_runs, load_runs
from rlhf.compare.stats import MAX_SEEDS_ESTIMATE, Estimate, resolved, seeds_to_resolve
from rlhf.kl import PANEL_ESTIMATORS, canonical

REPORT_NAME = "kl_estimators"  # -> kl_estimators.png, kl_estimators.md




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
        "value for n−1 degrees of freedom (a table in rlhf/compare/stats.py). `(n=1)`: one seed, no interval. "
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
