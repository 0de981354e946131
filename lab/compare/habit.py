"""The embedded default's planted habit in a comparison: what the KL placements predict for it, and the claims.

The warm start often reports the first step's result as its final answer, which the reward scores 0
(lab.habit). Where training stops on such a behaviour of the reference depends on the KL's direction
(docs/kl.md, "The habit a forward KL keeps"): the forward KL that k3 in the loss regularises keeps at least
beta q / (1 + beta) of it at each decision where the reference gives it q, while the reverse KL of k1 in the
reward and k2, k3+, full in the loss keeps the reference's share tilted by e^(-1/beta), which is more where the
reference gives the right answer almost nothing. `prediction` reads the reference's probabilities at the
decision token off the runs' own warm start and says which of the two keeps more habit at the runs' coefficient;
`habit_claims` judges that on the sampled `val/habit_rate` at the end of the runs, paired by seed, and
measures the forward KL next to it (no direction: the fixed points order it only at the decision token).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from lab.compare.claims import FORWARD, Claim, difference_claim
from rlhf.stats import Estimate

if TYPE_CHECKING:  # annotations only
    from lab.compare.runs import Group, Run

HABIT = "val/habit_rate"  # sampled at the rollout temperature (trainer.val_samples responses per problem)
SAMPLED_ACCURACY = "val/pass@1"  # the sampled responses' accuracy
END = " (end of run)"  # the claims' measure: an evaluation metric's last value, a KL's last steps
FORWARD_RUNS = ("loss:k3",)  # regularise KL(ref || pi)
REVERSE_RUNS = ("loss:k3+", "loss:k2", "loss:full", "reward:k1")  # regularise KL(pi || ref)


def final(key: str):
    """A run -> its last logged value of `key` (an evaluation metric: the end of the run)."""
    return lambda run: run.final(key)


def prediction(runs: list[Run]) -> dict | None:
    """lab.habit.predict at the runs' KL coefficient from their warm start, with `reach`, the share of the
    reference's habit probability that its sampled responses show (step 0's val/habit_rate over the
    predicted reference rate: responses that miss the reasoning lines never reach the decision), and each
    limit times it. None unless every run is the embedded default with val/habit_rate logged and its warm
    start cached."""
    from rlhf.config import from_dict
    from rlhf.embedded import cache_entry, embedded_cache_dir, embedded_options
    from lab.habit import held_out_problems, predict
    from rlhf.models import load_causal_lm, load_tokenizer

    configs = [run.config for run in runs]
    starts = [run.series(HABIT)[1][0] for run in runs if run.series(HABIT)[0][:1] == [0]]
    if not starts or any(c["model"]["path"] != "embedded" or c["data"]["val_files"] != "embedded" for c in configs):
        return None
    cfg = from_dict(configs[0])
    if not os.path.isdir(cache_entry(embedded_cache_dir(cfg), embedded_options(cfg))):
        return None
    betas = sorted({c["actor"]["kl_loss_coef"] for c in configs} | {c["algorithm"]["kl_ctrl"]["kl_coef"] for c in configs})
    artifacts, problems = held_out_problems(cfg)
    # (the solver inside takes gradients: no torch.no_grad here; decision_probabilities has its own)
    out = predict(load_causal_lm(artifacts.model_dir).eval(), load_tokenizer(artifacts.model_dir), problems,
                  betas, cfg.rollout.temperature)
    out["measured_start"] = sum(starts) / len(starts)
    out["reach"] = out["measured_start"] / out["reference_rate"]
    out["decisions"] = decision_rates(runs, problems, cfg.rollout.temperature)
    return out


def decision_rates(runs: list[Run], problems, temperature: float) -> dict[str, dict[int, float]]:
    """{label: {seed: the habit's probability at the decision token, summed over the held-out problems and
    divided by their number}} of each run's exported model (`<run>/model`, the end of the run): the number
    the prediction is about, free of whether a response reaches the decision. Runs without a model are
    left out."""
    from lab.habit import decision_probabilities
    from rlhf.models import load_causal_lm, load_tokenizer

    out: dict[str, dict[int, float]] = {}
    for run in runs:
        model_dir = os.path.join(run.path, "model")
        if os.path.isfile(os.path.join(model_dir, "config.json")):
            probs = decision_probabilities(load_causal_lm(model_dir).eval(), load_tokenizer(model_dir), problems,
                                           temperature)
            out.setdefault(run.label, {})[run.seed] = probs[:, 0].sum().item() / len(problems["question"])
    return out


def predicted_sign(pred: dict | None, beta: float) -> int | None:
    """+1 when the solver's k3 in the loss keeps more habit than its k3+ at `beta`, -1 when less; None without
    a prediction."""
    if pred is None or beta not in pred["betas"]:
        return None
    limits = pred["betas"][beta]
    return 1 if limits["k3"] > limits["k3+"] else -1


def habit_claims(groups: list[Group], sign: int | None) -> list[Claim]:
    """k3 in the loss against k3+ and against k2 in the loss: the sampled habit rate at the end (in the
    direction `sign` the solver's fixed points give, predicted_sign, or just measured), and the forward KL over
    the last steps and the greedy and sampled accuracy, measured: the fixed points order the KLs only at the
    decision token, not over a response's tokens. [] when no run logged val/habit_rate."""
    by_label = {group.label: group for group in groups}
    if not any(run.final(HABIT) is not None for group in groups for run in group.runs):
        return []
    more = {1: "more", -1: "less", None: "a different share"}[sign]
    out = []
    for other in ("loss:k3+", "loss:k2"):
        name = other.split(":")[1]
        out.append(difference_claim(by_label, "habit", f"k3 in the loss keeps {more} of the habit than {name} "
                                    "(prediction)", "loss:k3", other, HABIT, sign, final(HABIT), END))
        out.append(difference_claim(by_label, "habit", f"k3 in the loss against {name}, forward KL", "loss:k3",
                                    other, FORWARD, None, when=END))
    for key in ("val/accuracy", SAMPLED_ACCURACY):
        out.append(difference_claim(by_label, "habit", f"k3 against k3+ in the loss, {key}", "loss:k3", "loss:k3+",
                                    key, None, final(key), END))
    return out


def second_half(key: str):
    """A run -> how much `key` moved over the second half of the run: an evaluation metric from its value at
    the evaluation nearest half the steps to its last value; a per-step one from the mean of the 5 steps up to
    half the steps to the mean of the last 5. None if not logged."""

    def change(run: Run) -> float | None:
        steps, values = run.series(key)
        if len(values) < 2:
            return None
        half = run.total_steps // 2
        if len(values) < 10:  # an evaluation metric
            middle = min(range(len(steps)), key=lambda i: abs(steps[i] - half))
            return values[-1] - values[middle]
        before = [v for s, v in zip(steps, values) if half - 5 < s <= half]
        return sum(values[-5:]) / 5 - sum(before) / len(before) if before else None

    return change


def prediction_lines(pred: dict | None, groups: list[Group]) -> list[str]:
    """The report's habit section: the prediction per coefficient next to each run's measured end."""
    if pred is None:
        return []
    lines = ["## The planted habit: predicted and measured", "",
             f"The warm start at the habit's decision token (lab.habit.decision_probabilities): "
             f"{pred['num_habit_prone']} of {pred['num_problems']} held-out problems can show the habit; it "
             f"gets q = {pred['q_mean']:.2f} on average (median {pred['q_median']:.2f}), a habit rate of "
             f"{pred['reference_rate']:.3f} if every response reached the decision with the right reasoning "
             f"lines; sampled at step 0 it is {pred['measured_start']:.3f}, so reach = {pred['reach']:.2f} of "
             "that shows. Predicted end of training (the limit's habit rate x reach):", "",
             "| KL coefficient | k3 in the loss (forward KL) | k3+, k2, full in the loss; k1 in the reward (reverse KL) |",
             "|---|---|---|"]
    for beta, limits in sorted(pred["betas"].items()):
        lines.append(f"| {beta} | {limits['k3'] * pred['reach']:.3f} | {limits['k3+'] * pred['reach']:.3f} |")
    raw = {beta: (limits["k3"], limits["k3+"]) for beta, limits in pred["betas"].items()}
    lines += ["", "At the end, per run (mean ± 95% CI over seeds): the sampled habit rate, and the habit's "
              "probability at the decision token of the exported model (summed over the problems / "
              f"{pred['num_problems']}, as the prediction's raw rate: k3 in the loss "
              + ", ".join(f"{k3:.3f}" for k3, _ in raw.values()) + "; the reverse KL "
              + ", ".join(f"{rev:.3f}" for _, rev in raw.values()) + f"; the warm start {pred['reference_rate']:.3f}).",
              "Settled: the change over the second half of the run, per seed then over seeds (the habit rate from "
              "the evaluation at half the steps to the last; each KL from the mean of the 5 steps up to half the "
              "steps to the mean of the last 5).",
              "", "| run | seeds | sampled val/habit_rate | decision token: habit's probability | Δ habit rate, 2nd half "
              "| Δ kl/full, 2nd half | Δ kl/full_forward, 2nd half |", "|---|---|---|---|---|---|---|"]

    def cell(values) -> str:
        estimate = Estimate(tuple(values))
        if not estimate.n:
            return "n/a"
        return f"{estimate.mean:.3f}" + (f" ± {estimate.half_width:.3f}" if estimate.half_width is not None else "")

    for group in groups:
        sampled = [v for v in map(final(HABIT), group.runs) if v is not None]
        if sampled:
            changes = [cell(v for v in map(second_half(key), group.runs) if v is not None)
                       for key in (HABIT, "kl/full", FORWARD)]
            lines.append(f"| {group.label} | {len(sampled)} | {cell(sampled)} | "
                         f"{cell(pred['decisions'].get(group.label, {}).values())} | " + " | ".join(changes) + " |")
    return lines + [""]
