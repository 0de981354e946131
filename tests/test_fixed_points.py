"""Tests for lab/theory/fixed_points.py and optima.py: where each estimator x placement converges (docs/kl.md,
'Where each estimator converges'). Every solver result is compared, in float64, with an optimum or a stationary condition
written out here from its definition, so that the module's own analytic helpers are checked too."""

import math
import os

import pytest
import torch
from helpers import nudge

from lab import theory
from rlhf.config import AlgorithmConfig
from rlhf.kl import canonical
from lab.theory import advantage_models as am
from lab.theory import examples, fixed_point_tables, optima
from lab.theory import fixed_points as fp
from lab.theory import bandit_fixed_point, tree_fixed_point



def T(*values):
    return torch.tensor(values, dtype=torch.float64)


def random_bandit(seed: int, num_arms: int, beta: float):
    generator = torch.Generator().manual_seed(seed)
    ref = torch.softmax(torch.randn(num_arms, generator=generator, dtype=torch.float64), -1)
    return ref, torch.rand(num_arms, generator=generator, dtype=torch.float64), beta


# Three random bandits and the report's asymmetric one (the best reward on the least likely arm). Reward gaps
# stay below 12 beta, so that verl's k3 clamps are inactive at every optimum.
BANDITS = {
    "seed0": random_bandit(0, 4, 0.3),
    "seed1": random_bandit(1, 6, 0.2),
    "seed2": random_bandit(2, 3, 0.5),
    "asymmetric": tuple(examples.example(examples.BANDIT_EXAMPLE).values()),
}


def reverse_optimum(ref, r, beta):  # pi proportional to ref exp(r / beta)
    w = ref * torch.exp(r / beta)
    return w / w.sum(-1, keepdim=True)


def spread(x):
    return (x.max() - x.min()).item()


# ---------------------------------------------------------------------------------------------------------
# The analytic optima themselves, from their definitions


@pytest.mark.parametrize("bandit", BANDITS)
def test_analytic_optima_satisfy_their_definitions(bandit):
    ref, r, beta = BANDITS[bandit]
    rev, fwd = optima.reverse_kl_optimum(ref, r, beta), optima.forward_kl_optimum(ref, r, beta)
    assert torch.allclose(rev, reverse_optimum(ref, r, beta), rtol=1e-12)
    # forward KL: stationarity r + beta ref / pi = lam, on the simplex
    assert abs(fwd.sum().item() - 1) < 1e-12 and spread(r + beta * ref / fwd) < 1e-10
    # TV: a linear programme; no Dirichlet sample and no vertex scores higher
    objective = lambda pi: (pi * r).sum(-1) - beta * (pi - ref).abs().sum(-1)
    samples = torch.distributions.Dirichlet(torch.ones(len(ref), dtype=torch.float64)).sample((4000,))
    candidates = torch.cat([samples, torch.eye(len(ref), dtype=torch.float64), ref[None]])
    assert objective(optima.tv_optimum(ref, r, beta)) >= objective(candidates).max() - 1e-12


def test_tv_optimum_by_hand():
    ref, r = T(0.4, 0.3, 0.2, 0.1), T(0.0, 0.3, 0.6, 1.0)
    # gaps to the best arm: 1.0, 0.7, 0.4; 2 beta = 0.5: arms 0 and 1 give their mass to arm 3
    assert torch.allclose(optima.tv_optimum(ref, r, 0.25), T(0.0, 0.0, 0.2, 0.8), atol=1e-15)
    assert torch.allclose(optima.tv_optimum(ref, r, 0.6), ref, atol=1e-15)  # every gap <= 2 beta: stay at ref


