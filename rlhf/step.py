"""One PPO step, top to bottom in the order it runs (`train_step`; train.py is the run around it):

    prompts -> rollout (rollout.n responses per prompt; then, at the rollout's weights, the old log-probs where
    needed, the reference's log-probs, the exact KL, the critic's values) -> score (reward.function) -> KL in
    the reward -> advantages (GAE whitened, or grpo / rloo over each prompt's group) -> PPO epochs (clipped
    actor loss with the KL loss and the entropy bonus, clipped critic loss; one optimizer step per model and
    mini-batch) -> adaptive KL coefficient, lr schedules -> metrics

The stages hand each other a `Batch` of named tensors, (B, ...) with B = this process's responses; per-token
tensors are (B, R), entry t for response token t. The math is in rlhf/core_algos.py and rlhf/kl, the work over
several processes in rlhf/processes.py. ppo.py is the same algorithm in one file (tests/test_ppo.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from rlhf import core_algos, kl, rewards
from rlhf.processes import (backward, gradient_sync, mean_over_processes, optimizer_steps, process_share, stop_rule,
                            sum_over_processes, token_weighted_means)
from rlhf.rollout import (SamplingParams, Sequences, cut_responses, generate, left_pad, paired_noise_generator,
                          repeat_prompts, stop_token_ids)
from rlhf.samples import sample_rows

if TYPE_CHECKING:  # annotations only
    from rlhf.config import Config
    from rlhf.setup import Setup
    from rlhf.tracking import Timer


@dataclass
class StepResult:
    """What one step returns to the run."""

    metrics: dict[str, float]  # averaged over processes
    skipped: int  # optimizer updates skipped as non-finite
    num_tokens: float  # prompt and response tokens of all processes
    samples: list[dict]  # the batch's first responses as rows (rlhf.samples)


def train_step(cfg: Config, plan: Plan, accelerator, run: Setup, step: int, timer: Timer,
               num_samples: int = 0) -> StepResult:
    """One PPO step on this process's share of the global batch (`plan` is plan_step(cfg, ...))."""
    prompts = run.train_set[process_share(run.prompt_order.next_batch(), accelerator.process_index,
                                          accelerator.num_processes)]
    prompt_rows, group_ids = repeat_prompts(prompts, cfg.rollout.n)  # each prompt's group of rollout.n responses
    noise = (paired_noise_generator(cfg.trainer.seed, step, accelerator.process_index, accelerator.device)
             if cfg.rollout.paired_noise else None)  # same-seed runs draw the same noise (common random numbers)
    batch = rollout(cfg, plan, accelerator, run.models, run.tokenizer, prompt_rows,
                    group_ids.to(accelerator.device), noise, timer)
    with timer("reward"):
        scored = rewards.score_batch(run.reward, run.tokenizer, batch.seq, prompt_rows)

    reduce_sum, metrics = sum_over_processes(accelerator), {}
    reward_kl, batch.token_rewards, batch.advantages, batch.returns = rewards_to_advantages(
        cfg, plan, batch, scored.scores, run.kl_ctrl.value, reduce_sum)
    if reward_kl is not None:
        metrics["actor/reward_kl_penalty"] = core_algos.sequence_mean(reward_kl, batch.seq.response_mask, reduce_sum)
        metrics["actor/reward_kl_penalty_coeff"] = run.kl_ctrl.value
    learned, skipped, own_old_logprobs = ppo_update(cfg, plan, accelerator, run.models, run.optimizers, batch,
                                                    step, timer)
    metrics.update(mean_over_processes(accelerator, learned))
    if plan.reward_estimator is not None and math.isfinite(metrics["actor/reward_kl_penalty"]):
        run.kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=cfg.data.train_batch_size * cfg.rollout.n)
    if plan.loss_estimator is not None:
        metrics["actor/kl_coef"] = cfg.actor.kl_loss_coef
    # The lr this step's updates used; then one step of each schedule: once per PPO step, as verl.
    for name, scheduler in zip(("actor", "critic"), run.lr_schedulers):
        if scheduler is not None:
            metrics[f"{name}/lr"] = scheduler.get_last_lr()[0]
            scheduler.step()
    stop_ids = stop_token_ids(accelerator.unwrap_model(run.models[0]), run.tokenizer)
    old_logprobs = own_old_logprobs if plan.old_logprobs_from == "update" else batch.old_logprobs
    metrics.update(batch_metrics(cfg, accelerator, batch, scored, old_logprobs, stop_ids))
    samples = sample_rows(run.tokenizer, batch.seq, scored, stop_ids, num_samples) if num_samples else []
    num_tokens = accelerator.reduce(batch.seq.attention_mask.sum().float(), "sum").item()
    return StepResult(metrics=metrics, skipped=skipped, num_tokens=num_tokens, samples=samples)


