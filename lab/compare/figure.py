"""The figure of a comparison's report, `<output-dir>/kl_estimators.png`.

Top: the claims (claims.py) as a forest plot, each paired difference with its 95% interval, coloured by
verdict. Then, against steps, per run (mean over seeds, 95% interval shaded): the exact reverse KL and the
exact forward KL on log scales, and each run's paired difference to no KL; the task reward, the held-out
accuracy, and the crossover (k3 in the loss minus k3+, forward and reverse KL); last, each estimator's
bias against kl/full, every step of every seed.
"""

from __future__ import annotations

import math
import textwrap
from typing import TYPE_CHECKING

from lab.compare.claims import FORWARD, LAST_STEPS, REFERENCE, REVERSE, Claim
from rlhf.labels import legend_name
from rlhf.stats import Estimate
from rlhf.kl import PANEL_ESTIMATORS, canonical

if TYPE_CHECKING:  # annotations only
    from lab.compare.runs import Group, Run

# Colour = estimator (the same in both placements), line style = placement.
_COLOURS = {"k1": "tab:blue", "k2": "tab:orange", "k3": "tab:green", "k3+": "tab:red", "full": "tab:purple",
            "abs": "tab:brown", "k1+": "tab:pink", "abs+": "tab:olive", "k2+": "tab:cyan"}
_STYLES = {"reward": "-", "loss": "--", "loss-corrected": "-."}
_VERDICT_COLOURS = {"resolved": "tab:green", "contradicted": "tab:red", "measured": "tab:blue"}


def _style(label: str) -> dict:
    if label == "no-kl":
        return dict(color="black", linestyle=":", marker="o")
    placement, _, estimator = label.split(" + ")[0].partition(":")
    return dict(color=_COLOURS.get(canonical(estimator), "tab:gray"), linestyle=_STYLES[placement],
                marker="o" if placement == "reward" else "s")


