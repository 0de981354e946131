"""Every KL estimator x placement x correction: its exact expected gradient over the whole range of d.

d = log pi(x) - log pi_ref(x) runs from -15 to 15 here, on both sides of each of k3's clamp edges (its value
is clamped to 10 where exp(-d) - 1 + d > 10: d < -2.61087 and d > 10.99998), with the expectation over x taken
exactly by enumerating small vocabularies. The gradient is w.r.t. the policy's logits z, through the estimator
object the trainer calls (rlhf.kl.parse_estimator) and through kl_penalty. Each target is the one the table in
docs/kl.md ("Expected gradient by placement") and the README state, written out here by hand:

    rev  = grad KL(pi || ref) = pi * (d - E_pi[d])          fwd = grad KL(ref || pi) = pi - ref
    tv2  = 2 grad TV(pi, ref) = pi * (s - E_pi[s]), s = sign(d)
    score(w, f) = sum_x w_x f_x grad log pi(x) = w * f - pi * (w . f)   (grad_z log pi(x) = e_x - pi)

- in the loss, on-policy (no old_logprob): E_pi[X'(d) grad log pi] = score(pi, X'): k1 0, k2 rev, k3 fwd where no
  token is past a clamp edge (a token past one adds nothing: k3's value is flat there), abs tv2, every X+ rev,
  full rev (exactly, per state).
- in the loss, corrected (x ~ pi_old, kl_penalty(..., old_logprob=log pi_old)): rev at every d for k1, k2, k3 and
  every X+; abs keeps tv2.
- in the reward (the value detached, a score-function gradient): score(pi, X(d)): k1 rev; k3 rev - fwd where no
  token is past an edge, else its clamped value's; k2 and abs not KL gradients; X+ as X; full 0 (the exact KL is the
  same number for every token of a state, so it moves no token at its own state).
"""

import math

import numpy as np
import pytest
import torch

from rlhf.kl import ESTIMATOR_NAMES, full_kl, kl_penalty, parse_estimator

K3_LOWER_EDGE, K3_UPPER_EDGE = -2.610868638149876, 10.999983298020256  # where exp(-d) - 1 + d = 10

# Each vocabulary: tokens whose d is set exactly (pi_x, d_x), then two filler tokens that take the rest of pi's
# and ref's mass (their own d is whatever that leaves, near 0).
VOCABULARIES = {
    "inside": [(0.1, -1.5), (0.3, 0.8), (0.1, 2.0)],
    "just past the lower edge": [(0.03, -2.62), (0.03, -2.60), (0.2, 0.5)],
    "one token at d = -4.99": [(0.004, -4.99), (0.3, 0.4)],
    "far below": [(1e-7, -15.0), (1e-4, -8.0), (0.05, -1.0)],
    "above the upper edge": [(0.2, 10.9), (0.2, 11.1), (0.2, 15.0)],
    "every side": [(1e-7, -15.0), (0.001, -4.99), (0.01, -2.62), (0.1, -0.3), (0.15, 10.9), (0.15, 11.1), (0.1, 15.0)],
}
BASE = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3", "abs": "abs"}


def vocabulary(name):
    """(pi, ref) float64 numpy over the vocabulary `name`, with d exact on its set tokens."""
    set_pi = np.array([p for p, _ in VOCABULARIES[name]])
    set_ref = set_pi * np.exp(-np.array([d for _, d in VOCABULARIES[name]]))
    rest_pi, rest_ref = 1 - set_pi.sum(), 1 - set_ref.sum()
    assert rest_pi > 0 and rest_ref > 0
    pi = np.concatenate([set_pi, [0.6 * rest_pi, 0.4 * rest_pi]])
    ref = np.concatenate([set_ref, [0.4 * rest_ref, 0.6 * rest_ref]])
    return pi, ref


def old_policy(pi):
    """A sampling policy away from pi (half of it, half uniform), so rho = pi / pi_old is not 1."""
    return 0.5 * pi + 0.5 / len(pi)


def score(weight, f, pi):
    return weight * f - pi * (weight @ f)


def k3_value(d):
    return np.minimum(np.expm1(-d) + d, 10.0)


def past_an_edge(d):
    return (d < K3_LOWER_EDGE) | (d > K3_UPPER_EDGE)


def target(name, placement, pi, ref):
    """The docs' expected gradient for estimator `name` in `placement` ("loss", "loss-corrected", "reward")."""
    d = np.log(pi) - np.log(ref)
    rev, fwd, tv2 = pi * (d - pi @ d), pi - ref, pi * (np.sign(d) - pi @ np.sign(d))
    plus, base = name.endswith("+"), BASE.get(name.rstrip("+"), name)
    if base == "full":  # exact per state; it takes no importance weight (the weights of x ~ pi_old sum to 1)
        return np.zeros_like(pi) if placement == "reward" else rev
    if placement == "reward":  # X+ has X's value, and only the value enters a reward
        return {"k1": rev, "k2": score(pi, d**2 / 2, pi), "abs": score(pi, np.abs(d), pi),
                "k3": score(pi, k3_value(d), pi)}[base]
    if base == "abs" and not plus:
        return tv2
    if placement == "loss-corrected" or plus or base == "k2":
        return rev
    if base == "k1":
        return np.zeros_like(pi)
    return score(pi, np.where(past_an_edge(d), 0.0, -np.expm1(-d)), pi)  # k3: fwd where no token is past an edge


