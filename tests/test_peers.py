"""Tests for lab/theory/peers.py: every computed cell of the frameworks' table, exactly, in float64.

Each row's expected gradient is checked against a closed form written here, E_w[f(x) grad log pi(x)] =
w * f - pi * sum(w * f) for sampling weights w and a per-token factor f, and against lab.theory's own
enumerations; the verdict of each row is pinned, so changing a row's estimator, placement or weight fails.
"""

import os

import pytest
import torch
from helpers import nudge

from lab import theory
from lab.theory import peers
from lab.theory.fixed_points import token_penalty
from rlhf.kl.estimators import K3_CLAMP_EDGES
from lab.theory.peers import PEERS, PeerDefault, on_policy_value, peer_cells, peer_kl_grad, peer_report, verdict

TOL = 1e-10

# (framework, setting) -> (on-policy verdict, verdict after the first step, bandit fixed point, fixed point with
# the setting's advantage estimator): the rows' data pinned by what they compute (each estimator x placement x
# weight in PEERS gives a different triple; the advantage estimator moves the point of a KL loss only).
REVERSE, FORWARD, ARGMAX = "reverse-KL optimum", "forward-KL optimum", "argmax"
K3_LOSS = ("forward KL", "biased, cos=0.8283, norm x2.01", FORWARD)
K3_RHO = ("exact", "exact", REVERSE)
K3_UNIT = ("exact", "biased, cos=0.9646, norm x1.18", REVERSE)
K1_LOSS = ("zero", "biased, cos=-0.9953, norm x0.46", ARGMAX)
K1_LOSS_CLAMPED = ("zero", "biased, cos=-0.9953, norm x0.46", "other, max|pi - reverse opt| = 0.421")
K1_REWARD = ("exact", "biased, cos=0.9997, norm x0.58", REVERSE)
K3_REWARD = ("biased, cos=-0.3679, norm x0.49", "biased, cos=0.0165, norm x0.13", ARGMAX)
GRPO5_K3_LOSS = "grpo, n=5: best arm 0.786, TV 0.195 from it"
GRPO8_K3_LOSS = "grpo, n=8: best arm 0.824, TV 0.232 from it"
GRPO8_K2_LOSS = "grpo, n=8: best arm 0.975, TV 0.396 from it"  # rho-weighted k3: k2's gradient, in the loss
GRPO8_ARGMAX = "grpo, n=8: best arm 1.000, TV 0.421 from it"  # the same, clamped: no pull past the edge
VERDICTS = {
    ("verl", "GRPO recipes: actor.use_kl_loss=True"): (*K3_LOSS, GRPO5_K3_LOSS),
    ("verl", "algorithm.use_kl_in_reward=True"): (*K1_REWARD, "gae: the same"),
    ("TRL", "GRPOTrainer, beta > 0, use_bias_correction_kl=True"): (*K3_RHO, GRPO8_K2_LOSS),
    ("TRL", "GRPOTrainer, beta > 0, use_bias_correction_kl=False"): (*K3_LOSS, GRPO8_K3_LOSS),
    ("TRL", "RLOOTrainer"): (*K1_REWARD, "rloo, n=2: the same"),
    ("TRL", "PPOTrainer (trl.experimental.ppo)"): (*K1_REWARD, "gae: the same"),
    ("OpenRLHF", "default, every advantage estimator (gae, group_norm = GRPO, ...)"): (*K1_REWARD, "gae: the same"),
    ("OpenRLHF", "--algo.kl.use_loss, estimator left at its default"): (*K1_LOSS_CLAMPED,
                                                                         "gae: best arm 1.000, TV 0.000 from it"),
    ("NeMo-RL", "GRPO: grpo_math_1B.yaml, ClippedPGLossConfig"): (*K3_UNIT, "not modelled"),
    ("NeMo-RL", "use_on_policy_kl_approximation=True"): (*K3_RHO, "not modelled"),
    ("NeMo-RL", "use_kl_in_reward=True (Reinforce++, GAE)"): (*K3_REWARD, "not modelled"),
    ("slime", "GRPO scripts: --use-kl-loss --kl-loss-type low_var_kl"): (*K3_LOSS, GRPO8_K3_LOSS),
    ("slime", "--use-kl-loss, --kl-loss-type left at its default"): (*K1_LOSS, "grpo, n=8: the same"),
    ("slime", "--use-kl-loss --use-unbiased-kl (low_var_kl)"): (*K3_RHO, GRPO8_ARGMAX),
    ("slime", "--kl-coef > 0 (advantage estimator ppo or reinforce_plus_plus)"): (*K1_REWARD, "gae: the same"),
    ("SkyRL", "default (grpo and gae alike)"): (*K3_LOSS, GRPO5_K3_LOSS),
    ("SkyRL", "use_kl_in_reward=True (use_kl_loss=False)"): (*K3_REWARD, "grpo, n=5: the same"),
}
IDS = [f"{p.framework}: {p.setting}" for p in PEERS]


