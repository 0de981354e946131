"""Tests for rlhf.core_algos: hand-computed examples for every piece of PPO math."""

import math

import pytest
import torch
from helpers import in_processes

from rlhf import core_algos
from rlhf.config import AlgorithmConfig, ConfigError, load_config
from rlhf.core_algos import (
    ADV_ESTIMATOR_REGISTRY,
    ADV_ESTIMATORS,
    LOSS_AGG_MODES,
    LossAgg,
    agg_loss,
    check_adv_estimator,
    check_loss_agg_mode,
    compute_gae,
    entropy_from_logits,
    explained_variance,
    group_outcome_advantages,
    groups_with_equal_scores,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    needs_critic,
    policy_loss,
    sequence_mean,
    token_rewards,
    value_loss,
)
from rlhf.processes import one_process

NAN = float("nan")


# --- masked ops ------------------------------------------------------------------------------------------


def test_masked_mean_ignores_nan_in_masked_positions_including_gradient():
    x = torch.tensor([[1.0, NAN, 3.0], [NAN, 5.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    mean = masked_mean(x, mask)
    assert mean.item() == pytest.approx(3.0)
    mean.backward()
    assert torch.isfinite(x.grad).all()
    assert torch.allclose(x.grad, mask.float() / 3)
    assert masked_sum(x, mask).item() == pytest.approx(9.0)


def test_masked_mean_empty_mask_is_zero_and_per_row():
    x = torch.tensor([[1.0, 2.0], [NAN, 4.0]])
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0
    row_means = masked_mean(x, torch.tensor([[0, 0], [0, 1]]), dim=-1)
    assert row_means.tolist() == [0.0, 4.0]


def test_masked_var_and_whiten_use_valid_tokens_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, NAN, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # valid values 1, 2, 3: mean 2, biased var 2/3, unbiased var 1 (whitening's)
    assert masked_var(x, mask).item() == pytest.approx(2 / 3)
    whitened = masked_whiten(x, mask)
    expected = torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.allclose(whitened, expected, atol=1e-6)


def test_whiten_over_processes_equals_whitening_the_whole_batch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=gen) * 3 + 1
    mask = (torch.rand(6, 5, generator=gen) > 0.3).long()
    whole = masked_whiten(x, mask)
    valid = x[mask.bool()]
    torch.testing.assert_close(whole, torch.where(mask.bool(), (x - valid.mean()) / valid.std(), 0.0))
    halves = in_processes(lambda s, reduce_sum: masked_whiten(*s, reduce_sum), [(x[:2], mask[:2]), (x[2:], mask[2:])])
    torch.testing.assert_close(torch.cat(halves), whole)
    # Each process whitening alone would differ: the statistics are the batch's, not the shard's.
    assert not torch.allclose(torch.cat([masked_whiten(x[:2], mask[:2]), masked_whiten(x[2:], mask[2:])]), whole)


# --- GAE -------------------------------------------------------------------------------------------------


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.4]])
    advantages, returns = compute_gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # t=2: delta = 1 - 0.4 = 0.6;              A = 0.6
    # t=1: delta = 0.9*0.4 - 0.2 = 0.16;       A = 0.16 + 0.72*0.6 = 0.592
    # t=0: delta = 0.9*0.2 - 0.5 = -0.32;      A = -0.32 + 0.72*0.592 = 0.10624
    assert torch.allclose(advantages, torch.tensor([[0.10624, 0.592, 0.6]]), atol=1e-6)
    assert torch.allclose(returns, torch.tensor([[0.60624, 0.792, 1.0]]), atol=1e-6)


def test_gae_right_padding_ignores_values_and_rewards_there():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0, 7.0]])
    values = torch.tensor([[0.5, 0.2, 0.4, 3.0, -2.0]])
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert torch.allclose(advantages, torch.tensor([[0.10624, 0.592, 0.6, 0.0, 0.0]]), atol=1e-6)
    assert torch.allclose(returns, torch.tensor([[0.60624, 0.792, 1.0, 0.0, 0.0]]), atol=1e-6)

    perturbed = values.clone()
    perturbed[:, 3:] = torch.tensor([NAN, 1e6])
    advantages_perturbed, _ = compute_gae(rewards, perturbed, mask, gamma=0.9, lam=0.8)
    assert torch.equal(advantages_perturbed, advantages)


