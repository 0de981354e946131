"""Tests for rlhf/kl and lab/theory/expectations.py. The facts and numbers are those of docs/kl.md.

Expectations are exact (enumerating a 4-token vocabulary), so nothing here can flake; the one Monte-Carlo
test uses a fixed seed and 5 standard errors with the standard deviation computed exactly.
"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lab import theory
from rlhf.kl import (
    ESTIMATOR_NAMES,
    KL_CTRL_TYPES,
    PANEL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    check_estimator,
    check_kl_ctrl,
    full_kl,
    kl_panel,
    canonical,
    kl_penalty,
    off_policy_rule,
    register_estimator,
)
from rlhf.kl import exact
from rlhf.kl.estimators import AS_PLUS, DETACHED, IN_GRAPH

BASE_NAMES = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")
PLUS_NAMES = tuple(n + "+" for n in BASE_NAMES)
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
EPS32 = torch.finfo(torch.float32).eps


def random_logprobs(shape=(4, 8), seed=0, low=-5.0, dtype=torch.float32):
    """(logprob, ref_logprob) uniform in [low, 0], leaves that require grad."""
    g = torch.Generator().manual_seed(seed)
    lp = (torch.rand(shape, generator=g, dtype=torch.float64) * low).to(dtype).requires_grad_(True)
    ref = (torch.rand(shape, generator=g, dtype=torch.float64) * low).to(dtype).requires_grad_(True)
    return lp, ref


def grads(name, lp, ref):
    """d sum(kl_penalty) / d(logprob, ref_logprob)."""
    return torch.autograd.grad(kl_penalty(lp, ref, name).sum(), (lp, ref))


def numpy_reference(name, lp, ref):
    """Value and d/dlogprob of each estimator, written from docs/kl.md's table in float64 (verl's k3 clamps)."""
    base = name[:-1] if name.endswith("+") else name
    base = ALIASES.get(base, base)
    d = lp - ref
    if base == "k1":
        value, grad = d, np.ones_like(d)
    elif base == "k2":
        value, grad = 0.5 * d**2, d
    elif base == "k3":
        neg_d = np.clip(-d, -20, 20)
        raw = np.exp(neg_d) - 1 - neg_d
        value = np.clip(raw, -10, 10)
        grad = np.where((np.abs(raw) <= 10) & (np.abs(d) <= 20), 1 - np.exp(-d), 0.0)
    elif base == "abs":
        value, grad = np.abs(d), np.sign(d)
    if name.endswith("+"):
        grad = d
    return value, grad


# ---------------------------------------------------------------------------------------------------------
# The two upstream regression tests (verl PR #6058), then the rest of the '+' contract.


@pytest.mark.parametrize("name", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+"])
def test_kl_penalty_straight_through_value_matches_base(name):
    lp, ref = random_logprobs()
    assert torch.equal(kl_penalty(lp, ref, name), kl_penalty(lp, ref, name[:-1]))


def test_kl_penalty_k3_plus_uses_k2_gradient():
    lp, ref = random_logprobs()
    (g_plus,) = torch.autograd.grad(kl_penalty(lp, ref, "k3+").sum(), lp)
    (g_k2,) = torch.autograd.grad(kl_penalty(lp, ref, "k2").sum(), lp)
    torch.testing.assert_close(g_plus, g_k2, rtol=0, atol=0)
    (g_k3,) = torch.autograd.grad(kl_penalty(lp, ref, "k3").sum(), lp)
    assert not torch.allclose(g_plus, g_k3)  # the inputs are such that the '+' really changes something


@pytest.mark.parametrize("name", PLUS_NAMES)
def test_plus_gradient_is_log_ratio(name):
    lp, ref = random_logprobs()
    g_lp, g_ref = grads(name, lp, ref)
    d = (lp - ref).detach()
    torch.testing.assert_close(g_lp, d, rtol=0, atol=0)
    torch.testing.assert_close(g_ref, -d, rtol=0, atol=0)
    # and with a ref that does not require grad
    (g_lp_only,) = torch.autograd.grad(kl_penalty(lp, ref.detach(), name).sum(), lp)
    torch.testing.assert_close(g_lp_only, d, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["k2", "mse"])
def test_k2_plus_is_k2(name):
    lp, ref = random_logprobs()
    assert torch.equal(kl_penalty(lp, ref, name + "+"), kl_penalty(lp, ref, name))
    for a, b in zip(grads(name + "+", lp, ref), grads(name, lp, ref)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("suffix", ["", "+"])
@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_alias_equals_canonical(alias, suffix):
    lp, ref = random_logprobs()
    canonical = ALIASES[alias] + suffix
    assert torch.equal(kl_penalty(lp, ref, alias + suffix), kl_penalty(lp, ref, canonical))
    for a, b in zip(grads(alias + suffix, lp, ref), grads(canonical, lp, ref)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------
# Names and validation.


def test_estimator_names_are_every_base_and_plus_form():
    assert set(ESTIMATOR_NAMES) == set(BASE_NAMES) | set(PLUS_NAMES)
    assert len(ESTIMATOR_NAMES) == len(set(ESTIMATOR_NAMES))
    assert PANEL_ESTIMATORS == ("k1", "k2", "k3", "abs")
    for name in ESTIMATOR_NAMES:
        assert check_estimator(name) == name
        assert check_estimator(name, allow_full=True) == name


@pytest.mark.parametrize("bad", ["k4", "k3++", "+", "", "K3", "k3 +", "kl ", "full++", "++"])
def test_bad_names_raise_with_valid_list(bad):
    lp, ref = random_logprobs()
    for call in (lambda: kl_penalty(lp, ref, bad), lambda: check_estimator(bad)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert repr(bad) in message
        assert all(f"{name}," in message or f"{name}." in message for name in ESTIMATOR_NAMES)
        assert "'+'" in message


def test_bad_name_hint_and_full_listed_when_allowed():
    with pytest.raises(ValueError, match="did you mean 'k3'"):
        check_estimator("K3")
    with pytest.raises(ValueError, match="did you mean 'k3\\+'"):
        check_estimator("k3 +")
    with pytest.raises(ValueError, match="full"):
        check_estimator("k4", allow_full=True)


@pytest.mark.parametrize("bad", [None, 3, 3.0, b"k3"])
def test_non_string_names_raise_type_error(bad):
    lp, ref = random_logprobs()
    with pytest.raises(TypeError, match="str"):
        kl_penalty(lp, ref, bad)
    for allow_full in (False, True):
        with pytest.raises(TypeError, match="str"):
            check_estimator(bad, allow_full=allow_full)


@pytest.mark.parametrize("name", ["full", "full+"])
def test_full_in_kl_penalty_points_to_full_kl(name):
    lp, ref = random_logprobs()
    with pytest.raises(ValueError, match="full_kl") as info:
        kl_penalty(lp, ref, name)
    assert "logits" in str(info.value)
    with pytest.raises(ValueError, match="full_kl"):
        check_estimator(name)


def test_check_estimator_full():
    assert check_estimator("full", allow_full=True) == "full"
    with pytest.raises(ValueError, match="already") as info:
        check_estimator("full+", allow_full=True)
    assert "'full+'" in str(info.value)


def test_shape_mismatch_raises():
    lp, ref = random_logprobs((4, 8))
    with pytest.raises(ValueError, match="differ"):
        kl_penalty(lp, ref[:, :1], "k1")


def test_registry_refuses_reserved_names():
    for name in ("k1", "k5+", "full", ""):
        with pytest.raises(ValueError, match="reserved"):
            register_estimator(name)(lambda lp, ref: lp - ref)


# ---------------------------------------------------------------------------------------------------------
# Values and gradients against the formulas, precision, and extremes.


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 8 * EPS32), (torch.float64, 1e-12)])
@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_kl_penalty_matches_formulas(name, dtype, tol):
    # d spans [-40, 40]: k3's exponent clamp (|d| > 20), value clamp (d < -2.5 or d > 11) and the middle.
    lp, ref = random_logprobs((64, 64), seed=1, low=-40.0, dtype=dtype)
    d = (lp - ref).detach().double().numpy()
    assert (d > 20).any() and (d < -20).any() and ((d > -2) & (d < 10)).sum() > 500
    value = kl_penalty(lp, ref, name)
    (grad,) = torch.autograd.grad(value.sum(), lp)
    want_value, want_grad = numpy_reference(name, lp.detach().double().numpy(), ref.detach().double().numpy())
    assert value.dtype == dtype
    # float32 rounding: a few eps relative to the value, and a few eps absolute where k3 cancels near d = 0
    np.testing.assert_allclose(value.detach().double().numpy(), want_value, rtol=tol, atol=tol)
    np.testing.assert_allclose(grad.double().numpy(), want_grad, rtol=tol, atol=16 * tol)


def test_k3_is_never_negative():
    lp, ref = random_logprobs((64, 64), seed=2, low=-40.0)
    assert (kl_penalty(lp, ref, "k3") >= 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_half_inputs_computed_in_float32(name, dtype):
    lp, ref = random_logprobs(dtype=dtype)
    out = kl_penalty(lp, ref, name)
    assert out.dtype == torch.float32
    # computed from the upcast values (in half precision k3 near d = 0 would be off by ~1e-3)
    assert torch.equal(out, kl_penalty(lp.float(), ref.float(), name))
    (g,) = torch.autograd.grad(out.sum(), lp)
    assert g.dtype == dtype


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_extreme_log_ratios_stay_finite(name):
    lp = torch.tensor([0.0, -50.0, -1e-3, -100.0], requires_grad=True)
    ref = torch.tensor([-50.0, 0.0, -100.0, -1e-3], requires_grad=True)
    out = kl_penalty(lp, ref, name)
    g_lp, g_ref = torch.autograd.grad(out.sum(), (lp, ref))
    assert torch.isfinite(out).all() and torch.isfinite(g_lp).all() and torch.isfinite(g_ref).all()
    if name.rstrip("+") in ("k3", "low_var_kl"):
        assert torch.equal(out.detach(), torch.full((4,), 10.0))  # the value clamp holds


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_identical_inputs_give_zero(name):
    lp, _ = random_logprobs()
    ref = lp.detach().clone()
    out = kl_penalty(lp, ref, name)
    assert torch.equal(out, torch.zeros_like(out))
    (g,) = torch.autograd.grad(out.sum(), lp)
    # k1's gradient is 1 everywhere; every other estimator is flat at d = 0
    expected = torch.ones_like(g) if name in ("k1", "kl") else torch.zeros_like(g)
    assert torch.equal(g, expected)


# ---------------------------------------------------------------------------------------------------------
# The science, exactly, by enumerating docs/kl.md's examples A and B.


@pytest.fixture(params=["A", "B"])
def categorical(request):
    """(name, logits, ref_probs, pi, ref as float64 numpy)."""
    logits, ref = theory.example(request.param)
    return request.param, logits, ref, logits.softmax(-1).numpy(), ref.numpy()


def analytic_grads(pi, ref):
    """Gradients w.r.t. the logits written by hand: KL(pi||ref), KL(ref||pi), 2 TV."""
    d = np.log(pi) - np.log(ref)
    s = np.sign(d)
    return pi * (d - pi @ d), pi - ref, pi * (s - pi @ s)


def test_kl_md_numbers():
    logits, ref = theory.example("A")
    assert theory.reverse_kl(logits, ref).item() == pytest.approx(0.244174, abs=1e-6)
    assert theory.forward_kl(logits, ref).item() == pytest.approx(0.311199, abs=1e-6)
    assert theory.total_variation(logits, ref).item() == pytest.approx(0.3, abs=1e-12)
    assert theory.expected_value("k1", logits, ref).item() == pytest.approx(0.244174, abs=1e-6)
    assert theory.expected_value("k3", logits, ref).item() == pytest.approx(0.244174, abs=1e-6)
    assert theory.expected_value("k2", logits, ref).item() == pytest.approx(0.209427, abs=1e-6)
    assert theory.expected_value("abs", logits, ref).item() == pytest.approx(0.558366, abs=1e-6)
    np.testing.assert_allclose(
        theory.divergence_grad(theory.reverse_kl, logits, ref).numpy(),
        [0.224486, -0.018556, -0.113250, -0.092681], atol=1e-6,
    )
    np.testing.assert_allclose(
        theory.expected_loss_grad("k3", logits, ref).numpy(), [0.25, 0.05, -0.10, -0.20], atol=1e-12
    )
    logits, ref = theory.example("B")
    assert theory.reverse_kl(logits, ref).item() == pytest.approx(0.456435, abs=1e-6)
    assert theory.forward_kl(logits, ref).item() == pytest.approx(0.456435, abs=1e-6)
    np.testing.assert_allclose(
        theory.expected_loss_grad("k3+", logits, ref).numpy(),
        [0.371944, -0.015291, -0.172380, -0.184273], atol=1e-6,
    )
    np.testing.assert_allclose(
        theory.expected_loss_grad("k3", logits, ref).numpy(), [0.3, 0.1, -0.1, -0.3], atol=1e-12
    )


def test_divergence_helpers_match_hand_written_gradients(categorical):
    _, logits, ref, pi, ref_np = categorical
    rev, fwd, two_tv = analytic_grads(pi, ref_np)
    np.testing.assert_allclose(theory.divergence_grad(theory.reverse_kl, logits, ref), rev, atol=1e-12)
    np.testing.assert_allclose(theory.divergence_grad(theory.forward_kl, logits, ref), fwd, atol=1e-12)
    np.testing.assert_allclose(
        2 * theory.divergence_grad(theory.total_variation, logits, ref), two_tv, atol=1e-12
    )


def test_expected_values(categorical):
    _, logits, ref, pi, ref_np = categorical
    kl = float(pi @ (np.log(pi) - np.log(ref_np)))
    assert theory.expected_value("k1", logits, ref).item() == pytest.approx(kl, rel=1e-12)
    assert theory.expected_value("k3", logits, ref).item() == pytest.approx(kl, rel=1e-12)
    assert theory.expected_value("abs", logits, ref).item() >= kl
    assert theory.expected_value("k2", logits, ref).item() != pytest.approx(kl, rel=1e-3)
    for name in PLUS_NAMES:
        assert theory.expected_value(name, logits, ref) == theory.expected_value(name[:-1], logits, ref)
    # the sign trap: exp(d) - 1 - d has mean chi^2(ref||pi)-ish, not KL
    wrong_k3 = float(pi @ (pi / ref_np - 1 - np.log(pi / ref_np)))
    assert wrong_k3 != pytest.approx(kl, rel=1e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_expected_loss_and_reward_gradients(categorical, dtype, tol):
    _, logits64, ref64, pi, ref_np = categorical
    logits, ref = logits64.to(dtype), ref64.to(dtype)
    rev, fwd, two_tv = analytic_grads(pi, ref_np)

    def loss(name):
        return theory.expected_loss_grad(name, logits, ref).double().numpy()

    def reward(name):
        return theory.expected_reward_grad(name, logits, ref).double().numpy()

    close = dict(rtol=tol, atol=tol)
    np.testing.assert_allclose(loss("k1"), 0.0, **close)  # k1 as a loss does nothing on average
    np.testing.assert_allclose(loss("k2"), rev, **close)
    np.testing.assert_allclose(loss("k3"), fwd, **close)  # GRPO's k3 loss follows the forward KL
    np.testing.assert_allclose(loss("abs"), two_tv, **close)
    for name in PLUS_NAMES:
        np.testing.assert_allclose(loss(name), rev, **close)
        np.testing.assert_allclose(reward(name), reward(name[:-1]), **close)  # '+' is a no-op in the reward
    np.testing.assert_allclose(reward("k1"), rev, **close)
    np.testing.assert_allclose(reward("k3"), rev - fwd, **close)
    assert np.abs(loss("k3") - rev).max() > 0.05  # k3 as a loss is not the reverse-KL gradient


def test_monte_carlo_means_match_exact_values():
    logits, ref = theory.example("A")
    num_samples = 20_000
    g = torch.Generator().manual_seed(1234)
    tokens = torch.multinomial(logits.softmax(-1), num_samples, replacement=True, generator=g)
    lp, ref_lp = logits.log_softmax(-1)[tokens], ref.log()[tokens]
    for name in PANEL_ESTIMATORS:
        exact = theory.expected_value(name, logits, ref).item()
        std = theory.estimator_std(name, logits, ref).item()
        sample_mean = kl_penalty(lp, ref_lp, name).mean().item()
        assert abs(sample_mean - exact) <= 5 * std / math.sqrt(num_samples), name


@pytest.fixture(scope="module")
def demo_output() -> str:
    """`python -m lab.theory`, as a user runs it, once for the tests that read it; a fresh interpreter also
    shows that lab.theory imports alone."""
    return subprocess.run([sys.executable, "-m", "lab.theory"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout


def test_demo_prints_the_report(demo_output):
    out = demo_output
    for number in ("0.244174", "0.209427", "0.558366", "0.311199", "0.456435", "+0.224486, -0.018556"):
        assert number in out
    k3_plus_row = next(line for line in out.splitlines() if line.strip().startswith("k3+"))
    assert k3_plus_row.split()[1:3] == ["1.00000", "0.000000"]


@pytest.mark.parametrize("sign", [1, -1])
def test_report_digits_are_those_of_any_machine(monkeypatch, sign):
    """docs/kl.md quotes the report: it is the same to every printed digit for examples nudged by 1e-9 either
    way (helpers.nudge says why that makes it the same on any machine), and no number that is 0 in exact
    arithmetic prints the sign of its rounding error (k1's and k3's bias: +0.000000, never -0.000000)."""
    from helpers import nudge

    from lab.theory import expectations

    report = expectations.report()
    example, off_policy_example = expectations.example, expectations.off_policy_example
    assert "-0.000000" not in report and "-0.000 " not in report
    nudged = lambda name, dtype=torch.float64: (nudge(example(name, dtype)[0].exp(), sign).log(),
                                                nudge(example(name, dtype)[1], sign))
    monkeypatch.setattr(expectations, "example", nudged)
    monkeypatch.setattr(expectations, "off_policy_example", lambda name, dtype=torch.float64: (
        *nudged(expectations.OFF_POLICY_EXAMPLES[name][0], dtype), nudge(off_policy_example(name, dtype)[2], sign)))
    assert not torch.equal(expectations.example("A")[1], example("A")[1])  # nudged
    assert expectations.report() == report
    noise = expectations._unless_noise(-1e-17)
    assert noise == 0.0 and f"{noise:+.6f}" == "+0.000000"
    assert expectations._unless_noise(-1e-6) == -1e-6  # a real difference keeps its sign


# ---------------------------------------------------------------------------------------------------------
# Off-policy: kl_penalty(..., old_logprob) on tokens sampled from pi_old, exact by enumeration (docs/kl.md,
# 'Off-policy samples and importance correction', worked example C).

IN_GRAPH_NAMES = ("k1", "kl")  # rho inside the graph
AS_PLUS_NAMES = ("k3", "low_var_kl")  # weighted as k3+: sg(rho), k2's gradient; every other name: rho detached
KL_GRAD_NAMES = ("k1", "kl", "k2", "mse", "k3", "low_var_kl") + PLUS_NAMES  # corrected: grad KL(pi || ref)
C_TARGET = (0.224486, -0.018556, -0.113250, -0.092681)  # grad KL(pi || ref) of example A (and C)


@pytest.fixture(params=["C", "B-old-uniform"])
def off_policy(request):
    """(name, logits, ref_probs, old_probs, and pi, ref, old as float64 numpy): docs/kl.md's example C, and
    example B's pi and ref with tokens sampled from the uniform distribution."""
    if request.param == "C":
        logits, ref, old = theory.off_policy_example("C")
    else:
        logits, ref = theory.example("B")
        old = torch.full((4,), 0.25, dtype=torch.float64)
    return request.param, logits, ref, old, logits.softmax(-1).numpy(), ref.numpy(), old.numpy()


