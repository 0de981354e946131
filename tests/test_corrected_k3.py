"""The off-policy correction turns a k3 loss into k3+: the config says so, and the claim it makes is exact."""

import pytest
import torch

from rlhf.config import load_config, warnings_for
from rlhf.kl import ESTIMATOR_NAMES, kl_penalty


def corrected_k3_warnings(name, *extra):
    cfg = load_config(None, ["actor.use_kl_loss=true", f"actor.kl_loss_type={name}", *extra])
    return [w for w in warnings_for(cfg) if "bit for bit as k3+" in w]


@pytest.mark.parametrize("name", ESTIMATOR_NAMES + ("full",))
def test_the_warning_fires_for_k3_and_low_var_kl_only(name):
    on = corrected_k3_warnings(name, "actor.kl_loss_off_policy_correction=true")
    if name in ("k3", "low_var_kl"):
        assert len(on) == 1 and f"actor.kl_loss_type={name} " in on[0] and "actor.kl_loss_type=k3+" in on[0]
    else:
        assert on == []
    assert corrected_k3_warnings(name) == []  # no correction: k3 stays k3


def test_no_warning_when_the_kl_loss_is_off():
    cfg = load_config(None, ["actor.kl_loss_type=k3", "actor.kl_loss_off_policy_correction=true"])
    assert not any("k3+" in w for w in warnings_for(cfg))


@pytest.mark.parametrize("name", ["k3", "low_var_kl"])
def test_corrected_k3_is_bit_for_bit_k3_plus(name):
    """What the warning states: value and gradient equal k3+'s, corrected, on tokens on both sides of both of
    k3's clamp edges (d from -15 to 15), with rho = 1 and rho != 1."""
    d = torch.linspace(-15, 15, 301, dtype=torch.float64)
    ref = torch.full_like(d, -3.0)
    for shift in (0.0, 0.4, -0.7):
        grads, values = [], []
        for estimator in (name, "k3+"):
            lp = (ref + d).requires_grad_(True)
            value = kl_penalty(lp, ref, estimator, old_logprob=lp.detach() - shift)
            (grad,) = torch.autograd.grad(value.sum(), lp)
            values.append(value.detach())
            grads.append(grad)
        assert torch.equal(values[0], values[1]) and torch.equal(grads[0], grads[1])
