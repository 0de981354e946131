"""lab/decisions.py: the decision states and strata, the reward, the loss terms' expected gradients, and the exact
metrics, on crafted models whose probabilities are set."""

import math

import pytest
import torch

from lab import decisions
from lab.decisions import States, exact_metrics, loss_terms, stratum_of

V = 6
HABIT, RIGHT = 1, 2


def test_strata_are_the_reference_right_token_intervals():
    assert stratum_of(0.0) == "A" and stratum_of(0.04) == "A" and stratum_of(0.041) is None
    assert stratum_of(0.199) is None and stratum_of(0.2) == "B" and stratum_of(0.9) == "B"


class SetModel(torch.nn.Module):
    """Logits at every position set by the context's first token: right-token probability right[first]."""

    def __init__(self, right: dict[int, float]):
        super().__init__()
        self.right = right

    def forward(self, input_ids, attention_mask=None):
        rows = []
        for ids in input_ids:
            p = self.right[int(ids[0])]
            probs = torch.full((V,), (1 - p - 0.5) / (V - 2))
            probs[HABIT], probs[RIGHT] = 0.5, p
            rows.append(probs.log().expand(len(ids), V))
        return type("Out", (), {"logits": torch.stack(rows)})


def test_decision_states_take_the_first_states_of_each_stratum(monkeypatch):
    right = {10: 0.01, 11: 0.1, 12: 0.3, 13: 0.04, 14: 0.25, 15: 0.02, 16: 0.2}
    contexts = [([first] + [7] * (first - 9), HABIT, RIGHT) for first in right]  # lengths 2..8
    monkeypatch.setattr(decisions, "decision_contexts", lambda tokenizer, problems: contexts)
    states = decisions.decision_states(SetModel(right), None, None, per_stratum=2)
    assert states.strata == ["A", "A", "B", "B"]
    assert states.input_ids[:, 0].tolist() == [10, 13, 12, 14]  # 11 (0.1) in neither; 15, 16 past the quota
    assert states.lengths.tolist() == [2, 5, 4, 6] and states.input_ids.shape == (4, 6)
    assert (states.input_ids[0, 2:] == 0).all()  # right padding
    logits = decisions.decision_logits(SetModel(right), states)
    assert torch.allclose(torch.softmax(logits, -1)[:, RIGHT], torch.tensor([0.01, 0.04, 0.3, 0.25]))
    with pytest.raises(ValueError, match="too few states"):
        decisions.decision_states(SetModel(right), None, None, per_stratum=3)


def two_states():
    return States(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long),
                  torch.tensor([HABIT, HABIT]), torch.tensor([RIGHT, RIGHT]), ["A", "B"])


def test_exact_metrics_are_both_kls_over_the_vocabulary_and_the_two_tokens():
    generator = torch.Generator().manual_seed(0)
    logits, ref = (torch.randn(2, V, generator=generator, dtype=torch.float64) for _ in range(2))
    pi, r = torch.softmax(logits, -1), torch.softmax(ref, -1)
    got = exact_metrics(logits, ref, two_states())
    assert torch.allclose(got["reverse_kl"], (pi * (pi / r).log()).sum(-1))
    assert torch.allclose(got["forward_kl"], (r * (r / pi).log()).sum(-1))
    assert not torch.allclose(got["reverse_kl"], got["forward_kl"], atol=1e-3)
    assert torch.allclose(got["habit"], pi[:, HABIT]) and torch.allclose(got["right"], pi[:, RIGHT])


def mean_gradient(run: str, beta: float, n: int = 200_000):
    """The gradient of loss_terms w.r.t. the logits of two states, sampled with n tokens each (fixed seed)."""
    generator = torch.Generator().manual_seed(1)
    ref = 0.5 * torch.randn(2, V, generator=generator, dtype=torch.float64)  # |d| < 2.61: k3's clamp inactive
    logits = (0.5 * torch.randn(2, V, generator=generator, dtype=torch.float64)).requires_grad_(True)
    loss = loss_terms(logits, ref, two_states(), run, beta, torch.Generator().manual_seed(2), n=n)
    (grad,) = torch.autograd.grad(loss, logits)
    return grad, torch.softmax(logits.detach(), -1), torch.softmax(ref, -1)


