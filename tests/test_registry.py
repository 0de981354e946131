"""rlhf.registry and the KL module's per-name dispatch: registration, lookups that name the valid choices,
and kl_per_token giving the right term for every estimator name, `full` included."""

import pytest
import torch

from rlhf import kl
from rlhf.registry import Registry


def test_registry_registers_aliases_and_refuses_taken_or_reserved_names():
    registry = Registry("colour", plural="colours", reserved=lambda name: name.endswith("!"))

    @registry.register("red", "rouge")
    def red():
        return 1

    assert list(registry) == ["red", "rouge"] and registry["rouge"] is red and "red" in registry
    assert registry.check("red") == "red"
    with pytest.raises(ValueError, match="taken or reserved"):
        registry.register("red")(lambda: 2)
    with pytest.raises(ValueError, match="taken or reserved"):
        registry.register("blue!")(lambda: 2)
    with pytest.raises(ValueError, match=r"unknown colour 'RED' \(did you mean 'red'\?\); valid colours: red, rouge"):
        registry["RED"]
    with pytest.raises(ValueError, match=r"unknown colour 'green'; valid colours: red, rouge$"):
        registry.check("green")


def test_needs_logits_only_for_full():
    assert kl.needs_logits("full")
    assert not any(kl.needs_logits(name) for name in ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "k3+", "abs+"))
    with pytest.raises(ValueError, match="full"):
        kl.needs_logits("k4")


def test_kl_per_token_is_kl_penalty_for_sampled_names_and_the_given_exact_kl_for_full():
    g = torch.Generator().manual_seed(0)
    logprob, ref_logprob, old_logprob = (torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    exact = torch.rand(3, 5, generator=g, dtype=torch.float64)
    for name in ("k1", "k2", "k3", "abs", "k3+"):
        torch.testing.assert_close(kl.kl_per_token(name, logprob, ref_logprob), kl.kl_penalty(logprob, ref_logprob, name))
        torch.testing.assert_close(kl.kl_per_token(name, logprob, ref_logprob, old_logprob=old_logprob),
                                   kl.kl_penalty(logprob, ref_logprob, name, old_logprob=old_logprob))
    assert kl.kl_per_token("full", logprob, ref_logprob, full_kl=exact) is exact
    with pytest.raises(ValueError, match="needs full_kl"):
        kl.kl_per_token("full", logprob, ref_logprob)
