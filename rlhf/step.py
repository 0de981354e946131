"""One PPO step, top to bottom in the order it runs (`train_step`; train.py is the run around it):

    prompts -> rollout (rollout.n responses per prompt; then, at the rollout's weights, the old log-probs where
    needed, the reference's log-probs, the exact KL, the critic's values) -> score (reward.function) -> KL in
    the reward -> advantages (GAE whitened, or grpo / rloo over each prompt's group) -> PPO epochs (clipped
    actor loss with the KL loss and the entropy bonus, clipped critic loss; one optimizer step per model and
    mini-batch) -> adaptive KL coefficient, lr schedules -> logging (the batch's numbers, the KL panel)

The stages hand each other records of named tensors, (B, ...) with B = this process's responses; per-token
tensors are (B, R), entry t for response token t. The math is in rlhf/core_algos.py and rlhf/kl, the work over
several processes in rlhf/processes.py. ppo.py is the same algorithm in one file (tests/test_ppo.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from rlhf import core_algos, kl, rewards
from rlhf.processes import mean_over_processes, process_share, stop_rule, sum_over_processes, token_weighted_means
from rlhf.rollout import (SamplingParams, Sequences, cut_responses, generate, left_pad, paired_noise_generator,
                          repeat_prompts, stop_token_ids)

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
    seq: Sequences  # this process's batch, and its scores: the run logs samples of them (rlhf.samples)
    scored: rewards.Scored


def train_step(cfg: Config, plan: Plan, accelerator, run: Setup, step: int, timer: Timer) -> StepResult:
    """One PPO step on this process's share of the global batch (`plan` is plan_step(cfg, ...)); `step` counts
    the run's steps from 1 (it seeds the sampling noise and the mini-batches)."""
    a, (actor, _, _) = cfg.algorithm, run.models
    # ----------------------------------------------------------------------------- rollout
    prompts = run.train_set[process_share(run.prompt_order.next_batch(), accelerator.process_index,
                                          accelerator.num_processes)]
    prompt_rows, group_ids = repeat_prompts(prompts, cfg.rollout.n)  # each prompt's group of rollout.n responses
    prompt_ids, prompt_mask = left_pad(prompt_rows["input_ids"], run.tokenizer.pad_token_id)
    noise = (paired_noise_generator(cfg.trainer.seed, step, accelerator.process_index, accelerator.device)
             if cfg.rollout.paired_noise else None)  # same-seed runs draw the same noise (common random numbers)
    with timer("gen"), accelerator.autocast():
        seq = generate(accelerator.unwrap_model(actor), run.tokenizer, prompt_ids.to(accelerator.device),
                       prompt_mask.to(accelerator.device), plan.sampling, all_finished=stop_rule(accelerator),
                       generator=noise)
    passes = forward_passes(cfg, plan, accelerator, run.models, seq, timer)
    with timer("reward"):
        scored = rewards.score_batch(run.reward, run.tokenizer, seq, prompt_rows)

    # ----------------------------------------------------------------------------- advantages
    mask, reduce_sum = seq.response_mask, sum_over_processes(accelerator)
    reward_kl = None if plan.reward_kl is None else plan.reward_kl(passes.old_logprobs, passes.ref_logprobs,
                                                                   passes.exact_kl)
    token_rewards = core_algos.token_rewards(scored.scores, mask, reward_kl, run.kl_ctrl.value)
    group_ids = group_ids.to(mask.device)
    advantages, returns = core_algos.ADV_ESTIMATOR_REGISTRY[a.adv_estimator](token_rewards, passes.old_values, mask,
                                                                             group_ids, a, reduce_sum)
    batch = Batch(seq=seq, group_ids=group_ids, old_logprobs=passes.old_logprobs, sampler_logprobs=seq.logprobs,
                  ref_logprobs=passes.ref_logprobs, exact_kl=passes.exact_kl,
                  exact_forward_kl=passes.exact_forward_kl, old_values=passes.old_values, token_rewards=token_rewards,
                  advantages=advantages, returns=returns)

    # ----------------------------------------------------------------------------- PPO epochs
    learned, skipped = ppo_update(cfg, plan, accelerator, run, batch, step, timer)

    # ----------------------------------------------------------------------------- the KL coefficient, the lr
    metrics = {}
    if reward_kl is not None:  # verl's per-sequence mean, what the adaptive controller follows
        metrics["actor/reward_kl_penalty"] = core_algos.sequence_mean(reward_kl, mask, reduce_sum)
        metrics["actor/reward_kl_penalty_coeff"] = run.kl_ctrl.value
        if math.isfinite(metrics["actor/reward_kl_penalty"]):
            run.kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=cfg.data.train_batch_size * cfg.rollout.n)
    if plan.loss_kl is not None:
        metrics["actor/kl_coef"] = cfg.actor.kl_loss_coef
    # The lr this step's updates used; then one step of each schedule: once per PPO step, as verl.
    for name, scheduler in zip(("actor", "critic"), run.lr_schedulers):
        if scheduler is not None:
            metrics[f"{name}/lr"] = scheduler.get_last_lr()[0]
            scheduler.step()

    # ----------------------------------------------------------------------------- logging (nothing learned below)
    metrics.update(learned)
    stop_ids = stop_token_ids(accelerator.unwrap_model(actor), run.tokenizer)
    metrics.update(batch_metrics(cfg, plan, accelerator, batch, scored, stop_ids))
    num_tokens = accelerator.reduce(seq.attention_mask.sum().float(), "sum").item()
    return StepResult(metrics=metrics, skipped=skipped, num_tokens=num_tokens, seq=seq, scored=scored)


