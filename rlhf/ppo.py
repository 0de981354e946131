"""The glue of one PPO step: how train.py puts the KL estimators and the PPO losses together.

Each function here is one decision of the step, small enough to check by hand (tests/test_ppo.py):

    repeat_prompts     each prompt rollout.n times in a row, with its group id
    token_rewards      the score on the last response token, minus the KL penalty on every token
    sequence_mean      a per-token quantity averaged per sequence, then over sequences (the reward KL)
    advantages         by the configured estimator (GAE whitened, or grpo / rloo over each prompt's group)
    groups_with_equal_scores  the share of groups whose advantages are 0 (no learning signal)
    kl_per_token       the configured KL estimator per token
    actor_loss         policy loss - entropy bonus + KL loss, for the configured estimator
    minibatches        the mini-batches of every epoch, drawn from (seed, step)
    should_evaluate, should_checkpoint

Functions that need statistics of the whole global batch take `reduce_sum` (rlhf.processes), which sums a
tensor over processes; the default is one process.
"""

from __future__ import annotations

import torch

from rlhf import core_algos, kl
from rlhf.config import ActorConfig, AlgorithmConfig
from rlhf.processes import ReduceSum, one_process


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


def advantages(cfg: AlgorithmConfig, batch: dict[str, torch.Tensor],
               reduce_sum: ReduceSum = one_process) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), (B, R), by `cfg.adv_estimator` from the batch's token_rewards (and values and
    group_ids), as the estimator returns them (core_algos.ADV_ESTIMATOR_REGISTRY): GAE's whitened over all
    processes, grpo's and rloo's relative to their group."""
    return core_algos.ADV_ESTIMATOR_REGISTRY[cfg.adv_estimator](
        batch["token_rewards"], batch.get("values"), batch["response_mask"], batch.get("group_ids"), cfg.gamma,
        cfg.lam, cfg.norm_adv_by_std_in_grpo, reduce_sum)


def groups_with_equal_scores(scores: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of the prompt groups (of more than one response) whose responses all got the same score:
    their grpo/rloo advantages are 0, so they carry no learning signal. 0.0 when there is no such group."""
    groups = [scores[group_ids == g] for g in torch.unique(group_ids)]
    groups = [g for g in groups if len(g) > 1]
    return sum(bool((g == g[0]).all()) for g in groups) / len(groups) if groups else 0.0


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