def test_sequence_optimum_is_the_joint_optimum():
    tree = examples.example(examples.TREE_EXAMPLE)
    ref1, ref2, rewards, beta = tree["ref_first"], tree["ref_second"], tree["rewards"], tree["beta"]
    first, second = optima.sequence_optimum(ref1, ref2, rewards, beta)
    joint = (ref1[:, None] * ref2 * torch.exp(rewards / beta)).flatten()
    assert torch.allclose(first[:, None] * second, (joint / joint.sum()).view(3, 3), rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# The direction the solver follows is the trainer's expected gradient, divided by pi


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"])
def test_solver_direction_is_the_expected_gradient(name):
    ref, _, _ = BANDITS["seed0"]
    logits = T(0.3, -1.1, 0.4, 0.9)
    pi = torch.softmax(logits, -1)
    for placement, expected in (("loss", theory.expected_loss_grad), ("reward", theory.expected_reward_grad)):
        p = fp.token_penalty(logits, ref, name, placement)
        assert torch.allclose(pi * (p - (pi * p).sum()), expected(name, logits, ref), atol=1e-14), placement


def test_full_direction_is_the_exact_gradient_and_constant_in_the_reward():
    ref, _, _ = BANDITS["seed0"]
    logits = T(0.3, -1.1, 0.4, 0.9)
    pi = torch.softmax(logits, -1)
    p = fp.token_penalty(logits, ref, "full", "loss")
    target = theory.divergence_grad(theory.reverse_kl, logits, ref)
    assert torch.allclose(pi * (p - (pi * p).sum()), target, atol=1e-14)
    p = fp.token_penalty(logits, ref, "full", "reward")  # the state's KL, the same for every token
    assert spread(p) == 0 and abs(p[0].item() - theory.reverse_kl(logits, ref).item()) < 1e-14


# ---------------------------------------------------------------------------------------------------------
# Bandit: every estimator x placement against its optimum or stationary condition

ANALYTIC_ROWS = {
    ("k1", "reward"): reverse_optimum, ("k1+", "reward"): reverse_optimum,
    ("k2", "loss"): reverse_optimum, ("k1+", "loss"): reverse_optimum, ("k3+", "loss"): reverse_optimum,
    ("abs+", "loss"): reverse_optimum, ("full", "loss"): reverse_optimum,
    ("k3", "loss"): lambda ref, r, beta: optima.forward_kl_optimum(ref, r, beta),
    ("abs", "loss"): lambda ref, r, beta: optima.tv_optimum(ref, r, beta),
    ("k1", "loss"): lambda ref, r, beta: torch.nn.functional.one_hot(r.argmax(), len(r)).double(),
    ("full", "reward"): lambda ref, r, beta: torch.nn.functional.one_hot(r.argmax(), len(r)).double(),
}


@pytest.mark.parametrize("bandit", BANDITS)
@pytest.mark.parametrize("row", ANALYTIC_ROWS, ids="-".join)
def test_bandit_reaches_its_analytic_optimum(row, bandit):
    ref, r, beta = BANDITS[bandit]
    probs = bandit_fixed_point(ref, r, beta, *row)
    assert torch.allclose(probs, ANALYTIC_ROWS[row](ref, r, beta), atol=1e-10, rtol=0)


# The estimators' values, unclamped (every survivor below sits above ref, where no clamp binds).
VALUES = {"k2": lambda d: d ** 2 / 2, "k3": lambda d: torch.exp(-d) - 1 + d, "abs": lambda d: d.abs()}
DEAD_PENALTY = {"k2": math.inf, "k3": 10.0, "abs": math.inf}  # k(d -> -inf): k3 saturates at verl's clamp


@pytest.mark.parametrize("bandit", BANDITS)
@pytest.mark.parametrize("name", ["k2", "k3", "abs", "k2+", "k3+", "abs+", "low_var_kl"])
def test_nonnegative_estimators_in_the_reward_kill_tokens(name, bandit):
    """Stationary: r_x - beta k(d_x) = c on the survivors, each above ref; dead tokens cannot come back."""
    ref, r, beta = BANDITS[bandit]
    probs = bandit_fixed_point(ref, r, beta, name, "reward")
    alive = probs > 1e-10
    d = probs[alive].log() - ref[alive].log()
    base = canonical(name).rstrip("+")
    c = r[alive] - beta * VALUES[base](d)
    assert spread(c) < 1e-8
    assert (d > 0).all()  # a local maximum: the penalty is concave below ref
    assert (probs[~alive] < 1e-12).all()
    assert (r[~alive] - beta * DEAD_PENALTY[base] < c.mean()).all()
    assert torch.allclose(probs, optima.reward_stationary_point(ref, r, beta, name, alive), atol=1e-10, rtol=0)
    assert 0.5 * (probs - reverse_optimum(ref, r, beta)).abs().sum() > 0.05  # not a KL regulariser


def test_abs_in_the_reward_is_the_reverse_kl_optimum_of_its_survivors():
    ref, r, beta = BANDITS["asymmetric"]
    probs = bandit_fixed_point(ref, r, beta, "abs", "reward")
    alive = probs > 1e-10
    assert alive.tolist() == [False, False, True, True]
    assert torch.allclose(probs[alive], reverse_optimum(ref[alive], r[alive], beta), atol=1e-10, rtol=0)


def test_k3_in_the_reward_ascends_reverse_minus_forward_kl():
    """Its expected gradient is that of E r - beta (KL(pi || ref) - KL(ref || pi)), which grows without bound
    as any token's probability goes to 0."""
    ref, _, _ = BANDITS["seed0"]
    logits = T(0.3, -1.1, 0.4, 0.9).requires_grad_(True)
    pi = torch.softmax(logits, -1)
    divergence = (pi * (pi / ref).log()).sum() - (ref * (ref / pi).log()).sum()
    (grad,) = torch.autograd.grad(divergence, logits)
    assert torch.allclose(theory.expected_reward_grad("k3", logits.detach(), ref), grad, atol=1e-14)
    shrink = lambda eps: T(0.5 * (1 - eps), 0.5 * eps, 0.25, 0.25)  # token 1's probability to 0
    reverse_minus_forward = lambda q: ((q * (q / ref).log()).sum() - (ref * (ref / q).log()).sum()).item()
    values = [reverse_minus_forward(shrink(eps)) for eps in (1e-3, 1e-6, 1e-12)]
    assert values[0] > values[1] > values[2] and values[2] < -2


def test_k3_in_the_reward_on_the_asymmetric_bandit_is_the_argmax():
    ref, r, beta = BANDITS["asymmetric"]
    probs = bandit_fixed_point(ref, r, beta, "k3", "reward")
    assert torch.allclose(probs, T(0.0, 0.0, 0.0, 1.0), atol=1e-12, rtol=0)


def test_abs_in_the_loss_stays_at_ref_when_no_gap_exceeds_two_beta():
    ref, r, _ = BANDITS["seed1"]
    beta = 0.6  # every reward gap is below 2 beta = 1.2
    assert torch.allclose(bandit_fixed_point(ref, r, beta, "abs", "loss"), ref, atol=1e-12, rtol=0)


def test_k3_loss_clamp_leaves_far_tokens_to_the_reward():
    """A reward gap over ~13 beta puts the forward-KL optimum below d = -2.61, where k3's clamp zeroes its
    gradient: the module's k3 loss then lets those tokens die."""
    ref, r, beta = T(0.5, 0.3, 0.2), T(0.0, 0.5, 5.0), 0.3
    forward = optima.forward_kl_optimum(ref, r, beta)
    assert (forward.log() - ref.log())[:2].max() < -2.61 and forward[:2].min() > 0.01
    assert torch.allclose(bandit_fixed_point(ref, r, beta, "k3", "loss"), T(0.0, 0.0, 1.0), atol=1e-12, rtol=0)


def test_solver_raises_when_not_converged_and_on_bad_input():
    ref, r, beta = BANDITS["seed0"]
    with pytest.raises(RuntimeError, match="not converged after 1 steps"):
        bandit_fixed_point(ref, r, beta, "k1", "reward", max_steps=1)
    tree = examples.example(examples.TREE_EXAMPLE)
    with pytest.raises(RuntimeError, match="not converged after 5 steps"):
        tree_fixed_point(**tree, estimator="k2", placement="loss", max_steps=5)
    for bad, error in ((dict(estimator="k4"), "unknown KL estimator"), (dict(placement="both"), "unknown placement"),
                       (dict(beta=0.0), "beta must be > 0")):
        args = dict(ref_probs=ref, rewards=r, beta=beta, estimator="k1", placement="reward") | bad
        with pytest.raises(ValueError, match=error):
            bandit_fixed_point(**args)


# ---------------------------------------------------------------------------------------------------------
# The two-step tree: sequence-level against token-level optima

TREE = examples.example(examples.TREE_EXAMPLE)
REF1, REF2, R, BETA = TREE["ref_first"], TREE["ref_second"], TREE["rewards"], TREE["beta"]
SEQ_FIRST, SEQ_SECOND = optima.sequence_optimum(REF1, REF2, R, BETA)


def assert_tree(got, first, second, atol=1e-10):
    assert torch.allclose(got[0], first, atol=atol, rtol=0) and torch.allclose(got[1], second, atol=atol, rtol=0)


@pytest.mark.parametrize("name", ["k1", "k1+"])
def test_k1_in_the_reward_reaches_the_sequence_optimum(name):
    assert_tree(tree_fixed_point(REF1, REF2, R, BETA, name, "reward"), SEQ_FIRST, SEQ_SECOND)


@pytest.mark.parametrize("name", ["k2", "k1+", "k3+", "abs+", "full"])
def test_a_kl_loss_reaches_only_the_token_level_optimum(name):
    first, second = tree_fixed_point(REF1, REF2, R, BETA, name, "loss")
    assert torch.allclose(second, SEQ_SECOND, atol=1e-10, rtol=0)  # each conditional is right ...
    value = (second * R).sum(-1)  # E_{b ~ pi(.|a)} R(a, b), the second token's KL left out
    assert torch.allclose(first, reverse_optimum(REF1, value, BETA), atol=1e-10, rtol=0)
    # ... the first token is off by exp(KL(pi*(.|a) || ref(.|a))), prefix 0 (the 1% token) most
    second_kl = (SEQ_SECOND * (SEQ_SECOND / REF2).log()).sum(-1)
    ratio = first / SEQ_FIRST
    assert torch.allclose(ratio / ratio.sum(), second_kl.exp() / second_kl.exp().sum(), atol=1e-10, rtol=0)
    assert 0.5 * (first - SEQ_FIRST).abs().sum() > 0.2 and first.argmax() == 0 and SEQ_FIRST.argmax() == 1


def test_k3_loss_on_the_tree_is_the_token_level_forward_kl_optimum():
    first, second = tree_fixed_point(REF1, REF2, R, BETA, "k3", "loss")
    assert all(spread(R[a] + BETA * REF2[a] / second[a]) < 1e-9 for a in range(3))
    value = (second * R).sum(-1)
    assert spread(value + BETA * REF1 / first) < 1e-9 and abs(first.sum().item() - 1) < 1e-12


def test_abs_and_k1_losses_on_the_tree():
    # abs: prefix 0's second token takes R = 2 (gaps 2 and 1.9 > 2 beta = 1); the others stay at ref; then
    # V = (2, 0.6, 0.14) and the first token goes to prefix 0 (gaps 1.4 and 1.86 > 1)
    second = torch.stack([T(1.0, 0.0, 0.0), REF2[1], REF2[2]])
    assert_tree(tree_fixed_point(REF1, REF2, R, BETA, "abs", "loss"), T(1.0, 0.0, 0.0), second)
    # k1: no regularisation on either token: the best continuation, then the best prefix
    corners = torch.nn.functional.one_hot(R.argmax(-1), 3).double()
    assert_tree(tree_fixed_point(REF1, REF2, R, BETA, "k1", "loss"), T(1.0, 0.0, 0.0), corners)


def test_full_in_the_reward_on_the_tree():
    """Each token's own state KL is the same for every choice; the first token sees the second's."""
    corners = torch.nn.functional.one_hot(R.argmax(-1), 3).double()
    scores = R.max(-1).values + BETA * (corners * REF2).sum(-1).log()  # R(a, b*) - beta KL(corner || ref)
    first = torch.nn.functional.one_hot(scores.argmax(), 3).double()
    assert_tree(tree_fixed_point(REF1, REF2, R, BETA, "full", "reward"), first, corners)


@pytest.mark.parametrize("name", ["k2", "k3", "abs", "k3+"])
def test_nonnegative_estimators_in_the_reward_on_the_tree(name):
    first, second = tree_fixed_point(REF1, REF2, R, BETA, name, "reward")
    value = VALUES[name.rstrip("+")]
    returns = torch.zeros(3, dtype=torch.float64)
    for a in range(3):  # per state: stationary on the survivors, each above ref
        alive = second[a] > 1e-10
        d = second[a][alive].log() - REF2[a][alive].log()
        assert spread(R[a][alive] - BETA * value(d)) < 1e-8 and (d > 0).all()
        returns[a] = (second[a][alive] * (R[a][alive] - BETA * value(d))).sum()
    alive = first > 1e-10
    d = first[alive].log() - REF1[alive].log()
    assert spread(returns[alive] - BETA * value(d)) < 1e-8 and (d >= 0).all()


@pytest.fixture(scope="module")
def report():
    return fixed_point_tables.fixed_point_report()


def test_report_tables(report):
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| k") or line.startswith("| a")
            or line.startswith("| f")]
    assert len(rows) == 2 * 2 * len(fp.ESTIMATORS)  # bandit and tree, both placements
    # 'TV to it': every row where the analysis says, to float noise, which is printed as a bound (its digits
    # differ between machines: 3.5e-17 on one CPU, 4.2e-17 on another)
    assert all(row[4] == "< 1e-12" for row in rows)
    assert "| k3 | loss | (0.096, 0.102, 0.115, 0.687) | forward KL optimum |" in report
    assert "| k2 | loss | (0.511, 0.373, 0.115) | token-level reverse KL |" in report
    assert "| k1 | reward | (0.299, 0.541, 0.160) | sequence |" in report
    # docs/kl.md's section 'Where each estimator converges' carries every line of it (at digits that are the
    # same on every machine: test_report_digits_are_those_of_any_machine)
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "kl.md"), encoding="utf-8").read()
    section = docs[docs.index("## Where each estimator converges"):]
    assert [line for line in report.splitlines() if line not in section] == []


