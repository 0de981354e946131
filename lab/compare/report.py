"""The report of a comparison: `<output-dir>/kl_estimators.png` and `<output-dir>/kl_estimators.md`.

It opens with the claims (claims.py): each claim a training run can show, its paired effect with 95%
interval, and the verdict. Then per run: seeds; the mean over seeds and its 95% Student t interval of the
exact reverse and forward KL (each seed's mean over its last claims.LAST_STEPS steps), the final
`val/accuracy` and the mean reward, each with its paired difference to `no-kl` (per seed, then over seeds),
resolved when the paired interval excludes 0, else with a rough number of seeds that would resolve it; and
each estimator's bias, its batch mean minus `kl/full` on the same sampled tokens (both per-token means in
nats), averaged over the steps (the trainer logs every estimator in every run). The figure is figure.py's.
"""

from __future__ import annotations

import os

from lab.compare.claims import FORWARD, LAST_STEPS, REFERENCE, REVERSE, claims, claims_table, late, unresolved
from lab.compare.figure import plot_report
from lab.compare.habit import HABIT, SAMPLED_ACCURACY, habit_claims, prediction, prediction_lines, predicted_sign
from rlhf.labels import legend_name
from lab.compare.runs import Group, Run, duplicate_seeds, group_runs, load_runs
from rlhf.stats import Estimate, excludes_zero, paired_differences
from rlhf.kl import PANEL_ESTIMATORS

REPORT_NAME = "kl_estimators"  # -> kl_estimators.png, kl_estimators.md

# The outcome columns, each followed by its paired difference to no KL: (header, number per seed, format).
OUTCOMES = (
    (f"exact KL, last {LAST_STEPS} steps", late(REVERSE), ".4f"),
    (f"forward KL, last {LAST_STEPS} steps", late(FORWARD), ".4f"),
    ("final val/accuracy", lambda run: run.final("val/accuracy"), ".3f"),
    ("mean reward", lambda run: run.average("critic/score/mean"), ".3f"),
)
# With trainer.val_samples (and, for the habit, the embedded default's held-out problems): the sampled ones.
SAMPLED_OUTCOMES = (
    ("final sampled val/pass@1", lambda run: run.final(SAMPLED_ACCURACY), ".3f"),
    ("final sampled val/habit_rate", lambda run: run.final(HABIT), ".3f"),
)


def outcomes(groups: list[Group]) -> tuple:
    """OUTCOMES, and each of SAMPLED_OUTCOMES that some run logged."""
    logged = [o for o in SAMPLED_OUTCOMES if any(o[1](run) is not None for g in groups for run in g.runs)]
    return (*OUTCOMES, *logged)


def interval_cell(estimate: Estimate, spec: str) -> str:
    """`mean ± half-width` of the 95% interval; `mean (n=1)` with one seed (no interval); `n/a` with none."""
    if estimate.n == 0:
        return "n/a"
    if estimate.half_width is None:
        return f"{format(estimate.mean, spec)} (n=1)"
    return f"{format(estimate.mean, spec)} ± {format(estimate.half_width, spec.lstrip('+'))}"


def difference_cell(difference: Estimate, spec: str) -> str:
    """A paired difference run − no KL: `mean ± half-width resolved`, or `not resolved` with why or ~how many
    seeds would resolve it (`n/a` without common seeds)."""
    if difference.n == 0:
        return "n/a"
    cell = interval_cell(difference, "+" + spec.lstrip("+"))
    if excludes_zero(difference):
        return f"{cell} resolved"
    return f"{cell} {unresolved(difference)}"


def _steps_cell(group: Group) -> str:
    last, total = min(r.last_step for r in group.runs), max(r.total_steps for r in group.runs)
    return f"{last}" if last >= total else f"{last}/{total} ⚠"


def _seeds_cell(group: Group) -> str:
    return f"{len(group.runs)}" + (f" (+{len(group.stopped)} stopped early, left out)" if group.stopped else "")


