"""PPO on GSM8K with a KL penalty in the reward, in the actor loss, both or neither.

    python train.py --config configs/tiny.yaml                    # embedded default: CPU, no network
    accelerate launch train.py --config configs/gsm8k_qwen2.5_0.5b.yaml   # the GPU recipe (docs/gpu.md)
    python train.py --config configs/tiny.yaml actor.use_kl_loss=true actor.kl_loss_type=k3+   # any key=value

One step reads like the algorithm (`train_step`):
    rollout (sample rollout.n responses per prompt; old log-probs where needed, reference log-probs, exact
    KL, values) -> score (reward.function, GSM8K's rule by default) -> KL (into the reward and/or the loss)
    -> advantages (GAE whitened, or grpo / rloo over each prompt's group) -> PPO epochs (clipped actor loss,
    clipped critic loss when there is a critic) -> adaptive KL coefficient -> lr schedules -> log; `main` adds
    evaluation and checkpoints.
Building the run is `rlhf/setup.py`; the glue's decisions are small functions in `rlhf/ppo.py`, the math
in `rlhf/kl` and `rlhf/core_algos.py`, the split of the work over processes in `rlhf/processes.py`.

Simplifications against verl, on purpose: one group of processes does everything (our own KV-cache
decoding loop, `rlhf/rollout.py`, in place of a separate rollout engine), the critic is a separate model
with its own optimizer, and the KL panel (`kl/k1` ... `kl/full`, every estimator on the same batch) is
logged whatever the estimator in use, so runs with different estimators can be compared: the sampled
estimators from the rollout's log-probs, `kl/full` and the forward `kl/full_forward` exactly from both
models' logits.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import defaultdict

import torch
import yaml
from accelerate import Accelerator
from tqdm.auto import tqdm

from rlhf import core_algos, evaluation, export, kl, ppo, rewards
from rlhf.checkpoint import (BadStepsError, StopOnSignal, TrainerState, bad_steps_message, check_resumable,
                             latest_checkpoint, save_checkpoint)
from rlhf.labels import kl_tags
from rlhf.config import Config, ConfigError, load_config, to_dict, validate, warnings_for
from rlhf.processes import (backward, gradient_sync, launch_warnings, mean_over_processes, optimizer_steps,
                            process_share, stop_rule, sum_over_processes, token_weighted_means)
from rlhf.rollout import (SamplingParams, cut_responses, generate, left_pad, logprobs_and_logits,
                          paired_noise_generator, response_values, slice_batch, stop_token_ids)
from rlhf.samples import sample_rows
from rlhf.setup import Setup, setup, shard_on_cpu
from rlhf.tasks import get_task
from rlhf.tracking import (SAMPLES_FILE, MetricsLogger, Symptoms, Timer, eval_line, read_metrics, run_summary,
                           truncate_metrics, wandb_available)


# ----------------------------------------------------------------------------- one PPO step


def train_step(cfg: Config, accelerator, run: Setup, step: int, timer: Timer,
               num_samples: int = 0) -> tuple[dict[str, float], int, float, list[dict]]:
    """One PPO step on this process's share of the global batch. Returns (metrics averaged over processes,
    skipped optimizer updates, tokens processed by all processes, the batch's first `num_samples` responses as
    rows: rlhf.samples)."""
    prompts = run.train_set[process_share(run.sampler.next_batch(), accelerator.process_index,
                                          accelerator.num_processes)]
    rows, group_ids = ppo.repeat_prompts(prompts, cfg.rollout.n)  # each prompt's group of rollout.n responses
    noise = (paired_noise_generator(cfg.trainer.seed, step, accelerator.process_index, accelerator.device)
             if cfg.rollout.paired_noise else None)  # same-seed runs draw the same sampling noise (common random numbers)
    batch = rollout(cfg, accelerator, run.models, run.tokenizer, rows, timer, noise)
    with timer("reward"):
        batch.update(rewards.score_batch(run.reward, run.tokenizer, batch, rows))  # scores, and any reward/<part>
    stop_ids = stop_token_ids(accelerator.unwrap_model(run.models[0]), run.tokenizer)
    samples = sample_rows(run.tokenizer, batch, rows, stop_ids, num_samples) if num_samples else []
    batch["group_ids"] = group_ids.to(accelerator.device)
    metrics, skipped = update(cfg, accelerator, run.models, run.optimizers, batch, run.kl_ctrl, step, timer)
    # The lr this step's updates used; then one step of each schedule: once per PPO step, as verl.
    for name, scheduler in zip(("actor", "critic"), run.lr_schedulers):
        if scheduler is not None:
            metrics[f"{name}/lr"] = scheduler.get_last_lr()[0]
            scheduler.step()
    metrics.update(batch_metrics(cfg, accelerator, batch, stop_ids))
    num_tokens = accelerator.reduce(batch["attention_mask"].sum().float(), "sum").item()
    return metrics, skipped, num_tokens, samples


@torch.no_grad()
def rollout(cfg: Config, accelerator, models, tokenizer, rows, timer: Timer,
            noise: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Sample one response per row (the noise from `noise`, or the global random state); add, all (B, R) and
    micro-batched: the old log-probs from the actor's forward pass, or the sampler's, or none where the update
    scores the batch itself (ppo.old_logprobs_source); the reference log-probs when there is a reference; the
    exact per-token KL when the panel or the reward needs it (ppo.needs_rollout_full_kl) and the exact forward
    KL for the panel; the critic's values when there is a critic; and the sampler's log-probs, when kept and
    not the old ones (`rollout_logprobs`, for ppo.logprob_mismatch)."""
    actor, critic, ref = models
    prompt_ids, prompt_mask = left_pad(rows["input_ids"], tokenizer.pad_token_id)
    r = cfg.rollout
    params = SamplingParams(cfg.data.max_response_length, r.temperature, r.top_k, r.top_p, ignore_eos=r.ignore_eos)
    keep = ppo.keeps_sampler_logprobs(cfg, accelerator.mixed_precision)
    source = ppo.old_logprobs_source(cfg, keep)
    with timer("gen"), accelerator.autocast():
        batch = generate(accelerator.unwrap_model(actor), tokenizer, prompt_ids.to(accelerator.device),
                         prompt_mask.to(accelerator.device), params, all_finished=stop_rule(accelerator),
                         generator=noise, return_logprobs=keep)
    if source == "sampler":
        batch["old_logprobs"] = batch.pop("rollout_logprobs")
    need_full = ppo.needs_rollout_full_kl(cfg)  # then source == "pass": the actor's logits are at hand
    parts = defaultdict(list)
    for index in torch.arange(len(prompt_ids)).split(r.log_prob_micro_batch_size):
        micro, logits = slice_batch(batch, index), None
        if source == "pass":
            with timer("old_log_prob"), accelerator.autocast():
                logprobs, logits = logprobs_and_logits(actor, micro, r.temperature)
                parts["old_logprobs"].append(logprobs)
        if ref is not None:
            with timer("ref"), accelerator.autocast():
                ref_logprobs, ref_logits = logprobs_and_logits(ref, micro, r.temperature)
                parts["ref_logprobs"].append(ref_logprobs)
                if need_full:
                    parts["full_kl"].append(kl.full_kl(logits, ref_logits, r.temperature))
                if cfg.trainer.log_kl_panel:  # KL(pi_ref || pi): the direction a k3 loss regularises (docs/kl.md)
                    parts["full_forward_kl"].append(kl.full_kl(ref_logits, logits, r.temperature))
        del logits
        if critic is not None:
            with timer("values"), accelerator.autocast():
                parts["values"].append(response_values(critic, micro))
    batch.update({k: torch.cat(v) for k, v in parts.items()})
    return batch