# ---------------------------------------------------------------------------------------------------------
# The trainer's advantage estimators (lab/theory/advantage_models.py; docs/kl.md, 'Where the advantage estimator
# moves the fixed point')

GROUP_MODELS = [("rloo", 2), ("rloo", 4), ("grpo", 2), ("grpo", 4), ("grpo", 8), ("drgrpo", 3), ("drgrpo", 8)]
# Scores with few binary digits, so that the trainer's float32 group means are exact: a group of equal scores
# then gets advantage 0 there too, as in the model (eight float32 scores of 0.7 get 0.056 each, from the
# rounding of their mean over the group's std + 1e-6).
DYADIC_SCORES = T(0.0, 0.25, 0.5, 0.75, 1.0, 0.125)


def trainer_advantages(scores: torch.Tensor, arms: torch.Tensor, advantage: str) -> torch.Tensor:
    """core_algos.group_outcome_advantages of groups of arms (G, n): each sample's advantage (G, n), float64."""
    from rlhf import core_algos

    num_groups, n = arms.shape
    token_rewards = scores.float()[arms.flatten()][:, None]  # (G * n, 1): a one-token response
    group_ids = torch.arange(num_groups).repeat_interleave(n)
    estimator, norm_by_std = {"grpo": ("grpo", True), "drgrpo": ("grpo", False), "rloo": ("rloo", True)}[advantage]
    advantages, _ = core_algos.group_outcome_advantages(token_rewards, torch.ones_like(token_rewards), group_ids,
                                                        estimator, norm_by_std)
    return advantages[:, 0].double().view(num_groups, n)


def test_advantage_constants_are_the_trainers():
    import inspect

    from rlhf import core_algos

    assert am.GROUP_STD_EPS == inspect.signature(core_algos.group_outcome_advantages).parameters["eps"].default
    assert am.WHITEN_EPS == inspect.signature(core_algos.masked_whiten).parameters["eps"].default