def score_grad(weight, f, pi):
    """sum_x weight_x f_x grad_logits log pi(x) = weight * f - pi * (weight . f), written by hand."""
    return weight * f - pi * (weight @ f)


def hand_off_policy_grad(name, pi, ref, old, weighting):
    """The expected loss gradient over x ~ pi_old, by hand from numpy_reference's X and X' = dX/dlogprob:
    'none': E_old[X' grad log pi]; 'detached' rho: E_pi[X' grad log pi]; rho in the 'graph' adds
    E_pi[X grad log pi] (rho X has gradient rho X grad log pi + rho X' grad log pi); 'as plus': E_pi[d grad log pi]
    (sg(rho) with k2's slope d)."""
    value, slope = numpy_reference(name, np.log(pi), np.log(ref))
    if weighting == "none":
        return score_grad(old, slope, pi)
    if weighting == "as plus":
        return score_grad(pi, np.log(pi) - np.log(ref), pi)
    detached = score_grad(pi, slope, pi)
    return detached if weighting == "detached" else detached + score_grad(pi, value, pi)


def weighted_loss_grad(name, logits, ref, old, weighting):
    """Autograd of sum_x old_x w(x) kl_penalty(x) with the weight built here, not by kl_penalty:
    w = 1 ('none'), sg(rho) ('detached') or rho ('graph'), rho = pi / pi_old."""
    leaf = logits.detach().clone().requires_grad_(True)
    logprobs = torch.log_softmax(leaf, -1)
    rho = (logprobs - old.log()).exp()
    weight = {"none": torch.ones_like(rho), "detached": rho.detach(), "graph": rho}[weighting]
    (grad,) = torch.autograd.grad((old * weight * kl_penalty(logprobs, ref.log(), name)).sum(), leaf)
    return grad.numpy()