# ----------------------------------------------------------------------------- the plan: what the config decides once


OldLogprobsFrom = Literal["forward", "sampler", "update"]


@dataclass(frozen=True)
class Plan:
    """What the config decides for every step (`plan_step`)."""

    reward_kl: kl.KLEstimator | None  # the KL in the reward (algorithm.kl_penalty), parsed; None without one
    loss_kl: kl.KLEstimator | None  # the KL in the actor's loss (actor.kl_loss_type), parsed; None without one
    old_logprobs_from: OldLogprobsFrom  # where the old log-probs come from (old_logprobs_from)
    sampling: SamplingParams  # the rollout's settings; keep_logprobs is rollout.logprobs_from_sampler, decided
    computes_exact_kl: bool  # the rollout computes the exact KL: for the KL panel, or a `full` KL in the reward


def plan_step(cfg: Config, mixed_precision: str) -> Plan:
    """The run's Plan, once the config is checked; `mixed_precision` as accelerate names it (no | bf16 | fp16)."""
    a, ac, r = cfg.algorithm, cfg.actor, cfg.rollout
    # rollout.logprobs_from_sampler's None: on for float32 weights without mixed precision, where the sampler's
    # log-probs agree with the recomputed ones to float rounding (docs/training.md, the measured mismatch).
    keep = r.logprobs_from_sampler
    keep = keep if keep is not None else cfg.model.dtype == "float32" and mixed_precision == "no"
    return Plan(reward_kl=kl.parse_estimator(a.kl_penalty) if a.use_kl_in_reward else None,
                loss_kl=kl.parse_estimator(ac.kl_loss_type) if ac.use_kl_loss else None,
                old_logprobs_from=old_logprobs_from(cfg, keep),
                sampling=SamplingParams(cfg.data.max_response_length, r.temperature, r.top_k, r.top_p,
                                        ignore_eos=r.ignore_eos, keep_logprobs=keep),
                computes_exact_kl=computes_exact_kl(cfg))


def computes_exact_kl(cfg: Config) -> bool:
    """Whether the rollout computes the exact KL from both models' logits: for the KL panel, or a `full` reward."""
    a = cfg.algorithm
    return cfg.trainer.log_kl_panel or (a.use_kl_in_reward and kl.parse_estimator(a.kl_penalty).needs_logits)