def test_compositions_enumerate_every_count_vector_once():
    counts, log_coefficients = am.compositions(7, 6)
    assert counts.shape == (math.comb(12, 5), 6) == (792, 6)
    assert (counts.sum(-1) == 7).all() and (counts >= 0).all()
    assert len({tuple(row) for row in counts.tolist()}) == 792
    assert abs(log_coefficients.exp().sum().item() - 6 ** 7) < 1e-6  # the multinomial theorem
    assert am.compositions(16, 6)[0].shape[0] == math.comb(21, 5) == 20349


@pytest.mark.parametrize("advantage", ["grpo", "drgrpo", "rloo"])
def test_group_expected_advantages_equal_the_trainers_by_brute_force(advantage):
    """Every one of the K^n ordered groups (K = 3, n = 4) through the trainer's own group_outcome_advantages,
    weighted by its probability: E[A_1 | x_1 = x], to float32 rounding."""
    import itertools

    scores, n = T(0.25, 1.0, 0.5), 4
    logprobs = torch.log(T(0.5, 0.3, 0.2))
    arms = torch.tensor(list(itertools.product(range(3), repeat=n)))  # (81, n)
    advantages = trainer_advantages(scores, arms, advantage)  # (81, n)
    weight_of_others = logprobs[arms[:, 1:]].sum(-1).exp()  # P(x_2 .. x_n)
    expected = torch.stack([(weight_of_others * advantages[:, 0])[arms[:, 0] == x].sum() for x in range(3)])
    got = am.group_expected_advantages(scores, logprobs, advantage, n)
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert (got - expected).abs().max() < 1e-6 < (got - got.mean()).abs().max()


def group_moments(scores, probs, advantage: str, n: int):
    """E and E[.^2] of v_x = (1/n) sum_i A_i 1{x_i = x} over a group (K,) each, by enumerating all groups'
    counts: the mean and exact spread of the Monte-Carlo check below."""
    counts, log_coefficients = am.compositions(n, len(scores))  # (M, K)
    weights = (log_coefficients + (counts * probs.log()).sum(-1)).exp()  # (M,)
    first, second = torch.zeros_like(scores), torch.zeros_like(scores)
    for x in range(len(scores)):
        present = counts[:, x] > 0
        others = counts[present] - torch.eye(len(scores), dtype=counts.dtype)[x]
        v = counts[present, x] * am.own_advantages(others, scores, advantage)[:, x] / n
        first[x], second[x] = (weights[present] * v).sum(), (weights[present] * v ** 2).sum()
    return first, second


@pytest.mark.parametrize("advantage", ["grpo", "drgrpo", "rloo"])
def test_group_expected_advantages_match_monte_carlo_of_the_trainer(advantage):
    """K = 6, n = 8: groups sampled from pi, advantages from the trainer's code; the per-arm average of
    (1/n) sum_i A_i 1{x_i = x}, pi_x E[A_1 | x_1 = x] in expectation, within 5 standard errors (the standard
    deviation computed exactly, by enumeration), fixed seed."""
    n, num_groups = 8, 200_000
    probs = T(0.30, 0.25, 0.18, 0.12, 0.10, 0.05)
    generator = torch.Generator().manual_seed(0)
    arms = torch.multinomial(probs, num_groups * n, replacement=True, generator=generator).view(num_groups, n)
    advantages = trainer_advantages(DYADIC_SCORES, arms, advantage)
    per_group = torch.zeros(num_groups, 6, dtype=torch.float64).scatter_add_(1, arms, advantages / n)
    exact = probs * am.group_expected_advantages(DYADIC_SCORES, probs.log(), advantage, n)
    mean, square = group_moments(DYADIC_SCORES, probs, advantage, n)
    assert torch.allclose(mean, exact, atol=1e-14, rtol=0)  # the joint form agrees with the conditional one
    standard_error = ((square - mean ** 2) / num_groups).sqrt()
    assert ((per_group.mean(0) - exact).abs() <= 5 * standard_error).all()
    assert (exact.abs() > 20 * standard_error).any()  # a real signal, resolved


@pytest.mark.parametrize("model", GROUP_MODELS, ids=lambda m: f"{m[0]}{m[1]}")
def test_dr_grpo_and_rloo_expectations_in_closed_form(model):
    """E[A_1 | x_1 = x] = (s_x - E_pi s) * (n - 1) / n for Dr. GRPO (the group mean includes the sample itself)
    and * 1 for RLOO; grpo's std makes it no multiple of s_x - E_pi s."""
    advantage, n = model
    probs = torch.softmax(T(0.3, -1.1, 0.4, 0.9, 0.0, -0.5), -1)
    got = am.group_expected_advantages(DYADIC_SCORES, probs.log(), advantage, n)
    centred = DYADIC_SCORES - (probs * DYADIC_SCORES).sum()
    if advantage == "grpo":
        ratio = got / centred
        assert spread(ratio) > 0.05 and (ratio > 0).all()
    else:
        factor = {"rloo": 1.0, "drgrpo": (n - 1) / n}[advantage]
        assert torch.allclose(got, factor * centred, atol=1e-14, rtol=0)


def test_a_group_of_equal_scores_has_advantage_zero():
    """A group all on one arm: 0 for every estimator (grpo's eps keeps 0 / 0 away), also for tied arms."""
    scores = T(0.3, 0.3, 0.7)
    others = T(3.0, 0.0, 0.0)[None]  # x_1's three companions all on arm 0
    for advantage in am.GROUP_ADVANTAGES:
        own = am.own_advantages(others, scores, advantage)[0]
        assert own[0].item() == 0.0 and own[1].item() == 0.0  # arm 1 ties with arm 0
        assert own[2].item() != 0.0


@pytest.mark.parametrize("advantage", am.GROUP_ADVANTAGES)
def test_a_group_of_one_keeps_its_score(advantage):
    """n = 1 (verl's rule, the trainer's): A = s, no baseline, whose expected gradient is the exact one."""
    probs = torch.softmax(T(0.3, -1.1, 0.4), -1)
    assert torch.equal(am.group_expected_advantages(T(0.2, 0.5, 0.9), probs.log(), advantage, 1), T(0.2, 0.5, 0.9))
    ref, r, beta = BANDITS["seed0"]
    for row in (("k1", "reward"), ("k3+", "loss")):
        assert torch.allclose(bandit_fixed_point(ref, r, beta, *row, advantage=advantage, n=1),
                              bandit_fixed_point(ref, r, beta, *row), atol=1e-10, rtol=0)