def off_policy_weighting(name):
    """kl_penalty's off-policy rule for `name`, as hand_off_policy_grad names it."""
    return {IN_GRAPH: "graph", DETACHED: "detached", AS_PLUS: "as plus"}[off_policy_rule(name)]


def test_off_policy_rules():
    assert {name for name in ESTIMATOR_NAMES if off_policy_rule(name) == IN_GRAPH} == set(IN_GRAPH_NAMES)
    assert {name for name in ESTIMATOR_NAMES if off_policy_rule(name) == AS_PLUS} == set(AS_PLUS_NAMES)
    with pytest.raises(ValueError, match="valid names"):
        off_policy_rule("k4")
    with pytest.raises(ValueError, match="off_policy"):
        register_estimator("k9", off_policy="sometimes")


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_off_policy_expected_values(off_policy, name):
    case, logits, ref, old, pi, ref_np, old_np = off_policy
    value, _ = numpy_reference(name, np.log(pi), np.log(ref_np))
    corrected = theory.expected_off_policy_value(name, logits, ref, old, corrected=True).item()
    uncorrected = theory.expected_off_policy_value(name, logits, ref, old, corrected=False).item()
    # E_old[rho X] = E_pi[X], X's on-policy mean (bias included: k2, abs)
    assert corrected == pytest.approx(theory.expected_value(name, logits, ref).item(), rel=1e-12)
    assert corrected == pytest.approx(float(pi @ value), rel=1e-12)
    assert uncorrected == pytest.approx(float(old_np @ value), rel=1e-12)
    if case == "C":
        assert abs(uncorrected - corrected) > 0.03  # the unweighted mean is off
        assert corrected == pytest.approx(
            {"k1": 0.244174, "k2": 0.209427, "k3": 0.244174, "abs": 0.558366}[canonical(name).rstrip("+")], abs=1e-6
        )


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_off_policy_expected_loss_gradients(off_policy, name):
    case, logits, ref, old, pi, ref_np, old_np = off_policy
    rev, _, two_tv = analytic_grads(pi, ref_np)
    corrected = theory.expected_off_policy_loss_grad(name, logits, ref, old, corrected=True).numpy()
    uncorrected = theory.expected_off_policy_loss_grad(name, logits, ref, old, corrected=False).numpy()
    close = dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(uncorrected, hand_off_policy_grad(name, pi, ref_np, old_np, "none"), **close)
    rule = off_policy_weighting(name)
    np.testing.assert_allclose(corrected, hand_off_policy_grad(name, pi, ref_np, old_np, rule), **close)
    by_hand = weighted_loss_grad(name + "+" if rule == "as plus" else name, logits, ref, old,
                                 "detached" if rule == "as plus" else rule)
    np.testing.assert_allclose(corrected, by_hand, **close)
    if name in KL_GRAD_NAMES:
        np.testing.assert_allclose(corrected, rev, **close)  # the whole point
        if case == "C":
            assert np.abs(uncorrected - rev).max() > 0.05
    else:  # abs: rho detached keeps its on-policy loss gradient, 2 grad TV(pi, ref), not a KL gradient
        np.testing.assert_allclose(corrected, two_tv, **close)
        np.testing.assert_allclose(corrected, theory.expected_loss_grad(name, logits, ref).numpy(), **close)
        assert np.abs(corrected - rev).max() > 0.05
        if case == "C":
            assert np.abs(uncorrected - two_tv).max() > 0.05


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_off_policy_other_weighting_is_biased(off_policy, name):
    """The weighting kl_penalty does not use, built by hand, misses grad KL(pi || ref) in every case."""
    case, logits, ref, old, pi, ref_np, old_np = off_policy
    rev, fwd, two_tv = analytic_grads(pi, ref_np)
    other = "graph" if off_policy_rule(name) == DETACHED else "detached"
    grad = weighted_loss_grad(name, logits, ref, old, other)
    close = dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad, hand_off_policy_grad(name, pi, ref_np, old_np, other), **close)
    base = canonical(name).rstrip("+")
    if name in ("k1", "kl"):
        np.testing.assert_allclose(grad, 0.0, **close)  # detached rho: k1's on-policy loss, zero
    elif name in ("k3", "low_var_kl"):
        np.testing.assert_allclose(grad, fwd, **close)  # detached rho: k3's on-policy loss, the forward KL
    elif name.endswith("+") or base == "k2":
        # rho in the graph adds E_pi[X grad log pi], X's reward-placement gradient, to the exact one
        reward = theory.expected_reward_grad(base, logits, ref).numpy()
        np.testing.assert_allclose(grad, rev + reward, **close)
    else:  # abs with rho in the graph: grad E_pi|d|, the gradient of a value biased high

        def mean_abs(z, q):
            return (z.softmax(-1) * (z.log_softmax(-1) - q.log()).abs()).sum()

        np.testing.assert_allclose(grad, theory.divergence_grad(mean_abs, logits, ref).numpy(), **close)
        assert np.abs(grad - two_tv).max() > 0.05
    if base == "k1" and name.endswith("+"):
        np.testing.assert_allclose(grad, 2 * rev, **close)  # k1+ in the graph: twice the gradient
    assert np.abs(grad - rev).max() > 0.05