def test_gae_skips_masked_token_in_the_middle():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(1, 5, generator=gen)
    values = torch.randn(1, 5, generator=gen)
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.95, lam=0.9)
    # Same as GAE on the sequence with the masked tokens removed.
    keep = mask[0].bool()
    compact, _ = compute_gae(rewards[:, keep], values[:, keep], torch.ones(1, 3), gamma=0.95, lam=0.9)
    assert torch.allclose(advantages[:, keep], compact)
    assert advantages[0, 1] == 0 and advantages[0, 4] == 0

    perturbed = values.clone()
    perturbed[0, 1] = 123.0
    perturbed[0, 4] = NAN
    assert torch.equal(compute_gae(rewards, perturbed, mask, gamma=0.95, lam=0.9)[0], advantages)


def test_gae_gamma_lam_one_terminal_reward_gives_reward_minus_value():
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(3, 6, generator=gen, requires_grad=True)
    lengths = torch.tensor([6, 4, 1])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).float()
    terminal_reward = torch.tensor([1.0, -2.0, 0.5])
    rewards = torch.zeros(3, 6)
    rewards[torch.arange(3), lengths - 1] = terminal_reward
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    expected = (terminal_reward[:, None] - values.detach()) * mask
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.allclose(returns, terminal_reward[:, None] * mask, atol=1e-6)
    assert not advantages.requires_grad and not returns.requires_grad


# --- loss aggregation ------------------------------------------------------------------------------------