def test_advantage_model_maps_the_trainers_config():
    from rlhf import core_algos

    assert am.advantage_model("grpo", True, 8) == am.AdvantageModel("grpo", 8)
    assert am.advantage_model("grpo", False, 8) == am.AdvantageModel("drgrpo", 8)
    assert am.advantage_model("rloo", False, 4) == am.advantage_model("rloo", True, 4) == am.AdvantageModel("rloo", 4)
    assert am.advantage_model("gae", True, 4) == am.advantage_model("gae", False, 1) == am.AdvantageModel("gae")
    for name in core_algos.ADV_ESTIMATORS:  # an estimator added to the trainer needs a model here
        am.advantage_model(name, True, 4)
    with pytest.raises(ValueError, match="gae"):
        am.advantage_model("reinforce", True, 4)
    assert am.AdvantageModel("grpo", 8).label == "grpo, n=8" and am.AdvantageModel().label == "exact"


def test_bad_advantage_arguments_raise():
    ref, r, beta = BANDITS["seed0"]
    for bad, error in ((dict(advantage="ppo"), "unknown advantage model"), (dict(advantage="grpo"), "needs the group"),
                       (dict(advantage="rloo", n=0), "needs the group"), (dict(advantage="gae", n=4), "no groups"),
                       (dict(n=4), "no groups")):
        with pytest.raises(ValueError, match=error):
            bandit_fixed_point(ref, r, beta, "k1", "reward", **bad)
        with pytest.raises(ValueError, match=error):
            tree_fixed_point(REF1, REF2, R, BETA, "k1", "reward", **bad)


def test_fixed_point_for_config_is_the_solver_with_its_model():
    ref, r, beta = BANDITS["seed1"]
    got = fp.fixed_point_for_config(ref, r, beta, "k3+", "loss", "grpo", False, 4)
    assert torch.equal(got, bandit_fixed_point(ref, r, beta, "k3+", "loss", advantage="drgrpo", n=4))
    first, second = fp.tree_fixed_point_for_config(REF1, REF2, R, BETA, "k3+", "loss", "gae", True, 4)
    assert_tree((first, second), *tree_fixed_point(REF1, REF2, R, BETA, "k3+", "loss", advantage="gae"), atol=0)


# Bandit fixed points under each advantage estimator

@pytest.mark.parametrize("bandit", BANDITS)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("row", [("k1", "reward"), ("k2", "loss"), ("k3", "loss"), ("k3+", "loss"), ("abs", "loss"),
                                 ("k2", "reward")], ids="-".join)
def test_rloo_reaches_the_exact_fixed_point(row, n, bandit):
    ref, r, beta = BANDITS[bandit]
    assert torch.allclose(bandit_fixed_point(ref, r, beta, *row, advantage="rloo", n=n),
                          bandit_fixed_point(ref, r, beta, *row), atol=1e-10, rtol=0)


DR_GRPO_OPTIMA = {"k2": reverse_optimum, "k3+": reverse_optimum, "full": reverse_optimum,
                  "k3": lambda ref, r, beta: optima.forward_kl_optimum(ref, r, beta),
                  "abs": lambda ref, r, beta: optima.tv_optimum(ref, r, beta)}


@pytest.mark.parametrize("bandit", BANDITS)
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("estimator", DR_GRPO_OPTIMA)
def test_dr_grpo_with_a_kl_loss_reaches_the_optimum_at_beta_n_over_n_minus_1(estimator, n, bandit):
    """Its policy gradient is (n - 1)/n of the exact one, the KL loss's is not scaled: beta acts as beta n/(n-1)."""
    ref, r, beta = BANDITS[bandit]
    probs = bandit_fixed_point(ref, r, beta, estimator, "loss", advantage="drgrpo", n=n)
    optimum = DR_GRPO_OPTIMA[estimator](ref, r, beta * n / (n - 1))
    if estimator == "abs" and ((r.max() - r - 2 * beta * n / (n - 1)).abs() < 1e-12).any():
        # a gap of exactly 2 beta n/(n-1) (asymmetric, n = 2): the TV programme has a segment of optima
        objective = lambda pi: ((pi * r).sum() - beta * n / (n - 1) * (pi - ref).abs().sum()).item()
        assert abs(objective(probs) - objective(optimum)) < 1e-10
    else:
        assert torch.allclose(probs, optimum, atol=1e-10, rtol=0)
    if estimator != "abs":  # (abs: the TV optimum can be the same at both coefficients)
        assert optima.tv(probs, DR_GRPO_OPTIMA[estimator](ref, r, beta)) > 1e-3


@pytest.mark.parametrize("bandit", BANDITS)
@pytest.mark.parametrize("model", GROUP_MODELS + [("gae", None)], ids=lambda m: f"{m[0]}{m[1] or ''}")
def test_a_kl_in_the_reward_keeps_betas_optimum_under_every_advantage_estimator(model, bandit):
    """In the reward the penalty is inside the score, so at pi* every sample's score is the same and every
    estimator's advantage is 0, whatever it divides by: the reverse-KL optimum at beta itself."""
    ref, r, beta = BANDITS[bandit]
    advantage, n = model
    probs = bandit_fixed_point(ref, r, beta, "k1", "reward", advantage=advantage, n=n)
    assert torch.allclose(probs, reverse_optimum(ref, r, beta), atol=1e-10, rtol=0)


BANDIT6 = tuple(examples.example(examples.BANDIT6_EXAMPLE)[key] for key in ("ref_probs", "rewards", "beta"))
BANDIT6_BINARY = tuple(examples.example(examples.BANDIT6_EXAMPLE)[key]
                       for key in ("ref_probs", "binary_rewards", "beta"))


@pytest.mark.parametrize("n", [4, 8, 16])
def test_grpo_std_with_a_kl_loss_stops_where_samuelsons_bound_meets_the_kl(n):
    """Near the best arm, a group holding another arm y is one y among n - 1 best samples: A_y = -(n - 1)/sqrt(n),
    the most negative a standardised score can be (Samuelson), whatever y's reward, while a k2-gradient loss
    pulls back with beta (d_y - d_best) without bound: every y stops at d_y - d_best ~ -(n - 1)/(beta sqrt(n)),
    a fixed point at every finite n, the argmax as n grows."""
    ref, r, beta = BANDIT6
    probs = bandit_fixed_point(ref, r, beta, "k3+", "loss", advantage="grpo", n=n)
    d = probs.log() - ref.log()
    best = r.argmax()
    others = torch.arange(len(r)) != best
    bound = -(n - 1) / (beta * math.sqrt(n))
    relative = ((d[others] - d[best]) / bound - 1).abs().max().item()
    assert relative < {4: 0.2, 8: 0.03, 16: 0.001}[n]  # the groups with two other arms fade as pi_y does
    assert optima.tv(probs, optima.samuelson_point(ref, r, beta, n)) < {4: 0.03, 8: 4e-4, 16: 3e-7}[n]
    assert probs[best] > {4: 0.85, 8: 0.99, 16: 0.9999}[n]
    # in the large-batch limit (gae, the same standardised advantage, no bound): the argmax itself
    assert bandit_fixed_point(ref, r, beta, "k3+", "loss", advantage="gae")[others].max() < 1e-12  # a corner, to tol