def expected_gradient(run: str, beta: float, pi, ref):
    """Per state: the policy gradient of reward 1 for the right token, -pi_right (onehot_right - pi), plus beta
    times grad KL(ref || pi) = pi - ref for k3 in the loss and grad KL(pi || ref) for k1 in the reward and k3+
    and full in the loss (no clamp binds: |d| < 2.61)."""
    onehot = torch.zeros(V, dtype=torch.float64)
    onehot[RIGHT] = 1.0
    expected = -pi[:, RIGHT:RIGHT + 1] * (onehot - pi)
    d = (pi / ref).log()
    if run == "loss:k3":
        return expected + beta * (pi - ref)
    if run != "no-kl":
        return expected + beta * pi * (d - (pi * d).sum(-1, keepdim=True))
    return expected


@pytest.mark.parametrize("run", ["no-kl", "loss:k3", "loss:k3+", "loss:full"])
def test_the_loss_gradient_is_the_reward_gradient_plus_beta_times_the_kls(run):
    """Sampled (as the trainer): the mean over samples of each state's gradient, so over the two states / 2."""
    beta = 0.3
    grad, pi, ref = mean_gradient(run, beta)
    expected = expected_gradient(run, beta, pi, ref)
    assert torch.allclose(grad * 2, expected, atol=4e-3), (grad * 2 - expected).abs().max()


@pytest.mark.parametrize("run", decisions.RUNS)
def test_the_exact_policy_gradient_and_the_expected_kl_are_exact(run):
    """pg="exact" sums the policy gradient over the vocabulary and kl="expected" the KL loss's expectation, so
    with both the step's gradient is the expected one to float precision, for every run and with 4 samples; with
    pg="exact" alone, runs without a sampled KL (no KL, k1 in the reward, full) are exact too."""
    beta = 0.3
    generator = torch.Generator().manual_seed(1)
    ref_logits = 0.5 * torch.randn(2, V, generator=generator, dtype=torch.float64)
    logits = (0.5 * torch.randn(2, V, generator=generator, dtype=torch.float64)).requires_grad_(True)
    pi, ref = torch.softmax(logits.detach(), -1), torch.softmax(ref_logits, -1)
    expected = expected_gradient(run, beta, pi, ref)
    for kl in ("expected", "sampled"):
        loss = loss_terms(logits, ref_logits, two_states(), run, beta, torch.Generator().manual_seed(2), n=4,
                          pg="exact", kl=kl)
        (grad,) = torch.autograd.grad(loss, logits)
        exact = kl == "expected" or run in ("no-kl", "reward:k1", "loss:full")
        assert torch.allclose(grad * 2, expected, atol=1e-12) == exact, (run, kl)
        assert decisions.deterministic(run, decisions.Regime(pg="exact", kl=kl)) == exact
        assert not decisions.deterministic(run, decisions.Regime(pg="sampled", kl=kl))


def test_the_expected_k3_loss_keeps_k3s_clamp():
    """kl="expected" is the estimator's own expected loss gradient, clamp included: a sample past k3's lower edge
    (d = -4) adds nothing to it, so that token's logit moves only through the softmax, by -pi_x E_pi[slope],
    where the forward KL's pi - ref would pull it up."""
    ref = torch.tensor([[0.6, 0.2, 0.1, 0.05, 0.03, 0.02]], dtype=torch.float64)
    pi = ref.clone()
    pi[0, 0] = ref[0, 0] * math.exp(-4.0)
    pi = pi / pi.sum()
    logits = pi.log().requires_grad_(True)
    states = States(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), torch.tensor([HABIT]),
                    torch.tensor([RIGHT]), ["A"])
    grad, grad_without_kl = (torch.autograd.grad(loss_terms(logits, ref.log(), states, run, 1.0, torch.Generator(),
                                                            pg="exact", kl="expected"), logits)[0]
                             for run in ("loss:k3", "no-kl"))
    grad = grad - grad_without_kl
    d = (pi / ref).log()[0]
    slope = torch.where(d < -2.61087, 0.0, -torch.expm1(-d))
    want = pi[0] * slope - pi[0] * (pi[0] @ slope)
    assert torch.allclose(grad[0], want, atol=1e-12)
    assert not torch.allclose(grad[0], (pi - ref)[0], atol=1e-3)