def update(cfg: Config, accelerator, models, optimizers, batch, kl_ctrl, step: int,
           timer: Timer) -> tuple[dict[str, float], int]:
    """KL in the reward -> advantages (algorithm.adv_estimator) -> PPO epochs -> adaptive KL coefficient.
    Returns (metrics of all processes, skipped optimizer updates)."""
    a, mask, reduce_sum = cfg.algorithm, batch["response_mask"], sum_over_processes(accelerator)
    metrics = {}
    reward_kl = None
    if a.use_kl_in_reward:  # the estimator, parsed once (rlhf.kl.parse_estimator), per token: (B, R)
        reward_kl = kl.parse_estimator(a.kl_penalty)(batch["old_logprobs"], batch["ref_logprobs"], batch.get("full_kl"))
        metrics["actor/reward_kl_penalty"] = ppo.sequence_mean(reward_kl, mask, reduce_sum)
        metrics["actor/reward_kl_penalty_coeff"] = kl_ctrl.value
    batch["token_rewards"] = ppo.token_rewards(batch["scores"], mask, reward_kl, kl_ctrl.value)
    batch["advantages"], batch["returns"] = ppo.advantages(a, batch, reduce_sum)
    update_metrics, skipped, own_old_logprobs = ppo_update(cfg, accelerator, models, optimizers, batch, step, timer)
    if own_old_logprobs is not None:  # the update's own (an exactly on-policy step): for the batch's metrics
        batch["old_logprobs"] = own_old_logprobs
    metrics.update(mean_over_processes(accelerator, update_metrics))
    if a.use_kl_in_reward and math.isfinite(metrics["actor/reward_kl_penalty"]):
        kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=cfg.data.train_batch_size * cfg.rollout.n)
    if cfg.actor.use_kl_loss:
        metrics["actor/kl_coef"] = cfg.actor.kl_loss_coef
    return metrics, skipped