def old_logprobs_from(cfg: Config, sampler_logprobs: bool = False) -> OldLogprobsFrom:
    """Where a step's old log-probs come from: "forward" (the actor's forward pass over the rollout batch),
    "update" (the update's own, detached: one epoch of one mini-batch steps once, after every micro-batch's
    forward at the rollout's weights, so the ratio is exactly 1; none before the update) or "sampler" (the
    decoding loop's, if kept). A KL in the reward needs them before the advantages."""
    a, ac = cfg.algorithm, cfg.actor
    if ac.recompute_old_logprobs == "always" or computes_exact_kl(cfg):
        return "forward"
    on_policy = ac.ppo_epochs == 1 and ac.ppo_mini_batch_size == cfg.data.train_batch_size
    if on_policy and not a.use_kl_in_reward:
        return "update"
    return "sampler" if sampler_logprobs else "forward"


# ----------------------------------------------------------------------------- the rollout's forward passes


@dataclass
class Passes:
    """The forward passes over the sampled batch at the rollout's weights (`forward_passes`); None where the plan
    needs none."""

    old_logprobs: torch.Tensor | None  # log pi_old of each token (Batch.old_logprobs: from where the plan says)
    ref_logprobs: torch.Tensor | None  # log pi_ref; None without a reference model
    exact_kl: torch.Tensor | None  # exact KL(pi_old || pi_ref) per token (kl.full_kl): the panel, a `full` reward
    exact_forward_kl: torch.Tensor | None  # exact KL(pi_ref || pi_old) per token, for the panel
    old_values: torch.Tensor | None  # the critic's V(prompt + response[:t]); None without a critic


@torch.no_grad()
def forward_passes(cfg: Config, plan: Plan, accelerator, models, seq: Sequences, timer: Timer) -> Passes:
    """In micro-batches at the rollout's weights, the forward passes the plan needs: the actor's (the old
    log-probs), the reference's with the exact KL both ways from both models' logits, the critic's values. The old
    log-probs are the forward pass's, the sampler's (`seq.logprobs`) or, where the plan says "update", None (the
    update's own)."""
    (actor, critic, ref), r = models, cfg.rollout
    passes = defaultdict(list)
    for index in torch.arange(len(seq.response_ids)).split(r.log_prob_micro_batch_size):
        micro, logits = seq.select(index), None
        if plan.old_logprobs_from == "forward":
            with timer("old_log_prob"), accelerator.autocast():
                logprobs, logits = logprobs_and_logits(actor, micro, r.temperature)
                passes["old_logprobs"].append(logprobs)
        if ref is not None:
            with timer("ref"), accelerator.autocast():
                ref_logprobs, ref_logits = logprobs_and_logits(ref, micro, r.temperature)
                passes["ref_logprobs"].append(ref_logprobs)
                if plan.computes_exact_kl:
                    passes["exact_kl"].append(kl.full_kl(logits, ref_logits, r.temperature))
                if cfg.trainer.log_kl_panel:  # KL(pi_ref || pi): the direction a k3 loss regularises (docs/kl.md)
                    passes["exact_forward_kl"].append(kl.full_kl(ref_logits, logits, r.temperature))
        del logits
        if critic is not None:
            with timer("values"), accelerator.autocast():
                passes["old_values"].append(response_values(critic, micro))
    passes = {name: torch.cat(parts) for name, parts in passes.items()}
    old_logprobs = {"forward": passes.get("old_logprobs"), "sampler": seq.logprobs, "update": None}
    return Passes(old_logprobs=old_logprobs[plan.old_logprobs_from], ref_logprobs=passes.get("ref_logprobs"),
                  exact_kl=passes.get("exact_kl"), exact_forward_kl=passes.get("exact_forward_kl"),
                  old_values=passes.get("old_values"))


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