# ----------------------------------------------------------------------------- the plan: what the config decides once


OldLogprobsFrom = Literal["forward", "sampler", "update"]


@dataclass(frozen=True)
class Plan:
    """What the config decides for every step (`plan_step`)."""

    reward_estimator: kl.KLEstimator | None  # algorithm.kl_penalty, parsed; None without a KL in the reward
    loss_estimator: kl.KLEstimator | None  # actor.kl_loss_type, parsed; None without a KL loss
    old_logprobs_from: OldLogprobsFrom  # where the old log-probs come from (old_logprobs_from)
    keep_sampler_logprobs: bool  # the decoding loop keeps the sampled tokens' log-probs (rollout.logprobs_from_sampler)
    rollout_full_kl: bool  # the rollout computes the exact KL: for the KL panel, or a `full` KL in the reward


def plan_step(cfg: Config, mixed_precision: str) -> Plan:
    """The run's Plan, once the config is checked; `mixed_precision` as accelerate names it (no | bf16 | fp16)."""
    a, ac = cfg.algorithm, cfg.actor
    reward_estimator = kl.parse_estimator(a.kl_penalty) if a.use_kl_in_reward else None
    # rollout.logprobs_from_sampler's None: on for float32 weights without mixed precision, where the sampler's
    # log-probs agree with the recomputed ones to float rounding (docs/training.md, the measured mismatch).
    keep = cfg.rollout.logprobs_from_sampler
    keep = keep if keep is not None else cfg.model.dtype == "float32" and mixed_precision == "no"
    return Plan(reward_estimator=reward_estimator,
                loss_estimator=kl.parse_estimator(ac.kl_loss_type) if ac.use_kl_loss else None,
                old_logprobs_from=old_logprobs_from(cfg, keep), keep_sampler_logprobs=keep,
                rollout_full_kl=rollout_full_kl(cfg))


def rollout_full_kl(cfg: Config) -> bool:
    """Whether the rollout computes the exact KL from both models' logits: for the KL panel, or a `full` reward."""
    a = cfg.algorithm
    return cfg.trainer.log_kl_panel or (a.use_kl_in_reward and kl.parse_estimator(a.kl_penalty).needs_logits)


def old_logprobs_from(cfg: Config, sampler_logprobs: bool = False) -> OldLogprobsFrom:
    """Where a step's old log-probs come from: "forward" (the actor's forward pass over the rollout batch),
    "update" (the update's own, detached: one epoch of one mini-batch steps once, after every micro-batch's
    forward at the rollout's weights, so the ratio is exactly 1) or "sampler" (the decoding loop's, if kept). A
    KL in the reward needs them before the advantages."""
    a, ac = cfg.algorithm, cfg.actor
    if ac.recompute_old_logprobs == "always" or rollout_full_kl(cfg):
        return "forward"
    on_policy = ac.ppo_epochs == 1 and ac.ppo_mini_batch_size == cfg.data.train_batch_size
    if on_policy and not a.use_kl_in_reward:
        return "update"
    return "sampler" if sampler_logprobs else "forward"