def test_regime_refuses_unknown_settings():
    with pytest.raises(ValueError, match="policy gradient"):
        decisions.Regime(pg="adjoint")
    with pytest.raises(ValueError, match="policy gradient"):
        decisions.Regime(kl="sometimes")
    with pytest.raises(ValueError, match="train strata"):
        decisions.Regime(train_strata=("C",))
    with pytest.raises(ValueError, match="train strata"):
        decisions.Regime(train_strata=())


class PerStateLogits(torch.nn.Module):
    """A 'model' whose logits at a state are one free row per first context token: states share no parameter."""

    def __init__(self, num_states: int):
        super().__init__()
        self.rows = torch.nn.Parameter(torch.zeros(num_states, V))

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.rows[input_ids[:, 0]][:, None].expand(-1, input_ids.shape[1], V)})


def test_only_the_trained_strata_are_trained_and_every_state_is_measured():
    states = States(torch.tensor([[0], [1]]), torch.ones(2, dtype=torch.long), torch.tensor([HABIT, HABIT]),
                    torch.tensor([RIGHT, RIGHT]), ["A", "B"])
    model = PerStateLogits(2)
    ref_logits = torch.zeros(2, V)
    history = decisions.train(model, states, ref_logits, "loss:k3+", 0.3, 0,
                              decisions.Regime(steps=5, train_strata=("B",)), log_every=1)
    assert torch.equal(model.rows[0], torch.zeros(V)) and not torch.equal(model.rows[1], torch.zeros(V))
    assert history["steps"] == [0, 1, 2, 3, 4, 5] and all(len(row) == 2 for row in history["right"])
    assert history["right"][-1][1] > history["right"][0][1]  # B's right token rises; A's stays
    assert history["right"][-1][0] == history["right"][0][0]


def test_k1_in_the_reward_is_the_reverse_kls_gradient_and_a_bad_run_is_refused():
    beta = 0.3
    grad, pi, ref = mean_gradient("reward:k1", beta)
    onehot = torch.zeros(V, dtype=torch.float64)
    onehot[RIGHT] = 1.0
    d = (pi / ref).log()
    expected = -pi[:, RIGHT:RIGHT + 1] * (onehot - pi) + beta * pi * (d - (pi * d).sum(-1, keepdim=True))
    assert torch.allclose(grad * 2, expected, atol=4e-3)
    with pytest.raises(ValueError, match="unknown run"):
        loss_terms(torch.zeros(2, V), torch.zeros(2, V), two_states(), "loss:k9", beta, torch.Generator())


def test_the_limits_keep_the_references_ratios_within_the_zero_class():
    ref = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64), -1)
    states = two_states()
    for name, limit in decisions.limits(ref, states, 0.3).items():
        assert torch.allclose(limit.sum(-1), torch.ones(2, dtype=torch.float64))
        others = [v for v in range(V) if v != RIGHT]
        ratio = limit[:, others] / ref[:, others]
        assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio)), name
    reverse = decisions.limits(ref, states, 0.3)["reverse"]
    tilted = ref.clone()
    tilted[:, RIGHT] *= torch.exp(torch.tensor(1 / 0.3))
    assert torch.allclose(reverse, tilted / tilted.sum(-1, keepdim=True))


def test_the_sweep_runs_the_default_regime():
    """configs/sweeps/decisions.yaml and `python -m lab.decisions` (its defaults) run the same grid."""
    import os

    import yaml

    with open(os.path.join(os.path.dirname(__file__), "..", "configs", "sweeps", "decisions.yaml")) as f:
        params = yaml.safe_load(f)["parameters"]
    default = decisions.Regime()
    regime = {key: getattr(default, key) for key in ("pg", "kl", "n", "steps", "lr")}
    assert {key: params[key]["value"] for key in regime} == regime
    parsed = vars(decisions.arguments([]))
    assert parsed["seeds"] == params["seeds"]["values"] and sorted(parsed["beta"]) == sorted(params["beta"]["values"])
    assert {key: parsed[key] for key in regime} == regime