def test_loss_agg_modes_registered_and_unknown_mode_lists_them():
    assert LOSS_AGG_MODES == (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    )
    for mode in LOSS_AGG_MODES:
        check_loss_agg_mode(mode)
    with pytest.raises(ValueError) as excinfo:
        agg_loss(torch.ones(1, 1), torch.ones(1, 1), LossAgg("seq-mean"))
    assert all(mode in str(excinfo.value) for mode in LOSS_AGG_MODES)
    with pytest.raises(ValueError, match="token-mean"):
        check_loss_agg_mode("mean")


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("token-mean", {"num_tokens": 14}, 0.5),
        ("seq-mean-token-sum", {}, 3.5),  # (3 + 4) / 2 seqs
        ("seq-mean-token-sum", {"num_seqs": 7}, 1.0),
        ("seq-mean-token-mean", {}, 2.75),  # (1.5 + 4) / 2 seqs
        ("seq-mean-token-mean", {"num_seqs": 11}, 0.5),
        ("seq-mean-token-sum-norm", {}, 7 / 6),  # 7 / (2 seqs * T=3)
        ("seq-mean-token-sum-norm", {"norm_len": 7}, 0.5),  # 7 / (2 * 7)
    ],
)
def test_agg_loss_hand_numbers(mode, kwargs, expected):
    loss_mat = torch.tensor([[1.0, 2.0, NAN], [4.0, NAN, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert agg_loss(loss_mat, mask, LossAgg(mode, **kwargs)).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_microbatches_with_global_normalisers_sum_to_batch_loss(mode):
    gen = torch.Generator().manual_seed(2)
    loss_mat = torch.randn(6, 5, generator=gen)
    lengths = torch.tensor([5, 1, 3, 0, 2, 4])  # micro-batches hold 6, 3 and 6 tokens
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    whole = agg_loss(loss_mat, mask, LossAgg(mode))
    global_counts = {"num_tokens": mask.sum(), "num_seqs": 6}
    micro = sum(
        agg_loss(loss_mat[i : i + 2], mask[i : i + 2], LossAgg(mode, **global_counts)) for i in range(0, 6, 2)
    )
    assert micro.item() == pytest.approx(whole.item(), abs=1e-6)


# --- policy loss -----------------------------------------------------------------------------------------


def test_policy_loss_reports_the_importance_ratio_over_valid_tokens():
    old = torch.zeros(2, 3)
    logprobs = torch.log(torch.tensor([[2.0, 0.5, 1.0], [9.0, 1.5, 1.0]]))  # ratio = these; 9.0 is padding
    _, metrics = policy_loss(logprobs, old, torch.ones(2, 3), torch.tensor([[1, 1, 1], [0, 1, 1]]))
    assert metrics["actor/importance_ratio/mean"] == pytest.approx((2.0 + 0.5 + 1.0 + 1.5 + 1.0) / 5)
    assert metrics["actor/importance_ratio/max"] == pytest.approx(2.0)


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    advantages = torch.tensor([[1.0, -2.0, 0.5], [3.0, 100.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    logprobs = torch.full((2, 3), -1.3)
    loss, metrics = policy_loss(logprobs, logprobs, advantages, mask)
    assert loss.item() == pytest.approx(-1.5 / 5)
    assert metrics["actor/pg_loss"] == pytest.approx(-1.5 / 5)
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/ppo_kl"] == 0.0
    assert all(isinstance(value, float) for value in metrics.values())


def _crafted_policy_batch():
    """Five tokens, the last masked out; ratios exp(log 1.5) etc. against old log-prob 0."""
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    ratios = torch.tensor([[1.5, 0.5, 1.5, 0.5, 3.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return torch.zeros(1, 5), ratios.log().requires_grad_(), advantages, mask


def test_policy_loss_clipfrac_and_gradient_zero_where_clipped():
    old_logprobs, logprobs, advantages, mask = _crafted_policy_batch()
    loss, metrics = policy_loss(logprobs, old_logprobs, advantages, mask, clip_ratio=0.2)
    # per token: A=+1 r=1.5 -> clipped -1.2; A=+1 r=0.5 -> -0.5; A=-1 r=1.5 -> 1.5; A=-1 r=0.5 -> clipped 0.8
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)  # the masked (clipped) token is not counted
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    expected_kl = -(math.log(1.5) + math.log(0.5)) / 2
    assert metrics["actor/ppo_kl"] == pytest.approx(expected_kl, rel=1e-5)
    loss.backward()
    # d/dlogp of -A * r is -A * r / num_tokens where unclipped, exactly 0 where clipped or masked
    expected_grad = torch.tensor([[0.0, -0.5 / 4, 1.5 / 4, 0.0, 0.0]])
    assert torch.allclose(logprobs.grad, expected_grad, atol=1e-6)


def test_policy_loss_dual_clip_caps_negative_advantage_loss():
    advantages = torch.tensor([[-1.0, -2.0, 1.0]])
    logprobs = torch.tensor([[3.0, 0.1, 3.0]], requires_grad=True)  # ratios e^3 = 20.1, 1.105, 20.1
    mask = torch.ones(1, 3)
    loss, metrics = policy_loss(logprobs, torch.zeros(1, 3), advantages, mask, clip_ratio_c=3.0)
    # A=-1, r=20.1: PPO loss 20.1 capped at 3; A=-2, r=1.105: 2.21 < cap 6; A=+1: clipped to -1.2
    expected = (3.0 + 2.0 * math.exp(0.1) - 1.2) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3)  # only the A=+1 token; A<0 r>1.2 is unclipped
    loss.backward()
    assert logprobs.grad[0, 0] == 0.0 and logprobs.grad[0, 2] == 0.0
    assert logprobs.grad[0, 1] != 0.0

    with pytest.raises(ConfigError, match="clip_ratio_c"):  # the dual clip needs a cap above 1, checked once
        load_config(None, ["actor.clip_ratio_c=1.0"])
    assert load_config(None, ["actor.clip_ratio_c=1.01"]).actor.clip_ratio_c == 1.01


def test_policy_loss_float32_and_finite_for_huge_log_ratio():
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    logprobs = torch.tensor([[100.0, 100.0, -0.5]], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(logprobs, torch.zeros(1, 3, dtype=torch.bfloat16), advantages, torch.ones(1, 3))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx((-1.2 + 3.0 - math.exp(-0.5)) / 3, rel=1e-2)
    loss.backward()
    assert torch.isfinite(logprobs.grad.float()).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_uses_aggregation_mode(mode):
    old_logprobs, logprobs, advantages, mask = _crafted_policy_batch()
    token_losses = torch.tensor([[-1.2, -0.5, 1.5, 0.8, 0.0]])
    loss, _ = policy_loss(logprobs, old_logprobs, advantages, mask, agg=LossAgg(mode, num_seqs=3))
    assert loss.item() == pytest.approx(agg_loss(token_losses, mask, LossAgg(mode, num_seqs=3)).item(), rel=1e-5)


# --- value loss ------------------------------------------------------------------------------------------


def test_value_loss_clipping_hand_computed():
    values = torch.tensor([[0.5, 0.5, 0.1, 10.0]], requires_grad=True)
    old_values = torch.zeros(1, 4)
    returns = torch.tensor([[1.0, 0.0, 1.0, -10.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss(values, old_values, returns, mask, cliprange_value=0.2)
    # token 0: max((0.5-1)^2, (0.2-1)^2) = 0.64 (clipped); token 1: max(0.25, 0.04) = 0.25; token 2: 0.81
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.25 + 0.81) / 3)
    assert metrics["critic/vf_loss"] == pytest.approx(loss.item())
    assert metrics["critic/vf_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    assert values.grad[0, 0] == 0.0 and values.grad[0, 3] == 0.0
    assert values.grad[0, 1] == pytest.approx(0.5 / 3)

    unclipped_loss, metrics = value_loss(values, old_values, returns, mask, cliprange_value=1.0)
    assert unclipped_loss.item() == pytest.approx(0.5 * (0.25 + 0.25 + 0.81) / 3)
    assert metrics["critic/vf_clipfrac"] == 0.0


def test_value_clipfrac_counts_no_token_whose_value_is_inside_the_range():
    """verl clips v itself. old + clamp(v - old) rounds away from v in float32 for some in-range values, and
    then (clipped - R)^2 can exceed (v - R)^2, so the token would be counted as clipped when it is not."""
    gen = torch.Generator().manual_seed(0)
    old_values = torch.rand(1, 100_000, generator=gen) * 0.05
    values = torch.rand(1, 100_000, generator=gen) * 3  # all within old +- 10
    returns = torch.rand(1, 100_000, generator=gen) * 3
    mask = torch.ones(1, 100_000)
    round_trip = old_values + (values - old_values).clamp(-10.0, 10.0)
    assert ((round_trip - returns) ** 2 > (values - returns) ** 2).sum() > 100  # the data tells the two apart
    loss, metrics = value_loss(values, old_values, returns, mask, cliprange_value=10.0)
    assert metrics["critic/vf_clipfrac"] == 0.0
    assert loss.item() == pytest.approx((0.5 * (values - returns) ** 2).mean().item(), rel=1e-6)


# --- log-probs and entropy -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_logits_matches_naive_float32(dtype, temperature, monkeypatch):
    monkeypatch.setattr(core_algos, "LOGITS_CHUNK_ROWS", 3)  # 10 rows -> uneven chunks
    gen = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(2, 5, 50, generator=gen)).to(dtype)
    labels = torch.randint(0, 50, (2, 5), generator=gen)
    naive = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, labels[..., None])[..., 0]
    logprobs = logprobs_from_logits(logits, labels, temperature)
    assert logprobs.dtype == torch.float32 and logprobs.shape == (2, 5)
    # Tight tolerance: a log-softmax computed in bf16/fp16 is off by ~1e-2 and fails this.
    assert torch.allclose(logprobs, naive, atol=1e-5)


def test_logprobs_from_logits_gradient_matches_naive():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 4, 30, generator=gen, requires_grad=True)
    labels = torch.randint(0, 30, (2, 4), generator=gen)
    logprobs_from_logits(logits, labels, 0.8).sum().backward()
    fast_grad = logits.grad.clone()
    logits.grad = None
    torch.log_softmax(logits / 0.8, -1).gather(-1, labels[..., None]).sum().backward()
    assert torch.allclose(fast_grad, logits.grad, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_from_logits_matches_naive(dtype, monkeypatch):
    monkeypatch.setattr(core_algos, "LOGITS_CHUNK_ROWS", 4)
    gen = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(3, 3, 40, generator=gen)).to(dtype)
    x = logits.float() / 0.6
    naive = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)
    entropy = entropy_from_logits(logits, temperature=0.6)
    assert entropy.dtype == torch.float32 and entropy.shape == (3, 3)
    assert torch.allclose(entropy, naive, atol=1e-5)


def test_entropy_with_minus_inf_logits_is_finite():
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]])
    assert torch.allclose(entropy_from_logits(logits), torch.tensor([[math.log(2)]]))


def _autograd_logprobs_and_entropy(logits, labels, temperature):
    """The update's log-probs and entropy by plain autograd through a float32 copy of the logits."""
    x = logits.float() / temperature
    logp = torch.log_softmax(x, -1)
    entropy = -torch.where(logp > float("-inf"), logp.exp() * logp, 0.0).sum(-1)
    return logp.gather(-1, labels[..., None])[..., 0], entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [3, 12])  # blocks inside a sequence; several sequences per block, uneven
def test_logprobs_and_entropy_gradients_equal_autograd_through_float32(dtype, temperature, chunk_rows, monkeypatch):
    """The hand-written backwards give autograd's gradients through a float32 copy, to float rounding: float32
    to 1e-6, bf16 to one bf16 rounding of the float32 gradient. The logits are a slice of a longer tensor (as
    the model's (B, R + 1, V) logits are) and a mask and advantages weight the tokens, as in the update."""
    monkeypatch.setattr(core_algos, "LOGITS_CHUNK_ROWS", chunk_rows)
    gen = torch.Generator().manual_seed(6)
    full = (3 * torch.randn(5, 6, 40, generator=gen)).to(dtype)
    labels = torch.randint(0, 40, (5, 5), generator=gen)
    advantages = torch.randn(5, 5, generator=gen)
    mask = (torch.rand(5, 5, generator=gen) > 0.3).float()

    def gradient(fn):
        logits = full.clone().requires_grad_(True)
        logprobs, entropy = fn(logits[:, :-1], labels, temperature)
        assert logprobs.dtype == entropy.dtype == torch.float32
        loss = masked_mean(logprobs * advantages, mask) - 0.5 * masked_mean(entropy, mask)
        loss.backward()
        return logprobs.detach(), entropy.detach(), logits.grad

    ours = gradient(lambda z, y, t: (logprobs_from_logits(z, y, t), entropy_from_logits(z, t)))
    reference = gradient(_autograd_logprobs_and_entropy)
    assert torch.allclose(ours[0], reference[0], atol=1e-5) and torch.allclose(ours[1], reference[1], atol=1e-5)
    assert ours[2].dtype == dtype and bool(ours[2].abs().sum() > 0) and not ours[2][:, -1].any()
    if dtype == torch.float32:
        assert torch.allclose(ours[2], reference[2], rtol=1e-5, atol=1e-7)
    else:  # the log-probs' and the entropy's gradients are rounded to bf16 each, then added in bf16
        scale = sum(term.abs() for term in _float32_gradient_terms(full, labels, advantages, mask, temperature))
        assert ((ours[2].float() - reference[2].float()).abs() <= 2**-7 * scale + 1e-7).all()


def _float32_gradient_terms(full, labels, advantages, mask, temperature):
    """The log-probs' and the entropy's parts of the test's loss gradient, each alone, in float32."""
    terms = []
    for part in (0, 1):
        logits = full.float().requires_grad_(True)
        logprobs, entropy = _autograd_logprobs_and_entropy(logits[:, :-1], labels, temperature)
        (masked_mean(logprobs * advantages, mask) if part == 0 else -0.5 * masked_mean(entropy, mask)).backward()
        terms.append(logits.grad)
    return terms


def test_logprobs_and_entropy_keep_no_float32_copy_for_the_backward(monkeypatch):
    """What autograd keeps between the forward and the backward, counted with saved-tensor hooks on bf16 logits of
    (4, 64, 8192): the logits themselves (shared by both) and (B, T) tensors, nothing of a float32 (B, T, V) copy
    (plain autograd through float32 blocks keeps over 3 such copies' worth)."""
    monkeypatch.setattr(core_algos, "LOGITS_CHUNK_ROWS", 64)
    logits = torch.randn(4, 65, 8192, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 8192, (4, 64))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logprobs = logprobs_from_logits(logits[:, :-1], labels, 0.7)
        entropy = entropy_from_logits(logits[:, :-1], 0.7)
    large = [t for t in saved if t.numel() > 4 * 64]
    assert large and all(t.dtype == torch.bfloat16 and t.untyped_storage().data_ptr() == logits.data_ptr()
                         for t in large), [(t.dtype, tuple(t.shape)) for t in large]
    (logprobs.sum() + entropy.sum()).backward()  # and the backward runs from what was kept
    assert logits.grad.shape == logits.shape and logits.grad[:, :-1].abs().sum() > 0


def test_entropy_gradient_is_zero_on_tokens_of_probability_zero():
    """-inf logits (probability 0) get a zero gradient, not the NaN plain autograd through p * log p gives."""
    logits = torch.tensor([[[0.0, 1.0, float("-inf")]]], requires_grad=True)
    entropy_from_logits(logits, 0.5).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 2] == 0


# --- diagnostics -----------------------------------------------------------------------------------------


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 2.0), returns, mask) == pytest.approx(0.0, abs=1e-6)
    # residuals (0, 0, 1) -> var 2/9; var(returns) = 2/3
    values = torch.tensor([[1.0, 2.0, 2.0, NAN]])
    assert explained_variance(values, returns, mask) == pytest.approx(1 - (2 / 9) / (2 / 3))
    constant = torch.ones(1, 4)
    assert explained_variance(constant, constant, mask) == 1.0
    assert explained_variance(torch.tensor([[0.0, 1.0, 0.0, 0.0]]), constant, mask) == 0.0


