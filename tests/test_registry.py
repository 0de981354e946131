"""rlhf.registry and the KL module's per-name dispatch: registration, lookups that name the valid choices,
and the parsed estimator (parse_estimator) giving the right term for every estimator name, `full` included."""

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


def test_parsed_estimator_is_kl_penalty_for_sampled_names_and_the_given_exact_kl_for_full():
    g = torch.Generator().manual_seed(0)
    logprob, ref_logprob, old_logprob = (torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    logprob.requires_grad_(True)
    exact = torch.rand(3, 5, generator=g, dtype=torch.float64)
    for name in kl.ESTIMATOR_NAMES:
        estimator = kl.parse_estimator(name)
        assert estimator is kl.parse_estimator(name) and not estimator.needs_logits  # parsed once
        for old in (None, old_logprob):
            term, want = estimator(logprob, ref_logprob, old_logprob=old), kl.kl_penalty(logprob, ref_logprob, name, old)
            assert torch.equal(term, want)
            assert torch.equal(*(torch.autograd.grad(t.sum(), logprob)[0] for t in (term, want)))
    assert kl.parse_estimator("full")(logprob, ref_logprob, full_kl=exact) is exact
    with pytest.raises(ValueError, match="needs full_kl"):
        kl.parse_estimator("full")(logprob, ref_logprob)
    with pytest.raises(ValueError, match="valid names"):
        kl.parse_estimator("k4")