def score_grad(weights: torch.Tensor, f: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """sum_x w_x f_x grad_logits log pi_x = w * f - pi * sum(w * f)  (grad log pi_x = e_x - pi)."""
    return weights * f - pi * (weights * f).sum()


def k3(log_pi, log_ref):
    return torch.exp(log_ref - log_pi) - 1 + (log_pi - log_ref)


def closed_form(peer: PeerDefault, logits, ref, old=None) -> torch.Tensor:
    """The row's expected KL gradient by hand: f is d(term)/d(log pi) per token, plus the term itself when a
    weight in the graph (rho, unit) or the PPO ratio (reward) differentiates it."""
    pi = torch.softmax(logits, -1)
    log_pi, log_ref = pi.log(), ref.log()
    sampler = pi if old is None else old
    if peer.placement == "reward":  # E_old[rho k_old grad log pi] = E_pi[k_old grad log pi]
        k_old = {"k1": sampler.log() - log_ref, "k3": k3(sampler.log(), log_ref)}[peer.estimator]
        return score_grad(pi, k_old, pi)
    value, derivative = {
        "k1": (log_pi - log_ref, torch.ones_like(pi)),
        "k3": (k3(log_pi, log_ref), 1 - ref / pi),
    }[peer.estimator]
    if peer.correction == "none":
        return score_grad(sampler, derivative, pi)
    if peer.correction == "rho":  # E_old[(pi/old) (k + k') grad log pi] = E_pi[(k + k') grad log pi]
        return score_grad(pi, value + derivative, pi)
    return score_grad(sampler, value + derivative, pi)  # unit: value 1, no reweighting


@pytest.mark.parametrize("peer", PEERS, ids=IDS)
def test_row_gradients_equal_their_closed_form(peer):
    logits, ref = theory.example("A")
    c_logits, c_ref, c_old = theory.off_policy_example("C")
    torch.testing.assert_close(peer_kl_grad(peer, logits, ref), closed_form(peer, logits, ref), rtol=0, atol=TOL)
    torch.testing.assert_close(
        peer_kl_grad(peer, c_logits, c_ref, c_old), closed_form(peer, c_logits, c_ref, c_old), rtol=0, atol=TOL
    )


@pytest.mark.parametrize("peer", PEERS, ids=IDS)
def test_row_verdicts_are_pinned(peer):
    cells = peer_cells(peer)
    assert tuple(cells.values()) == VERDICTS[(peer.framework, peer.setting)]


def test_every_row_is_pinned():
    assert sorted(VERDICTS) == sorted((p.framework, p.setting) for p in PEERS)
    assert {p.framework for p in PEERS} == set(peers.SOURCES)


@pytest.mark.parametrize("name", ["A", "B"])
@pytest.mark.parametrize("peer", PEERS, ids=IDS)
def test_on_policy_agrees_with_theory(peer, name):
    """On-policy: a 'none' loss is expected_loss_grad, a reward expected_reward_grad, and a weight in the graph
    (rho, unit) adds the reward gradient to the loss one."""
    logits, ref = theory.example(name)
    loss = theory.expected_loss_grad(peer.estimator, logits, ref)
    reward = theory.expected_reward_grad(peer.estimator, logits, ref)
    expected = {"none": loss, "rho": loss + reward, "unit": loss + reward}[peer.correction]
    if peer.placement == "reward":
        expected = reward
    torch.testing.assert_close(peer_kl_grad(peer, logits, ref), expected, rtol=0, atol=TOL)


@pytest.mark.parametrize("peer", [p for p in PEERS if p.placement == "loss" and p.correction != "unit"], ids=str)
def test_off_policy_loss_agrees_with_theory(peer):
    """Off-policy, 'none' is theory's uncorrected loss and k3's 'rho' its corrected one (rho in the graph)."""
    logits, ref, old = theory.off_policy_example("C")
    corrected = peer.correction == "rho"
    expected = theory.expected_off_policy_loss_grad(peer.estimator, logits, ref, old, corrected)
    torch.testing.assert_close(peer_kl_grad(peer, logits, ref, old), expected, rtol=0, atol=TOL)


def test_unit_weight_is_k2_per_sample():
    """NeMo-RL's exp(lp - sg(lp)) * k3 has k2's gradient (k3 + k3' = d): on- and off-policy alike."""
    (nemo,) = [p for p in PEERS if p.correction == "unit"]
    logits, ref, old = theory.off_policy_example("C")
    k2 = theory.expected_off_policy_loss_grad("k2", logits, ref, old, corrected=False)
    torch.testing.assert_close(peer_kl_grad(nemo, logits, ref, old), k2, rtol=0, atol=TOL)


@pytest.mark.parametrize("peer", PEERS, ids=IDS)
def test_biased_cells_are_far_from_the_reverse_kl_gradient(peer):
    """A 'biased' or forward-KL verdict is a measured gap, not a rounding: max |grad - grad KL| > 0.05."""
    for args in (theory.example("A"), theory.off_policy_example("C")):
        logits, ref = args[:2]
        grad = peer_kl_grad(peer, *args)
        gap = (grad - theory.divergence_grad(theory.reverse_kl, logits, ref)).abs().max()
        if verdict(grad, logits, ref) == "exact":
            assert gap <= TOL
        else:
            assert gap > 0.05


@pytest.mark.parametrize("name", ["A", "B"])
@pytest.mark.parametrize("peer", PEERS, ids=IDS)
def test_on_policy_value_has_the_same_gradient(peer, name):
    """The fixed points' value function gives the row's own on-policy expected gradient, pi (p - E_pi p)."""
    logits, ref = theory.example(name)
    pi = torch.softmax(logits, -1)
    p = token_penalty(logits, ref, on_policy_value(peer), "loss")
    if peer.placement == "reward":  # the detached penalty reaches the policy through the ratio: E_pi[k grad log pi]
        p = token_penalty(logits, ref, on_policy_value(peer), "reward")
    torch.testing.assert_close(peer_kl_grad(peer, logits, ref), pi * (p - (pi * p).sum()), rtol=0, atol=TOL)


D = torch.linspace(-15.0, 15.0, 601, dtype=torch.float64)  # both sides of k3's edges, -2.611 and 11.0


def pull(peer: PeerDefault) -> torch.Tensor:
    """The on-policy loss term's per-sample pull d(term)/d(log pi) at each d in D (token_penalty's p)."""
    ref_logprob = torch.full_like(D, 0.5).log()
    logprob = (ref_logprob + D).requires_grad_(True)
    (grad,) = torch.autograd.grad(on_policy_value(peer)(logprob, ref_logprob).sum(), logprob)
    return grad


def test_each_framework_clamps_where_its_code_does():
    """Past k3's edges (d < -2.611 or d > 11.0) a clamped term pulls on nothing, TRL's unclamped k3 keeps its pull:
    rho- or unit-weighted, k2's d (TRL) or d inside the edges only (slime, NeMo-RL, which clamp after the weight);
    unweighted, k3's 1 - e^-d (TRL) or that inside the edges only (verl, SkyRL, slime's low_var_kl)."""
    low, high = K3_CLAMP_EDGES
    inside = (D > low) & (D < high)
    row = {(p.framework, p.setting): p for p in PEERS}
    trl_rho = row[("TRL", "GRPOTrainer, beta > 0, use_bias_correction_kl=True")]
    trl_plain = row[("TRL", "GRPOTrainer, beta > 0, use_bias_correction_kl=False")]
    torch.testing.assert_close(pull(trl_rho), D, rtol=0, atol=1e-9)
    torch.testing.assert_close(pull(trl_plain), -torch.expm1(-D), rtol=1e-12, atol=1e-12)
    for peer in PEERS:
        if peer.placement != "loss" or peer.estimator != "k3" or peer.framework == "TRL":
            continue
        assert peer.clamp == 10.0, peer
        want = D if peer.correction != "none" else -torch.expm1(-D)
        torch.testing.assert_close(pull(peer), torch.where(inside, want, 0.0), rtol=1e-12, atol=1e-9)


def test_openrlhf_clamps_k1_too():
    """OpenRLHF clamps every estimator: its k1 loss pulls with 1 inside [-10, 10] and not at all past it, so on the
    bandit a token that falls below d = -10 is held there (the second arm, at its clamp's edge) while the others die."""
    (openrlhf,) = [p for p in PEERS if p.framework == "OpenRLHF" and p.placement == "loss"]
    torch.testing.assert_close(pull(openrlhf), torch.where(D.abs() <= 10, 1.0, 0.0).double(), rtol=0, atol=1e-12)
    ref = peers.bandit()[0]
    d = (peers.peer_fixed_point(openrlhf) / ref).log()
    assert -10.5 < d[1] < -10.0 and (d[2:] < -25).all()


def test_bad_rows_raise():
    row = PEERS[0]
    for bad in (dict(placement="both"), dict(correction="clipped")):
        with pytest.raises(ValueError, match="placement must be one of"):
            peer_kl_grad(PeerDefault(**{**row.__dict__, **bad}), *theory.example("A"))


def test_report_lists_every_row_and_source():
    report = peer_report()
    table = [line for line in report.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(PEERS)
    for source in peers.SOURCES.values():
        assert f"{source.repo} @ {source.commit[:7]} ({source.date}, {source.version})" in report
    for peer in PEERS:
        assert all(f in report for f in peer.files + peer.advantage_files)
        assert peer.advantage_notes in report


OPTIMA = (REVERSE, FORWARD, ARGMAX)


def test_one_row_stops_at_no_optimum():
    """Every row but OpenRLHF's clamped k1 loss (test_openrlhf_clamps_k1_too) stops at a named optimum."""
    assert [key for key, cells in VERDICTS.items() if cells[2] not in OPTIMA] == [
        ("OpenRLHF", "--algo.kl.use_loss, estimator left at its default")]


@pytest.mark.parametrize("peer", [p for p in PEERS if VERDICTS[(p.framework, p.setting)][2] in OPTIMA], ids=str)
def test_fixed_points_equal_the_named_optimum(peer):
    """The fixed point equals its named optimum to 1e-10, and the bandit tells the three optima apart."""
    from lab.theory.optima import argmax_optimum, forward_kl_optimum, reverse_kl_optimum

    ref, rewards, beta = peers.bandit()
    optima = {name: fn(ref, rewards, beta) for name, fn in
              ((REVERSE, reverse_kl_optimum), (FORWARD, forward_kl_optimum), (ARGMAX, argmax_optimum))}
    named = VERDICTS[(peer.framework, peer.setting)][2]
    torch.testing.assert_close(peers.peer_fixed_point(peer), optima[named], rtol=0, atol=TOL)
    for other, optimum in optima.items():
        if other != named:
            assert (optimum - optima[named]).abs().max() > 0.03


def test_docs_carry_the_report():
    """docs/kl.md's section 'What the frameworks' defaults give' holds peer_report() verbatim."""
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "kl.md"), encoding="utf-8").read()
    section = docs[docs.index("## What the frameworks' defaults give"):]
    assert peer_report() in section