def ppo_update(cfg: Config, accelerator, models, optimizers, batch, step: int, timer: Timer):
    """`actor.ppo_epochs` passes over the batch in mini-batches, one optimizer step per model and mini-batch
    (the critic only when there is one). A batch without old log-probs (ppo.old_logprobs_source is "update")
    uses the update's own, detached: its one mini-batch's forwards all run before its optimizer step. Returns
    (metrics averaged over mini-batches, the maximum for keys ending in /max; skipped updates; the update's
    own old log-probs (B, R), or None when the batch brought them)."""
    (actor, critic, ref), (actor_opt, critic_opt), ac = models, optimizers, cfg.actor
    own_old = "old_logprobs" not in batch
    if own_old and not ppo.is_on_policy(cfg):
        raise ValueError("the batch has no old log-probs and the update is not exactly on-policy "
                         "(rlhf.ppo.old_logprobs_source says when the rollout must compute them)")
    own_logprobs = torch.zeros(batch["response_mask"].shape, device=accelerator.device) if own_old else None
    world, mini_size = accelerator.num_processes, ac.ppo_mini_batch_size * cfg.rollout.n  # responses
    learners = [("actor", actor, actor_opt, ac.grad_clip)]
    if critic is not None:
        learners.append(("critic", critic, critic_opt, cfg.critic.grad_clip))
    records, skipped = defaultdict(list), 0
    for mini_index in ppo.minibatches(len(batch["response_ids"]), mini_size // world, ac.ppo_epochs,
                                      cfg.trainer.seed, step):
        # Normalised by the global mini-batch (all micro-batches, all processes), so that the summed
        # micro-batch gradients are the mini-batch's.
        agg = dict(num_tokens=accelerator.reduce(batch["response_mask"][mini_index].sum().float(), "sum"),
                   num_seqs=mini_size, norm_len=batch["response_ids"].shape[1])
        losses, finite = defaultdict(float), {name: True for name, *_ in learners}
        micro_indices = mini_index.split(ac.ppo_micro_batch_size)
        for i, micro_index in enumerate(micro_indices):
            micro, last = slice_batch(batch, micro_index), i == len(micro_indices) - 1
            with timer("update_actor"), gradient_sync(accelerator, actor, last):
                with accelerator.autocast():  # forward only: the backward runs outside autocast
                    loss, micro_metrics, logprobs = micro_actor_loss(cfg, actor, ref, micro, agg)
                finite["actor"] &= backward(accelerator, loss)
            if own_old:
                own_logprobs[micro_index] = logprobs
            if critic is not None:
                with timer("update_critic"), gradient_sync(accelerator, critic, last):
                    with accelerator.autocast():
                        values = response_values(critic, micro)
                    vf_loss, critic_metrics = core_algos.value_loss(
                        values, micro["values"], micro["returns"], micro["response_mask"],
                        cfg.critic.cliprange_value, ac.loss_agg_mode, **agg)
                    finite["critic"] &= backward(accelerator, vf_loss)
                micro_metrics.update(critic_metrics)
            for key, value in micro_metrics.items():
                if key in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss"):
                    losses[key] += value  # summed over micro-batches: the mini-batch's loss
                else:
                    records[key].append(value)
        # Each process holds its share of the global mini-batch loss; x world so that the mean over
        # processes (train_step) is their sum.
        for key, value in losses.items():
            records[key].append(value * world)
        with timer("update_step"):
            num_skipped, grad_norms = optimizer_steps(accelerator, learners, list(finite.values()))
        skipped += num_skipped
        for (name, *_), grad_norm in zip(learners, grad_norms):
            records[f"{name}/grad_norm"].append(grad_norm)
    metrics = {key: max(values) if key.endswith("/max") else sum(values) / len(values)
               for key, values in records.items()}
    return metrics, skipped, own_logprobs


