"""Tests for rlhf/kl/fixed_points.py: where each estimator x placement converges (docs/kl.md, 'Where each
estimator converges'). Every solver result is compared, in float64, with an optimum or a stationary condition
written out here from its definition, so that the module's own analytic helpers are checked too."""

import math
import os

import pytest
import torch
from helpers import nudge

from rlhf import kl_theory
from rlhf.kl import canonical
from rlhf.kl import fixed_points as fp
from rlhf.kl_theory import bandit_fixed_point, tree_fixed_point



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
    "asymmetric": tuple(fp.example(fp.BANDIT_EXAMPLE).values()),
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
    rev, fwd = fp.reverse_kl_optimum(ref, r, beta), fp.forward_kl_optimum(ref, r, beta)
    assert torch.allclose(rev, reverse_optimum(ref, r, beta), rtol=1e-12)
    # forward KL: stationarity r + beta ref / pi = lam, on the simplex
    assert abs(fwd.sum().item() - 1) < 1e-12 and spread(r + beta * ref / fwd) < 1e-10
    # TV: a linear programme; no Dirichlet sample and no vertex scores higher
    objective = lambda pi: (pi * r).sum(-1) - beta * (pi - ref).abs().sum(-1)
    samples = torch.distributions.Dirichlet(torch.ones(len(ref), dtype=torch.float64)).sample((4000,))
    candidates = torch.cat([samples, torch.eye(len(ref), dtype=torch.float64), ref[None]])
    assert objective(fp.tv_optimum(ref, r, beta)) >= objective(candidates).max() - 1e-12


def test_tv_optimum_by_hand():
    ref, r = T(0.4, 0.3, 0.2, 0.1), T(0.0, 0.3, 0.6, 1.0)
    # gaps to the best arm: 1.0, 0.7, 0.4; 2 beta = 0.5: arms 0 and 1 give their mass to arm 3
    assert torch.allclose(fp.tv_optimum(ref, r, 0.25), T(0.0, 0.0, 0.2, 0.8), atol=1e-15)
    assert torch.allclose(fp.tv_optimum(ref, r, 0.6), ref, atol=1e-15)  # every gap <= 2 beta: stay at ref


def test_sequence_optimum_is_the_joint_optimum():
    tree = fp.example(fp.TREE_EXAMPLE)
    ref1, ref2, rewards, beta = tree["ref_first"], tree["ref_second"], tree["rewards"], tree["beta"]
    first, second = fp.sequence_optimum(ref1, ref2, rewards, beta)
    joint = (ref1[:, None] * ref2 * torch.exp(rewards / beta)).flatten()
    assert torch.allclose(first[:, None] * second, (joint / joint.sum()).view(3, 3), rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# The direction the solver follows is the trainer's expected gradient, divided by pi


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"])
def test_solver_direction_is_the_expected_gradient(name):
    ref, _, _ = BANDITS["seed0"]
    logits = T(0.3, -1.1, 0.4, 0.9)
    pi = torch.softmax(logits, -1)
    for placement, expected in (("loss", kl_theory.expected_loss_grad), ("reward", kl_theory.expected_reward_grad)):
        p = fp.token_penalty(logits, ref, name, placement)
        assert torch.allclose(pi * (p - (pi * p).sum()), expected(name, logits, ref), atol=1e-14), placement


def test_full_direction_is_the_exact_gradient_and_constant_in_the_reward():
    ref, _, _ = BANDITS["seed0"]
    logits = T(0.3, -1.1, 0.4, 0.9)
    pi = torch.softmax(logits, -1)
    p = fp.token_penalty(logits, ref, "full", "loss")
    target = kl_theory.divergence_grad(kl_theory.reverse_kl, logits, ref)
    assert torch.allclose(pi * (p - (pi * p).sum()), target, atol=1e-14)
    p = fp.token_penalty(logits, ref, "full", "reward")  # the state's KL, the same for every token
    assert spread(p) == 0 and abs(p[0].item() - kl_theory.reverse_kl(logits, ref).item()) < 1e-14


# ---------------------------------------------------------------------------------------------------------
# Bandit: every estimator x placement against its optimum or stationary condition

ANALYTIC_ROWS = {
    ("k1", "reward"): reverse_optimum, ("k1+", "reward"): reverse_optimum,
    ("k2", "loss"): reverse_optimum, ("k1+", "loss"): reverse_optimum, ("k3+", "loss"): reverse_optimum,
    ("abs+", "loss"): reverse_optimum, ("full", "loss"): reverse_optimum,
    ("k3", "loss"): lambda ref, r, beta: fp.forward_kl_optimum(ref, r, beta),
    ("abs", "loss"): lambda ref, r, beta: fp.tv_optimum(ref, r, beta),
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
    assert torch.allclose(probs, fp.reward_stationary_point(ref, r, beta, name, alive), atol=1e-10, rtol=0)
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
    assert torch.allclose(kl_theory.expected_reward_grad("k3", logits.detach(), ref), grad, atol=1e-14)
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
    forward = fp.forward_kl_optimum(ref, r, beta)
    assert (forward.log() - ref.log())[:2].max() < -2.61 and forward[:2].min() > 0.01
    assert torch.allclose(bandit_fixed_point(ref, r, beta, "k3", "loss"), T(0.0, 0.0, 1.0), atol=1e-12, rtol=0)


def test_solver_raises_when_not_converged_and_on_bad_input():
    ref, r, beta = BANDITS["seed0"]
    with pytest.raises(RuntimeError, match="not converged after 1 steps"):
        bandit_fixed_point(ref, r, beta, "k1", "reward", max_steps=1)
    tree = fp.example(fp.TREE_EXAMPLE)
    with pytest.raises(RuntimeError, match="not converged after 5 steps"):
        tree_fixed_point(**tree, estimator="k2", placement="loss", max_steps=5)
    for bad, error in ((dict(estimator="k4"), "unknown KL estimator"), (dict(placement="both"), "unknown placement"),
                       (dict(beta=0.0), "beta must be > 0")):
        args = dict(ref_probs=ref, rewards=r, beta=beta, estimator="k1", placement="reward") | bad
        with pytest.raises(ValueError, match=error):
            bandit_fixed_point(**args)


# ---------------------------------------------------------------------------------------------------------
# The two-step tree: sequence-level against token-level optima

TREE = fp.example(fp.TREE_EXAMPLE)
REF1, REF2, R, BETA = TREE["ref_first"], TREE["ref_second"], TREE["rewards"], TREE["beta"]
SEQ_FIRST, SEQ_SECOND = fp.sequence_optimum(REF1, REF2, R, BETA)


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
    return fp.fixed_point_report()


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


@pytest.mark.parametrize("sign", [1, -1])
def test_report_digits_are_those_of_any_machine(report, monkeypatch, sign):
    """The report, docs/kl.md's tables, is the same to every printed digit for examples nudged by 1e-9 either
    way (helpers.nudge says why that makes it the same on any CPU, BLAS and thread count)."""
    example = fp.example
    monkeypatch.setattr(fp, "example", lambda ex: {k: nudge(v, sign) for k, v in example(ex).items()})
    assert fp.example(fp.BANDIT_EXAMPLE)["rewards"][1].item() != fp.BANDIT_EXAMPLE["rewards"][1]  # nudged
    assert fp.fixed_point_report() == report
