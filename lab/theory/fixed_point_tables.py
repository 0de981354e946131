"""docs/kl.md's fixed-point tables, printed by `python -m lab.theory`.

`fixed_point_report()`: where each estimator x placement converges on BANDIT_EXAMPLE and TREE_EXAMPLE, against
each analytic optimum ('Where each estimator converges'). `advantage_report()`: where each of the trainer's
advantage estimators leaves the policy on BANDIT6_EXAMPLE ('Where the advantage estimator moves the fixed
point').
"""

import math

import torch

from lab.theory.advantage_models import WHITEN_EPS, AdvantageModel
from lab.theory.examples import BANDIT6_EXAMPLE, BANDIT_EXAMPLE, TREE_EXAMPLE, example
from lab.theory.expectations import NOISE_BOUND
from lab.theory.fixed_points import ESTIMATORS, PLACEMENTS, bandit_fixed_point, tree_fixed_point
from lab.theory.optima import (
    OPTIMUM_NAMES,
    kl,
    predicted_bandit,
    predicted_tree,
    predicted_with_advantage,
    reverse_kl_optimum,
    sequence_optimum,
    tilt_peak,
    token_level_optimum,
    tv,
    whitened_optimum,
)


def _residual(distance: float) -> str:
    """A distance to the predicted point: "< 1e-12" at float-noise level, else its value (a real gap)."""
    return f"< {NOISE_BOUND:.0e}" if distance < NOISE_BOUND else f"{distance:.1e}"


def _vec(x: torch.Tensor) -> str:
    return "(" + ", ".join(f"{v:.3f}" for v in x.tolist()) + ")"