# ----------------------------------------------------------------------------- the batch the update learns from


@dataclass
class Batch:
    """One step's responses and all that the step computed about them, before the update (train_step builds it
    once, whole); None where the config needs none."""

    seq: Sequences  # prompts, responses, their masks and positions (rlhf.rollout)
    group_ids: torch.Tensor  # (B,) the index of each response's prompt on this process
    old_logprobs: torch.Tensor | None  # log pi_old: the forward pass's or the sampler's; None: the update's own (Plan)
    sampler_logprobs: torch.Tensor | None  # the decoding loop's, where kept (Plan.sampling.keep_logprobs)
    ref_logprobs: torch.Tensor | None  # log pi_ref; None without a reference model
    exact_kl: torch.Tensor | None  # exact KL(pi_old || pi_ref) per token: the panel, a `full` reward
    exact_forward_kl: torch.Tensor | None  # exact KL(pi_ref || pi_old) per token, for the panel
    old_values: torch.Tensor | None  # the critic's at the rollout's weights; None without a critic
    token_rewards: torch.Tensor  # the score on the last token, minus the reward's KL penalty
    advantages: torch.Tensor
    returns: torch.Tensor  # the critic's targets

    def select(self, index) -> Batch:
        """The rows `index` of every tensor (a micro-batch)."""
        return Batch(**{f.name: None if (v := getattr(self, f.name)) is None else v.select(index) if f.name == "seq"
                        else v[index] for f in dataclasses.fields(self)})


# ----------------------------------------------------------------------------- PPO epochs