def test_gae_with_a_kl_loss_is_the_reverse_optimum_at_beta_times_the_rewards_std():
    """Whitened advantages (r - E r) / std_pi(r) against a k2-gradient loss: pi = pi*(beta_eff) with
    beta_eff = beta * sqrt(std^2 + 1e-8) at that pi, i.e. pi_t ∝ ref exp(t r) with t beta std(pi_t) = 1; from
    ref the flow stops at the smallest such t, which exists only when beta * max_t t std(pi_t) >= 1."""
    ref, r, _ = BANDIT6
    tilted = lambda t: torch.softmax(ref.log() + t * r, -1)
    std = lambda pi: ((pi * (r - (pi * r).sum()) ** 2).sum() + am.WHITEN_EPS).sqrt()
    beta = 1.0  # beta * max_t t std(pi_t) = 1.45 here: two roots
    t = optima._bisect(lambda t: t * beta * std(tilted(t)) - 1, torch.tensor(0.0, dtype=torch.float64),
                   torch.tensor(6.5, dtype=torch.float64))  # t std(pi_t) rises until t = 6.5 on this bandit
    probs = bandit_fixed_point(ref, r, beta, "k3+", "loss", advantage="gae")
    assert torch.allclose(probs, tilted(t), atol=1e-10, rtol=0)
    assert torch.allclose(optima.whitened_optimum(ref, r, beta), probs, atol=1e-10, rtol=0)
    assert optima.tv(probs, reverse_optimum(ref, r, beta)) > 0.1
    assert abs(optima.tilt_peak(ref, r) - 1.449) < 1e-3
    # beta = 0.3: beta * 1.449 < 1, no root but the whitening eps's: the argmax
    corner = bandit_fixed_point(ref, r, 0.3, "k3+", "loss", advantage="gae")
    assert torch.allclose(optima.whitened_optimum(ref, r, 0.3), corner, atol=1e-12, rtol=0)
    assert torch.allclose(corner, optima.argmax_optimum(ref, r, 0.3), atol=1e-12, rtol=0)


def test_grpo_std_with_a_binary_reward_and_a_kl_loss():
    """A 0/1 reward: the fixed point exists and keeps ref's ratios inside each reward class (the KL loss alone
    sets them); the wrong class's mass is where Samuelson's bound meets the KL, far below beta's optimum's."""
    ref, r, beta = BANDIT6_BINARY
    probs = bandit_fixed_point(ref, r, beta, "k3+", "loss", advantage="grpo", n=8)
    right = r == 1
    assert torch.allclose(probs[right] / probs[right].sum(), ref[right] / ref[right].sum(), atol=1e-10, rtol=0)
    wrong_mass, optimum_wrong_mass = probs[~right].sum().item(), reverse_optimum(ref, r, beta)[~right].sum().item()
    assert wrong_mass < 1e-3 < 0.05 < optimum_wrong_mass
    assert abs(optima.tv(probs, reverse_optimum(ref, r, beta)) - (optimum_wrong_mass - wrong_mass)) < 1e-12


def test_gae_models_the_trainers_whitening():
    """A batch holding each arm in proportion to pi, through the trainer's gae estimator (compute_gae with the
    converged critic V = E_pi s, masked_whiten): each arm's advantage is the model's c (s_x - E_pi s), up to
    the batch's Bessel correction (1 / 20000)."""
    from rlhf import core_algos

    ref, r, beta = BANDITS["seed0"]
    probs = T(0.1, 0.2, 0.3, 0.4)
    arms = torch.repeat_interleave(torch.arange(4), (probs * 20000).round().long())
    logits = probs.log()
    for placement in PLACEMENTS_AND_ESTIMATORS:
        estimator = PLACEMENTS_AND_ESTIMATORS[placement]
        penalty = fp.token_penalty(logits, ref, estimator, placement)
        scores = r - beta * penalty if placement == "reward" else r
        value = (probs * scores).sum()
        token_rewards, values = scores[arms][:, None], torch.full((len(arms), 1), value.item(), dtype=torch.float64)
        advantages, _ = core_algos.ADV_ESTIMATOR_REGISTRY["gae"](token_rewards, values, torch.ones_like(values),
                                                                 None, MONTE_CARLO, core_algos.one_process)
        trainer = torch.stack([advantages[arms == x, 0].mean() for x in range(4)])
        base, p = fp._bandit_advantages(am.AdvantageModel("gae"), logits, r, beta, penalty, placement)
        model = base - beta * p if placement == "reward" else base
        model = model - (probs * model).sum()
        assert torch.allclose(trainer, model, rtol=1e-4, atol=0)


PLACEMENTS_AND_ESTIMATORS = {"reward": "k3", "loss": "k3+"}
MONTE_CARLO = AlgorithmConfig(gamma=1.0, lam=1.0)  # GAE with Monte-Carlo returns


# The tree under each advantage estimator

@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("row", [("k1", "reward"), ("k3+", "loss"), ("k3", "loss"), ("k2", "reward")], ids="-".join)
def test_tree_rloo_is_exact_and_dr_grpo_is_beta_n_over_n_minus_1(row, n):
    exact = tree_fixed_point(REF1, REF2, R, BETA, *row)
    assert_tree(tree_fixed_point(REF1, REF2, R, BETA, *row, advantage="rloo", n=n), *exact)
    dr_grpo = tree_fixed_point(REF1, REF2, R, BETA, *row, advantage="drgrpo", n=n)
    if row[1] == "reward":  # the penalties are inside the sequence's score: beta's own fixed point
        assert_tree(dr_grpo, *exact)
    else:
        assert_tree(dr_grpo, *tree_fixed_point(REF1, REF2, R, BETA * n / (n - 1), *row))
        assert optima.tv(dr_grpo[0], exact[0]) > 0.01


@pytest.mark.parametrize("model", [("grpo", 4), ("gae", None)], ids=["grpo4", "gae"])
def test_tree_kl_in_the_reward_keeps_the_sequence_optimum(model):
    advantage, n = model
    assert_tree(tree_fixed_point(REF1, REF2, R, BETA, "k1", "reward", advantage=advantage, n=n), SEQ_FIRST, SEQ_SECOND)


