"""lab/decisions.py: the decision states and strata, the reward, the loss terms' expected gradients, and the exact
metrics, on crafted models whose probabilities are set."""

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


@pytest.mark.parametrize("run, direction", [("no-kl", None), ("loss:k3", "forward"), ("loss:k3+", "reverse"),
                                            ("loss:k3-corrected", "reverse"), ("loss:full", "reverse")])
def test_the_loss_gradient_is_the_reward_gradient_plus_beta_times_the_kls(run, direction):
    """Reward 1 for the right token only: the policy-gradient part's expected gradient (of the loss, per state
    averaged over the samples, so over the two states / 2) is -pi_right (onehot_right - pi); a KL in the loss adds
    beta times grad KL(ref || pi) = pi - ref for k3, grad KL(pi || ref) for k3+, full and corrected k3."""
    beta = 0.3
    grad, pi, ref = mean_gradient(run, beta)
    onehot = torch.zeros(V, dtype=torch.float64)
    onehot[RIGHT] = 1.0
    expected = -pi[:, RIGHT:RIGHT + 1] * (onehot - pi)
    if direction == "forward":
        expected = expected + beta * (pi - ref)
    elif direction == "reverse":
        d = (pi / ref).log()
        expected = expected + beta * pi * (d - (pi * d).sum(-1, keepdim=True))
    assert torch.allclose(grad * 2, expected, atol=4e-3), (grad * 2 - expected).abs().max()


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