def expected_gradient(name, placement, pi, ref, old=None, through="object"):
    """The exact expected gradient w.r.t. pi's logits of the estimator in `placement`, by enumeration; old is
    pi_old (x ~ pi_old, the term weighted by kl_penalty's old_logprob) for "loss-corrected"."""
    logits = torch.tensor(np.log(pi)).requires_grad_(True)
    ref_logits = torch.tensor(np.log(ref))
    logprobs, ref_logprobs = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    probs = torch.tensor(pi)
    estimator = parse_estimator(name)

    def term(lp, old_logprob=None):
        if estimator.needs_logits:  # the state's exact KL, the same for every token x
            return full_kl(logits if lp.requires_grad else logits.detach(), ref_logits).expand_as(lp)
        if through == "kl_penalty":
            return kl_penalty(lp, ref_logprobs, name, old_logprob=old_logprob)
        return estimator(lp, ref_logprobs, old_logprob=old_logprob)

    if placement == "loss":
        objective = (probs * term(logprobs)).sum() if not estimator.needs_logits else term(logprobs)[0]
    elif placement == "loss-corrected":
        old = torch.tensor(old)
        objective = (old * term(logprobs, old_logprob=old.log())).sum()
    else:  # reward -X: the policy gradient descends E_pi[sg(X) log pi] (score function), so its gradient is ours
        objective = (probs * term(logprobs.detach()).detach() * logprobs).sum()
    (grad,) = torch.autograd.grad(objective, logits)
    return grad.numpy()


PLACEMENTS = ("loss", "loss-corrected", "reward")
# Every name through the object the step calls, and every sampled name through kl_penalty too (which refuses
# `full`: it takes sampled log-probs only).
CALLS = [(name, "object") for name in ESTIMATOR_NAMES + ("full",)] + [(name, "kl_penalty") for name in ESTIMATOR_NAMES]


@pytest.mark.parametrize("vocab", VOCABULARIES)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name, through", CALLS)
def test_expected_gradient_is_the_docs_target_at_every_d(name, through, placement, vocab):
    pi, ref = vocabulary(vocab)
    expected = target(name, placement, pi, ref)
    olds = [old_policy(pi), pi] if placement == "loss-corrected" else [None]  # off-policy, and rho == 1
    for old in olds:
        got = expected_gradient(name, placement, pi, ref, old, through)
        np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-14, err_msg=f"{name} {placement} {vocab}")


def test_the_vocabularies_hold_tokens_on_both_sides_of_every_edge():
    """The d values the tests above cover: past and short of both of k3's edges, and |d| up to 15."""
    ds = np.concatenate([np.log(p) - np.log(r) for p, r in map(vocabulary, VOCABULARIES)])
    for low, high in [(-16, -14), (K3_LOWER_EDGE - 0.02, K3_LOWER_EDGE), (K3_LOWER_EDGE, K3_LOWER_EDGE + 0.02),
                      (-0.5, 0.5), (K3_UPPER_EDGE - 0.2, K3_UPPER_EDGE), (K3_UPPER_EDGE, K3_UPPER_EDGE + 0.2),
                      (14, 16)]:
        assert ((ds > low) & (ds < high)).any(), (low, high)
    assert math.isclose(math.expm1(-K3_LOWER_EDGE) + K3_LOWER_EDGE, 10.0, rel_tol=1e-14)
    assert math.isclose(math.expm1(-K3_UPPER_EDGE) + K3_UPPER_EDGE, 10.0, rel_tol=1e-14)


@pytest.mark.parametrize("vocab", ["one token at d = -4.99", "far below", "above the upper edge"])
def test_where_k3s_clamp_changes_the_target(vocab):
    """Past an edge k3's value is flat: as a loss, on-policy, such a token adds no gradient (so k3's loss no longer
    follows grad KL(ref || pi)), and in the reward it is the constant 10 (so not rev - fwd either). Corrected, the
    loss still gives grad KL(pi || ref): the clamp bounds the value, never the gradient's direction."""
    pi, ref = vocabulary(vocab)
    d = np.log(pi) - np.log(ref)
    rev, fwd = pi * (d - pi @ d), pi - ref
    assert np.abs(expected_gradient("k3", "loss", pi, ref) - fwd).max() > 1e-4
    assert np.abs(expected_gradient("k3", "reward", pi, ref) - (rev - fwd)).max() > 1e-3
    corrected = expected_gradient("k3", "loss-corrected", pi, ref, old_policy(pi))
    np.testing.assert_allclose(corrected, rev, rtol=1e-9, atol=1e-14)


def test_corrected_k3_pulls_a_token_below_the_edge_up():
    """A token the policy gives far less than the reference (d = -4.99): the reverse KL's gradient raises it
    (descent moves its logit by -grad > 0), and so does corrected k3's, on- and off-policy; on its own sample,
    d(rho k3)/d log pi is d, as k2's, not k3's clamped value 10."""
    pi, ref = vocabulary("one token at d = -4.99")
    for old in (pi, old_policy(pi)):
        grad = expected_gradient("k3", "loss-corrected", pi, ref, old)
        assert grad[0] < 0
    lp = torch.tensor([math.log(0.004)], dtype=torch.float64, requires_grad=True)
    ref_lp = lp.detach() + 4.99
    for old_logprob in (lp.detach(), lp.detach() - 0.3):
        (slope,) = torch.autograd.grad(kl_penalty(lp, ref_lp, "k3", old_logprob=old_logprob).sum(), lp)
        rho = math.exp((lp.detach() - old_logprob).item())
        assert slope.item() == pytest.approx(-4.99 * rho, rel=1e-12)