@pytest.mark.parametrize("peer", [p for p in PEERS if p.advantage is not None], ids=str)
def test_the_advantage_estimator_moves_only_a_loss_that_regularises(peer):
    """A KL in the reward sits inside the score the estimator normalises, and k1 in the loss regularises nothing:
    their fixed points are the idealised advantage's whatever the estimator. A regularising KL loss next to
    grpo's std keeps unit-scale policy gradients against it: the policy goes far towards the best arm."""
    idealised, probs = peers.peer_fixed_point(peer), peers.peer_fixed_point(peer, with_advantage=True)
    gap = (probs - idealised).abs().max().item()
    if peer.placement == "loss" and peer.estimator in ("k1", "kl"):
        assert gap < 2e-5  # nothing but what a clamp holds: OpenRLHF's, at e^-10 of the reference's odds
    elif peer.placement == "reward" or peer.advantage.advantage != "grpo":
        assert gap < TOL
    else:
        assert gap > 0.1 and probs.argmax() == 0 and probs[0] > idealised[0]


def test_a_rho_weighted_loss_stays_a_loss_under_grpo():
    """rho-weighted k3 has k1-in-the-reward's on-policy gradient but is not inside the advantage: grpo's std moves
    it (TRL's, unclamped, to 0.975 on the best arm; slime's, clamped, past the edge and on to the argmax), and k1 in
    the reward it does not."""
    trl, slime = ([p for p in PEERS if p.framework == name and p.correction == "rho"][0] for name in ("TRL", "slime"))
    ref, rewards, beta = peers.bandit()
    reward_placed = theory.bandit_fixed_point(ref, rewards, beta, "k1", "reward", advantage="grpo", n=8)
    for peer in (trl, slime):
        assert (reward_placed - peers.peer_fixed_point(peer)).abs().max() < TOL
        assert (peers.peer_fixed_point(peer, with_advantage=True) - reward_placed).abs().max() > 0.1
    k2_loss = theory.bandit_fixed_point(ref, rewards, beta, "k2", "loss", advantage="grpo", n=8)
    assert (peers.peer_fixed_point(trl, with_advantage=True) - k2_loss).abs().max() < TOL
    slime_point = peers.peer_fixed_point(slime, with_advantage=True)
    assert slime_point[0] > 1 - 1e-12 and (slime_point / ref).log()[1:].max() < K3_CLAMP_EDGES[0]


def test_an_unmodelled_advantage_raises():
    (nemo,) = [p for p in PEERS if p.correction == "unit"]
    with pytest.raises(ValueError, match="not modelled"):
        peers.peer_fixed_point(nemo, with_advantage=True)
@pytest.mark.parametrize("sign", [1, -1])
def test_report_digits_are_those_of_any_machine(monkeypatch, sign):
    """peer_report(), which docs/kl.md holds verbatim, is the same to every printed digit (cosines to 4
    decimals, norms to 2) for examples nudged by 1e-9 either way (helpers.nudge says why that makes it the same
    on any machine)."""
    report, example, off_policy_example = peer_report(), peers.example, peers.off_policy_example
    nudged = lambda name: (nudge(example(name)[0].exp(), sign).log(), nudge(example(name)[1], sign))
    monkeypatch.setattr(peers, "example", nudged)
    monkeypatch.setattr(peers, "off_policy_example", lambda name: (
        *nudged(theory.OFF_POLICY_EXAMPLES[name][0]), nudge(off_policy_example(name)[2], sign)))
    assert not torch.equal(peers.bandit()[0], example("A")[1])  # nudged
    assert peer_report() == report