def test_example_c_numbers():
    """docs/kl.md's worked example C, pinned."""
    logits, ref, old = theory.off_policy_example("C")
    assert theory.OFF_POLICY_EXAMPLES["C"] == ("A", (0.4, 0.3, 0.2, 0.1))

    def corrected(name):
        return theory.expected_off_policy_loss_grad(name, logits, ref, old, corrected=True).numpy()

    def uncorrected(name):
        return theory.expected_off_policy_loss_grad(name, logits, ref, old, corrected=False).numpy()

    def by_hand(name, weighting):
        return weighted_loss_grad(name, logits, ref, old, weighting)

    pinned = [
        (uncorrected("k3"), (0.341667, 0.135000, -0.090833, -0.385833)),
        (uncorrected("k2"), (0.242836, 0.034043, -0.112492, -0.164386)),
        (uncorrected("k3+"), (0.242836, 0.034043, -0.112492, -0.164386)),
        (uncorrected("k1"), (-0.1, 0.0, 0.05, 0.05)),  # = pi_old - pi
        (uncorrected("abs"), (0.2, 0.18, -0.26, -0.12)),
        (corrected("k1"), C_TARGET),
        (corrected("k3"), C_TARGET),
        (corrected("k2"), C_TARGET),
        (corrected("k3+"), C_TARGET),
        (corrected("abs"), (0.2, 0.12, -0.24, -0.08)),  # = 2 grad TV
        (by_hand("k3+", "graph"), (0.198973, -0.087112, -0.126500, 0.014639)),
        (by_hand("k2", "graph"), (0.239886, -0.076398, -0.125093, -0.038395)),
        (by_hand("k3", "detached"), (0.25, 0.05, -0.10, -0.20)),  # = pi - ref
        (by_hand("k1", "detached"), (0.0, 0.0, 0.0, 0.0)),
        (by_hand("abs", "graph"), (0.267391, 0.007187, -0.247131, -0.027446)),
    ]
    for got, want in pinned:
        np.testing.assert_allclose(got, want, atol=1e-6)
    for name, want in (("k1", 0.244174), ("k3", 0.244174), ("k2", 0.209427), ("abs", 0.558366)):
        value = theory.expected_off_policy_value(name, logits, ref, old, corrected=True).item()
        assert value == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_old_logprob_none_or_equal_to_logprob(name):
    lp, ref = random_logprobs()
    today = kl_penalty(lp, ref, name)
    today_grads = grads(name, lp, ref)
    for a, b in zip(torch.autograd.grad(kl_penalty(lp, ref, name, old_logprob=None).sum(), (lp, ref)), today_grads):
        assert torch.equal(a, b)
    # rho == 1: the value is today's, bit for bit; the old_logprob passed with grad is not differentiated
    for old in (lp.detach().clone(), lp):
        out = kl_penalty(lp, ref, name, old_logprob=old)
        assert torch.equal(out, today)
        g_lp, g_ref = torch.autograd.grad(out.sum(), (lp, ref))
        assert torch.equal(g_ref, -(lp - ref).detach() if name in AS_PLUS_NAMES else today_grads[1])
        if name in IN_GRAPH_NAMES:
            # rho in the graph is not a no-op at rho == 1: d(rho X)/dlogprob = X + X'
            torch.testing.assert_close(g_lp, today_grads[0] + today.detach(), rtol=1e-6, atol=1e-6)
            assert not torch.allclose(g_lp, today_grads[0])
        elif name in AS_PLUS_NAMES:  # k2's slope, d, whatever the clamp: not k3's own 1 - exp(-d)
            assert torch.equal(g_lp, (lp - ref).detach())
            assert not torch.allclose(g_lp, today_grads[0])
        else:  # detached rho == 1: exactly today's gradient
            assert torch.equal(g_lp, today_grads[0])


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_old_logprob_per_sample_formula(name):
    """rho * X, rho = exp(clamp(logprob - old_logprob, -20, 20)), with rho in the graph or detached."""
    lp, ref = random_logprobs((16, 16), seed=4, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    shift = torch.randn((16, 16), generator=g, dtype=torch.float64)
    shift[0, :4] = torch.tensor([25.0, -25.0, 19.5, -19.5])  # two ratios clamped, two not
    old = (lp.detach() - shift).requires_grad_(True)
    out = kl_penalty(lp, ref, name, old_logprob=old)
    g_lp, g_ref, g_old = torch.autograd.grad(out.sum(), (lp, ref, old), allow_unused=True)
    assert g_old is None or torch.equal(g_old, torch.zeros_like(g_old))  # old_logprob is never differentiated
    value, slope = numpy_reference(name, lp.detach().numpy(), ref.detach().numpy())
    log_ratio = shift.numpy()
    rho = np.exp(np.clip(log_ratio, -20, 20))
    np.testing.assert_allclose(out.detach().numpy(), rho * value, rtol=1e-12, atol=1e-12)
    if name in AS_PLUS_NAMES:  # sg(rho) d: the gradient rho k3 in the graph has wherever k3 is not clamped
        want = rho * (lp - ref).detach().numpy()
    else:
        want = rho * slope + (rho * value * (np.abs(log_ratio) < 20) if name in IN_GRAPH_NAMES else 0)
    np.testing.assert_allclose(g_lp.numpy(), want, rtol=1e-10, atol=1e-10)
    (g_ref_today,) = torch.autograd.grad(kl_penalty(lp, ref, name + "+" if name in AS_PLUS_NAMES else name).sum(), ref)
    np.testing.assert_allclose(g_ref.numpy(), rho * g_ref_today.numpy(), rtol=1e-12, atol=1e-12)
    assert out[0, 0].item() == pytest.approx(math.exp(20) * value[0, 0], rel=1e-12)


def test_old_logprob_shape_mismatch_raises():
    lp, ref = random_logprobs((4, 8))
    for bad in (lp.detach()[:, :1], lp.detach()[0], lp.detach().unsqueeze(0)):
        with pytest.raises(ValueError, match="old_logprob"):
            kl_penalty(lp, ref, "k3", old_logprob=bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_old_logprob_half_inputs(name, dtype):
    lp, ref = random_logprobs(dtype=dtype)
    old = (lp.detach().float() - 0.3 * torch.arange(8).float()).to(dtype)
    out = kl_penalty(lp, ref, name, old_logprob=old)
    assert out.dtype == torch.float32
    assert torch.equal(out, kl_penalty(lp.float(), ref.float(), name, old_logprob=old.float()))
    (g,) = torch.autograd.grad(out.sum(), lp)
    assert g.dtype == dtype and torch.isfinite(g.float()).all()
    assert not torch.equal(out, kl_penalty(lp, ref, name))  # the weight is applied


def test_demo_prints_the_off_policy_table(demo_output):
    out = demo_output
    section = out[out.index("Example C (off-policy)"):]
    assert "pi_old = (0.4, 0.3, 0.2, 0.1)" in section and "+0.224486, -0.018556" in section
    # estimator, rho, uncorrected cos/err, corrected cos/err, other rho cos/err, E_old[k], E_old[rho k], E_pi[k]
    rows = {}
    for line in section.replace("in graph", "in-graph").replace("as X+", "as-X+").splitlines():
        cells = line.split()
        if cells and cells[0] in theory.REPORT_ESTIMATORS:
            rows[cells[0]] = cells[1:]
    assert list(rows) == list(theory.REPORT_ESTIMATORS)
    for name, cells in rows.items():
        assert len(cells) == 10, name
        assert cells[0] == {IN_GRAPH: "in-graph", DETACHED: "detached", AS_PLUS: "as-X+"}[off_policy_rule(name)], name
        if name != "abs":
            assert cells[3:5] == ["1.00000", "0.000000"], name  # corrected: grad KL(pi || ref)
        assert cells[8] == cells[9] != cells[7], name  # corrected value == E_pi[k] != uncorrected value
    assert rows["k1"][1:3] == ["-0.99534", "0.324486"]  # uncorrected k1: pi_old - pi
    assert rows["k1"][5:7] == ["zero", "0.224486"]  # k1 with rho detached: nothing
    assert rows["k1+"][5:7] == ["1.00000", "0.224486"]  # k1+ with rho in the graph: twice grad KL
    assert rows["abs"][1:8] == ["0.77807", "0.198556", "0.83595", "0.138556", "0.92175", "0.133881", "0.595064"]
    assert rows["k3"][1:3] == ["0.82827", "0.293153"] and rows["k3"][7:] == ["0.352180", "0.244174", "0.244174"]


# ---------------------------------------------------------------------------------------------------------
# full_kl


def naive_full_kl(logits, ref_logits, temperature=1.0):
    logp = torch.log_softmax(logits.double() / temperature, -1)
    logq = torch.log_softmax(ref_logits.double() / temperature, -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def random_logits(shape, seed=0, dtype=torch.float64, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def test_full_kl_matches_naive_and_torch_distributions():
    logits, ref = random_logits((2, 3, 11), 0), random_logits((2, 3, 11), 1)
    out = full_kl(logits, ref)
    assert out.shape == (2, 3)
    torch.testing.assert_close(out, naive_full_kl(logits, ref), rtol=1e-12, atol=1e-12)
    dist = torch.distributions
    torch.testing.assert_close(
        out, dist.kl_divergence(dist.Categorical(logits=logits), dist.Categorical(logits=ref)), rtol=1e-12, atol=1e-12
    )
    assert (out > 0).all()


def test_full_kl_chunked_equals_unchunked(monkeypatch):
    logits, ref = random_logits((5, 7, 13), 2), random_logits((5, 7, 13), 3)
    monkeypatch.setattr(exact, "CHUNK_ROWS", 10_000)
    whole = full_kl(logits, ref)
    for chunk_rows in (1, 3, 34, 35):
        monkeypatch.setattr(exact, "CHUNK_ROWS", chunk_rows)
        torch.testing.assert_close(full_kl(logits, ref), whole, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("chunk_rows", [4, 100])
def test_full_kl_gradient_matches_autograd_of_naive(chunk_rows, monkeypatch):
    monkeypatch.setattr(exact, "CHUNK_ROWS", chunk_rows)
    temperature = 0.7
    logits = random_logits((2, 3, 11), 4).requires_grad_(True)
    ref = random_logits((2, 3, 11), 5).requires_grad_(True)
    weights = random_logits((2, 3), 6)  # a non-uniform upstream gradient
    got = torch.autograd.grad((full_kl(logits, ref, temperature) * weights).sum(), (logits, ref))
    want = torch.autograd.grad((naive_full_kl(logits, ref, temperature) * weights).sum(), (logits, ref))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    (only_logits,) = torch.autograd.grad(full_kl(logits, ref.detach(), temperature).sum(), logits)
    (want_logits,) = torch.autograd.grad(naive_full_kl(logits, ref.detach(), temperature).sum(), logits)
    torch.testing.assert_close(only_logits, want_logits, rtol=1e-10, atol=1e-12)


def test_full_kl_saves_no_vocab_sized_intermediates(monkeypatch):
    """Memory stays bounded: autograd keeps only the two inputs, nothing else of size (N, V)."""
    monkeypatch.setattr(exact, "CHUNK_ROWS", 8)
    logits = random_logits((4, 16, 50), 7, dtype=torch.bfloat16).requires_grad_(True)
    ref = random_logits((4, 16, 50), 8, dtype=torch.bfloat16)
    saved_bytes = []

    def pack(t):
        saved_bytes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = full_kl(logits, ref)
    assert sum(saved_bytes) <= 2 * logits.numel() * logits.element_size()
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_full_kl_half_inputs_give_float32():
    logits = random_logits((3, 4, 17), 9, dtype=torch.bfloat16)
    ref = random_logits((3, 4, 17), 10, dtype=torch.bfloat16)
    out = full_kl(logits, ref)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, naive_full_kl(logits, ref).float(), rtol=1e-5, atol=1e-6)
    assert full_kl(logits.half(), ref.half()).dtype == torch.float32


def test_full_kl_temperature():
    logits, ref = random_logits((3, 9), 11), random_logits((3, 9), 12)
    for temperature in (0.5, 2.0):
        out = full_kl(logits, ref, temperature=temperature)
        torch.testing.assert_close(out, full_kl(logits / temperature, ref / temperature), rtol=1e-12, atol=1e-12)
        assert not torch.allclose(out, full_kl(logits, ref), rtol=1e-3)


def test_full_kl_real_vocabulary_and_masked_tokens(monkeypatch):
    monkeypatch.setattr(exact, "CHUNK_ROWS", 2)  # 3 rows: uneven chunks
    vocab = 151_936
    logits = random_logits((3, vocab), 13, dtype=torch.float32)
    ref = random_logits((3, vocab), 14, dtype=torch.float32)
    logits[:, :1000] = -float("inf")  # e.g. tokens masked out of the policy: 0 * log 0 = 0
    logits.requires_grad_(True)
    out = full_kl(logits, ref)
    # KL over the kept tokens, with ref normalised over the whole vocabulary
    kept = slice(1000, None)
    log_ref_mass_kept = torch.logsumexp(ref.double()[:, kept], -1) - torch.logsumexp(ref.double(), -1)
    want = naive_full_kl(logits.detach()[:, kept], ref[:, kept]) - log_ref_mass_kept
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[:, :1000] == 0).all()


def test_full_kl_rejects_logits_of_two_shapes_or_no_vocabulary():
    logits = random_logits((2, 5), 15)
    with pytest.raises(ValueError, match=r"\(2, 5\) and ref_logits \(2, 4\): one shape"):
        full_kl(logits, logits[:, :4])
    with pytest.raises(ValueError, match="one shape"):
        full_kl(logits[0, 0], logits[0, 0])


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_full_kl_rejects_a_temperature_that_is_not_finite_and_positive(temperature):
    logits = random_logits((2, 5), 15)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        full_kl(logits, logits, temperature)
    assert torch.isfinite(full_kl(logits, logits, 1e-3)).all()  # just above the edge: accepted


# ---------------------------------------------------------------------------------------------------------
# KL-coefficient controllers


def test_adaptive_controller_hand_worked():
    ctrl = build_kl_controller("adaptive", kl_coef=0.1, target_kl=6.0, horizon=10_000)
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == 0.1
    ctrl.update(current_kl=6.6, n_steps=256)  # e = 6.6/6 - 1 = 0.1: 0.1 * (1 + 0.1 * 0.0256)
    assert ctrl.value == pytest.approx(0.100256, rel=1e-12)
    ctrl.update(current_kl=12.0, n_steps=256)  # e = 1 clipped to 0.2: * 1.00512
    assert ctrl.value == pytest.approx(0.10076931072, rel=1e-12)
    ctrl.update(current_kl=0.0, n_steps=256)  # e = -1 clipped to -0.2: * 0.99488
    assert ctrl.value == pytest.approx(0.10076931072 * 0.99488, rel=1e-12)


@pytest.mark.parametrize("low, high", [(1.2, 100.0), (0.8, 0.0)])
def test_adaptive_controller_clips_error_at_0_2(low, high):
    a, b = AdaptiveKLController(0.1, 1.0, 100), AdaptiveKLController(0.1, 1.0, 100)
    a.update(low, 10)
    b.update(high, 10)
    assert a.value == b.value == pytest.approx(0.1 * (1 + math.copysign(0.2, low - 1) * 0.1))


def test_fixed_controller_never_moves():
    ctrl = build_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.05


def test_adaptive_controller_rejects_nan_kl():
    ctrl = AdaptiveKLController(0.1, 1.0, 100)
    with pytest.raises(ValueError, match="finite"):
        ctrl.update(float("nan"), 10)
    assert ctrl.value == 0.1


@pytest.mark.parametrize("kind", KL_CTRL_TYPES)
def test_controller_state_round_trip(kind):
    a = build_kl_controller(kind, 0.2, target_kl=0.5, horizon=50)
    for kl in (0.1, 0.9, 0.6):
        a.update(kl, 8)
    b = build_kl_controller(kind, 0.2, target_kl=0.5, horizon=50)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value
    for kl in (0.3, 2.0):
        a.update(kl, 8)
        b.update(kl, 8)
        assert b.value == a.value
    if kind == "adaptive":
        assert a.value != 0.2


@pytest.mark.parametrize(
    "args, words",
    [
        (("adaptive", 0.1, 6.0, 0), ["horizon", "0", "> 0"]),
        (("adaptive", 0.1, 6.0, -5.0), ["horizon", "-5.0"]),
        (("adaptive", 0.1, None, 100), ["target_kl", "None"]),
        (("adaptive", 0.1, -1.0, 100), ["target_kl", "-1.0"]),
        (("adaptive", 0.1, 0.0, 100), ["target_kl", "0.0"]),
        (("fixed", -0.1, None, None), ["kl_coef", "-0.1", ">= 0"]),
        (("adaptive", float("nan"), 6.0, 100), ["kl_coef", "nan"]),
        (("linear", 0.1, 6.0, 100), ["'linear'", "fixed", "adaptive"]),
        (("Fixed", 0.1, None, None), ["'Fixed'", "fixed", "adaptive"]),
    ],
)
def test_invalid_controller_settings(args, words):
    for call in (check_kl_ctrl, build_kl_controller):
        with pytest.raises(ValueError) as info:
            call(*args)
        assert all(word in str(info.value) for word in words), str(info.value)
    if args[0] == "adaptive":
        with pytest.raises(ValueError):
            AdaptiveKLController(*args[1:])


def test_valid_controller_settings_pass_check():
    check_kl_ctrl("fixed", 0.0)
    check_kl_ctrl("fixed", 0.1, target_kl=None, horizon=None)
    check_kl_ctrl("adaptive", 0.0, 6.0, 10_000)


# ---------------------------------------------------------------------------------------------------------
# kl_panel


def test_kl_panel_matches_masked_means():
    lp, ref = random_logprobs((4, 16), seed=3)
    mask = torch.zeros(4, 16)
    mask[0, :5] = mask[1, :16] = mask[2, :1] = 1  # row 3 fully masked out
    panel = kl_panel(lp, ref, mask)
    assert list(panel) == ["kl/k1", "kl/k2", "kl/k3", "kl/abs"]
    keep = mask.bool()
    for name in PANEL_ESTIMATORS:
        want = kl_penalty(lp, ref, name).detach()[keep].mean().item()
        assert isinstance(panel[f"kl/{name}"], float)
        assert panel[f"kl/{name}"] == pytest.approx(want, rel=1e-6)
    # garbage in masked-out positions (padding) changes nothing
    lp2, ref2 = lp.detach().clone(), ref.detach().clone()
    lp2[~keep], ref2[~keep] = float("nan"), float("inf")
    assert kl_panel(lp2, ref2, mask) == panel
    assert kl_panel(lp, ref, torch.zeros(4, 16)) == {f"kl/{n}": 0.0 for n in PANEL_ESTIMATORS}
    for args in ((lp, ref, mask[:, :8]), (lp, ref[:, :8], mask)):  # a broadcast would hide the mistake
        with pytest.raises(ValueError, match="differ"):
            kl_panel(*args)


@pytest.mark.parametrize("name, expected", [("k1", "k1"), ("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"),
                                            ("low_var_kl+", "k3+"), ("kl+", "k1+"), ("abs+", "abs+"),
                                            ("full", "full")])
def test_canonical_names(name, expected):
    assert canonical(name) == expected


def test_canonical_refuses_unknown_names():
    with pytest.raises(ValueError, match="valid names"):
        canonical("k4")


def test_demo_prints_the_fixed_points_and_the_frameworks_table(demo_output):
    from lab.theory.fixed_point_tables import advantage_report, fixed_point_report
    from lab.theory.peers import peer_report

    assert fixed_point_report() in demo_output and peer_report() in demo_output
    assert advantage_report() in demo_output