def micro_actor_loss(cfg: Config, actor, ref, micro, agg) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The actor's forward pass and loss on one micro-batch (rlhf.ppo.actor_loss), with actor/entropy. Returns
    (loss, metrics, the micro-batch's log-probs, detached). Without old log-probs in `micro` (an exactly
    on-policy update), the old ones are its own log-probs, detached."""
    temperature, mask = cfg.rollout.temperature, micro["response_mask"]
    logprobs, logits = logprobs_and_logits(actor, micro, temperature)
    old_logprobs = micro["old_logprobs"] if "old_logprobs" in micro else logprobs.detach()
    with torch.set_grad_enabled(bool(cfg.actor.entropy_coeff)):  # out of the graph unless in the loss
        entropy = core_algos.entropy_from_logits(logits, temperature)
    full = None
    if cfg.actor.use_kl_loss and kl.parse_estimator(cfg.actor.kl_loss_type).needs_logits:  # exact, through the logits
        with torch.no_grad():
            ref_logits = logprobs_and_logits(ref, micro, temperature)[1]
        full = kl.full_kl(logits, ref_logits, temperature)
    loss, metrics = ppo.actor_loss(cfg.actor, logprobs, old_logprobs, micro["advantages"], mask, entropy,
                                   micro.get("ref_logprobs"), full, **agg)
    metrics["actor/entropy"] = core_algos.masked_mean(entropy.detach(), mask).item()
    return loss, metrics, logprobs.detach()


def batch_metrics(cfg: Config, accelerator, batch, eos_token_ids: int | tuple[int, ...]) -> dict[str, float]:
    """The step's logged numbers that describe the batch: scores, rewards, lengths, advantages, value fit, the
    share of groups without signal, the KL panel, the sampler's log-prob mismatch; over all processes (the
    panel and the mismatch KL over all their tokens)."""
    mask, reduce_sum = batch["response_mask"], sum_over_processes(accelerator)
    lengths = mask.sum(dim=1)
    clipped = cut_responses(batch, eos_token_ids)
    local = {
        "critic/score/mean": batch["scores"].mean(),
        "critic/rewards/mean": core_algos.masked_sum(batch["token_rewards"], mask, dim=1).mean(),
        "response_length/mean": lengths.float().mean(),
        "response_length/clip_ratio": clipped.float().mean(),
        "critic/advantages/mean": core_algos.masked_mean(batch["advantages"], mask),
        "critic/advantages/max": batch["advantages"][mask.bool()].max(),
        "critic/advantages/min": batch["advantages"][mask.bool()].min(),
    }
    if "values" in batch:
        local["critic/vf_explained_var"] = core_algos.explained_variance(batch["values"], batch["returns"], mask)
    for key in (k for k in batch if k.startswith("reward/")):  # the parts of a reward of several (reward.functions)
        local[f"{key}/mean"] = batch[key].mean()
    if cfg.rollout.n > 1:
        local["critic/groups_with_equal_scores"] = ppo.groups_with_equal_scores(batch["scores"], batch["group_ids"])
    metrics = mean_over_processes(accelerator, local)
    if "ref_logprobs" in batch and cfg.trainer.log_kl_panel:
        panel = kl.kl_panel(batch["old_logprobs"], batch["ref_logprobs"], mask)
        panel["kl/full"] = core_algos.masked_mean(batch["full_kl"], mask).item()
        panel["kl/full_forward"] = core_algos.masked_mean(batch["full_forward_kl"], mask).item()
        metrics.update(token_weighted_means(panel, mask.sum(), reduce_sum))
    if "rollout_logprobs" in batch:  # the sampler's log-probs against the recomputed old ones
        mismatch = ppo.logprob_mismatch(batch["rollout_logprobs"], batch["old_logprobs"], mask)
        largest = {"rollout/logprob_abs_diff/max": mismatch.pop("rollout/logprob_abs_diff/max")}
        metrics.update(mean_over_processes(accelerator, largest))
        metrics.update(token_weighted_means(mismatch, mask.sum(), reduce_sum))
    return metrics


# ----------------------------------------------------------------------------- main


def main(cfg: Config) -> dict[str, float]:
    """Train; returns the last step's metrics (with val/accuracy). Callable from tests in-process."""
    started = time.perf_counter()
    accelerator = start_accelerator(cfg)
    out_dir = cfg.trainer.output_dir
    resume_dir = cfg.trainer.resume_from
    if resume_dir == "auto":
        resume_dir = latest_checkpoint(out_dir)
        accelerator.print(f"resume_from=auto: {resume_dir or 'no checkpoint found, starting fresh'}")
    if resume_dir:
        check_resumable(resume_dir, cfg.algorithm.adv_estimator)  # before any model loads
    if accelerator.is_main_process:
        os.makedirs(out_dir, exist_ok=True)
        resolved = yaml.safe_dump(to_dict(cfg), sort_keys=False)
        print(f"resolved config:\n{resolved}")
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            f.write(resolved)
    run = setup(cfg, accelerator)
    task = get_task(cfg.task.name)
    task_metrics = task.step_metrics(cfg, accelerator, run)  # the task's own per-step metrics (rlhf.tasks), or None
    state = TrainerState()
    accelerator.register_for_checkpointing(state)
    for scheduler in (s for s in run.lr_schedulers if s is not None):  # after state: it stays custom_checkpoint_0
        accelerator.register_for_checkpointing(scheduler)
    if resume_dir:
        accelerator.load_state(resume_dir)
        run.sampler.load_state_dict(state.sampler)
        run.kl_ctrl.load_state_dict(state.kl_ctrl)
        accelerator.print(f"resumed from {resume_dir} at step {state.step}")
    if accelerator.is_main_process:  # keep the rows up to the checkpoint; a fresh run starts new files
        for name in ("metrics.jsonl", SAMPLES_FILE):
            truncate_metrics(os.path.join(out_dir, name), state.step if resume_dir else -1)
    logger = MetricsLogger(accelerator, out_dir, use_wandb=bool(accelerator.log_with))
    logger.start(cfg.trainer.project_name, to_dict(cfg), cfg.trainer.experiment_name, cfg.trainer.group,
                 kl_tags(cfg), out_dir, resume_run_id=state.wandb_run_id)
    state.wandb_run_id = logger.wandb_run_id or state.wandb_run_id

    def checkpoint(step: int) -> str:
        state.step, state.sampler, state.kl_ctrl = step, run.sampler.state_dict(), run.kl_ctrl.state_dict()
        path = save_checkpoint(accelerator, out_dir, step, cfg.trainer.max_ckpt_to_keep,
                               info={"adv_estimator": cfg.algorithm.adv_estimator})
        if cfg.trainer.save_model_with_checkpoints:  # <checkpoint>/model, for from_pretrained (rlhf/export.py)
            export.save_model(accelerator, run, cfg, export.model_dir(path))
        return path

    total, symptoms = cfg.trainer.total_steps, Symptoms()
    metrics: dict[str, float] = {}
    try:
        if state.step == 0:
            metrics, val_samples = evaluation.evaluate_and_sample(cfg, accelerator, run, 0, cfg.trainer.log_samples)
            if task_metrics:
                metrics.update(task_metrics.metrics(accelerator.unwrap_model(run.models[0])))
            logger.log(metrics, step=0)
            logger.log_samples("val", val_samples, step=0)
            accelerator.print(eval_line(0, metrics))
            warn(accelerator, symptoms.check(0, metrics))
        progress = tqdm(range(state.step + 1, total + 1), desc="ppo", initial=state.step, total=total,
                        disable=not accelerator.is_local_main_process)
        with StopOnSignal() as stop:
            for step in progress:
                timer = Timer()
                val_samples = []
                with timer("step"):
                    metrics, skipped, num_tokens, train_samples = train_step(cfg, accelerator, run, step, timer,
                                                                             num_train_samples(cfg, step))
                    state.bad_steps = state.bad_steps + 1 if skipped else 0
                    if ppo.should_evaluate(step, total, cfg.trainer.test_freq):
                        with timer("testing"):
                            val_metrics, val_samples = evaluation.evaluate_and_sample(cfg, accelerator, run, step,
                                                                                      cfg.trainer.log_samples)
                            metrics.update(val_metrics)
                metrics.update(timer.metrics())
                if task_metrics:
                    metrics.update(task_metrics.metrics(accelerator.unwrap_model(run.models[0])))
                metrics.update({"actor/skipped_updates": skipped,
                                "perf/throughput": num_tokens / metrics["timing_s/step"] / accelerator.num_processes})
                if torch.accelerator.is_available():  # verl's name; the peak of this process's device so far
                    metrics["perf/max_memory_allocated_gb"] = torch.accelerator.max_memory_allocated() / 2**30
                logger.log(metrics, step=step)
                logger.log_samples("train", train_samples, step)
                logger.log_samples("val", val_samples, step)
                warn(accelerator, symptoms.check(step, metrics))
                progress.set_postfix(score=f"{metrics['critic/score/mean']:.2f}", kl=f"{metrics.get('kl/full', 0):.4f}")
                if "val/accuracy" in metrics and accelerator.is_main_process:  # above the bar, which stays
                    progress.write(eval_line(step, metrics))
                if state.bad_steps >= cfg.trainer.max_bad_steps:
                    raise BadStepsError(bad_steps_message(cfg, step - state.bad_steps + 1, step))
                stopping = stop.requested(accelerator)
                if ppo.should_checkpoint(step, total, cfg.trainer.save_freq, stopping, state.bad_steps):
                    path = checkpoint(step)
                    if stopping:
                        accelerator.print(f"{stop.signal or 'stop'} received: saved {path} after step {step}. "
                                          f"Resume with:\n  python train.py ... trainer.output_dir={out_dir} "
                                          "trainer.resume_from=auto")
                        break
        if task_metrics and accelerator.is_main_process:
            task_metrics.finish(out_dir, accelerator.unwrap_model(run.models[0]))
        export.save_model(accelerator, run, cfg, export.model_dir(out_dir))  # the user's model (rlhf/export.py)
        if accelerator.is_main_process:
            rows = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
            print(run_summary(rows, time.perf_counter() - started, outputs(cfg, logger.wandb_where)), flush=True)
    finally:
        logger.finish()  # every process, after the last collective (the export's)
    return metrics


