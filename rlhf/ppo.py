"""The glue of one PPO step: how train.py puts the KL estimators and the PPO losses together.

Each function here is one decision of the step, small enough to check by hand (tests/test_ppo.py):

    token_rewards      the score on the last response token, minus the KL penalty on every token
    sequence_mean      a per-token quantity averaged per sequence, then over sequences (the reward KL)
    whiten             advantages normalised over the valid tokens of all processes
    advantages         GAE (whitened) or grpo / rloo over each prompt's group of responses
    actor_loss         policy loss - entropy bonus + KL loss, for the configured estimator
    token_weighted_means, process_share, repeat_prompts, minibatches, should_evaluate, should_checkpoint

Functions that need statistics of the whole global batch take `reduce_sum`, a function that sums a
tensor over processes (`lambda t: accelerator.reduce(t, "sum")` in train.py); the default, the identity,
is one process. So the function the tests check is the function the trainer calls, whatever the world size.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlhf import core_algos, kl
from rlhf.config import ActorConfig, AlgorithmConfig

ReduceSum = Callable[[torch.Tensor], torch.Tensor]


def one_process(tensor: torch.Tensor) -> torch.Tensor:
    """The cross-process sum when there is one process."""
    return tensor


def process_share(global_indices: list[int], rank: int, world: int) -> list[int]:
    """This process's contiguous share of the global batch (validation made the sizes divide)."""
    share = len(global_indices) // world
    return global_indices[rank * share:(rank + 1) * share]


def eval_batches(num_rows: int, batch_size: int, rank: int, world: int) -> list[list[int]]:
    """This process's held-out rows (a contiguous share, the first processes one larger when the sizes do not
    divide) in batches of at most batch_size. Every process gets the same number of batches, the last ones
    possibly empty: with sharded weights (FSDP) each forward is collective, so a process that ran out of rows
    must still take part (it decodes a stand-in row and discards it)."""
    share = -(-num_rows // world)  # ceil
    mine = list(range(rank * share, min((rank + 1) * share, num_rows)))
    return [mine[start:start + batch_size] for start in range(0, share, batch_size)]


def stop_together(reduce_sum):
    """generate's `all_finished` for sharded weights (FSDP): every forward pass is collective, so all processes
    must decode the same number of tokens. True once the sequences of every process have stopped."""
    return lambda finished: reduce_sum((~finished).sum()).item() == 0


def repeat_prompts(rows: dict[str, list], n: int) -> tuple[dict[str, list], torch.Tensor]:
    """Each prompt n times in a row (its group of responses), and each copy's group id (B * n,): the index of
    its prompt on this process. Groups stay on the process that holds the prompt."""
    repeated = {key: [value for value in values for _ in range(n)] for key, values in rows.items()}
    return repeated, torch.arange(len(next(iter(rows.values())))).repeat_interleave(n)


def token_rewards(scores: torch.Tensor, response_mask: torch.Tensor, kl_per_token: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """(B,) scores and (B, R) mask -> (B, R) rewards: each score on its response's last valid token, and, with
    `kl_per_token`, -kl_coef * kl on every valid token (Ziegler et al. 2019; verl's apply_kl_penalty).

    Masked-out tokens get 0 whatever kl holds there. A response with no valid token puts its score on
    position 0, where GAE ignores it."""
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    last = (response_mask.sum(dim=1) - 1).clamp(min=0)
    rewards[torch.arange(len(scores), device=rewards.device), last] = scores.float()
    if kl_per_token is not None:
        rewards = rewards - kl_coef * torch.where(response_mask.bool(), kl_per_token.float(), 0.0)
    return rewards


def sequence_mean(values: torch.Tensor, response_mask: torch.Tensor, reduce_sum: ReduceSum = one_process) -> float:
    """Mean over each sequence's valid tokens, then over the sequences of all processes: (B, R) -> float.

    This is how verl reduces the reward KL (`actor/reward_kl_penalty`, and what the adaptive controller
    sees): every response counts once whatever its length, so the controller's target_kl means the same
    as in verl. A token mean would weight long responses more."""
    per_sequence = core_algos.masked_mean(values.float(), response_mask, dim=-1)  # (B,)
    total, count = reduce_sum(torch.stack([per_sequence.sum(), per_sequence.new_tensor(len(per_sequence))]))
    return (total / count.clamp(min=1)).item()


def whiten(x: torch.Tensor, response_mask: torch.Tensor, reduce_sum: ReduceSum = one_process,
           eps: float = 1e-8) -> torch.Tensor:
    """core_algos.masked_whiten with the mean and unbiased variance of every process's valid tokens, so N
    processes whiten as one process holding the whole batch would (verl whitens on the driver). (B, R)."""
    valid = response_mask.bool()
    total, count = reduce_sum(torch.stack([torch.where(valid, x, 0.0).sum(), valid.sum().to(x.dtype)]))
    mean = total / count.clamp(min=1)
    square_sum = reduce_sum(torch.where(valid, (x - mean) ** 2, 0.0).sum())
    var = square_sum / (count - 1).clamp(min=1)  # Bessel's correction, as masked_var
    return torch.where(valid, (x - mean) * torch.rsqrt(var + eps), 0.0)


def advantages(cfg: AlgorithmConfig, batch: dict[str, torch.Tensor],
               reduce_sum: ReduceSum = one_process) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), (B, R), by `cfg.adv_estimator` from the batch's token_rewards (and values and
    group_ids). GAE's advantages are whitened over all processes (as verl); grpo's and rloo's are already
    relative to their group, which never straddles processes."""
    mask = batch["response_mask"]
    adv, returns = core_algos.ADV_ESTIMATOR_REGISTRY[cfg.adv_estimator](
        batch["token_rewards"], batch.get("values"), mask, batch.get("group_ids"), cfg.gamma, cfg.lam,
        cfg.norm_adv_by_std_in_grpo)
    if cfg.adv_estimator == "gae":
        adv = whiten(adv, mask, reduce_sum)
    return adv, returns


def groups_with_equal_scores(scores: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of the prompt groups (of more than one response) whose responses all got the same score:
    their grpo/rloo advantages are 0, so they carry no learning signal. 0.0 when there is no such group."""
    groups = [scores[group_ids == g] for g in torch.unique(group_ids)]
    groups = [g for g in groups if len(g) > 1]
    return sum(bool((g == g[0]).all()) for g in groups) / len(groups) if groups else 0.0