def report_table(groups: list[Group]) -> str:
    """Markdown: one row per run label: seeds, steps, each outcome (mean ± 95% half-width over seeds) with its
    paired difference to no KL when there is a no-kl run, each estimator's bias (mean over steps, then over
    seeds)."""
    reference = next((g for g in groups if g.label == REFERENCE), None)
    head = ["run", "seeds", "steps"]
    for name, _, _ in outcomes(groups):
        head += [f"{name} (mean ± 95% CI)"] + ([f"Δ {name} vs no KL (paired)"] if reference else [])
    head += [f"{e} bias (mean ± 95% CI)" for e in PANEL_ESTIMATORS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in groups:
        cells = [legend_name(group.label), _seeds_cell(group), _steps_cell(group)]
        for _, number, spec in outcomes(groups):
            cells.append(interval_cell(group.estimate(number), spec))
            if reference is group:
                cells.append("reference")
            elif reference:
                difference = paired_differences(group.per_seed(number), reference.per_seed(number))
                cells.append(difference_cell(difference, spec))
        cells += [interval_cell(group.estimate(lambda run, e=e: run.mean_bias(e)), "+.1e") for e in PANEL_ESTIMATORS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _common(runs: list[Run], getter) -> str:
    values = sorted({str(getter(r.config)) for r in runs})
    return values[0] if len(values) == 1 else "differs: " + ", ".join(values)


def _coefficients(reward: float, loss: float) -> str:
    """`0.1` when the reward's and the loss's coefficient are one number (the grid's), else `0.1 (reward), 0.2 (loss)`."""
    return f"{reward}" if reward == loss else f"{reward} (reward), {loss} (loss)"


def _seeds_text(groups: list[Group]) -> str:
    """`seed 42` or `seeds 42, 43, 44` (all the seeds any run used)."""
    seeds = sorted({s for g in groups for s in g.seeds})
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def _claims_text() -> list[str]:
    """What the claims table's columns and verdicts mean."""
    return [
        f"Each claim is judged on a **paired** difference: for every seed both runs have, the run's number "
        f"minus the other's (the KL averaged over the last {LAST_STEPS} steps of that seed), then the mean of "
        "these differences over the seeds and its 95% Student t interval. Runs with the same seed see the "
        "same prompts and, with `rollout.paired_noise`, the same sampling noise, so what the seed does to both "
        "cancels. *resolved*: the interval excludes 0 in the direction claimed; *contradicted*: it excludes 0 "
        "in the other; *not resolved (~N seeds)*: it contains 0, and about N seeds would resolve it if the "
        "mean and the spread of the per-seed differences stayed as observed (the smallest N with "
        "t(N−1)·sd/√N < |mean|; it assumes the observed spread, whose own 95% interval with 3 seeds is 0.52x "
        "to 6.3x it, and every seed starts from the one warm start); *measured*: no direction claimed. "
        "(b) is resolved when k1 in the loss ends above each of (a)'s runs (each paired interval above 0), "
        "and says where it ends against no KL when that resolves too (*not small*: it moves the KL by more "
        "than the smallest of (a)'s differences); "
        "(e) compares every logged number but the KL loss's own value and the clocks.",
    ]


def _explanation(groups: list[Group], coef: str) -> list[str]:
    """The paragraphs that say what the per-run table's numbers are and how differences are judged."""
    start = [r.series("val/accuracy")[1][0] for g in groups for r in g.runs if r.series("val/accuracy")[1]]
    start_text = ("n/a" if not start else f"{start[0]:.3f} in every run" if min(start) == max(start)
                  else f"{min(start):.3f} to {max(start):.3f} over the runs")
    paired_noise = _common([r for g in groups for r in g.runs],
                           lambda c: c.get("rollout", {}).get("paired_noise", False))
    differences = (
        "**Differences to no KL** (Δ, paired): per seed, the run's number minus no KL's with the same seed, "
        "then the mean of those over the seeds ± its 95% half-width; *resolved* when that interval excludes 0. "
        "An unresolved difference shows ~N seeds, the seeds that would resolve it at the observed mean and "
        "spread of the per-seed differences. `(n=1)`: a single seed has no interval, so nothing can be "
        "resolved or sized: run more seeds (`--seeds N`)."
        if any(g.label == REFERENCE for g in groups) else
        f"No `{REFERENCE}` run, so no differences to it are shown.")
    return [
        f"KL coefficient: {coef}; `rollout.paired_noise`: {paired_noise}. All KL numbers are "
        "per-token means in nats over the sampled response tokens: exact KL = `kl/full`, the full-vocabulary "
        "reverse KL(π‖π_ref); forward KL = `kl/full_forward`, KL(π_ref‖π) on the same tokens.",
        "",
        f"**Per seed, then over seeds.** Each number is first taken per run of one seed: the KLs averaged over "
        f"its last {LAST_STEPS} steps, the final `val/accuracy` (its last evaluation), the mean reward "
        "(`critic/score/mean`, the task score of the sampled responses, averaged over the steps) and each "
        "estimator's bias (its logged batch mean `kl/<estimator>` minus `kl/full` on the same tokens, averaged "
        "over the steps). A cell is the mean of these over the run's n seeds ± the half-width of its 95% "
        "interval, t·sd/√n, with sd the sample standard deviation over the seeds and t Student's two-sided 95% "
        "value for n−1 degrees of freedom (a table in rlhf/stats.py). `(n=1)`: one seed, no interval. "
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
        lines += ["", "Seeds found twice (each copy counted as a seed, the last one paired): "
                  + "; ".join(duplicates) + "."]
    return lines


def write_report(directory: str, status: dict[str, str] | None = None) -> tuple[str, str]:
    """Read every run under `directory`, write <directory>/kl_estimators.{png,md}; return their paths."""
    runs = [r for r in load_runs(directory) if r.rows]
    if not runs:
        raise FileNotFoundError(f"no train.py runs (metrics.jsonl + config.yaml) under {directory!r}")
    groups = group_runs(runs)
    habit = prediction(runs)
    beta = runs[0].config["actor"]["kl_loss_coef"]
    results = claims(groups) + habit_claims(groups, predicted_sign(habit, beta))
    steps = _common(runs, lambda c: c["trainer"]["total_steps"])
    coef = _common(runs, lambda c: _coefficients(c["algorithm"]["kl_ctrl"]["kl_coef"], c["actor"]["kl_loss_coef"]))
    lr = _common(runs, lambda c: c["actor"].get("lr"))
    model = _common(runs, lambda c: c["model"]["path"])
    title = (f"KL estimators × placement: {len(groups)} runs, model {model}, {steps} PPO steps, "
             f"KL coefficient {coef}, actor lr {lr}, {_seeds_text(groups)}")
    png = os.path.join(directory, f"{REPORT_NAME}.png")
    md = os.path.join(directory, f"{REPORT_NAME}.md")
    plot_report(groups, results, png, title)
    lines = [f"# {title}", "", "## Claims", "", claims_table(results), "", *_claims_text(), "",
             *prediction_lines(habit, groups), "## Per run", "", *_explanation(groups, coef), "", report_table(groups), "",
             f"![KL estimators]({REPORT_NAME}.png)", *_notes(groups, status)]
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    write_curves(groups, os.path.join(directory, CURVES_NAME))
    return png, md


CURVES_NAME = "curves.json"  # the mean curves, small enough to ship (the notebook plots docs/kl_binding_curves.json)
CURVE_KEYS = ("kl/full", "kl/full_forward", "val/accuracy", "val/pass@1", "val/habit_rate", "critic/score/mean")


def write_curves(groups: list[Group], path: str) -> None:
    """{label: {key: {"steps", "mean", "low", "high"}}} for CURVE_KEYS, each the mean over seeds with its 95%
    interval (figure.mean_curve; null where one seed), rounded to 5 decimals, as JSON at `path`."""
    import json

    from lab.compare.figure import mean_curve

    def rounded(values):
        return [None if v != v else round(v, 5) for v in values]  # NaN (one seed: no interval) -> null

    out = {}
    for group in groups:
        curves = {}
        for key in CURVE_KEYS:
            steps, mean, low, high = mean_curve(group.runs, key)
            if steps:
                curves[key] = {"steps": steps, "mean": rounded(mean), "low": rounded(low), "high": rounded(high)}
        out[group.label] = {"seeds": group.seeds, "curves": curves}
    with open(path, "w") as f:
        json.dump(out, f)