def test_tree_grpo_with_dead_prefixes_converges_on_what_training_sees():
    """k2 in the reward kills prefixes 0 and 2; under grpo every continuation of a dead prefix is a lone
    outlier, -(n - 1)/sqrt(n) whatever its score, so its conditional has no direction: convergence is judged
    on pi(a, b), which matches the exact advantage's."""
    exact_first, exact_second = tree_fixed_point(REF1, REF2, R, BETA, "k2", "reward")
    first, second = tree_fixed_point(REF1, REF2, R, BETA, "k2", "reward", advantage="grpo", n=4)
    assert first[1] > 1 - 1e-12
    assert torch.allclose(first[:, None] * second, exact_first[:, None] * exact_second, atol=1e-10, rtol=0)


def test_tree_gae_models_the_trainers_whitening():
    """The tree's batch with each sequence (a, b) in proportion to pi(a, b), two tokens each, through the
    trainer's gae estimator with the converged critic (V(root) on the first token, V(a) on the second): each
    token's mean advantage given its state and choice is the model's, up to the Bessel correction."""
    from rlhf import core_algos

    first_probs, second_probs = T(0.5, 0.3, 0.2), T(0.2, 0.5, 0.3, 0.6, 0.2, 0.2, 0.25, 0.25, 0.5).view(3, 3)
    joint = first_probs[:, None] * second_probs
    sequences = torch.repeat_interleave(torch.arange(9), (joint.flatten() * 10000).round().long())
    a, b = sequences // 3, sequences % 3
    for placement, estimator in PLACEMENTS_AND_ESTIMATORS.items():
        z1, z2 = first_probs.log(), second_probs.log()
        p1, p2 = fp.token_penalty(z1, REF1, estimator, placement), fp.token_penalty(z2, REF2, estimator, placement)
        if placement == "reward":
            token_rewards = torch.stack([-BETA * p1[a], R[a, b] - BETA * p2[a, b]], -1)  # (B, 2)
        else:
            token_rewards = torch.stack([torch.zeros_like(R[a, b]), R[a, b]], -1)
        second_values = (second_probs * token_rewards.new_zeros(3, 3).index_put_((a, b), token_rewards[:, 1])).sum(-1)
        first_values = (joint * token_rewards.new_zeros(3, 3).index_put_((a, b), token_rewards.sum(-1))).sum()
        values = torch.stack([first_values.expand(len(a)), second_values[a]], -1)
        advantages, _ = core_algos.ADV_ESTIMATOR_REGISTRY["gae"](token_rewards, values, torch.ones_like(values),
                                                                 None, MONTE_CARLO, core_algos.one_process)
        (base1, q1), (base2, q2) = fp._tree_advantages(am.AdvantageModel("gae"), z1, z2, REF1, REF2, R, BETA,
                                                        estimator, placement)
        model1, model2 = base1 - BETA * q1, base2 - BETA * q2
        if placement == "loss":  # the loss's term is not part of the policy gradient's advantage
            model1, model2 = base1, base2
        model1 = model1 - (first_probs * model1).sum()
        model2 = model2 - (second_probs * model2).sum(-1, keepdim=True)
        trainer1 = torch.stack([advantages[a == x, 0].mean() for x in range(3)])
        trainer2 = torch.stack([advantages[sequences == s, 1].mean() for s in range(9)]).view(3, 3)
        assert torch.allclose(trainer1, model1, rtol=1e-3, atol=0), placement
        assert torch.allclose(trainer2, model2, rtol=1e-3, atol=0), placement


def test_advantage_report():
    report = fixed_point_tables.advantage_report()
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| r ") or line.startswith("| 0/1 ")]
    assert len(rows) == len(fixed_point_tables.ADVANTAGE_ROWS)
    # derived points are met to float noise, printed as the bound; the approximations' gaps are real ones
    assert all(row[6] == "< 1e-12 |" for row in rows if row[5] not in ("Samuelson's bound", "-"))
    assert all(float(row[6].rstrip(" |")) > 1e-12 for row in rows if row[5] == "Samuelson's bound")
    assert "| r | k3+, loss | drgrpo, n=8 | (0.148, 0.069, 0.213, 0.106, 0.212, 0.254) | 0.055 |" in report
    assert "| r | k3+, loss | grpo, n=8 | (0.002, 0.001, 0.001, 0.001, 0.001, 0.995) | 0.695 |" in report
    assert "| 0/1 | k3+, loss | grpo, n=8 | (0.000, 0.000, 0.545, 0.000, 0.303, 0.151) | 0.067 |" in report
    assert "| r | k1, reward | grpo, n=16 | (0.125, 0.053, 0.204, 0.097, 0.221, 0.300) | 0.000 |" in report
    # docs/kl.md's section 'Where the advantage estimator moves the fixed point' carries every line of it
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "kl.md"), encoding="utf-8").read()
    section = docs[docs.index("## Where the advantage estimator moves the fixed point"):]
    assert [line for line in report.splitlines() if line not in section] == []
@pytest.mark.parametrize("sign", [1, -1])
def test_report_digits_are_those_of_any_machine(report, monkeypatch, sign):
    """The report, docs/kl.md's tables, is the same to every printed digit for examples nudged by 1e-9 either
    way (helpers.nudge says why that makes it the same on any CPU, BLAS and thread count)."""
    example = fixed_point_tables.example
    monkeypatch.setattr(fixed_point_tables, "example", lambda ex: {k: nudge(v, sign) for k, v in example(ex).items()})
    nudged = fixed_point_tables.example(examples.BANDIT_EXAMPLE)
    assert nudged["rewards"][1].item() != examples.BANDIT_EXAMPLE["rewards"][1]
    assert fixed_point_tables.fixed_point_report() == report


# The plain-gradient path: the same fixed points, another way to them

def joint(point):
    return point[0][:, None] * point[1]


@pytest.mark.parametrize("row", [("k3", "loss"), ("k3+", "loss"), ("k1", "reward")], ids="-".join)
def test_tree_plain_flow_reaches_the_solvers_point_where_it_is_the_only_stable_one(row):
    """With a working regulariser the tree has one stable point, and the plain gradient reaches it too: after
    its finite time (lr x steps = 1,000) within 1e-5 in TV (measured below 1e-7: the plain path's slower
    approach, a hundredfold margin; another point would be > 0.1 away)."""
    flow = fp.tree_plain_flow(REF1, REF2, R, BETA, *row)
    assert optima.tv(joint(flow), joint(tree_fixed_point(REF1, REF2, R, BETA, *row))) < 1e-5