def num_train_samples(cfg: Config, step: int) -> int:
    """How many of training step `step`'s responses are logged as samples (rlhf.samples): trainer.log_samples
    every trainer.log_samples_freq steps (0: only at evaluations), else none."""
    freq = cfg.trainer.log_samples_freq
    return cfg.trainer.log_samples if freq and step % freq == 0 else 0


def warn(accelerator, messages: list[str]) -> None:
    for message in messages:
        accelerator.print(f"warning: {message}")


def outputs(cfg: Config, wandb_where: str) -> dict[str, str]:
    """Where a finished run's files are, and the command that evaluates its model against the one it started
    from, for the summary (rlhf.tracking.run_summary)."""
    out_dir, model = cfg.trainer.output_dir, export.model_dir(cfg.trainer.output_dir)
    found = {"metrics": os.path.join(out_dir, "metrics.jsonl"), "wandb": wandb_where,
             "checkpoint": f"{latest_checkpoint(out_dir)} (resume: add trainer.resume_from=auto)",
             "model": f"{model} (transformers' from_pretrained)"}
    if cfg.trainer.log_samples:
        found["samples"] = os.path.join(out_dir, SAMPLES_FILE)
    task = get_task(cfg.task.name)
    if task.has_held_out:
        found["evaluate"] = (f"python -m rlhf.evaluate --model {model} --baseline {task.base_model(cfg, out_dir)} "
                             f"--config {os.path.join(out_dir, 'config.yaml')}")
    return found