@dataclass
class Batch:
    """One step's responses on this process and what the stages compute about them; None where the config
    needs none. `rollout` fills the first part, `train_step` the last three fields."""

    seq: Sequences  # prompts, responses, their masks and positions (rlhf.rollout)
    group_ids: torch.Tensor  # (B,) the index of each response's prompt on this process
    old_logprobs: torch.Tensor | None  # log pi_old of each token; None where the update's own serve
    ref_logprobs: torch.Tensor | None  # log pi_ref; None without a reference model
    full_kl: torch.Tensor | None  # exact KL(pi_old || pi_ref) per token (kl.full_kl): the panel, a `full` reward
    full_forward_kl: torch.Tensor | None  # exact KL(pi_ref || pi_old) per token, for the panel
    values: torch.Tensor | None  # the critic's V(prompt + response[:t]); None without a critic
    sampler_logprobs: torch.Tensor | None  # the decoding loop's, kept to compare with the old ones
    token_rewards: torch.Tensor | None = None  # the score on the last token, minus the reward's KL penalty
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # the critic's targets

    def rows(self, index) -> Batch:
        """The rows `index` of every tensor (a micro-batch)."""
        return Batch(**{f.name: None if (v := getattr(self, f.name)) is None else v.rows(index) if f.name == "seq"
                        else v[index] for f in dataclasses.fields(self)})



# ----------------------------------------------------------------------------- rollout


@torch.no_grad()
def rollout(cfg: Config, plan: Plan, accelerator, models, tokenizer, prompt_rows, group_ids: torch.Tensor,
            noise: torch.Generator | None, timer: Timer) -> Batch:
    """Sample one response per prompt row (the noise from `noise`, or the global random state); then, in
    micro-batches at the rollout's weights, the forward passes the plan needs: the actor's (the old log-probs),
    the reference's with the exact KL both ways from both models' logits, the critic's values."""
    (actor, critic, ref), r = models, cfg.rollout
    prompt_ids, prompt_mask = left_pad(prompt_rows["input_ids"], tokenizer.pad_token_id)
    params = SamplingParams(cfg.data.max_response_length, r.temperature, r.top_k, r.top_p, ignore_eos=r.ignore_eos)
    with timer("gen"), accelerator.autocast():
        seq = generate(accelerator.unwrap_model(actor), tokenizer, prompt_ids.to(accelerator.device),
                       prompt_mask.to(accelerator.device), params, all_finished=stop_rule(accelerator),
                       generator=noise, return_logprobs=plan.keep_sampler_logprobs)
    passes = defaultdict(list)
    for index in torch.arange(len(prompt_ids)).split(r.log_prob_micro_batch_size):
        micro, logits = seq.rows(index), None
        if plan.old_logprobs_from == "forward":
            with timer("old_log_prob"), accelerator.autocast():
                logprobs, logits = logprobs_and_logits(actor, micro, r.temperature)
                passes["old_logprobs"].append(logprobs)
        if ref is not None:
            with timer("ref"), accelerator.autocast():
                ref_logprobs, ref_logits = logprobs_and_logits(ref, micro, r.temperature)
                passes["ref_logprobs"].append(ref_logprobs)
                if plan.rollout_full_kl:
                    passes["full_kl"].append(kl.full_kl(logits, ref_logits, r.temperature))
                if cfg.trainer.log_kl_panel:  # KL(pi_ref || pi): the direction a k3 loss regularises (docs/kl.md)
                    passes["full_forward_kl"].append(kl.full_kl(ref_logits, logits, r.temperature))
        del logits
        if critic is not None:
            with timer("values"), accelerator.autocast():
                passes["values"].append(response_values(critic, micro))
    passes = {name: torch.cat(parts) for name, parts in passes.items()}
    from_sampler = plan.old_logprobs_from == "sampler"
    return Batch(seq=seq, group_ids=group_ids,
                 old_logprobs=seq.logprobs if from_sampler else passes.get("old_logprobs"),
                 ref_logprobs=passes.get("ref_logprobs"), full_kl=passes.get("full_kl"),
                 full_forward_kl=passes.get("full_forward_kl"), values=passes.get("values"),
                 sampler_logprobs=None if from_sampler else seq.logprobs)


def response_logits(model, seq: Sequences) -> torch.Tensor:
    """(B, R, V) logits predicting each response token (only the last R+1 positions are computed)."""
    num_response = seq.response_ids.shape[1]
    out = model(input_ids=seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids,
                logits_to_keep=num_response + 1, use_cache=False)
    return out.logits[:, :-1]


