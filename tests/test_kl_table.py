"""The README's k3 row, cell by cell, as written: each claim derived exactly over small vocabularies with one
token swept over d from -15 to 15 (past both of k3's clamp edges, d < -2.611 and d > 11.0) and, in some, a second
token past the other edge. The expected gradients are the trainer's (rlhf.kl.parse_estimator, enumerated over
the vocabulary); each target is a divergence differentiated by autograd, not the score-function formula
tests/test_kl_gradients.py uses."""

import os

import numpy as np
import pytest
import torch

from rlhf.kl import K3_CLAMP_EDGES, parse_estimator

LOWER, UPPER = K3_CLAMP_EDGES
SWEEP = sorted(set(np.linspace(-15, 15, 61).round(6)) | {LOWER - 1e-3, LOWER + 1e-3, UPPER - 1e-3, UPPER + 1e-3})
OTHER = (None, -5.0, 0.3, 12.0)  # a second set token: none, past the lower edge, inside, past the upper edge


def k3_row() -> str:
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    (row,) = [line for line in readme.splitlines() if line.startswith("| `k3` (`low_var_kl`) |")]
    return row


def vocabulary(*ds):
    """(pi, ref) float64 tensors: a token at each d (pi small enough that ref's share stays <= 0.3), then two
    fillers with the rest of both."""
    set_pi = np.array([min(0.05, 0.3 * np.exp(d)) for d in ds])
    set_ref = set_pi * np.exp(-np.array(ds))
    rest_pi, rest_ref = 1 - set_pi.sum(), 1 - set_ref.sum()
    pi = np.concatenate([set_pi, [0.6 * rest_pi, 0.4 * rest_pi]])
    ref = np.concatenate([set_ref, [0.45 * rest_ref, 0.55 * rest_ref]])
    return torch.tensor(pi), torch.tensor(ref)


def past(pi, ref):
    d = pi.log() - ref.log()
    return (d < LOWER) | (d > UPPER)


def trainer_gradient(pi, ref, placement, old=None):
    """The expected gradient w.r.t. pi's logits of the trainer's k3 term: "loss" (x ~ pi), "reward" (the
    detached value, a score-function gradient), "corrected" (x ~ old, weighted by old_logprob)."""
    z = pi.log().clone().requires_grad_(True)
    lp, ref_lp = torch.log_softmax(z, -1), ref.log()
    k3 = parse_estimator("k3")
    if placement == "loss":
        objective = (pi * k3(lp, ref_lp)).sum()
    elif placement == "reward":
        objective = (pi * k3(lp.detach(), ref_lp) * lp).sum()
    else:
        objective = (old * k3(lp, ref_lp, old_logprob=old.log())).sum()
    return torch.autograd.grad(objective, z)[0]


def divergence_gradient(fn, pi):
    z = pi.log().clone().requires_grad_(True)
    return torch.autograd.grad(fn(torch.softmax(z, -1)), z)[0]


def reverse_kl(ref):
    return lambda p: (p * (p.log() - ref.log())).sum()


def forward_kl(ref):
    return lambda p: (ref * (ref.log() - p.log())).sum()


def cases():
    for d in SWEEP:
        for other in OTHER:
            yield (d,) if other is None else (d, other)


def test_the_clamp_edges_the_row_states():
    row = k3_row()
    assert f"`d < {LOWER:.3f}`".replace("-", "−") in row and f"`d > {UPPER:.1f}`" in row


def test_k3_as_a_loss_is_the_forward_kl_inside_and_the_cross_entropy_with_ref_prime_past_the_clamp():
    row = k3_row()
    assert "*forward* KL (GRPO's choice), while every token is inside the clamp" in row
    assert "a token past it loses its own pull but still moves through the softmax" in row
    assert "the gradient is that of `−Σ_x ref'_x log pi_x`, `ref' = ref` inside the clamp and `sg(pi)` past it" in row
    seen_past = 0
    for ds in cases():
        pi, ref = vocabulary(*ds)
        got = trainer_gradient(pi, ref, "loss")
        out = past(pi, ref)
        ref_prime = torch.where(out, pi, ref)  # sg(pi): a constant in the cross-entropy below
        claim = divergence_gradient(lambda p: -(ref_prime * p.log()).sum(), pi)
        torch.testing.assert_close(got, claim, rtol=1e-9, atol=1e-15)
        if not out.any():
            torch.testing.assert_close(got, divergence_gradient(forward_kl(ref), pi), rtol=1e-9, atol=1e-15)
        else:  # still moves: each past token's logit gradient is pi_x (P - R), not 0
            seen_past += 1
            assert (got[out].abs() > 1e-6 * pi[out]).all(), ds
    assert seen_past > len(SWEEP)