# --- critic-free advantages (grpo, rloo) --------------------------------------------------------------------


def _scores_as_rewards(scores, mask):
    """Token rewards whose valid-token sum per row is `scores` (split over two tokens where there are two)."""
    rewards = torch.zeros(mask.shape)
    for i, score in enumerate(scores):
        valid = mask[i].nonzero().flatten()
        rewards[i, valid[0]] = score / 2 if len(valid) > 1 else score
        if len(valid) > 1:
            rewards[i, valid[-1]] = score / 2
    rewards[~mask.bool()] = 77.0  # padding holds garbage, which must not count
    return rewards


# Rows: a group of 3 (id 5), a group of 2 (id 1), a group of one (id 9), a group of 2 with equal scores (id 4).
GROUP_IDS = torch.tensor([5, 1, 5, 9, 5, 1, 4, 4])
GROUP_SCORES = torch.tensor([1.0, 0.0, 0.0, 0.7, 1.0, 2.0, 1.0, 1.0])
GROUP_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])


def test_grpo_advantages_by_hand():
    rewards = _scores_as_rewards(GROUP_SCORES, GROUP_MASK)
    advantages, returns = group_outcome_advantages(rewards, GROUP_MASK, GROUP_IDS, "grpo")
    # group 5: scores 1, 0, 1 -> mean 2/3, unbiased std sqrt(1/3); group 1: 0, 2 -> mean 1, std sqrt(2);
    # group 9 alone: the score 0.7; group 4: equal scores -> 0.
    s3, s2 = math.sqrt(1 / 3) + 1e-6, math.sqrt(2) + 1e-6
    expected = torch.tensor([(1 / 3) / s3, -1 / s2, (-2 / 3) / s3, 0.7, (1 / 3) / s3, 1 / s2, 0.0, 0.0])
    torch.testing.assert_close(advantages, torch.where(GROUP_MASK.bool(), expected[:, None], 0.0))
    assert torch.equal(returns, advantages)
    dr_grpo, _ = group_outcome_advantages(rewards, GROUP_MASK, GROUP_IDS, "grpo", norm_by_std=False)
    expected = torch.tensor([1 / 3, -1.0, -2 / 3, 0.7, 1 / 3, 1.0, 0.0, 0.0])
    torch.testing.assert_close(dr_grpo, torch.where(GROUP_MASK.bool(), expected[:, None], 0.0))