def start_accelerator(cfg: Config) -> Accelerator:
    """The Accelerator, after the checks that need the number of processes; warnings printed once."""
    launched = int(os.environ.get("WORLD_SIZE", 1))
    # Several processes and no GPU: run them on the CPU over gloo. (accelerate would set up N copies of a
    # 1-process run unless told ACCELERATE_USE_CPU=1; this saves the user that step.)
    on_cpu = launched > 1 and not torch.accelerator.is_available()
    accelerator = Accelerator(
        cpu=on_cpu, log_with="wandb" if cfg.trainer.logger == "wandb" and wandb_available() else None,
        mixed_precision=cfg.trainer.mixed_precision)
    if on_cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        shard_on_cpu(accelerator)
    if launched != accelerator.num_processes:  # else N copies of a 1-process run would write the same files
        raise ConfigError(f"{launched} processes were launched (WORLD_SIZE={launched}) but accelerate set up "
                          f"{accelerator.num_processes}: start them with `accelerate launch` (or torchrun), "
                          "which sets RANK, LOCAL_RANK and MASTER_ADDR for each process.")
    validate(cfg, num_processes=accelerator.num_processes)  # per-process batch arithmetic
    if cfg.trainer.logger == "wandb" and not wandb_available():
        accelerator.print("warning: wandb is not installed; logging to metrics.jsonl only.")
    for message in [*warnings_for(cfg), *launch_warnings(os.environ, accelerator.num_processes)]:
        accelerator.print(f"warning: {message}")
    return accelerator


def cli(argv: list[str] | None = None) -> int:
    """The command line: train; returns the exit status (2 for a bad config or a reward function's refused
    result, 1 after too many bad steps)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a YAML file under configs/ (only what differs from the defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. actor.kl_loss_type=k3+")
    args = parser.parse_args(argv)
    try:
        main(load_config(args.config, args.overrides))
    # ConfigError is raised before any model loads (main() checks what needs the process count); RewardError at
    # the reward function's first result, before it reaches an update (step 0's evaluation, or the first step).
    except (ConfigError, rewards.RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BadStepsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
