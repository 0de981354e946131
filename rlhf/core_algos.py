"""PPO math as small pure functions: masked ops, token rewards, GAE, loss aggregation, policy/value losses,
log-probs.

Every tensor argument named `*_mask` is a 0/1 float or bool tensor of shape (B, T) over response tokens;
masked-out positions never influence a result, even when they hold NaN or inf.

Every loss returns `(loss, metrics)` where `loss` is a scalar tensor and `metrics` a dict of Python floats
named as in verl (`actor/pg_loss`, `critic/vf_loss`, ...), so users of verl can read the dashboards as is.

How a (B, T) loss matrix becomes a scalar is chosen by name from `LOSS_AGG_MODES` (a `LossAgg`, see `agg_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.processes import ReduceSum, one_process
from rlhf.registry import Registry

# Rows of (B, T, V) logits converted to float32 at a time, so the float32 copy of a bfloat16 logit tensor
# never has to exist whole (a (8, 1024, 152k) batch would need 5 GB).
LOGITS_CHUNK_ROWS = 1024


# ---------------------------------------------------------------------------------------- Masked reductions


def upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 (and ints) -> float32; float32/float64 unchanged."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of `x` where `mask` is set (over all dims if `dim` is None); torch.where, not x * mask: NaN * 0 is NaN."""
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of `x` over the positions where `mask` is set; 0 where the mask is empty."""
    num_valid = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / num_valid.to(x.dtype).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The biased variance of `x` over all valid positions (a scalar); 0 for an empty mask."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, reduce_sum: ReduceSum = one_process,
                  eps: float = 1e-8) -> torch.Tensor:
    """`x` (B, T) at zero mean and unit unbiased variance over the valid tokens of all processes (their sums by
    `reduce_sum`, rlhf.processes), as verl whitens the whole batch on its driver; 0 where masked."""
    valid = mask.bool()
    total, count = reduce_sum(torch.stack([torch.where(valid, x, 0.0).sum(), valid.sum().to(x.dtype)]))
    mean = total / count.clamp(min=1)
    square_sum = reduce_sum(torch.where(valid, (x - mean) ** 2, 0.0).sum())
    var = square_sum / (count - 1).clamp(min=1)  # Bessel's correction; one valid token: 0
    return torch.where(valid, (x - mean) * torch.rsqrt(var + eps), 0.0)


def sequence_mean(values: torch.Tensor, response_mask: torch.Tensor, reduce_sum: ReduceSum = one_process) -> float:
    """Mean over each sequence's valid tokens, then over the sequences of all processes: (B, R) -> float. verl
    reduces the reward KL so (`actor/reward_kl_penalty`, what the adaptive controller sees): every response counts
    once whatever its length, so target_kl means what it does in verl."""
    per_sequence = masked_mean(values.float(), response_mask, dim=-1)  # (B,)
    total, count = reduce_sum(torch.stack([per_sequence.sum(), per_sequence.new_tensor(len(per_sequence))]))
    return (total / count.clamp(min=1)).item()


# -------------------------------------------------------------------------------------------- Token rewards


def token_rewards(scores: torch.Tensor, response_mask: torch.Tensor, kl_per_token: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """(B,) scores and (B, R) mask -> (B, R) rewards: each score on its response's last valid token, and, with
    `kl_per_token`, -kl_coef * kl on every valid token (Ziegler et al. 2019; verl's apply_kl_penalty). A response
    with no valid token puts its score on position 0, where GAE ignores it."""
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    last = (response_mask.sum(dim=1) - 1).clamp(min=0)
    rewards[torch.arange(len(scores), device=rewards.device), last] = scores.float()
    if kl_per_token is not None:
        rewards = rewards - kl_coef * torch.where(response_mask.bool(), kl_per_token.float(), 0.0)
    return rewards


# ----------------------------------------------------------------------------------------------- Advantages


@torch.no_grad()
def compute_gae(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float,
                lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the valid response tokens, all (B, T):

        delta_t = r_t + gamma * V_next(t) - V_t,   A_t = delta_t + gamma * lam * A_next(t)

    with next(t) the next valid token (V = A = 0 past the last: the episode ends). Returns (advantages, returns =
    advantages + values), 0 where masked; not whitened (`gae` is).
    """
    valid = response_mask.bool()
    num_seqs, num_steps = values.shape
    next_value = values.new_zeros(num_seqs)  # V of the next valid token; 0 past the end
    next_advantage = values.new_zeros(num_seqs)
    advantages_reversed = []
    for t in reversed(range(num_steps)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        # A masked token leaves the carried state untouched, so it is skipped by the recursion.
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        advantages_reversed.append(torch.where(valid[:, t], advantage, torch.zeros_like(advantage)))
    advantages = torch.stack(advantages_reversed[::-1], dim=1)  # (B, T)
    returns = torch.where(valid, advantages + values, torch.zeros_like(values))
    return advantages, returns


# verl's `algorithm.adv_estimator` names -> fn(token_rewards, values, response_mask, group_ids, algorithm,
# reduce_sum) -> the final (advantages, returns), all (B, T); `algorithm` holds gamma, lam and
# norm_adv_by_std_in_grpo (the config's algorithm section).
ADV_ESTIMATOR_REGISTRY = Registry("advantage estimator", "estimators")


@ADV_ESTIMATOR_REGISTRY.register("gae")
def _gae_advantages(token_rewards, values, response_mask, group_ids, algorithm, reduce_sum):
    """compute_gae's advantages, whitened over all processes' valid tokens as verl does, and its returns."""
    advantages, returns = compute_gae(token_rewards, values, response_mask, algorithm.gamma, algorithm.lam)
    return masked_whiten(advantages, response_mask, reduce_sum), returns


@ADV_ESTIMATOR_REGISTRY.register("grpo")
def _grpo_advantages(token_rewards, values, response_mask, group_ids, algorithm, reduce_sum):
    """(score - group mean) / (group std + 1e-6), or score - group mean without norm_adv_by_std_in_grpo (Dr.
    GRPO). A group never straddles processes, so nothing is reduced over them."""
    return group_outcome_advantages(token_rewards, response_mask, group_ids, "grpo",
                                    algorithm.norm_adv_by_std_in_grpo)


@ADV_ESTIMATOR_REGISTRY.register("rloo")
def _rloo_advantages(token_rewards, values, response_mask, group_ids, algorithm, reduce_sum):
    """score - mean of the group's other scores (within one process, as grpo)."""
    return group_outcome_advantages(token_rewards, response_mask, group_ids, "rloo")


ADV_ESTIMATORS = tuple(ADV_ESTIMATOR_REGISTRY)
CRITIC_FREE = ("grpo", "rloo")  # the estimators that need no value model (their values are ignored)


def check_adv_estimator(name: str) -> None:
    """Raise ValueError naming the valid estimators if `name` is not a registered one."""
    ADV_ESTIMATOR_REGISTRY.check(name)


def needs_critic(name: str) -> bool:
    """Whether advantage estimator `name` needs a value model (not critic-free); raises like check_adv_estimator."""
    return ADV_ESTIMATOR_REGISTRY.check(name) not in CRITIC_FREE


@torch.no_grad()
def group_outcome_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    estimator: str,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Critic-free advantages from each response's total reward, relative to its prompt's group, as verl's
    `compute_grpo_outcome_advantage` and `compute_rloo_outcome_advantage`:

        score_i = sum_t token_rewards[i, t] over valid tokens (the score plus the KL penalty, if in the reward)
        grpo:  A_i = (score_i - mean_g) / (std_g + eps)     mean and unbiased std over i's group g;
               with norm_by_std=False, A_i = score_i - mean_g (Dr. GRPO, Liu et al. arXiv:2503.20783)
        rloo:  A_i = score_i - mean of the other n - 1 scores = n / (n - 1) * (score_i - mean_g)
               (Ahmadian et al. arXiv:2402.14740)

    A group of one keeps A_i = score_i, as in verl. `group_ids` (B,) holds any integer per prompt. The
    advantage is broadcast to every valid token: returns (advantages, returns), both (B, T), equal (no critic).
    """
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"unknown group advantage estimator {estimator!r}; valid: grpo, rloo")
    scores = masked_sum(token_rewards, response_mask, dim=-1).float()  # (B,)
    group = torch.unique(group_ids, return_inverse=True)[1].to(scores.device)
    num_groups = int(group.max()) + 1 if len(group) else 0

    def per_group_sum(x):
        return torch.zeros(num_groups, dtype=x.dtype, device=x.device).index_add_(0, group, x)

    size = per_group_sum(torch.ones_like(scores))
    centred = scores - (per_group_sum(scores) / size)[group]
    n = size[group]
    if estimator == "grpo":
        std = (per_group_sum(centred ** 2) / (size - 1).clamp(min=1)).sqrt()[group]  # unbiased, as torch.std
        advantages = centred / (std + eps) if norm_by_std else centred
    else:
        advantages = centred * n / (n - 1).clamp(min=1)
    advantages = torch.where(n > 1, advantages, scores)  # a group of one: the score itself
    advantages = torch.where(response_mask.bool(), advantages[:, None], 0.0)
    return advantages, advantages


# ------------------------------------------------------ Loss aggregation: (B, T) per-token losses -> scalar

# name -> fn(loss_mat, mask, num_tokens, num_seqs, norm_len) -> scalar; actor.loss_agg_mode names.
LOSS_AGG_REGISTRY = Registry("loss_agg_mode", "modes")


@dataclass(frozen=True)
class LossAgg:
    """How a (B, T) per-token loss becomes a scalar (`agg_loss`): `mode`, one of LOSS_AGG_MODES (each says how),
    and the counts it divides by. On a micro-batch, the mini-batch's (its valid tokens, sequences and padded
    length), so that the micro-batches' losses add up to the mini-batch's; None: the loss's own (an empty sequence
    counts in B)."""

    mode: str = "token-mean"
    num_tokens: torch.Tensor | int | None = None
    num_seqs: int | None = None
    norm_len: int | None = None


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, agg: LossAgg = LossAgg()) -> torch.Tensor:
    """A (B, T) per-token loss aggregated into a scalar as `agg` says."""
    return LOSS_AGG_REGISTRY[agg.mode](loss_mat, mask, agg.num_tokens, agg.num_seqs, agg.norm_len)


def _divide(total: torch.Tensor, denominator) -> torch.Tensor:
    """`total / denominator` with the denominator (int, float or tensor) clamped to at least 1."""
    if isinstance(denominator, torch.Tensor):
        return total / denominator.to(total.dtype).clamp(min=1)
    return total / max(denominator, 1)


@LOSS_AGG_REGISTRY.register("token-mean")
def _agg_token_mean(loss_mat, mask, num_tokens=None, num_seqs=None, norm_len=None):
    """Every valid token weighs the same: sum of token losses / number of valid tokens."""
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    return _divide(masked_sum(loss_mat, mask), num_tokens)


# ----------------------------------------------------------------------------------------------- PPO losses


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_ratio: float = 0.2, clip_ratio_c: float = 3.0,
                agg: LossAgg = LossAgg()) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) with dual clip (Ye et al. 2020), all (B, T) inputs:

        ratio = exp(logprobs - old_logprobs)
        loss  = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio, 1 + clip_ratio))
        loss  = min(loss, -A * clip_ratio_c)       only where A < 0 (dual clip)

    For A < 0 the plain PPO loss grows without bound in the ratio; the dual clip caps it, as verl does, so one
    stale sample cannot dominate the step. Metrics as verl's; `actor/ppo_kl` is the k1 estimate of KL(old || new).
    """
    advantages = advantages.float()
    log_ratio = (logprobs.float() - old_logprobs.float()).clamp(-20.0, 20.0)  # so that exp cannot overflow
    ratio = torch.exp(log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    ppo_losses = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * clip_ratio_c
    dual_clipped = (advantages < 0) & (ppo_losses > dual_cap)
    pg_losses = torch.where(dual_clipped, dual_cap, ppo_losses)  # (B, T)

    loss = agg_loss(pg_losses, response_mask, agg)
    with torch.no_grad():
        metrics = {
            "actor/pg_loss": loss.item(),
            "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).item(),
            "actor/ppo_kl": masked_mean(old_logprobs.float() - logprobs.float(), response_mask).item(),
            "actor/pg_clipfrac_lower": masked_mean(dual_clipped.float(), response_mask).item(),
            # rho = pi/pi_old: how far off-policy this update's tokens are (1 on the first mini-batch)
            "actor/importance_ratio/mean": masked_mean(ratio, response_mask).item(),
            "actor/importance_ratio/max": torch.where(response_mask.bool(), ratio, 0.0).max().item(),
        }
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor,
               cliprange_value: float = 0.2, agg: LossAgg = LossAgg()) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss, all (B, T) inputs: 0.5 * max((v - R)^2, (clip(v, v_old ± cliprange_value) - R)^2),
    which keeps the critic near its rollout-time values, as the original PPO code (openai/baselines ppo2)."""
    values, returns, old_values = values.float(), returns.float(), old_values.float()
    unclipped = (values - returns) ** 2
    # Clip v itself, as verl does: old + clamp(v - old) is not exactly v in float32 even when v is in range,
    # which would count in-range tokens as clipped.
    values_clipped = values.clamp(old_values - cliprange_value, old_values + cliprange_value)
    clipped = (values_clipped - returns) ** 2
    vf_losses = 0.5 * torch.maximum(unclipped, clipped)  # (B, T)

    loss = agg_loss(vf_losses, response_mask, agg)
    with torch.no_grad():
        metrics = {
            "critic/vf_loss": loss.item(),
            "critic/vf_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).item(),
        }
    return loss, metrics


# ------------------------------------------------------------- The other aggregation modes (actor.loss_agg_mode)


@LOSS_AGG_REGISTRY.register("seq-mean-token-sum")
def _agg_seq_mean_token_sum(loss_mat, mask, num_tokens=None, num_seqs=None, norm_len=None):
    """Sum token losses within each sequence, then average over sequences (long answers weigh more)."""
    num_seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    return _divide(masked_sum(loss_mat, mask, dim=-1).sum(), num_seqs)


@LOSS_AGG_REGISTRY.register("seq-mean-token-mean")
def _agg_seq_mean_token_mean(loss_mat, mask, num_tokens=None, num_seqs=None, norm_len=None):
    """Average token losses within each sequence, then over sequences (every sequence weighs the same)."""
    num_seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    return _divide(masked_mean(loss_mat, mask, dim=-1).sum(), num_seqs)


@LOSS_AGG_REGISTRY.register("seq-mean-token-sum-norm")
def _agg_seq_mean_token_sum_norm(loss_mat, mask, num_tokens=None, num_seqs=None, norm_len=None):
    """Sum of all token losses / (num_seqs * norm_len): a constant normaliser, so no length bias.

    This is Dr. GRPO's fix (Liu et al. 2025, "Understanding R1-Zero-Like Training"); `norm_len` defaults to
    T, the padded response length.
    """
    num_seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    norm_len = loss_mat.shape[-1] if norm_len is None else norm_len
    return _divide(masked_sum(loss_mat, mask), num_seqs * norm_len)


LOSS_AGG_MODES = tuple(LOSS_AGG_REGISTRY)


def check_loss_agg_mode(mode: str) -> None:
    """Raise ValueError naming the valid modes if `mode` is not a registered aggregation mode."""
    LOSS_AGG_REGISTRY.check(mode)


# ------------------------------------------------------------------------ Log-probs and entropy from logits


def _row_blocks(shape: torch.Size):
    """Index tuples over the leading dims of a (B, T, V) tensor, each block at most `LOGITS_CHUNK_ROWS` rows of the
    tensor as it is, so that a slice of the logits ((B, R, V) of (B, R + 1, V)) is never copied whole to flatten."""
    num_seqs, num_steps = shape[0], shape[1]
    if num_steps <= LOGITS_CHUNK_ROWS:
        per_block = max(1, LOGITS_CHUNK_ROWS // max(num_steps, 1))
        for b in range(0, num_seqs, per_block):
            yield slice(b, b + per_block), slice(None)
    else:
        for b in range(num_seqs):
            for t in range(0, num_steps, LOGITS_CHUNK_ROWS):
                yield slice(b, b + 1), slice(t, t + LOGITS_CHUNK_ROWS)


def _scaled(block: torch.Tensor, temperature: float) -> torch.Tensor:
    return block.float() / temperature  # the one float32 copy there is: a block's


class _LabelLogprobs(torch.autograd.Function):
    """log softmax(z / T) at the labels, block by block, keeping only the logits for the backward (no float32
    copy): d logprob / dz = (onehot(label) - softmax(z / T)) / T, recomputed a block at a time."""

    @staticmethod
    def forward(ctx, logits, labels, temperature):
        label_logits = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float() / temperature  # (B, T)
        log_normaliser = label_logits.new_empty(labels.shape)
        for block in _row_blocks(logits.shape):
            log_normaliser[block] = torch.logsumexp(_scaled(logits[block], temperature), dim=-1)
        ctx.save_for_backward(logits, labels)
        ctx.temperature = temperature
        return label_logits - log_normaliser

    @staticmethod
    def backward(ctx, grad_out):
        logits, labels = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for block in _row_blocks(logits.shape):
            g = grad_out[block].unsqueeze(-1) / temperature  # (b, t, 1)
            grad = -torch.softmax(_scaled(logits[block], temperature), dim=-1) * g
            grad.scatter_add_(-1, labels[block].unsqueeze(-1), g)
            grad_logits[block] = grad
        return grad_logits, None, None


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(z / T), block by block, keeping only the logits for the backward (no float32 copy):
    with log p = log softmax(z / T) and H = -sum p log p, dH/dz = -p (log p + H) / T, recomputed a block at a time."""

    @staticmethod
    def _p_logp(logp):
        return torch.where(logp > float("-inf"), logp.exp() * logp, torch.zeros_like(logp))

    @staticmethod
    def forward(ctx, logits, temperature):
        entropy = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
        for block in _row_blocks(logits.shape):
            logp = torch.log_softmax(_scaled(logits[block], temperature), dim=-1)
            entropy[block] = -_Entropy._p_logp(logp).sum(-1)
        ctx.save_for_backward(logits, entropy)
        ctx.temperature = temperature
        return entropy

    @staticmethod
    def backward(ctx, grad_out):
        logits, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for block in _row_blocks(logits.shape):
            logp = torch.log_softmax(_scaled(logits[block], temperature), dim=-1)
            centred = _Entropy._p_logp(logp) + logp.exp() * entropy[block].unsqueeze(-1)  # p (log p + H)
            grad_logits[block] = centred * (-grad_out[block].unsqueeze(-1) / temperature)
        return grad_logits, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at `labels`: (B, T, V) any float dtype, (B, T) -> (B, T) float32; equal to
    `log_softmax(logits.float() / temperature).gather(-1, labels)` without a float32 (B, T, V) tensor."""
    return _LabelLogprobs.apply(logits, labels, float(temperature))


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: (B, T, V) any float dtype -> (B, T) float32, without
    a float32 (B, T, V) tensor; tokens with -inf logits (probability 0) contribute 0, not NaN."""
    return _Entropy.apply(logits, float(temperature))


# ---------------------------------------------------------------------------------------------- Diagnostics


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over valid tokens: 1 is a perfect critic, <= 0 a useless one;
    finite at the edges, as scikit-learn's `explained_variance_score(force_finite=True)`."""
    values, returns = values.float(), returns.float()
    var_returns = masked_var(returns, mask).item()
    var_residual = masked_var(returns - values, mask).item()
    if var_returns == 0.0:
        return 1.0 if var_residual == 0.0 else 0.0
    return 1.0 - var_residual / var_returns


def groups_with_equal_scores(scores: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of the prompt groups (of more than one response) whose responses all got the same score:
    their grpo/rloo advantages are 0, so they carry no learning signal. 0.0 when there is no such group."""
    groups = [scores[group_ids == g] for g in torch.unique(group_ids)]
    groups = [g for g in groups if len(g) > 1]
    return sum(bool((g == g[0]).all()) for g in groups) / len(groups) if groups else 0.0