def test_rloo_advantages_by_hand():
    rewards = _scores_as_rewards(GROUP_SCORES, GROUP_MASK)
    advantages, _ = group_outcome_advantages(rewards, GROUP_MASK, GROUP_IDS, "rloo")
    # score minus the mean of the group's other scores; alone: the score
    expected = torch.tensor([1 - 0.5, 0 - 2, 0 - 1, 0.7, 1 - 0.5, 2 - 0, 0.0, 0.0])
    torch.testing.assert_close(advantages, torch.where(GROUP_MASK.bool(), expected[:, None], 0.0))


def test_group_advantages_match_a_loop_over_groups_on_random_data():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (40,), generator=gen)
    mask = (torch.rand(40, 5, generator=gen) > 0.3).long()
    mask[:, 0] = 1
    rewards = torch.randn(40, 5, generator=gen)
    grpo, _ = group_outcome_advantages(rewards, mask, ids, "grpo")
    rloo, _ = group_outcome_advantages(rewards, mask, ids, "rloo")
    scores = (rewards * mask).sum(1)
    for g in ids.unique():
        rows = (ids == g).nonzero().flatten()
        group = scores[rows]
        for j, i in enumerate(rows):
            others = torch.cat([group[:j], group[j + 1:]])
            want_grpo = (group[j] - group.mean()) / (group.std() + 1e-6) if len(rows) > 1 else group[j]
            want_rloo = group[j] - others.mean() if len(rows) > 1 else group[j]
            assert grpo[i, 0].item() == pytest.approx(want_grpo.item(), abs=1e-5)
            assert rloo[i, 0].item() == pytest.approx(want_rloo.item(), abs=1e-5)


