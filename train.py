"""Training: the run around one PPO step (rlhf/step.py): the config, setting up, the loop, evaluation,
checkpoints, the summary.

    python train.py --config configs/tiny.yaml                    # embedded default: CPU, no network
    accelerate launch train.py --config configs/gsm8k_qwen2.5_0.5b.yaml   # the GPU recipe (docs/gpu.md)
    python train.py --config configs/tiny.yaml actor.use_kl_loss=true actor.kl_loss_type=k3+   # any key=value

`main(cfg)`: check the config against the processes launched, work out the step's `Plan` (the KL estimators
parsed once), build the run (rlhf/setup.py: data, models, optimizers, lr schedules, prompt order, KL
controller, reward), resume from a checkpoint if asked, evaluate at step 0, then for each step
`rlhf.step.train_step`, the held-out evaluation every trainer.test_freq steps (rlhf/held_out.py), one
`accelerator.log` of its metrics, a checkpoint every trainer.save_freq steps; at the end, the model for
`from_pretrained` (rlhf/export.py) and the summary. ppo.py is the same algorithm in one file.

Simplifications against verl, on purpose: one group of processes does everything (our own KV-cache
decoding loop, `rlhf/rollout.py`, in place of a separate rollout engine), the critic is a separate model
with its own optimizer, and the KL panel (`kl/k1` ... `kl/full`, every estimator on the same batch) is
logged whatever the estimator in use, so runs with different estimators can be compared: the sampled
estimators from the rollout's log-probs, `kl/full` and the forward `kl/full_forward` exactly from both
models' logits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from rlhf import export, held_out, rewards
from rlhf.checkpoint import (BadStepsError, StopOnSignal, TrainerState, adapters_only, bad_steps_message,
                             check_resumable, latest_checkpoint, run_info, save_checkpoint)
from rlhf.labels import kl_tags
from rlhf.config import Config, ConfigError, check_batch_sizes, load_config, to_dict, warnings_for
from rlhf.processes import launch_warnings
from rlhf.rollout import stop_token_ids
from rlhf.samples import sample_rows
from rlhf.setup import setup, shard_on_cpu
from rlhf.step import plan_step, train_step
from rlhf.tasks import get_task
from rlhf.tracking import (SAMPLES_FILE, MetricsLogger, Symptoms, Timer, eval_line, read_metrics, run_summary,
                           truncate_metrics, wandb_available)


# ----------------------------------------------------------------------------- main


def main(cfg: Config) -> dict[str, float]:
    """Train; returns the last step's metrics (with val/accuracy). Callable from tests in-process."""
    started = time.perf_counter()
    accelerator = start_accelerator(cfg)  # the config's checks that need the processes launched
    plan = plan_step(cfg, accelerator.mixed_precision)  # the KL estimators parsed, the step's passes
    out_dir = cfg.trainer.output_dir
    resume_dir = cfg.trainer.resume_from
    if resume_dir == "auto":
        resume_dir = latest_checkpoint(out_dir)
        accelerator.print(f"resume_from=auto: {resume_dir or 'no checkpoint found, starting fresh'}")
    if resume_dir:
        check_resumable(resume_dir, cfg)  # before any model loads
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
    if cfg.model.lora.rank:  # checkpoints hold the adapters and their optimizer states, not the frozen base
        adapters_only(accelerator)
    if resume_dir:
        accelerator.load_state(resume_dir, strict=not cfg.model.lora.rank)  # LoRA: adapters_only checks the names
        run.prompt_order.load_state_dict(state.prompt_order)
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
        state.step, state.prompt_order, state.kl_ctrl = step, run.prompt_order.state_dict(), run.kl_ctrl.state_dict()
        path = save_checkpoint(accelerator, out_dir, step, cfg.trainer.max_ckpt_to_keep,
                               info=run_info(cfg))
        if cfg.trainer.save_model_with_checkpoints:  # <checkpoint>/model, for from_pretrained (rlhf/export.py)
            export.save_model(accelerator, run, cfg, export.model_dir(path))
        return path

    total, symptoms = cfg.trainer.total_steps, Symptoms()
    stop_ids = stop_token_ids(accelerator.unwrap_model(run.models[0]), run.tokenizer)  # for the samples' `cut`
    metrics: dict[str, float] = {}
    try:
        if state.step == 0:
            metrics, val_samples = held_out.evaluate_and_sample(cfg, accelerator, run, 0, cfg.trainer.log_samples)
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
                    result = train_step(cfg, plan, accelerator, run, step, timer)
                    num_samples = num_train_samples(cfg, step)
                    train_samples = (sample_rows(run.tokenizer, result.seq, result.scored, stop_ids, num_samples)
                                     if num_samples else [])
                    metrics, skipped = result.metrics, result.skipped
                    state.bad_steps = state.bad_steps + 1 if skipped else 0
                    if should_evaluate(step, total, cfg.trainer.test_freq):
                        with timer("testing"):
                            val_metrics, val_samples = held_out.evaluate_and_sample(cfg, accelerator, run, step,
                                                                                    cfg.trainer.log_samples)
                            metrics.update(val_metrics)
                metrics.update(timer.metrics())
                if task_metrics:
                    metrics.update(task_metrics.metrics(accelerator.unwrap_model(run.models[0])))
                metrics.update({"actor/skipped_updates": skipped,
                                "perf/throughput": result.num_tokens / metrics["timing_s/step"] / accelerator.num_processes})
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
                if should_checkpoint(step, total, cfg.trainer.save_freq, stopping, state.bad_steps):
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


def should_evaluate(step: int, total_steps: int, test_freq: int) -> bool:
    """Greedy evaluation after every `test_freq` steps (0: never in between) and after the last step. Step 0
    (before training) is evaluated by `main` when a run starts fresh."""
    return step == total_steps or bool(test_freq and step % test_freq == 0)


def should_checkpoint(step: int, total_steps: int, save_freq: int, stopping: bool, bad_steps: int) -> bool:
    """Save after the last step, when stopping on a signal, and every `save_freq` steps, except during a run of
    non-finite steps: the latest periodic checkpoint must stay one from before them."""
    periodic = bool(save_freq and step % save_freq == 0)
    return step == total_steps or stopping or (periodic and not bad_steps)


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
    if cfg.model.lora.rank and accelerator.distributed_type == DistributedType.FSDP:
        raise ConfigError(f"model.lora.rank={cfg.model.lora.rank} under FSDP2 is not supported: FSDP2's sharded "
                          "checkpoints would hold the whole frozen base, and the reference (the policy with its "
                          "adapters off) and the merged export are tested only with unsharded weights. A LoRA run's "
                          "optimizer states are a few MB, so data parallel fits where FSDP2 was needed for full fine-"
                          "tuning: launch with --multi_gpu or configs/accelerate/ddp.yaml.")
    check_batch_sizes(cfg, num_processes=accelerator.num_processes)  # load_config checked the rest
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