def _band(by_step: dict[int, list[float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """{step: values over seeds} -> (steps, mean, low, high); low/high NaN where fewer than 2 seeds."""
    steps = sorted(by_step)
    estimates = [Estimate(tuple(by_step[s])) for s in steps]
    half = [math.nan if e.half_width is None else e.half_width for e in estimates]
    return (steps, [e.mean for e in estimates], [e.mean - h for e, h in zip(estimates, half)],
            [e.mean + h for e, h in zip(estimates, half)])


def mean_curve(runs: list[Run], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """`key` against steps over seeds: (steps, mean, low, high), one entry per step that some seed logged;
    low and high bound the 95% interval of the mean (Estimate), NaN where fewer than 2 seeds logged the step."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for step, value in zip(*run.series(key)):
            by_step.setdefault(step, []).append(value)
    return _band(by_step)


def paired_curve(runs: list[Run], reference: list[Run], key: str) -> tuple[list[int], list[float], list[float],
                                                                             list[float]]:
    """Per step, the paired difference run − reference of `key` over the seeds both have: (steps, mean, low,
    high) as mean_curve, the interval being the paired one."""
    theirs = {run.seed: dict(zip(*run.series(key))) for run in reference}
    by_step: dict[int, list[float]] = {}
    for run in runs:
        other = theirs.get(run.seed, {})
        for step, value in zip(*run.series(key)):
            if step in other:
                by_step.setdefault(step, []).append(value - other[step])
    return _band(by_step)


def _plot_band(ax, steps, mean, low, high, style: dict, label: str | None = None) -> None:
    ax.plot(steps, mean, label=label, linewidth=1.6, markersize=3.5, **style)
    ax.fill_between(steps, low, high, color=style["color"], alpha=0.15, linewidth=0)


def _finish(ax, title: str, ylabel: str, log: bool = False) -> None:
    """Titles, integer steps, a grid; a log y axis when asked for and some value is positive. An axis with
    nothing plotted says so (a metric the runs did not log)."""
    from matplotlib.ticker import MaxNLocator

    ax.set(title=title, xlabel="PPO step", ylabel=ylabel)
    values = [y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y)]
    if not values:
        ax.text(0.5, 0.5, "not logged by these runs", transform=ax.transAxes, ha="center", color="gray")
    if log and any(y > 0 for y in values):
        ax.set_yscale("log", nonpositive="mask")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, which="both" if log else "major")


def plot_claims(ax, text_ax, results: list[Claim]) -> None:
    """The forest plot: each claim's paired difference (mean, 95% interval), coloured by its verdict, on a
    symmetric log x axis (linear within ±0.01, so that the small differences and the large ones both show);
    `text_ax`, beside it, holds each row's effect and verdict."""
    rows = list(reversed(results))
    for y, claim in enumerate(rows):
        colour = _VERDICT_COLOURS.get(claim.verdict.split(":")[0], "tab:gray")
        d = claim.difference
        if d is not None and d.n:
            error = None if d.half_width is None else [[d.half_width], [d.half_width]]
            ax.errorbar([d.mean], [y], xerr=error, fmt="o", color=colour, capsize=4, markersize=6)
        elif claim.name == "(e)" and claim.verdict == "resolved":
            ax.plot([0.0], [y], marker="D", color=colour, markersize=6)  # identical: a difference of exactly 0
        text_ax.text(0.0, y, textwrap.fill(f"{claim.effect}: {claim.verdict}", 75), va="center", fontsize=9,
                     color=colour)
    for a in (ax, text_ax):
        a.set_ylim(-0.7, len(rows) - 0.3)
    text_ax.axis("off")
    ax.axvline(0.0, color="gray", linewidth=1)
    ax.set_yticks(range(len(rows)), [f"{c.name} {c.measure.split('; ')[0]}" for c in rows], fontsize=9)
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set(title=f"Claims: paired differences (per seed: mean of the last {LAST_STEPS} steps), 95% t-interval\n"
                 "green = resolved, red = contradicted, blue = measured (no direction claimed), grey = not resolved",
           xlabel="difference, nats per token (symmetric log scale, linear within ±0.01)")
    ax.grid(alpha=0.3, axis="x")


def plot_report(groups: list[Group], results: list[Claim], path: str, title: str) -> None:
    """The whole figure (see the module docstring), written to `path`."""
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global state (safe in notebooks)

    fig = Figure(figsize=(18, 21), layout="constrained")
    grid = fig.add_gridspec(4, 12, height_ratios=[1.1, 1, 1, 0.9])
    plot_claims(fig.add_subplot(grid[0, :7]), fig.add_subplot(grid[0, 7:]), results)
    middle = [fig.add_subplot(grid[r, 4 * i:4 * (i + 1)]) for r in (1, 2) for i in range(3)]
    bottom = [fig.add_subplot(grid[3, 3 * i:3 * (i + 1)]) for i in range(len(PANEL_ESTIMATORS))]
    by_label = {g.label: g for g in groups}
    curves = [
        (REVERSE, "Exact reverse KL(π‖π_ref) on the sampled responses", "kl/full (nats per token, log)", True),
        (FORWARD, "Exact forward KL(π_ref‖π) on the same tokens", "kl/full_forward (nats per token, log)", True),
        ("critic/score/mean", "Task reward on the sampled responses", "critic/score/mean (fraction correct)", False)
        if not any(run.final("val/habit_rate") is not None for g in groups for run in g.runs) else
        ("val/habit_rate", "The planted habit: sampled held-out answers that report the first step's result",
         "val/habit_rate (fraction of sampled answers)", False),
        ("val/accuracy", "Held-out accuracy, greedy decoding", "val/accuracy (fraction correct)", False),
    ]
    for ax, (key, heading, ylabel, log) in zip([middle[0], middle[1], middle[3], middle[4]], curves):
        for group in groups:
            seeds = f" ({len(group.runs)} seeds)" if len(group.runs) > 1 else ""
            _plot_band(ax, *mean_curve(group.runs, key), _style(group.label), legend_name(group.label) + seeds)
        _finish(ax, heading, ylabel, log)
    if REFERENCE in by_label:
        for group in groups:
            if group.label != REFERENCE:
                _plot_band(middle[2], *paired_curve(group.runs, by_label[REFERENCE].runs, REVERSE),
                           _style(group.label))
    middle[2].axhline(0.0, color="black", linestyle=":", linewidth=1)
    _finish(middle[2], "Each run minus no KL, same seed (paired)", "Δ kl/full (nats per token)")
    if "loss:k3" in by_label and "loss:k3+" in by_label:
        for key, colour in ((REVERSE, "tab:red"), (FORWARD, "tab:green")):
            _plot_band(middle[5], *paired_curve(by_label["loss:k3"].runs, by_label["loss:k3+"].runs, key),
                       dict(color=colour, linestyle="-", marker="."), f"Δ {key}")
        middle[5].legend(fontsize=9)
    middle[5].axhline(0.0, color="black", linestyle=":", linewidth=1)
    _finish(middle[5], "Crossover: loss:k3 − loss:k3+, same seed", "Δ KL (nats per token)")
    for ax, estimator in zip(bottom, PANEL_ESTIMATORS):
        for group in groups:
            rows = [r for run in group.runs for r in run.rows
                    if r.get(f"kl/{estimator}") is not None and r.get(REVERSE) is not None]
            style = _style(group.label)
            ax.plot([r[REVERSE] for r in rows], [r[f"kl/{estimator}"] - r[REVERSE] for r in rows],
                    linestyle="none", marker=style["marker"], color=style["color"], markersize=4, alpha=0.8)
        ax.axhline(0.0, color="gray", linewidth=0.8)
        ax.set(title=f"Bias of {estimator}: kl/{estimator} − kl/full\n(every step of every seed)",
               xlabel="exact KL, kl/full (nats per token)", ylabel=f"kl/{estimator} − kl/full (nats per token)")
        ax.ticklabel_format(axis="both", style="sci", scilimits=(-2, 3))
        ax.grid(alpha=0.3)
    handles, labels = middle[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 5), fontsize=10,
               title="placement: estimator (colour = estimator; solid/circle = in the reward, dashed/square = "
                     "in the loss, dash-dot/square = in the loss with the off-policy correction)\n"
                     "lines: mean over seeds; shaded: its 95% interval (Student t; none with one seed)")
    fig.suptitle(title, fontsize=13)
    fig.savefig(path, dpi=100)