def test_tree_plain_flow_under_whitened_advantages_ends_in_another_corner_than_the_solver():
    """GAE's whitening with a k2-gradient KL loss: the solver's per-state natural gradient stops at an interior
    point (most mass on prefix 0, whose R = 2 continuation it finds at once); the plain gradient moves prefix 0's
    conditional only by pi(0) times, leaves it near the reference (R = 2 at 1%), and ends on prefix 1's best
    pair (1, 2), R = 0.7, where the runs of the trainer end too (docs/results.md, 'The tree'). Each path stops
    at one of the two."""
    solver = joint(tree_fixed_point(REF1, REF2, R, BETA, "k2", "loss", advantage="gae"))
    plain = joint(fp.tree_plain_flow(REF1, REF2, R, BETA, "k2", "loss", advantage="gae"))
    assert plain[1, 2] > 0.99 and plain.sum() == pytest.approx(1, abs=1e-12)
    assert solver[0].sum() > 0.5 and optima.tv(plain, solver) > 0.9


# ---------------------------------------------------------------------------------------------------------
# k3's value clamp: the solver's answer is the small-step flow's, whatever its step size

DECISION_REF, DECISION_REWARDS = T(0.8, 0.04, 0.16), T(0.0, 1.0, 0.0)
K3_EDGE = -2.6115  # d below which verl's clamp saturates k3 at 10 (expm1(-d) + d = 10)


def test_k3_edge_is_where_the_clamp_saturates():
    below, above = T(K3_EDGE - 1e-3), T(K3_EDGE + 1e-3)
    from rlhf.kl import kl_penalty
    assert kl_penalty(below, T(0.0), "k3").item() == 10.0 and kl_penalty(above, T(0.0), "k3").item() < 10.0


@pytest.mark.parametrize("beta, inside", [(0.074, True), (0.08, True), (0.1, True), (0.15, True), (0.06, False)])
def test_k3_loss_fixed_point_is_the_small_step_flows_on_both_sides_of_the_clamp(beta, inside):
    """At (q, p, o) = (0.8, 0.04, 0.16), rewards (0, 1, 0): the forward optimum's d = log(beta / lam) lies inside
    the clamp's edge from beta ~0.0735 up (0.074: 0.005 nats inside; 0.08: 0.08), past it below (0.06). The
    solver reports the point the natural-gradient flow it follows reaches at small steps (lr 0.01 to 1): the
    optimum inside, the corner past the edge; from 0.08 up the plain-gradient flow (lr 0.3 to 3) agrees."""
    forward = optima.forward_kl_optimum(DECISION_REF, DECISION_REWARDS, beta)
    d_optimum = math.log(forward[0].item() / DECISION_REF[0].item())
    assert (d_optimum > K3_EDGE) == inside
    solved = bandit_fixed_point(DECISION_REF, DECISION_REWARDS, beta, "k3", "loss")
    if inside:
        assert torch.allclose(solved, forward, atol=1e-9, rtol=0)
        for lr in (0.01, 0.1, 1.0):
            flow = fp.bandit_plain_flow(DECISION_REF, DECISION_REWARDS, beta, "k3", "loss", lr=lr, natural=True,
                                        max_steps=int(20 / lr) + 2000)
            assert torch.allclose(flow, solved, atol=1e-6, rtol=0), lr
        for lr in (0.3, 1.0, 3.0) if beta >= 0.08 else ():
            flow = fp.bandit_plain_flow(DECISION_REF, DECISION_REWARDS, beta, "k3", "loss", lr=lr)
            assert torch.allclose(flow, solved, atol=1e-6, rtol=0), lr
    else:
        assert solved[0].item() < 1e-12  # the corner: past the edge nothing holds the habit
        for natural in (True, False):
            flow = fp.bandit_plain_flow(DECISION_REF, DECISION_REWARDS, beta, "k3", "loss", lr=1.0, max_steps=3000,
                                        natural=natural)
            d_flow = math.log(flow[0].item() / DECISION_REF[0].item())
            assert d_flow < K3_EDGE - 1.0 and flow[0].item() < forward[0].item() / 3  # crossed, and still dying


def test_near_the_edge_the_path_decides():
    """At beta = 0.076 the optimum sits 0.03 nats inside the edge: the natural-gradient flow stops on it, the
    plain-gradient flow (tokens move at the rate pi, the dying ones slowest) passes the edge and the habit dies."""
    beta = 0.076
    natural = fp.bandit_plain_flow(DECISION_REF, DECISION_REWARDS, beta, "k3", "loss", lr=0.1, natural=True)
    plain = fp.bandit_plain_flow(DECISION_REF, DECISION_REWARDS, beta, "k3", "loss", lr=1.0, max_steps=5000)
    assert natural[0].item() > 0.05 and plain[0].item() < 1e-3


@pytest.mark.parametrize("beta", [0.08, 0.1])
@pytest.mark.parametrize("advantage, n", [("exact", None), ("rloo", 4)])
def test_the_solvers_step_size_does_not_change_its_answer(beta, advantage, n, monkeypatch):
    """The same fixed point from initial steps 0.05 to 50 (in 1/beta) and moves capped at 0.05 to 3 nats a step:
    before the step control probed its moves, a long step jumped the window between the optimum and the
    clamp's edge and reported the corner."""
    answers = []
    for initial, cap in ((0.05, 0.05), (0.5, 0.5), (50.0, 3.0), (5.0, 1.5)):
        monkeypatch.setattr(fp, "_STEP", initial)
        monkeypatch.setattr(fp, "_MAX_MOVE", cap)
        answers.append(bandit_fixed_point(DECISION_REF, DECISION_REWARDS, beta, "k3", "loss", advantage=advantage,
                                          n=n, max_steps=100_000))
    for other in answers[1:]:
        assert torch.allclose(other, answers[0], atol=1e-9, rtol=0)
    assert answers[0][0].item() > 0.05  # the floor, not the corner


@pytest.mark.parametrize("margin, same", [(0.01, True), (0.002, False)])
def test_the_solver_resolves_an_optimum_down_to_a_hundredth_of_a_nat_from_the_edge(margin, same, monkeypatch):
    """Where the forward optimum lies 0.01 nats inside k3's clamp edge, initial steps from 0.05 to 50 all stop on
    it; at 0.002 nats a move still jumps the window and the habit dies (docs/kl.md, 'The habit a forward KL
    keeps', says so): the probes are finite."""
    from lab.habit import crossing_betas, edge_margins, habit_limits
    from lab.theory.optima import _bisect

    row = DECISION_REF[None]
    low = crossing_betas(row)
    beta = _bisect(lambda b: edge_margins(row, b) - margin, low, low + 0.05).item()
    optimum = habit_limits(row, beta)["forward"].item()
    answers = []
    for initial in (0.05, 0.5, 5.0, 50.0):
        monkeypatch.setattr(fp, "_STEP", initial)
        answers.append(bandit_fixed_point(DECISION_REF, DECISION_REWARDS, beta, "k3", "loss", advantage="rloo",
                                          n=4)[0].item())
    assert all(abs(a - optimum) < 1e-6 for a in answers) == same, answers