def test_every_advantage_estimator_returns_final_advantages():
    """gae whitens its advantages itself (over all processes, by reduce_sum), grpo and rloo return their
    group-relative ones: the trainer uses what the registry returns as is."""
    rewards = _scores_as_rewards(GROUP_SCORES, GROUP_MASK)
    values = torch.linspace(-1, 1, GROUP_MASK.numel()).reshape(GROUP_MASK.shape)
    args = (rewards, values, GROUP_MASK, GROUP_IDS, AlgorithmConfig(gamma=0.9, lam=0.8))
    gae, returns = ADV_ESTIMATOR_REGISTRY["gae"](*args, one_process)
    raw, raw_returns = compute_gae(rewards, values, GROUP_MASK, 0.9, 0.8)
    torch.testing.assert_close(gae, masked_whiten(raw, GROUP_MASK))
    assert torch.equal(returns, raw_returns)
    assert masked_mean(gae, GROUP_MASK).abs().item() < 1e-6
    num_valid = GROUP_MASK.sum().item()  # unit unbiased variance
    assert masked_var(gae, GROUP_MASK).item() * num_valid / (num_valid - 1) == pytest.approx(1.0, rel=1e-5)
    shards = [tuple(a[:3] if isinstance(a, torch.Tensor) else a for a in args),
              tuple(a[3:] if isinstance(a, torch.Tensor) else a for a in args)]
    halves = in_processes(lambda s, reduce_sum: ADV_ESTIMATOR_REGISTRY["gae"](*s, reduce_sum)[0], shards)
    torch.testing.assert_close(torch.cat(halves), gae)  # whitened over both processes, as one
    for name in ("grpo", "rloo"):
        advantages, _ = ADV_ESTIMATOR_REGISTRY[name](*args, one_process)
        torch.testing.assert_close(advantages, group_outcome_advantages(rewards, GROUP_MASK, GROUP_IDS, name)[0])