def fixed_point_report() -> str:
    """Markdown tables: where each estimator x placement converges on BANDIT_EXAMPLE and TREE_EXAMPLE, with
    the distance (total variation) to each analytic optimum."""
    ex = example(BANDIT_EXAMPLE)
    ref, rewards, beta = ex["ref_probs"], ex["rewards"], ex["beta"]
    optima = {name: f(ref, rewards, beta) for f, name in OPTIMUM_NAMES.items()}
    lines = [
        f"Bandit: pi_ref = {BANDIT_EXAMPLE['ref_probs']}, r = {BANDIT_EXAMPLE['rewards']}, beta = {beta}; the "
        "advantage r_x - E_pi r (advantage=\"exact\", which RLOO gives in expectation); the optima:",
        "",
        *(f"- {name}: {_vec(p)}" for name, p in optima.items()),
        "",
        "| estimator | placement | fixed point | converges to | TV to it | " + " | ".join(
            f"TV to {name} optimum" for name in optima) + " |",
        "|---" * (5 + len(optima)) + "|",
    ]
    for estimator in ESTIMATORS:
        for placement in PLACEMENTS:
            probs = bandit_fixed_point(ref, rewards, beta, estimator, placement)
            label, point = predicted_bandit(ref, rewards, beta, estimator, placement, probs)
            lines.append(f"| {estimator} | {placement} | {_vec(probs)} | {label} | {_residual(tv(probs, point))} | "
                         + " | ".join(f"{tv(probs, p):.3f}" for p in optima.values()) + " |")
    tree = example(TREE_EXAMPLE)
    seq_first, seq_second = sequence_optimum(tree["ref_first"], tree["ref_second"], tree["rewards"], tree["beta"])
    seq_joint = seq_first[:, None] * seq_second
    lines += [
        "",
        f"Tree: pi_ref(a) = {_vec(tree['ref_first'])}, pi_ref(b | a) rows {TREE_EXAMPLE['ref_second']}, "
        f"R(a, b) rows {TREE_EXAMPLE['rewards']}, beta = {tree['beta']}; each token's return less its expected "
        f"value as the advantage (advantage=\"exact\", RLOO's in expectation); the sequence optimum's first token "
        f"{_vec(seq_first)}.",
        "",
        "| estimator | placement | first token pi(a) | converges to | joint TV to it | joint TV to sequence "
        "optimum | first token: TV, KL to the sequence optimum's |",
        "|---|---|---|---|---|---|---|",
    ]
    for estimator in ESTIMATORS:
        for placement in PLACEMENTS:
            first, second = tree_fixed_point(**tree, estimator=estimator, placement=placement)
            label, (p_first, p_second) = predicted_tree(tree, estimator, placement, second, first)
            joint = first[:, None] * second
            lines.append(
                f"| {estimator} | {placement} | {_vec(first)} | {label} | {_residual(tv(joint, p_first[:, None] * p_second))}"
                f" | {tv(joint, seq_joint):.3f} | {tv(first, seq_first):.3f}, {kl(first, seq_first):.3f} |")
    ref1, ref2, rewards, beta = tree["ref_first"], tree["ref_second"], tree["rewards"], tree["beta"]
    tok_first, tok_second = token_level_optimum(ref1, ref2, rewards, beta)
    second_kl = (tok_second * (tok_second.log() - ref2.log())).sum(-1)
    objective = lambda first, second: (first[:, None] * second * (
        rewards - beta * (first.log()[:, None] + second.log() - ref1.log()[:, None] - ref2.log()))).sum().item()
    lines += [
        "",
        f"A KL loss (k2, every X+, full) leaves the second token at the sequence optimum's pi*(b | a) and weights"
        f" prefix a by exp(KL(pi*(.|a) || ref(.|a))) = {_vec(second_kl.exp())} relative to the sequence"
        f" optimum, so E[R] - beta KL(pi || ref) over the sequence is {objective(tok_first, tok_second):.4f}"
        f" instead of its maximum {objective(seq_first, seq_second):.4f}.",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# The advantage estimators' report: docs/kl.md, 'Where the advantage estimator moves the fixed point'.

# (reward, estimator, placement, advantage, n) per row; reward "r" is BANDIT6_EXAMPLE's rewards, "0/1" its
# binary_rewards.
ADVANTAGE_ROWS = (
    *(("r", "k3+", "loss", advantage, n) for advantage, n in (
        ("exact", None), ("rloo", 4), ("rloo", 8), ("drgrpo", 4), ("drgrpo", 8), ("drgrpo", 16), ("grpo", 2),
        ("grpo", 4), ("grpo", 8), ("grpo", 16), ("gae", None))),
    *(("r", "k3", "loss", advantage, n) for advantage, n in (("exact", None), ("drgrpo", 8), ("grpo", 8),
                                                               ("gae", None))),
    *(("r", "k1", "reward", advantage, n) for advantage, n in (("exact", None), ("rloo", 8), ("drgrpo", 8),
                                                                 ("grpo", 8), ("grpo", 16), ("gae", None))),
    *(("0/1", "k3+", "loss", advantage, n) for advantage, n in (("exact", None), ("drgrpo", 8), ("grpo", 8),
                                                                  ("grpo", 16), ("gae", None))),
    ("0/1", "k1", "reward", "grpo", 8),
)


def advantage_report() -> str:
    """Markdown: where each advantage estimator (ADVANTAGE_ROWS) leaves the policy on BANDIT6_EXAMPLE, against
    the idealised advantage's fixed point and the point derived for it, then the whitened advantages' criterion."""
    ex = example(BANDIT6_EXAMPLE)
    ref, beta = ex["ref_probs"], ex["beta"]
    rewards = {"r": ex["rewards"], "0/1": ex["binary_rewards"]}
    lines = [
        f"Bandit: pi_ref = {BANDIT6_EXAMPLE['ref_probs']}, r = {BANDIT6_EXAMPLE['rewards']}, 0/1 reward "
        f"{BANDIT6_EXAMPLE['binary_rewards']}, beta = {beta}. beta's reverse-KL optimum: "
        f"{_vec(reverse_kl_optimum(ref, rewards['r'], beta))} "
        f"(0/1: {_vec(reverse_kl_optimum(ref, rewards['0/1'], beta))}).",
        "",
        "| reward | KL | advantage | fixed point | TV to exact's | converges to | TV to it |",
        "|---|---|---|---|---|---|---|",
    ]
    exact = {}  # the idealised advantage's fixed point of each reward x KL
    for reward, estimator, placement, advantage, n in ADVANTAGE_ROWS:
        model = AdvantageModel(advantage, n)
        probs = bandit_fixed_point(ref, rewards[reward], beta, estimator, placement, advantage=advantage, n=n)
        if (reward, estimator, placement) not in exact:
            exact[reward, estimator, placement] = bandit_fixed_point(ref, rewards[reward], beta, estimator, placement)
        label, point = predicted_with_advantage(ref, rewards[reward], beta, estimator, placement, model)
        distance = "-" if point is None else _residual(tv(probs, point))
        lines.append(f"| {reward} | {estimator}, {placement} | {model.label} | {_vec(probs)} | "
                     f"{tv(probs, exact[reward, estimator, placement]):.3f} | {label} | {distance} |")
    lines += ["", "Whitened advantages against a k2-gradient KL loss (whitened_optimum):", ""]
    for name, r in rewards.items():
        peak = beta * tilt_peak(ref, r)
        if peak < 1:
            lines.append(f"- reward {name}: beta max_t t std_pi_t(r) = {peak:.3f} < 1, no root at the rewards' scale; "
                         f"the whitening's eps stops the flow at t = 1 / (beta sqrt(1e-8)) = "
                         f"{1 / (beta * math.sqrt(WHITEN_EPS)):.3g}: the best arms in ref's ratios.")
        else:
            lines.append(f"- reward {name}: beta max_t t std_pi_t(r) = {peak:.3f} >= 1: the flow stops inside, at "
                         f"{_vec(whitened_optimum(ref, r, beta))}.")
    return "\n".join(lines)