def logprobs_and_logits(model, seq: Sequences, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, R) of the sampled tokens at the sampling temperature, in float32, and the logits
    (B, R, V) they came from (for the exact KL and the entropy)."""
    logits = response_logits(model, seq)
    return core_algos.logprobs_from_logits(logits, seq.response_ids, temperature), logits


def response_values(critic, seq: Sequences) -> torch.Tensor:
    """(B, R) float32 values V(prompt + response[:t]) from a one-label token-classification critic."""
    num_response = seq.response_ids.shape[1]
    out = critic(input_ids=seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids,
                 use_cache=False)
    return out.logits[:, -num_response - 1:-1, 0].float()


# ----------------------------------------------------------------------------- advantages


def rewards_to_advantages(cfg: Config, plan: Plan, batch: Batch, scores: torch.Tensor, kl_coef: float,
                          reduce_sum) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """KL in the reward -> token rewards -> advantages (algorithm.adv_estimator: GAE's whitened over all
    processes' tokens, grpo's and rloo's relative to each prompt's group). Returns, all (B, R): the reward's KL
    per token (None without one), the token rewards, the advantages and the returns (the critic's targets)."""
    a, mask = cfg.algorithm, batch.seq.response_mask
    reward_kl = None
    if plan.reward_estimator is not None:
        reward_kl = plan.reward_estimator(batch.old_logprobs, batch.ref_logprobs, batch.full_kl)
    token_rewards = core_algos.token_rewards(scores, mask, reward_kl, kl_coef)
    advantages, returns = core_algos.ADV_ESTIMATOR_REGISTRY[a.adv_estimator](
        token_rewards, batch.values, mask, batch.group_ids, a.gamma, a.lam, a.norm_adv_by_std_in_grpo, reduce_sum)
    return reward_kl, token_rewards, advantages, returns


# ----------------------------------------------------------------------------- PPO epochs


def ppo_update(cfg: Config, plan: Plan, accelerator, models, optimizers, batch: Batch, step: int,
               timer: Timer) -> tuple[dict[str, float], int, torch.Tensor | None]:
    """`actor.ppo_epochs` passes over the batch in mini-batches (`minibatches`), each in micro-batches whose
    gradients add up to the mini-batch's: one optimizer step per model and mini-batch (the critic only when
    there is one). Returns (metrics (`update_metrics`); the optimizer updates skipped as non-finite; the
    update's own old log-probs (B, R), where the plan takes them)."""
    (actor, critic, _), (actor_opt, critic_opt), ac, mask = models, optimizers, cfg.actor, batch.seq.response_mask
    own_old = torch.zeros(mask.shape, device=mask.device) if plan.old_logprobs_from == "update" else None
    world, mini_size = accelerator.num_processes, ac.ppo_mini_batch_size * cfg.rollout.n  # responses
    learners = [("actor", actor, actor_opt, ac.grad_clip)]
    if critic is not None:
        learners.append(("critic", critic, critic_opt, cfg.critic.grad_clip))
    records, skipped = defaultdict(list), 0
    mini_indices = minibatches(len(mask), mini_size // world, ac.ppo_epochs, cfg.trainer.seed, step)
    for mini_index in mini_indices:
        # Normalised by the global mini-batch (all micro-batches, all processes), so that the summed
        # micro-batch gradients are the mini-batch's.
        norm = dict(num_tokens=accelerator.reduce(mask[mini_index].sum().float(), "sum"), num_seqs=mini_size,
                    norm_len=mask.shape[1])
        finite = {name: True for name, *_ in learners}
        micro_indices = mini_index.split(ac.ppo_micro_batch_size)
        for i, micro_index in enumerate(micro_indices):
            micro, last = batch.rows(micro_index), i == len(micro_indices) - 1
            with timer("update_actor"), gradient_sync(accelerator, actor, last):
                with accelerator.autocast():  # forward only: the backward runs outside autocast
                    loss, metrics, logprobs = micro_actor_loss(cfg, plan, models, micro, norm)
                finite["actor"] &= backward(accelerator, loss)
            if own_old is not None:
                own_old[micro_index] = logprobs
            if critic is not None:
                with timer("update_critic"), gradient_sync(accelerator, critic, last):
                    with accelerator.autocast():
                        values = response_values(critic, micro.seq)
                    vf_loss, critic_metrics = core_algos.value_loss(
                        values, micro.values, micro.returns, micro.seq.response_mask, cfg.critic.cliprange_value,
                        ac.loss_agg_mode, **norm)
                    finite["critic"] &= backward(accelerator, vf_loss)
                metrics.update(critic_metrics)
            for key, value in metrics.items():
                records[key].append(value)
        with timer("update_step"):
            num_skipped, grad_norms = optimizer_steps(accelerator, learners, list(finite.values()))
        skipped += num_skipped
        for (name, *_), grad_norm in zip(learners, grad_norms):
            records[f"{name}/grad_norm"].append(grad_norm)
    return update_metrics(records, len(mini_indices), world), skipped, own_old


MINI_BATCH_LOSSES = ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss")  # normalised by the whole mini-batch


def update_metrics(records: dict[str, list[float]], num_minibatches: int, world: int) -> dict[str, float]:
    """The update's metrics from every micro-batch's records: a loss is the mean over mini-batches of the sum of
    their micro-batches (x world: train_step averages the processes' shares); /max keys the maximum; others the
    mean."""
    return {key: sum(values) * world / num_minibatches if key in MINI_BATCH_LOSSES else
            max(values) if key.endswith("/max") else sum(values) / len(values) for key, values in records.items()}


def minibatches(num_local: int, local_mini_size: int, num_epochs: int, seed: int, step: int) -> list[torch.Tensor]:
    """Index tensors of this process's mini-batches for all epochs: a fresh permutation per epoch, drawn from
    (seed, step) only, so that a resumed run takes the same mini-batches."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return [index for _ in range(num_epochs)
            for index in torch.randperm(num_local, generator=generator).split(local_mini_size)]


def micro_actor_loss(cfg: Config, plan: Plan, models, micro: Batch,
                     norm: dict) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The actor's forward pass and loss (`actor_loss`) on one micro-batch, with actor/entropy. Returns (loss,
    metrics, the micro-batch's log-probs, detached: the old ones where the plan says "update")."""
    (actor, _, ref), temperature, mask = models, cfg.rollout.temperature, micro.seq.response_mask
    logprobs, logits = logprobs_and_logits(actor, micro.seq, temperature)
    old_logprobs = logprobs.detach() if plan.old_logprobs_from == "update" else micro.old_logprobs
    with torch.set_grad_enabled(bool(cfg.actor.entropy_coeff)):  # out of the graph unless in the loss
        entropy = core_algos.entropy_from_logits(logits, temperature)
    full = None
    if plan.loss_estimator is not None and plan.loss_estimator.needs_logits:  # exact, through the actor's logits
        with torch.no_grad():
            ref_logits = response_logits(ref, micro.seq)
        full = kl.full_kl(logits, ref_logits, temperature)
    loss, metrics = actor_loss(cfg.actor, plan.loss_estimator, logprobs, old_logprobs, micro.advantages, mask,
                               entropy, micro.ref_logprobs, full, norm)
    metrics["actor/entropy"] = core_algos.masked_mean(entropy.detach(), mask).item()
    return loss, metrics, logprobs.detach()


def actor_loss(ac, estimator: kl.KLEstimator | None, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
               advantages: torch.Tensor, response_mask: torch.Tensor, entropy: torch.Tensor,
               ref_logprobs: torch.Tensor | None = None, full_kl: torch.Tensor | None = None,
               norm: dict | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's loss on a micro-batch, all (B, R), with `ac` the actor's config:

        loss = policy_loss(ratio, A) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl)   (kl: `estimator`)

    with kl weighted by rho = exp(logprobs - old_logprobs) when kl_loss_off_policy_correction is on; `full_kl`
    (differentiable through the actor's logits) only for a `full` estimator. `norm` (num_tokens, num_seqs,
    norm_len) normalises by the whole mini-batch, so that micro-batch losses add up to its loss."""
    norm = norm or {}
    loss, metrics = core_algos.policy_loss(logprobs, old_logprobs, advantages, response_mask, ac.clip_ratio,
                                           ac.clip_ratio_c, ac.loss_agg_mode, **norm)
    if ac.entropy_coeff:
        loss = loss - ac.entropy_coeff * core_algos.agg_loss(entropy, response_mask, ac.loss_agg_mode, **norm)
    if estimator is not None:
        old = old_logprobs if ac.kl_loss_off_policy_correction else None
        kl_loss = core_algos.agg_loss(estimator(logprobs, ref_logprobs, full_kl, old), response_mask,
                                      ac.loss_agg_mode, **norm)
        loss = loss + ac.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.item()
    return loss, metrics


# ----------------------------------------------------------------------------- metrics


def batch_metrics(cfg: Config, accelerator, batch: Batch, scored: rewards.Scored, old_logprobs: torch.Tensor | None,
                  stop_ids: int | tuple[int, ...]) -> dict[str, float]:
    """The step's logged numbers that describe the batch: scores, rewards, lengths, advantages, value fit, the
    share of groups without signal, the KL panel (of `old_logprobs`), the sampler's log-prob mismatch; over all
    processes (the panel and the mismatch KL over all their tokens)."""
    mask, reduce_sum, valid = batch.seq.response_mask, sum_over_processes(accelerator), batch.seq.response_mask.bool()
    local = {
        "critic/score/mean": scored.scores.mean(),
        "critic/rewards/mean": core_algos.masked_sum(batch.token_rewards, mask, dim=1).mean(),
        "response_length/mean": mask.sum(dim=1).float().mean(),
        "response_length/clip_ratio": cut_responses(batch.seq, stop_ids).float().mean(),
        "critic/advantages/mean": core_algos.masked_mean(batch.advantages, mask),
        "critic/advantages/max": batch.advantages[valid].max(),
        "critic/advantages/min": batch.advantages[valid].min(),
    }
    if batch.values is not None:
        local["critic/vf_explained_var"] = core_algos.explained_variance(batch.values, batch.returns, mask)
    for key, values in scored.parts.items():  # the parts of a reward of several (reward.functions)
        local[f"{key}/mean"] = values.mean()
    if cfg.rollout.n > 1:
        local["critic/groups_with_equal_scores"] = core_algos.groups_with_equal_scores(scored.scores, batch.group_ids)
    metrics = mean_over_processes(accelerator, local)
    if cfg.trainer.log_kl_panel:
        panel = kl.kl_panel(old_logprobs, batch.ref_logprobs, mask)
        panel["kl/full"] = core_algos.masked_mean(batch.full_kl, mask).item()
        panel["kl/full_forward"] = core_algos.masked_mean(batch.full_forward_kl, mask).item()
        metrics.update(token_weighted_means(panel, mask.sum(), reduce_sum))
    if batch.sampler_logprobs is not None:  # the sampler's log-probs against the recomputed old ones
        mismatch = logprob_mismatch(batch.sampler_logprobs, old_logprobs, mask)
        largest = {"rollout/logprob_abs_diff/max": mismatch.pop("rollout/logprob_abs_diff/max")}
        metrics.update(mean_over_processes(accelerator, largest))
        metrics.update(token_weighted_means(mismatch, mask.sum(), reduce_sum))
    return metrics


def logprob_mismatch(sampler_logprobs: torch.Tensor, logprobs: torch.Tensor,
                     response_mask: torch.Tensor) -> dict[str, float]:
    """The sampler's log-probs of the sampled tokens against the recomputed ones, (B, R) x 3 -> metrics:
    `rollout/logprob_mismatch_kl`, the token-mean k3 estimate of KL(sampler || recomputed) (the tokens are
    the sampler's samples; >= 0 per token), and `rollout/logprob_abs_diff/max`, the largest |difference|
    over valid tokens (0 without any)."""
    diff = torch.where(response_mask.bool(), (sampler_logprobs.float() - logprobs.float()).abs(), 0.0)
    k3 = kl.kl_penalty(sampler_logprobs.float(), logprobs.float(), "k3")
    return {"rollout/logprob_mismatch_kl": core_algos.masked_mean(k3, response_mask).item(),
            "rollout/logprob_abs_diff/max": (diff.max() if diff.numel() else diff.sum()).item()}