def ppo_update(cfg: Config, plan: Plan, accelerator, run: Setup, batch: Batch, step: int,
               timer: Timer) -> tuple[dict[str, float], int]:
    """`actor.ppo_epochs` passes over the batch in mini-batches (`minibatches`), each in micro-batches whose
    gradients add up to the mini-batch's: one optimizer step per model and mini-batch (the critic only when
    there is one). Returns (the update's metrics over all processes, the optimizer updates skipped as
    non-finite)."""
    (actor, critic, _), ac, mask = run.models, cfg.actor, batch.seq.response_mask
    world, mini_size = accelerator.num_processes, ac.ppo_mini_batch_size * cfg.rollout.n  # responses, all processes
    learners = [("actor", actor, run.optimizers[0], ac.grad_clip)]
    if critic is not None:
        learners.append(("critic", critic, run.optimizers[1], cfg.critic.grad_clip))
    records, skipped = defaultdict(list), 0
    mini_indices = minibatches(len(mask), mini_size // world, ac.ppo_epochs, cfg.trainer.seed, step)
    for mini_index in mini_indices:  # every epoch's mini-batches, in the epoch's order
        # The one scaling: a micro-batch's losses are divided by the counts of the whole global mini-batch (its
        # tokens over all processes, its sequences, the padded length: LossAgg), so that the micro-batches'
        # gradients add up to the mini-batch's; and DDP averages gradients over processes, so each process's
        # share counts `world` times, to make that average the sum (its logged losses too: averaged likewise).
        agg = core_algos.LossAgg(ac.loss_agg_mode, num_tokens=accelerator.reduce(mask[mini_index].sum().float(), "sum"),
                                 num_seqs=mini_size, norm_len=mask.shape[1])
        finite = {name: True for name, *_ in learners}
        micro_indices = mini_index.split(ac.ppo_micro_batch_size)
        for i, micro_index in enumerate(micro_indices):
            # DDP all-reduces the gradients on a mini-batch's last micro-batch only: accelerate's no_sync on the
            # others, the forward inside it, as DDP needs
            sync = accelerator.no_sync if i < len(micro_indices) - 1 else lambda model: contextlib.nullcontext()
            micro = batch.select(micro_index)
            with timer("update_actor"), sync(actor):
                with accelerator.autocast():  # forward only: the backward runs outside autocast
                    out = actor_forward(cfg, plan, run.models, micro.seq)
                    if plan.old_logprobs_from == "update":  # one epoch, one step: the weights are the rollout's
                        micro = dataclasses.replace(micro, old_logprobs=out.logprobs.detach())
                    loss, metrics = actor_loss(ac, plan.loss_kl, micro, out, agg)
                accelerator.backward(loss * world)
                finite["actor"] &= math.isfinite(loss.item())
            if critic is not None:
                with timer("update_critic"), sync(critic):
                    with accelerator.autocast():
                        values = response_values(critic, micro.seq)
                    vf_loss, critic_metrics = core_algos.value_loss(values, micro.old_values, micro.returns,
                                                                    micro.seq.response_mask, cfg.critic.cliprange_value,
                                                                    agg)
                    accelerator.backward(vf_loss * world)
                    finite["critic"] &= math.isfinite(vf_loss.item())
                metrics.update(critic_metrics)
            if plan.old_logprobs_from == "update" and micro.sampler_logprobs is not None:  # the sampler's against them
                metrics.update(logprob_mismatch(micro.sampler_logprobs, micro.old_logprobs, micro.seq.response_mask))
            for key, value in metrics.items():
                records[key].append(value * world if key in MINI_BATCH_LOSSES else value)
        with timer("update_step"):
            num_skipped, grad_norms = optimizer_steps(accelerator, learners, list(finite.values()))
        skipped += num_skipped
        for (name, *_), grad_norm in zip(learners, grad_norms):
            records[f"{name}/grad_norm"].append(grad_norm)
    # A loss: the mean over mini-batches of the sum of their micro-batches'; /max keys the maximum; others the mean.
    learned = {key: sum(numbers) / len(mini_indices) if key in MINI_BATCH_LOSSES else
               max(numbers) if key.endswith("/max") else sum(numbers) / len(numbers)
               for key, numbers in records.items()}
    return mean_over_processes(accelerator, learned), skipped


MINI_BATCH_LOSSES = ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss")  # normalised by the whole mini-batch


def optimizer_steps(accelerator, learners, finite: list[bool]) -> tuple[int, list[float]]:
    """One optimizer step per learner (name, model, optimizer, max gradient norm) after clipping, only when no
    process saw a non-finite loss (`finite`, per learner) and the norm is finite: one decision for all processes,
    or their copies would drift apart. Returns (skipped steps, each learner's gradient norm)."""
    num_bad = accelerator.reduce(torch.tensor([float(not ok) for ok in finite], device=accelerator.device), "sum")
    skipped, norms = 0, []
    for (name, model, optimizer, max_norm), bad in zip(learners, num_bad):
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
        if torch.isfinite(grad_norm) and bad.item() == 0:
            optimizer.step()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
        norms.append(grad_norm.item())
    return skipped, norms


def minibatches(num_local: int, local_mini_size: int, num_epochs: int, seed: int, step: int) -> list[torch.Tensor]:
    """Index tensors of this process's mini-batches for all epochs: a fresh permutation per epoch, drawn from
    (seed, step) only, so that a resumed run takes the same mini-batches."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return [index for _ in range(num_epochs)
            for index in torch.randperm(num_local, generator=generator).split(local_mini_size)]


@dataclass
class ActorOutput:
    """The actor's forward pass on a micro-batch (`actor_forward`), all (B, R)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor  # in the graph only if in the loss (actor.entropy_coeff)
    exact_kl: torch.Tensor | None  # exact KL(pi || pi_ref) through the actor's logits, for a `full` KL loss; else None


def actor_forward(cfg: Config, plan: Plan, models, seq: Sequences) -> ActorOutput:
    """The actor's forward pass on a micro-batch, and what the loss needs from its logits."""
    (actor, _, ref), temperature = models, cfg.rollout.temperature
    logprobs, logits = logprobs_and_logits(actor, seq, temperature)
    with torch.set_grad_enabled(bool(cfg.actor.entropy_coeff)):  # out of the graph unless in the loss
        entropy = core_algos.entropy_from_logits(logits, temperature)
    exact_kl = None
    if plan.loss_kl is not None and plan.loss_kl.needs_logits:
        with torch.no_grad():
            ref_logits = response_logits(ref, seq)
        exact_kl = kl.full_kl(logits, ref_logits, temperature)
    return ActorOutput(logprobs=logprobs, entropy=entropy, exact_kl=exact_kl)


def actor_loss(ac, loss_kl: kl.KLEstimator | None, micro: Batch, out: ActorOutput,
               agg: core_algos.LossAgg) -> tuple[torch.Tensor, dict]:
    """The actor's loss on a micro-batch, with `ac` the actor's config and `out` its forward pass:

        loss = policy_loss(ratio, A) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl)   (kl: `loss_kl`)

    with kl weighted by rho = exp(logprobs - old_logprobs) when kl_loss_off_policy_correction is on. `agg` normalises
    by the whole mini-batch (ppo_update says why)."""
    mask = micro.seq.response_mask
    loss, metrics = core_algos.policy_loss(out.logprobs, micro.old_logprobs, micro.advantages, mask, ac.clip_ratio,
                                           ac.clip_ratio_c, agg)
    if ac.entropy_coeff:
        loss = loss - ac.entropy_coeff * core_algos.agg_loss(out.entropy, mask, agg)
    if loss_kl is not None:
        old = micro.old_logprobs if ac.kl_loss_off_policy_correction else None
        kl_loss = core_algos.agg_loss(loss_kl(out.logprobs, micro.ref_logprobs, out.exact_kl, old), mask, agg)
        loss = loss + ac.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.item()
    metrics["actor/entropy"] = core_algos.masked_mean(out.entropy.detach(), mask).item()
    return loss, metrics


# ----------------------------------------------------------------------------- logging (nothing learned here)


def batch_metrics(cfg: Config, plan: Plan, accelerator, batch: Batch, scored: rewards.Scored,
                  stop_ids: int | tuple[int, ...]) -> dict[str, float]:
    """The step's logged numbers that describe the batch: scores, rewards, lengths, advantages, value fit, the
    share of groups without signal, the KL panel (of the old log-probs), the sampler's log-prob mismatch with the
    recomputed old ones; over all processes (the panel and the mismatch KL over all their tokens)."""
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
    if batch.old_values is not None:
        local["critic/vf_explained_var"] = core_algos.explained_variance(batch.old_values, batch.returns, mask)
    for key, part_scores in scored.parts.items():  # the parts of a reward of several (reward.functions)
        local[f"{key}/mean"] = part_scores.mean()
    if cfg.rollout.n > 1:
        local["critic/groups_with_equal_scores"] = core_algos.groups_with_equal_scores(scored.scores, batch.group_ids)
    metrics = mean_over_processes(accelerator, local)
    if cfg.trainer.log_kl_panel:
        panel = kl.kl_panel(batch.old_logprobs, batch.ref_logprobs, mask)
        panel["kl/full"] = core_algos.masked_mean(batch.exact_kl, mask).item()
        panel["kl/full_forward"] = core_algos.masked_mean(batch.exact_forward_kl, mask).item()
        metrics.update(token_weighted_means(panel, mask.sum(), reduce_sum))
    if batch.sampler_logprobs is not None and plan.old_logprobs_from == "forward":  # against the recomputed ones
        mismatch = logprob_mismatch(batch.sampler_logprobs, batch.old_logprobs, mask)
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
    k3 = kl.kl_k3(sampler_logprobs.float(), logprobs.float())
    return {"rollout/logprob_mismatch_kl": core_algos.masked_mean(k3, response_mask).item(),
            "rollout/logprob_abs_diff/max": (diff.max() if diff.numel() else diff.sum()).item()}
