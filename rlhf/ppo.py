"""The glue of one PPO step: how train.py puts the KL estimators and the PPO losses together.

Each function here is one decision of the step, small enough to check by hand (tests/test_ppo.py):

    repeat_prompts     each prompt rollout.n times in a row, with its group id
    token_rewards      the score on the last response token, minus the KL penalty on every token
    sequence_mean      a per-token quantity averaged per sequence, then over sequences (the reward KL)
    advantages         by the configured estimator (GAE whitened, or grpo / rloo over each prompt's group)
    groups_with_equal_scores  the share of groups whose advantages are 0 (no learning signal)
    actor_loss         policy loss - entropy bonus + KL loss, for the configured estimator
    minibatches        the mini-batches of every epoch, drawn from (seed, step)
    is_on_policy, old_logprobs_source, keeps_sampler_logprobs, needs_rollout_full_kl
                       which forward passes a step needs for its old log-probs and exact KLs
    logprob_mismatch   the sampler's log-probs against the recomputed ones
    should_evaluate, should_checkpoint

Functions that need statistics of the whole global batch take `reduce_sum` (rlhf.processes), which sums a
tensor over processes; the default is one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlhf import core_algos, kl
from rlhf.processes import ReduceSum, one_process

if TYPE_CHECKING:  # annotations only
    from rlhf.config import ActorConfig, AlgorithmConfig, Config


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
        kl_per_token = kl.parse_estimator(cfg.kl_loss_type)(logprobs, ref_logprobs, full_kl, old)  # (B, R)
        kl_loss = core_algos.agg_loss(kl_per_token,
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


def is_on_policy(cfg: Config) -> bool:
    """Whether the update is exactly on-policy: one epoch over one mini-batch (actor.ppo_epochs=1,
    actor.ppo_mini_batch_size=data.train_batch_size), so the one optimizer step per model comes after every
    micro-batch's forward (they accumulate gradients), and every forward runs at the rollout's weights."""
    return cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size


def needs_rollout_full_kl(cfg: Config) -> bool:
    """Whether the rollout computes the exact per-token KL, which needs the actor's and the reference's logits:
    for the KL panel (kl/full, kl/full_forward) and for a KL in the reward by an estimator that needs logits
    (full). A `full` KL loss takes its own, through the update's logits."""
    a = cfg.algorithm
    return cfg.trainer.log_kl_panel or (a.use_kl_in_reward and kl.parse_estimator(a.kl_penalty).needs_logits)


def old_logprobs_source(cfg: Config, sampler_logprobs: bool = False) -> str:
    """Where a step's old log-probs come from: "pass" (the actor's forward over the rollout batch, the timer's
    `old_log_prob`), "update" (the update's own log-probs, detached) or "sampler" (those the decoding loop
    kept, when `sampler_logprobs`: keeps_sampler_logprobs).

    The pass runs when
      - actor.recompute_old_logprobs=always;
      - the actor's logits are needed before the update (needs_rollout_full_kl: the KL panel, or a `full` KL
        in the reward);
      - a sampled KL estimator is in the reward: it needs the old log-probs before the advantages, so before
        the update; the sampler's serve if kept;
      - the update is not exactly on-policy (is_on_policy): after its first optimizer step the ratio needs the
        log-probs at the rollout's weights; the sampler's serve if kept.
    Otherwise "update": the update's one optimizer step follows all its micro-batch forwards, at the
    rollout's weights, so its own log-probs, detached, are the old ones; the ratio is then exactly 1 (and the
    off-policy correction's rho: value 1, gradient that of the log-prob), as with the pass up to float
    rounding. The reference's and the critic's passes are separate and unaffected: the KL loss, the critic
    and the entropy use nothing of the actor's pass. Sampler log-probs that are kept but not used as the old
    ones are compared with them (logprob_mismatch).
    """
    a = cfg.algorithm
    if cfg.actor.recompute_old_logprobs == "always" or needs_rollout_full_kl(cfg):
        return "pass"
    if is_on_policy(cfg) and not a.use_kl_in_reward:
        return "update"
    return "sampler" if sampler_logprobs else "pass"


def keeps_sampler_logprobs(cfg: Config, mixed_precision: str) -> bool:
    """rollout.logprobs_from_sampler, where None means: on for float32 weights without mixed precision
    (`mixed_precision` as accelerate names it: no | bf16 | fp16), where the sampler's log-probs agree with the
    recomputed ones to float rounding, off otherwise (docs/training.md, the measured mismatch)."""
    kept = cfg.rollout.logprobs_from_sampler
    return kept if kept is not None else cfg.model.dtype == "float32" and mixed_precision == "no"


def logprob_mismatch(rollout_logprobs: torch.Tensor, logprobs: torch.Tensor,
                     response_mask: torch.Tensor) -> dict[str, float]:
    """The sampler's log-probs of the sampled tokens against the recomputed ones, (B, R) x 3 -> metrics:
    `rollout/logprob_mismatch_kl`, the token-mean k3 estimate of KL(sampler || recomputed) (the tokens are
    the sampler's samples; >= 0 per token), and `rollout/logprob_abs_diff/max`, the largest |difference|
    over valid tokens (0 without any)."""
    valid = response_mask.bool()
    diff = torch.where(valid, (rollout_logprobs.float() - logprobs.float()).abs(), 0.0)
    k3 = kl.kl_penalty(rollout_logprobs.float(), logprobs.float(), "k3")
    return {"rollout/logprob_mismatch_kl": core_algos.masked_mean(k3, response_mask).item(),
            "rollout/logprob_abs_diff/max": (diff.max() if diff.numel() else diff.sum()).item()}


def should_evaluate(step: int, total_steps: int, test_freq: int) -> bool:
    """Greedy evaluation after every `test_freq` steps (0: never in between) and after the last step. Step 0
    (before training) is evaluated by the trainer when a run starts fresh."""
    return step == total_steps or bool(test_freq and step % test_freq == 0)


def should_checkpoint(step: int, total_steps: int, save_freq: int, stopping: bool, bad_steps: int) -> bool:
    """Save after the last step, when stopping on a signal, and every `save_freq` steps, except during a run of
    non-finite steps: the latest periodic checkpoint must stay one from before them."""
    periodic = bool(save_freq and step % save_freq == 0)
    return step == total_steps or stopping or (periodic and not bad_steps)