def token_weighted_means(local_means: dict[str, float], num_tokens: torch.Tensor,
                         reduce_sum: ReduceSum = one_process) -> dict[str, float]:
    """Per-process token means -> means over all processes' tokens (not the mean of the means)."""
    weight = num_tokens.float().reshape(1)
    stacked = torch.tensor(list(local_means.values()), dtype=torch.float32, device=weight.device)
    totals = reduce_sum(torch.cat([stacked * weight, weight]))
    return dict(zip(local_means, (totals[:-1] / totals[-1].clamp(min=1)).tolist()))


def kl_per_token(estimator: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                 full_kl: torch.Tensor | None = None, old_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """The configured estimator per token, (B, R), by kl.kl_per_token: `full_kl` (the exact KL from the
    logits) for an estimator that kl.needs_logits, else the sampled estimate, importance-weighted for
    off-policy tokens when `old_logprobs` is given."""
    return kl.kl_per_token(estimator, logprobs, ref_logprobs, full_kl, old_logprob=old_logprobs)


def actor_loss(cfg: ActorConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, entropy: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
               full_kl: torch.Tensor | None = None, **agg) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's loss on a micro-batch, all (B, R):

        loss = policy_loss(ratio, A) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl)   (kl if use_kl_loss)

    with kl weighted by rho = exp(logprobs - old_logprobs) when kl_loss_off_policy_correction is on.

    `entropy` carries a graph only when entropy_coeff != 0; `full_kl` (differentiable through the actor's
    logits) is needed only for kl_loss_type=full. `agg` (num_tokens, num_seqs, norm_len) normalises by the
    whole mini-batch, so that micro-batch losses add up to it. Metrics: the policy loss's and actor/kl_loss.
    """
    loss, metrics = core_algos.policy_loss(old_logprobs, logprobs, advantages, response_mask, cfg.clip_ratio,
                                           cfg.clip_ratio_c, cfg.loss_agg_mode, **agg)
    if cfg.entropy_coeff:
        loss = loss - cfg.entropy_coeff * core_algos.agg_loss(entropy, response_mask, cfg.loss_agg_mode, **agg)
    if cfg.use_kl_loss:
        old = old_logprobs if cfg.kl_loss_off_policy_correction else None
        kl_loss = core_algos.agg_loss(kl_per_token(cfg.kl_loss_type, logprobs, ref_logprobs, full_kl, old),
                                      response_mask, cfg.loss_agg_mode, **agg)
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.item()
    return loss, metrics


def minibatches(num_local: int, local_mini_size: int, num_epochs: int, seed: int, step: int) -> list[torch.Tensor]:
    """Index tensors of this process's mini-batches for all epochs: a fresh permutation per epoch, drawn from
    (seed, step) only, so that a resumed run takes the same mini-batches."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return [index for _ in range(num_epochs)
            for index in torch.randperm(num_local, generator=generator).split(local_mini_size)]


def should_evaluate(step: int, total_steps: int, test_freq: int) -> bool:
    """Greedy evaluation after every `test_freq` steps (0: never in between) and after the last step. Step 0
    (before training) is evaluated by the trainer when a run starts fresh."""
    return step == total_steps or bool(test_freq and step % test_freq == 0)


def should_checkpoint(step: int, total_steps: int, save_freq: int, stopping: bool, bad_steps: int) -> bool:
    """Save after the last step, when stopping on a signal, and every `save_freq` steps, except during a run of
    non-finite steps: the latest periodic checkpoint must stay one from before them."""
    periodic = bool(save_freq and step % save_freq == 0)
    return step == total_steps or stopping or (periodic and not bad_steps)