def test_k3_in_the_reward_is_reverse_minus_forward_inside_and_penalises_10_past_the_clamp():
    row = k3_row()
    assert ("`grad KL(pi \\|\\| ref) - grad KL(ref \\|\\| pi)`: biased, while every token is inside the clamp; "
            "a token past it is penalised 10, not `k3(d)`") in row
    for ds in cases():
        pi, ref = vocabulary(*ds)
        got = trainer_gradient(pi, ref, "reward")
        d = pi.log() - ref.log()
        penalty = torch.where(past(pi, ref), torch.tensor(10.0, dtype=d.dtype), torch.expm1(-d) + d)
        lp = lambda p: p.log()  # noqa: E731
        claim = divergence_gradient(lambda p: (pi * penalty * lp(p)).sum(), pi)  # E_pi[penalty grad log pi]
        torch.testing.assert_close(got, claim, rtol=1e-9, atol=1e-15)
        if not past(pi, ref).any():
            difference = divergence_gradient(reverse_kl(ref), pi) - divergence_gradient(forward_kl(ref), pi)
            torch.testing.assert_close(got, difference, rtol=1e-9, atol=1e-15)


def test_k3_corrected_is_the_reverse_kl_at_every_d():
    assert ("`grad KL(pi \\|\\| ref)` at every `d` while `\\|log pi − log pi_old\\| ≤ 20`, rho's own clamp (weighted as "
            "`k3+`, bit for bit; the config check warns)") in k3_row()
    for ds in cases():
        pi, ref = vocabulary(*ds)
        target = divergence_gradient(reverse_kl(ref), pi)
        for old in (pi, 0.5 * pi + 0.5 / len(pi)):  # rho == 1 and off-policy
            torch.testing.assert_close(trainer_gradient(pi, ref, "corrected", old), target, rtol=1e-9, atol=1e-15)


def test_docs_kl_past_the_lower_edge_pulled_back_weakly_alone_pushed_down_next_to_the_upper():
    """docs/kl.md's reading of the loss cell: a token past the lower edge is pulled back (descent raises its
    logit), by less than pi - ref would, while no token is past the upper edge; and pushed down where tokens past
    the upper edge hold more of pi than of ref (P > R)."""
    for ds in cases():
        pi, ref = vocabulary(*ds)
        d = pi.log() - ref.log()
        got, below = trainer_gradient(pi, ref, "loss"), d < LOWER
        if below.any() and not (d > UPPER).any():
            assert (got[below] < 0).all() and (got[below].abs() < (ref - pi)[below]).all(), ds
    set_pi = torch.tensor([0.002, 0.3, 0.3], dtype=torch.float64)  # d = -5, 12, 12.5: P = 0.602 > R = 0.30
    set_ref = set_pi * torch.exp(-torch.tensor([-5.0, 12.0, 12.5], dtype=torch.float64))
    pi = torch.cat([set_pi, (1 - set_pi.sum()) * torch.tensor([0.5, 0.5], dtype=torch.float64)])
    ref = torch.cat([set_ref, (1 - set_ref.sum()) * torch.tensor([0.5, 0.5], dtype=torch.float64)])
    out = past(pi, ref)
    assert pi[out].sum() > ref[out].sum()
    assert trainer_gradient(pi, ref, "loss")[0] > 0  # the token at d = -5 is pushed down


def test_docs_kl_rho_in_the_graph_on_k3_pushes_a_token_past_the_lower_edge_down():
    """docs/kl.md's example for why the correction weights k3 as k3+: on tests/test_kl_gradients.py's vocabulary
    "one token at d = -4.99", rho k3 in the graph (rho = 1) gives that token's logit +0.036, the reverse KL -0.024."""
    from test_kl_gradients import vocabulary as gradients_vocabulary

    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "kl.md")).read()
    assert "on that token's logit is +0.036 (at rho = 1), where\n  `grad KL(pi || ref)` is -0.024" in page
    pi, ref = map(torch.tensor, gradients_vocabulary("one token at d = -4.99"))
    z = pi.log().clone().requires_grad_(True)
    lp = torch.log_softmax(z, -1)
    rho = torch.exp(lp - pi.log())  # in the graph; 1 in value
    (in_graph,) = torch.autograd.grad((pi * rho * parse_estimator("k3")(lp, ref.log())).sum(), z)
    assert in_graph[0].item() == pytest.approx(0.036, abs=5e-4)
    assert divergence_gradient(reverse_kl(ref), pi)[0].item() == pytest.approx(-0.024, abs=5e-4)