def test_advantage_estimators_are_a_registry_with_clear_errors():
    assert ADV_ESTIMATORS == ("gae", "grpo", "rloo")
    assert needs_critic("gae") and not needs_critic("grpo") and not needs_critic("rloo")
    with pytest.raises(ValueError, match="unknown advantage estimator 'reinforce'; valid estimators: gae, grpo, rloo"):
        check_adv_estimator("reinforce")


# --- token rewards, the reward KL's mean, groups without signal ------------------------------------------

MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


def test_token_rewards_put_the_score_last_and_the_kl_penalty_on_every_valid_token():
    scores = torch.tensor([1.0, 0.0, 0.5])
    kl_values = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]], requires_grad=True)
    rewards = token_rewards(scores, MASK, kl_values, kl_coef=0.5)
    expected = torch.tensor([[-0.05, -0.1, 1.0 - 0.15, 0.0],
                             [-0.2, 0.0, 0.0, 0.0],
                             [0.5, 0.0, 0.0, 0.0]])  # an empty response: score at 0, where GAE ignores it
    torch.testing.assert_close(rewards, expected)
    rewards.sum().backward()  # d reward / d kl: -coef on valid tokens, exactly 0 elsewhere
    assert torch.equal(kl_values.grad, -0.5 * MASK.float())
    torch.testing.assert_close(token_rewards(scores, MASK),  # no KL in the reward: the scores alone
                               torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0] * 4, [0.5, 0.0, 0.0, 0.0]]))


def test_sequence_mean_weights_every_response_once_over_all_processes():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert sequence_mean(values, mask) == pytest.approx(2.0)  # (1 + 3) / 2; the token mean is 7 / 5
    assert masked_mean(values, mask).item() == pytest.approx(1.4)
    # Two processes holding one sequence each give the one-process answer.
    shards = [(values[:1], mask[:1]), (values[1:], mask[1:])]
    assert in_processes(lambda s, reduce_sum: sequence_mean(*s, reduce_sum), shards) == pytest.approx([2.0, 2.0])


def test_groups_with_equal_scores_counts_groups_without_signal():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # equal, mixed, equal, alone (not a group)
    assert groups_with_equal_scores(scores, group_ids) == pytest.approx(2 / 3)
    assert groups_with_equal_scores(scores[-1:], group_ids[-1:]) == 0.0
